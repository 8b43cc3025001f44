"""Workers AI's queueRequest: the batch branch of the native run route (submit a list of requests, poll by
request_id). The run view hands such bodies here; each request is checked as the run route would check it."""

from __future__ import annotations

from typing import Any

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse

from controlplane.accounts.models import ApiKey
from controlplane.accounts.services import KeyContext, authenticate_key, parse_bearer
from controlplane.api import errors
from controlplane.api.auth import require_account, require_permission
from controlplane.api.errors import ApiError
from controlplane.api.http import envelope, json_response
from controlplane.batches import results, services
from controlplane.batches.validation import check_native_body
from controlplane.catalog.services import ModelEntry
from controlplane.serving import pipeline


def _ctx(request: HttpRequest, account_id: str | None, permission: str) -> KeyContext:
    ctx = authenticate_key(parse_bearer(request.headers.get("Authorization")))
    require_account(ctx, account_id)
    require_permission(ctx, permission)
    return ctx


def wants_queue(request: HttpRequest, raw: dict[str, Any] | None) -> bool:
    """A queueRequest submission or poll (?queueRequest=true, options.queueRequest, or a request_id body)."""
    if request.GET.get("queueRequest", "").lower() in ("true", "1"):
        return True
    if raw is None:
        return False
    options = raw.get("options")
    return (isinstance(options, dict) and options.get("queueRequest") is True) or "request_id" in raw


def _native_requests(raw: dict[str, Any] | None, deferred: ApiError | None, entry: ModelEntry | None,
                     account_id: str) -> list[tuple[str | None, dict[str, Any]]] | None:
    if deferred is not None:
        raise deferred
    if entry is None:
        return None
    assert raw is not None
    requests = raw.get("requests")
    if not isinstance(requests, list) or not requests:
        raise errors.invalid("requests: give a non-empty list of request objects (or a request_id to poll)",
                             "requests")
    limit = services.settings.HEARTH_BATCH_MAX_REQUESTS
    if len(requests) > limit:
        raise errors.invalid(f"requests: {len(requests):,} requests; a batch takes at most {limit:,}", "requests")
    if not entry.supports_batch:
        raise errors.invalid(f"{entry.name} does not accept batch requests", "model")
    parsed = []
    for i, one in enumerate(requests):
        if not isinstance(one, dict):
            raise errors.invalid(f"requests[{i}]: each request must be an object", "requests")
        reference = one.get("external_reference")
        if reference is not None and (not isinstance(reference, str) or len(reference) > 512):
            raise errors.invalid(f"requests[{i}].external_reference: a string of up to 512 characters",
                                 "external_reference")
        body = {k: v for k, v in one.items() if k != "external_reference"}
        try:
            check_native_body(entry, body, account_id)
        except ApiError as exc:
            exc.message = f"requests[{i}]: {exc.message}"
            raise
        parsed.append((reference, body))
    return parsed


async def native_queue(request: HttpRequest, account_id: str, model: str, raw: dict[str, Any] | None,
                       deferred: ApiError | None) -> HttpResponse:
    if raw is not None and "request_id" in raw:
        return await sync_to_async(_native_poll)(request, account_id, raw, deferred)
    adm = await sync_to_async(pipeline.admit)(
        request.headers.get("Authorization"), account_id=account_id, model=model,
        body=lambda entry: _native_requests(raw, deferred, entry, account_id))
    batch = await sync_to_async(services.create_native_batch)(adm.ctx, adm.entry.name, adm.body)
    return json_response(envelope({"status": "queued", "request_id": batch.pk, "model": batch.model}))


def _native_poll(request: HttpRequest, account_id: str, raw: dict[str, Any],
                 deferred: ApiError | None) -> HttpResponse:
    ctx = _ctx(request, account_id, ApiKey.Permission.READ)
    if deferred is not None:
        raise deferred
    request_id = raw.get("request_id")
    if not isinstance(request_id, str) or not request_id:
        raise errors.invalid("request_id: the id a queued request returned", "request_id")
    batch = services.get_batch(ctx.account_id, request_id)
    if batch.api != batch.Api.NATIVE:
        raise errors.not_found(f"No such queued request: {request_id}")
    if batch.results_purged_at is not None:
        raise errors.not_found(f"The results of {request_id} were removed after the retention period")
    if batch.status not in batch.TERMINAL:
        return json_response(envelope(results.native_status(batch)))
    return json_response(envelope(results.native_result(batch, services.items_of(batch))), bulk=True)
