"""Progress events for the dashboard: every change of a batch's counts or status is sent to the account's
channel-layer group, `batches.<account_id>`, as {"type": "batch.progress", ...}. A consumer subscribes with
`channel_layer.group_add(group_name(account_id), channel_name)`. Publishing never fails the work it reports:
no layer configured, or an unreachable one, only costs the event.

Within one process a batch's events go out in order: counts only grow and statuses only move forward, but the
worker threads that finish a batch's items publish after their own commits, so the thread holding the older
counts could reach the layer last. So each batch has at most one thread sending at a time, and a state older than
the newest one decided is dropped. A thread with news while another is sending leaves it to that one and returns
(the sender sends the newest waiting state after its own): nobody waits on someone else's send, which matters when
the layer hangs. (Workers in other processes can still interleave theirs; the dashboard ignores an event that
would move a row back.)"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from controlplane.api import layer
from controlplane.batches.models import Batch

log = logging.getLogger("controlplane.batches")
EVENT_TYPE = "batch.progress"
# Per-item progress is published at most this often per batch: a dashboard needs no more, and a 1,000-item batch
# should not pay a channel-layer send per item. Status changes are always sent.
PROGRESS_INTERVAL_S = 0.5
# How far a batch has got: its status's rank first, then its finished items. The dashboard orders events the same way.
STATUS_RANK = {Batch.Status.VALIDATING.value: 0, Batch.Status.IN_PROGRESS.value: 1, Batch.Status.CANCELLING.value: 2,
               Batch.Status.FINALIZING.value: 3, **{s.value: 4 for s in Batch.TERMINAL}}
# A finished batch's entry is kept this long, so that a late, older event of it is still recognised and dropped.
FORGET_AFTER_S = 600.0
FORGET_CHECK_SIZE = 1024


@dataclass(slots=True)
class _Books:
    """One batch's publishing: the newest state decided (sent, being sent or waiting) and when."""

    at: float
    stage: tuple[int, int]
    sending: bool = False
    waiting: dict[str, Any] | None = None  # the newest event for the sending thread to send after its own


_books: dict[str, _Books] = {}
_books_lock = threading.Lock()


def group_name(account_id: str) -> str:
    return f"batches.{account_id}"


def progress(batch: Batch) -> dict[str, Any]:
    return {"type": EVENT_TYPE, "batch_id": batch.pk, "api": batch.api, "status": batch.status,
            "total": batch.total_count, "completed": batch.completed_count, "failed": batch.failed_count,
            "cancelled": batch.cancelled_count}


def stage(batch: Batch) -> tuple[int, int]:
    return (STATUS_RANK.get(batch.status, -1),
            batch.completed_count + batch.failed_count + batch.cancelled_count)


def publish(batch: Batch, *, throttle: bool = False) -> None:
    """throttle: a count update that may be skipped when this batch published under PROGRESS_INTERVAL_S ago.
    A state older than the newest one decided for the batch is dropped (see the module's note)."""
    now = time.monotonic()
    reached, event, group = stage(batch), progress(batch), group_name(batch.account_id)
    with _books_lock:
        books = _books.get(batch.pk)
        if books is not None and (reached < books.stage or (throttle and now - books.at < PROGRESS_INTERVAL_S)):
            return
        if books is None:
            books = _books[batch.pk] = _Books(now, reached)
        books.at, books.stage = now, reached
        if books.sending:
            books.waiting = event
            return
        books.sending = True
        if len(_books) > FORGET_CHECK_SIZE:
            _forget_finished(now)
    try:
        while True:
            layer.group_send(group, event)
            with _books_lock:  # one critical section: a state left here after this look is not left unsent
                if books.waiting is None:
                    books.sending = False
                    return
                event, books.waiting = books.waiting, None
    except BaseException:
        with _books_lock:
            books.sending = False
        raise


def _forget_finished(now: float) -> None:
    terminal = STATUS_RANK[Batch.Status.COMPLETED.value]
    for pk in [pk for pk, b in _books.items()
               if b.stage[0] >= terminal and not b.sending and now - b.at > FORGET_AFTER_S]:
        del _books[pk]
