"""Request bodies of the adapters (finetunes) API."""

from __future__ import annotations

from pydantic import Field

from controlplane.api.body import StrictBody


class FinetuneCreate(StrictBody):
    name: str = Field(description="Unique in the account: letters, digits, '.', '_', '-'; up to 100 characters.")
    model: str = Field(description="The base model the adapter was trained for, e.g. @hearth/smollm2-135m-instruct.")
    description: str = ""
