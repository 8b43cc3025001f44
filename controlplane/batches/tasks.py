"""Celery tasks. Each takes ids only and re-reads the database, so a message can be delivered twice, late or
never (the sweep re-sends) without changing the outcome. Messages are acknowledged after the work is stored
(acks_late); a worker killed mid-item leaves its message unacknowledged and the broker hands it to another."""

from __future__ import annotations

import logging
import random
from typing import Any

from celery.signals import task_postrun, task_prerun
from django.db import close_old_connections

from controlplane.batches import execute, maintenance, services
from controlplane.celery import app

log = logging.getLogger("controlplane.batches")
MAX_BACKOFF_S = 60.0


@task_prerun.connect
@task_postrun.connect
def _fresh_connections(**kwargs: Any) -> None:
    # The in-process worker is a bare WorkController, without the Django fixup of `celery worker`: drop broken
    # or expired connections around each task as Django does around each request.
    close_old_connections()


def backoff(retries: int) -> float:
    """Exponential with jitter, capped: 1, 2, 4 ... 60 s, so a busy engine is not hammered by every item."""
    return min(MAX_BACKOFF_S, 2.0 ** min(retries, 6)) * random.uniform(0.5, 1.0)


@app.task(name="batches.prepare", acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def prepare_batch(batch_id: str) -> None:
    services.prepare(batch_id)


@app.task(name="batches.run_item", bind=True, acks_late=True, reject_on_worker_lost=True, ignore_result=True,
          max_retries=None)
def run_item(self, item_id: int) -> str:
    result = services.claim(item_id)
    if result.wait_s is not None:
        # Someone holds a live lease on it. Look again once it could have lapsed: if the holder died, take it.
        raise self.retry(countdown=min(result.wait_s + 0.5, MAX_BACKOFF_S), max_retries=None)
    if result.claim is None:
        return "done"
    claim, item = result.claim, result.item
    assert item is not None  # a claim comes with its item
    try:
        outcome = execute.run_claimed(claim, item, item.batch)
    except execute.Busy as exc:
        services.release(claim)
        log.info("engine busy (%s); batch item %s retries", exc, item_id)
        raise self.retry(countdown=backoff(self.request.retries), max_retries=None) from None
    except execute.LeaseLost:
        return "lost"
    except Exception:
        # A bug or an outage of our own: give the item back (counted as an attempt) and try again later.
        log.exception("batch item %s failed unexpectedly", item_id)
        services.release(claim, busy=False)
        raise self.retry(countdown=backoff(self.request.retries), max_retries=None) from None
    return "stored" if services.finish(claim, outcome) else "lost"


@app.task(name="batches.sweep", ignore_result=True)
def sweep() -> dict[str, int]:
    return maintenance.sweep()


@app.task(name="batches.cleanup", ignore_result=True)
def cleanup() -> dict[str, int]:
    return maintenance.cleanup()
