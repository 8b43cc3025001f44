"""The Celery worker (and beat) inside the server process: `make run` gets asynchronous, durable batches with no
broker server, and batch items share the one in-process engine with interactive requests, where the BATCH
priority class and its cap keep interactive latency. Production can run the same thread next to each engine,
or `celery -A controlplane worker -B` processes (HEARTH_BATCH_WORKER=off on the servers)."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any

from django.conf import settings
from django.db import close_old_connections, connection

from controlplane.celery import app, ensure_broker_dirs

log = logging.getLogger("controlplane.batches")
RESTART_DELAY_S = 1.0


class EmbeddedWorker:
    def __init__(self, *, concurrency: int | None = None, beat: bool | None = None,
                 rebuild_queue: bool | None = None, recover: bool = True) -> None:
        self.recover = recover
        self.concurrency = concurrency or settings.HEARTH_BATCH_CONCURRENCY
        self.beat = settings.HEARTH_BATCH_BEAT if beat is None else beat
        # The embedded filesystem queue has this process as its only consumer, so on startup it can be rebuilt
        # from the item rows exactly: messages that were in memory when the last process died come back.
        self.rebuild_queue = (str(app.conf.broker_url).startswith("filesystem://") if rebuild_queue is None
                              else rebuild_queue)
        self.worker: Any = None
        self._thread: threading.Thread | None = None
        self._beat: Any = None
        self._lock = threading.Lock()
        self._stopping = False
        self.restarts = 0  # times the worker stopped by itself and was started again

    def start(self) -> None:
        from celery.beat import EmbeddedService

        from controlplane.batches import maintenance

        ensure_broker_dirs()
        app.finalize()
        app.set_current()
        if self.recover:
            if self.rebuild_queue:
                with app.connection_for_write() as conn:
                    conn.default_channel.queue_purge(app.conf.task_default_queue)
            try:
                maintenance.sweep(startup=self.rebuild_queue)
            finally:
                close_old_connections()
                connection.close()
        ready = threading.Event()
        self._stopping = False
        self.worker = self._controller(ready)
        self._thread = threading.Thread(target=self._serve, name="hearth-batch-worker", daemon=True)
        self._thread.start()
        if not ready.wait(30):
            log.warning("the embedded batch worker took over 30 s to start")
        if self.beat:
            self._beat = EmbeddedService(app, thread=True, schedule_filename=settings.CELERY_BEAT_SCHEDULE_FILENAME)
            self._beat.start()
        log.info("embedded batch worker started (%d threads, broker %s)", self.concurrency,
                 app.conf.broker_url.split("://", 1)[0])

    def _controller(self, ready: threading.Event) -> Any:
        return app.WorkController(
            hostname=f"hearth-embedded-{os.getpid()}@{socket.gethostname()}", pool_cls="threads",
            concurrency=self.concurrency, loglevel=logging.WARNING, without_heartbeat=True,
            without_mingle=True, without_gossip=True, ready_callback=lambda *a: ready.set(),
            task_events=False)

    def _serve(self) -> None:
        """Run the worker, and a fresh one whenever it stops by itself: Celery's worker exits on an error it
        does not expect from its broker, and in embedded mode it is the only worker there is."""
        while True:
            self.worker.start()
            if self._stopping:
                return
            log.error("the embedded batch worker stopped unexpectedly; starting a fresh one")
            _end_pool_threads(self.worker, RESTART_DELAY_S * 10)
            time.sleep(RESTART_DELAY_S)  # a broker that fails at once is not hammered
            with self._lock:
                if self._stopping:
                    return
                self.restarts += 1
                self.worker = self._controller(threading.Event())

    def stop(self, timeout: float = 10.0) -> None:
        if self._beat is not None:
            self._beat.stop()
            self._beat = None
        with self._lock:
            self._stopping = True
            worker = self.worker
        if worker is not None:
            # Cold: items in flight stay unacknowledged (and leased) and are run again after a restart.
            worker.terminate()
            _end_pool_threads(worker, timeout)
            if self._thread is not None:
                self._thread.join(timeout)
            self.worker = None


def _end_pool_threads(worker: Any, timeout: float) -> None:
    """End a stopped worker's pool threads (each once its current task is done, waiting up to `timeout`) and
    close the database connections they kept between tasks (tasks.py). Terminating a thread pool leaves its idle
    threads waiting for work forever, each with its connection: on PostgreSQL, server sessions that nothing
    would close until the process exits."""
    from controlplane.batches.tasks import close_connections_of_ended_threads

    executor = getattr(getattr(worker, "pool", None), "executor", None)
    if executor is not None:
        # shutdown(wait=True) has no timeout of its own: a task still running must not hold up the stop.
        ender = threading.Thread(target=executor.shutdown, kwargs={"wait": True, "cancel_futures": True},
                                 name="hearth-batch-pool-end", daemon=True)
        ender.start()
        ender.join(timeout)
    close_connections_of_ended_threads()


_embedded: EmbeddedWorker | None = None


def start_embedded() -> EmbeddedWorker | None:
    """Called by the ASGI lifespan when HEARTH_BATCH_WORKER=inprocess."""
    global _embedded
    if settings.HEARTH_BATCH_WORKER != "inprocess" or _embedded is not None:
        return _embedded
    worker = EmbeddedWorker()
    worker.start()
    _embedded = worker
    return worker


def stop_embedded() -> None:
    global _embedded
    if _embedded is not None:
        _embedded.stop()
        _embedded = None
