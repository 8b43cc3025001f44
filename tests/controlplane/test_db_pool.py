"""PostgreSQL sessions are pooled: under ASGI each request's database work runs on a thread of its own, and
without the pool every request opened (and the server started) a new session."""

from __future__ import annotations

import threading

import httpx
import pytest
from cp_support import CHAT_MODEL
from django.db import connection
from django.db.backends.signals import connection_created
from test_live_server import live, wait_for_events  # noqa: F401  (a fixture)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.real_model]


def test_requests_share_pooled_sessions_and_a_session_the_server_ended_is_replaced(live):  # noqa: F811
    if connection.vendor != "postgresql":
        pytest.skip("a pool of PostgreSQL sessions (DATABASE_URL=postgres://...): SQLite opens a file")
    url, tenant = live
    run_url = f"{url}/client/v4/accounts/{tenant.account.pk}/ai/run/{CHAT_MODEL}"
    sessions: list[int] = []  # the server process behind each connection a request's thread took

    def record(sender, connection, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            sessions.append(connection.connection.info.backend_pid)

    with connection.cursor() as cursor:  # the sessions this database has before the requests
        cursor.execute("SELECT pid FROM pg_stat_activity WHERE datname = current_database()")
        before = {pid for (pid,) in cursor.fetchall()}
    connection_created.connect(record, weak=False)
    try:
        for i in range(8):
            response = httpx.post(run_url, headers=tenant.headers, timeout=60,
                                  json={"prompt": f"Say {i}.", "max_tokens": 1, "temperature": 0})
            assert response.status_code == 200, response.text
        wait_for_events(8)
        # Each request took a session, and the server started at most two new ones for all of them (the pool
        # lends its idle sessions in turn, so several that other tests left there may serve).
        assert len(sessions) >= 8 and len(set(sessions) - before) <= 2, (sessions, before)

        # The server ends every other session on this database (a restart, an idle timeout): the pool tests a
        # session before lending it, so the next requests get a fresh one instead of an error. Eight idle
        # sessions first: met one by one, with the pool's waits of 1, 2, 4, 8, 16 s after each dead one, the
        # sixth would pass the pool's 30 s timeout (controlplane/db_pool.py).
        pool = connection.pool
        taken = [pool.getconn() for _ in range(8)]
        for session in taken:
            pool.putconn(session)
        assert pool.get_stats()["pool_available"] >= 8
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                           "WHERE datname = current_database() AND pid <> pg_backend_pid()")
            assert cursor.fetchone()[0] >= 1
        for i in range(3):
            response = httpx.post(run_url, headers=tenant.headers, timeout=60,
                                  json={"prompt": f"Again {i}.", "max_tokens": 1, "temperature": 0})
            assert response.status_code == 200, response.text
        assert len(wait_for_events(11)) == 11
    finally:
        connection_created.disconnect(record)
