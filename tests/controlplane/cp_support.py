"""Shared helpers for the control-plane tests (imported by conftest and the test modules)."""

from __future__ import annotations

from dataclasses import dataclass

from controlplane.accounts.models import Account, ApiKey
from controlplane.accounts.services import create_account, issue_key
from inference.models.catalog import DEFAULT_EMBEDDING_MODEL, DEFAULT_MODEL

CHAT_MODEL = DEFAULT_MODEL
EMBED_MODEL = DEFAULT_EMBEDDING_MODEL
BATCH_BROKER = "redis://127.0.0.1:6379/14"  # the real Redis; batch tests use a queue of their own


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
