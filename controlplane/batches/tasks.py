"""Celery tasks. Each takes ids only and re-reads the database, so a message can be delivered twice, late or
never (the sweep re-sends) without changing the outcome. Messages are acknowledged after the work is stored
(acks_late); a worker killed mid-item leaves its message unacknowledged and the broker hands it to another."""

from __future__ import annotations

import logging
import random
import threading
import time
import weakref
from typing import Any

from celery.signals import task_postrun, task_prerun
from django.db import close_old_connections, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.signals import connection_created
from django.dispatch import receiver

from controlplane.batches import execute, item_services, maintenance, services
from controlplane.celery import app

log = logging.getLogger("controlplane.batches")
MAX_BACKOFF_S = 60.0
# A worker thread runs one task after another. With CONN_MAX_AGE 0 (the requests' setting) it opened a fresh
# database connection for every task: on SQLite about 2 ms of CPU, eight times a query on an open one, and in
# the in-process worker that CPU is taken from the engine's step loop. A connection a task opens lives this long
# (and Celery's Django fixup closes it every CELERY_DB_REUSE_MAX tasks); a broken one is dropped after the task,
# and on PostgreSQL a kept one is checked before its first query (CONN_HEALTH_CHECKS). PostgreSQL's sessions are
# pooled by default (settings: DB_POOL), and a pooled connection is not kept: its task gives it back.
WORKER_CONN_MAX_AGE_S = 300.0
_in_task = threading.local()
# Each kept connection and the thread it belongs to. A thread that ends cannot close its connection, and a
# Django connection object holds reference cycles, so it would stay open until the garbage collector ran.
_kept: weakref.WeakKeyDictionary[BaseDatabaseWrapper, threading.Thread] = weakref.WeakKeyDictionary()
_kept_lock = threading.Lock()


@receiver(connection_created)
def _keep_worker_connection(sender: type, connection: BaseDatabaseWrapper, **kwargs: Any) -> None:
    # A pooled connection goes back to the pool after its task (a checkout is cheap), so no thread holds one the
    # others could use.
    if getattr(connection, "pool", None) is not None:
        return
    if getattr(_in_task, "active", False) and connection.close_at is not None:
        connection.close_at = max(connection.close_at, time.monotonic() + WORKER_CONN_MAX_AGE_S)
        with _kept_lock:
            _kept[connection] = threading.current_thread()


def close_connections_of_ended_threads() -> int:
    """Close the connections kept by worker threads that have ended (a stopped worker's pool); returns how many.
    Nothing else uses them any more, so closing from this thread is safe."""
    with _kept_lock:
        ended = [conn for conn, thread in _kept.items() if not thread.is_alive()]
        for conn in ended:
            del _kept[conn]
    closed = 0
    for conn in ended:
        if conn.connection is not None:
            conn.inc_thread_sharing()
            try:
                conn.close()
            finally:
                conn.dec_thread_sharing()
            closed += 1
    return closed


@task_prerun.connect
def _task_starts(task: Any = None, **kwargs: Any) -> None:
    # Drop broken or expired connections around each task, as Django does around each request.
    close_old_connections()
    # Only a worker's own threads keep what they open: an eager task runs in its caller's thread (a request's).
    _in_task.active = not getattr(getattr(task, "request", None), "is_eager", False)


@task_postrun.connect
def _task_ends(**kwargs: Any) -> None:
    _in_task.active = False  # only connections a task opens live on, not what its thread opens later
    close_old_connections()


def give_back_pooled_connection() -> None:
    """While the engine works on an item, its thread needs no database session: a pooled one goes back to the
    pool, so a worker's threads waiting on the engine do not hold a session each (24 by default)."""
    connection = connections["default"]
    if (getattr(connection, "pool", None) is not None and connection.connection is not None
            and not connection.in_atomic_block):
        connection.close()


def backoff(retries: int) -> float:
    """Exponential with jitter, capped: 1, 2, 4 ... 60 s, so a busy engine is not hammered by every item."""
    return min(MAX_BACKOFF_S, 2.0 ** min(retries, 6)) * random.uniform(0.5, 1.0)


@app.task(name="batches.prepare", acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def prepare_batch(batch_id: str) -> None:
    services.prepare(batch_id)


@app.task(name="batches.run_items", bind=True, acks_late=True, reject_on_worker_lost=True, ignore_result=True,
          max_retries=None)
def run_items(self, item_ids: list[int]) -> dict[str, int]:
    """Claim a run of items, run them on the engine together and store their results (execute.run_run).
    Items the engine could not take now, or that failed unexpectedly, are given back and retried with
    backoff; items another worker holds are looked at again once their lease could have lapsed."""
    run = item_services.claim_run([int(i) for i in item_ids])
    report = execute.Report()
    if run.taken:
        report = execute.run_run(run.taken, idle=give_back_pooled_connection)
    if report.busy:
        log.info("engine busy (%s); %d batch items retry", report.busy_reason, len(report.busy))
        item_services.release(report.busy)
    if report.broken:
        item_services.release(report.broken, busy=False)  # counted as an attempt
    again = [c.item_id for c in (*report.busy, *report.broken)]
    if run.later:
        countdown = min(run.wait_s + 0.5, MAX_BACKOFF_S)
        if again:  # two different waits: the held items get a message of their own
            run_items.apply_async((run.later,), countdown=countdown)
        else:
            raise self.retry(args=(run.later,), countdown=countdown, max_retries=None)
    if again:
        raise self.retry(args=(again,), countdown=backoff(self.request.retries), max_retries=None)
    return {"stored": report.stored, "lost": report.lost}


@app.task(name="batches.run_item", acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def run_item(item_id: int) -> None:
    """One item, the message of earlier releases (still in a broker when the worker is upgraded): passed on as
    a run of one."""
    run_items.apply_async(([item_id],))


@app.task(name="batches.sweep", ignore_result=True)
def sweep() -> dict[str, int]:
    return maintenance.sweep()


@app.task(name="batches.cleanup", ignore_result=True)
def cleanup() -> dict[str, int]:
    return maintenance.cleanup()
