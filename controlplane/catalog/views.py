"""Catalog listings: OpenAI's /v1/models and Workers AI's models/search, both with prices."""

from __future__ import annotations

import time
import uuid
from typing import Any
from urllib.parse import unquote

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse

from controlplane.accounts.models import ApiKey
from controlplane.accounts.services import authenticate_key, authenticate_key_cached, parse_bearer
from controlplane.api import errors
from controlplane.api.auth import key_context, require_account, require_permission
from controlplane.api.http import api_view, envelope, json_response
from controlplane.catalog.services import catalog, catalog_cached, served_models


def _visible(ctx_models: tuple[str, ...], items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m for m in items if not ctx_models or m["id"] in ctx_models]


def _listing(header: str | None, account_id: str | None) -> dict[str, Any]:
    ctx = authenticate_key(parse_bearer(header))
    require_account(ctx, account_id)
    return {"object": "list", "data": _visible(ctx.allowed_models, served_models())}


def _listing_from_cache(header: str | None, account_id: str | None) -> dict[str, Any] | None:
    ctx = authenticate_key_cached(parse_bearer(header))
    entries = catalog_cached() if ctx is not None else None
    if ctx is None or entries is None:
        return None
    require_account(ctx, account_id)
    return {"object": "list", "data": _visible(ctx.allowed_models, served_models(entries=entries))}


@api_view("openai", ("GET",))
async def list_models(request: HttpRequest, account_id: str | None = None) -> HttpResponse:
    # The busiest read: answered on the event loop from the cached key and catalog when both are warm, with a
    # thread hop to the database only when one of them is not.
    header = request.headers.get("Authorization")
    data = _listing_from_cache(header, account_id) or await sync_to_async(_listing)(header, account_id)
    return json_response(data)


@api_view("openai", ("GET",))
def retrieve_model(request: HttpRequest, model: str, account_id: str | None = None) -> HttpResponse:
    ctx = key_context(request)
    require_account(ctx, account_id)
    model = unquote(model)
    entry = catalog().get(model)
    if entry is None or not entry.installed or not ctx.may_use(model):
        raise errors.unknown_model(model)
    return json_response(entry.listing(time.time()))


def _workers_ai_shape(item: dict[str, Any]) -> dict[str, Any]:
    pricing = item["pricing"] or {}
    price = [
        {"unit": "per M input tokens", "price": pricing.get("usd_per_m_input_tokens"), "currency": "USD"},
        {"unit": "per M cached input tokens", "price": pricing.get("usd_per_m_cached_input_tokens"),
         "currency": "USD"},
        {"unit": "per M output tokens", "price": pricing.get("usd_per_m_output_tokens"), "currency": "USD"},
    ] if pricing else []
    properties = [{"property_id": "context_window", "value": str(item["context_window"])},
                  {"property_id": "lora", "value": str(item["supports_lora"]).lower()},
                  {"property_id": "function_calling", "value": str(item["supports_tools"]).lower()},
                  {"property_id": "json_mode", "value": str(item["supports_json_mode"]).lower()},
                  {"property_id": "price", "value": price}]
    spec = item["speculation"]
    if spec is not None:
        properties += [{"property_id": "speculation", "value": spec["mode"]},
                       {"property_id": "num_speculative_tokens", "value": str(spec["k"])}]
        if spec["draft_model"]:
            properties.append({"property_id": "draft_model", "value": spec["draft_model"]})
    properties += [{"property_id": k, "value": str(v)} for k, v in item["properties"].items()
                   if k not in ("function_calling", "json_mode")]  # said above, as the catalog decides them
    return {
        "id": str(uuid.uuid5(uuid.NAMESPACE_URL, item["id"])),
        "name": item["id"],
        "description": item["description"],
        "task": {"id": item["task"], "name": item["task"].replace("-", " ").title()},
        "created_at": item["created"],
        "deprecated_on": item["deprecated_on"],
        "properties": properties,
        "pricing": item["pricing"],
    }


@api_view("native", ("GET",))
def search_models(request: HttpRequest, account_id: str) -> HttpResponse:
    ctx = key_context(request)
    require_account(ctx, account_id)
    require_permission(ctx, ApiKey.Permission.READ)
    items = _visible(ctx.allowed_models, served_models())
    search = request.GET.get("search", "").strip().lower()
    task = request.GET.get("task", "").strip().lower()
    if search:
        items = [m for m in items if search in m["id"].lower() or search in m["description"].lower()]
    if task:
        items = [m for m in items if m["task"] == task or m["task"].replace("-", " ") == task]
    try:
        page = max(1, int(request.GET.get("page", 1)))
        per_page = min(100, max(1, int(request.GET.get("per_page", 50))))
    except ValueError:
        raise errors.invalid("page and per_page must be integers") from None
    window = items[(page - 1) * per_page: page * per_page]
    info = {"page": page, "per_page": per_page, "count": len(window), "total_count": len(items)}
    return json_response(envelope([_workers_ai_shape(m) for m in window], result_info=info))
