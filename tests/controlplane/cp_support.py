"""Shared helpers for the control-plane tests (imported by conftest and the test modules)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from controlplane.accounts.models import Account, ApiKey
from controlplane.accounts.services import create_account, issue_key
from inference.models.catalog import DEFAULT_EMBEDDING_MODEL, DEFAULT_MODEL

CHAT_MODEL = DEFAULT_MODEL
EMBED_MODEL = DEFAULT_EMBEDDING_MODEL


def redis_url(slot: int) -> str:
    """A database of the real Redis for one use of the tests (slot 0: the dashboard's channel layer, 1: the
    batches' channel layer, 2: the batch broker, 3: the cache). The suite's two passes run side by side
    (`.ci/test-suite`), each on a block of four databases of its own (HEARTH_TEST_REDIS_DB, the block's first):
    Celery's unacked bookkeeping and the cache's clear() (FLUSHDB) span a whole database, and accounts of the two
    passes share primary keys, so their channel groups would meet."""
    first = int(os.environ.get("HEARTH_TEST_REDIS_DB", "12"))
    if not 0 <= slot < 4 or not 0 <= first <= 12:
        raise ValueError(f"Redis slot {slot} or first database {first} out of range (a server has 16)")
    return f"redis://127.0.0.1:6379/{first + slot}"


BATCH_BROKER = redis_url(2)  # the real Redis; batch tests use a queue of their own


@dataclass
class Tenant:
    account: Account
    key: ApiKey
    secret: str

    @property
    def auth(self) -> dict[str, str]:
        return {"HTTP_AUTHORIZATION": f"Bearer {self.secret}"}

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.secret}"}

    @property
    def run_url(self) -> str:
        return f"/client/v4/accounts/{self.account.pk}/ai/run/"


def make_tenant(name: str, **key_options) -> Tenant:
    account = create_account(name)
    key, secret = issue_key(account, **key_options)
    return Tenant(account, key, secret)


def seconds_left_in_minute(before: float, after: float) -> range:
    """Retry-After values a rate-limited answer may carry if it was computed between `before` and `after`:
    the whole seconds left in that minute's window, rounded up."""
    import math

    def left(t: float) -> int:
        return max(1, math.ceil(60 - t % 60))

    low, high = sorted((left(after), left(before)))
    return range(low, high + 1)
