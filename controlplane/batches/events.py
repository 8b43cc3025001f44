"""Progress events for the dashboard: every change of a batch's counts or status is sent to the account's
channel-layer group, `batches.<account_id>`, as {"type": "batch.progress", ...}. A consumer subscribes with
`channel_layer.group_add(group_name(account_id), channel_name)`. Publishing never fails the work it reports:
no layer configured, or an unreachable one, only costs the event."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from controlplane.api import layer
from controlplane.batches.models import Batch

log = logging.getLogger("controlplane.batches")
EVENT_TYPE = "batch.progress"
# Per-item progress is published at most this often per batch: a dashboard needs no more, and a 1,000-item batch
# should not pay a channel-layer send per item. Status changes are always sent.
PROGRESS_INTERVAL_S = 0.5
_last_sent: dict[str, float] = {}
_last_lock = threading.Lock()


def group_name(account_id: str) -> str:
    return f"batches.{account_id}"


def progress(batch: Batch) -> dict[str, Any]:
    return {"type": EVENT_TYPE, "batch_id": batch.pk, "api": batch.api, "status": batch.status,
            "total": batch.total_count, "completed": batch.completed_count, "failed": batch.failed_count,
            "cancelled": batch.cancelled_count}


def publish(batch: Batch, *, throttle: bool = False) -> None:
    """throttle: a count update that may be skipped when this batch published under PROGRESS_INTERVAL_S ago."""
    now = time.monotonic()
    with _last_lock:
        if throttle and now - _last_sent.get(batch.pk, float("-inf")) < PROGRESS_INTERVAL_S:
            return
        if batch.status in Batch.TERMINAL:
            _last_sent.pop(batch.pk, None)
        else:
            _last_sent[batch.pk] = now
    layer.group_send(group_name(batch.account_id), progress(batch))
