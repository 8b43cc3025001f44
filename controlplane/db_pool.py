"""The test the PostgreSQL session pool runs on a session before lending it.

psycopg_pool's own test, and, when a session fails it, a test of every idle session at once. The pool waits
before each next attempt after a failed test, doubling from one second (1, 2, 4, 8 s...), so after the server
ended every session (a restart, an idle timeout, `pg_terminate_backend`) a request would meet the pool's dead
idle sessions one at a time: with five it waited ~15 s for a fresh one, with six it passed the pool's 30 s timeout
and failed. Testing the idle ones as soon as one fails discards them together and starts their replacements, so the
request's next attempt, a second later, gets a fresh session.

Django creates the pool itself with psycopg_pool's test when CONN_HEALTH_CHECKS is on, and takes no other `check`
from the pool's options, so this one replaces it on the pool once the pool exists (at its first new session).
That sets the pool's private `_check`; tests/controlplane/test_db_pool.py fails if a psycopg_pool release stops
reading it (eight dead idle sessions would then take the request past the pool's timeout).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from django.db.backends.signals import connection_created
from psycopg_pool import ConnectionPool


def _tester(pool: ConnectionPool) -> Callable[[Any], None]:
    """The pool's test of one session: psycopg_pool's, and on a failure, first every idle session of the pool."""
    sweeping = threading.local()  # pool.check() tests each idle session with this same function

    def check(conn: Any) -> None:
        try:
            ConnectionPool.check_connection(conn)
        except Exception:
            if not getattr(sweeping, "active", False):
                sweeping.active = True
                try:
                    pool.check()
                finally:
                    sweeping.active = False
            raise

    return check


def _install(sender: Any, connection: Any, **kwargs: Any) -> None:
    pool = getattr(connection, "pool", None)
    if pool is not None and getattr(pool, "_check", None) is ConnectionPool.check_connection:
        pool._check = _tester(pool)


connection_created.connect(_install, dispatch_uid="hearth-db-pool-check")
