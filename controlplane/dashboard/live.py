"""Live overview updates: a committed usage event tells the account's dashboard group that its figures moved.

The notice carries no figures. Each open dashboard re-reads the rollups on its own schedule (consumers.py),
so a burst of a thousand requests costs a few notices and a few reads, not a message per request.
Notices go out at most once per NOTICE_INTERVAL_S per account. A consumer reads again REREAD_AFTER_S after
each notice, which is longer than that interval, so an event whose notice was skipped still shows. Sending never
fails the request that was metered."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from controlplane.api import layer

log = logging.getLogger("controlplane.dashboard")
EVENT_TYPE = "usage.changed"
NOTICE_INTERVAL_S = 0.5
REREAD_AFTER_S = 1.0
_last: dict[str, float] = {}
_lock = threading.Lock()


def group_name(account_id: str) -> str:
    return f"usage.{account_id}"


def notify(account_id: str, **_: Any) -> None:
    now = time.monotonic()
    with _lock:
        if now - _last.get(account_id, float("-inf")) < NOTICE_INTERVAL_S:
            return
        _last[account_id] = now
    layer.group_send(group_name(account_id), {"type": EVENT_TYPE})
