"""Request bodies of the accounts API (API keys)."""

from __future__ import annotations

from pydantic import Field

from controlplane.accounts.models import ApiKey
from controlplane.api.body import Integer, StrictBody

MAX_LIMIT = 2**31 - 1


class KeyCreate(StrictBody):
    name: str = Field("default", min_length=1, max_length=100)
    permission: str = Field(ApiKey.Permission.RUN, description="read, run or admin")
    models: list[str] = Field(default_factory=list, description="Model names; empty: every model.")
    expires_on: str | None = Field(None, description="ISO 8601 time after which the key stops working.")
    # Bounded by the database's integer column: a larger number would fail the insert, not the request.
    requests_per_minute: Integer | None = Field(None, ge=0, le=MAX_LIMIT)
    tokens_per_minute: Integer | None = Field(None, ge=0, le=MAX_LIMIT)
