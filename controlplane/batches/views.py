"""Batch routes. OpenAI: /v1/files and /v1/batches (also under /client/v4/accounts/{id}/ai/v1/). Workers AI:
the queueRequest branch of the native run route (submit and poll). Views parse and delegate to services."""

from __future__ import annotations

from typing import Any

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse
from django.http.multipartparser import MultiPartParserError

from controlplane.accounts.models import ApiKey
from controlplane.accounts.services import KeyContext, authenticate_key, parse_bearer
from controlplane.api import errors
from controlplane.api.auth import require_account, require_permission
from controlplane.api.errors import ApiError
from controlplane.api.http import api_view, envelope, json_response, read_json
from controlplane.batches import results, services
from controlplane.batches.schemas import BatchCreate
from controlplane.batches.validation import check_native_body
from controlplane.catalog.services import ModelEntry
from controlplane.serving import pipeline
from controlplane.serving.schemas import parse
from controlplane.usage import limits
from controlplane.usage.services import check_account_limits

MAX_PAGE = 100


def _ctx(request: HttpRequest, account_id: str | None, permission: str) -> KeyContext:
    ctx = authenticate_key(parse_bearer(request.headers.get("Authorization")))
    require_account(ctx, account_id)
    require_permission(ctx, permission)
    return ctx


def _page_args(request: HttpRequest) -> tuple[int, str | None]:
    raw = request.GET.get("limit", "20")
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_PAGE:
        raise errors.invalid(f"limit: an integer from 1 to {MAX_PAGE}", "limit")
    return int(raw), request.GET.get("after") or None


def _list(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


# ------------------------------------------------------------------------------------------------ files
@api_view("openai", ("GET", "POST"))
def files(request: HttpRequest, account_id: str | None = None) -> HttpResponse:
    if request.method == "GET":
        ctx = _ctx(request, account_id, ApiKey.Permission.READ)
        limit, after = _page_args(request)
        rows, more = services.list_files(ctx.account_id, purpose=request.GET.get("purpose"), limit=limit,
                                         after=after)
        return json_response(_list([results.file_json(f) for f in rows], more))
    ctx = _ctx(request, account_id, ApiKey.Permission.RUN)
    if not request.content_type.startswith("multipart/form-data"):
        raise errors.invalid("Upload the file as multipart/form-data with fields file and purpose", "file")
    try:
        form, uploads = request.POST, request.FILES
    except MultiPartParserError as exc:
        raise errors.malformed(f"Malformed multipart body: {exc}") from None
    upload = uploads.get("file")
    if upload is None:
        raise errors.invalid("file: missing (a multipart field named file)", "file")
    if upload.size is not None and upload.size > services.settings.HEARTH_BATCH_MAX_FILE_BYTES:
        raise errors.request_too_large(f"The file is {upload.size:,} bytes; the limit is "
                                       f"{services.settings.HEARTH_BATCH_MAX_FILE_BYTES:,}")
    expires = None
    if form.get("expires_after[seconds]") is not None:
        seconds = form.get("expires_after[seconds]", "")
        if form.get("expires_after[anchor]", "created_at") != "created_at" or not seconds.isdigit() or not (
                3600 <= int(seconds) <= 30 * 86400):
            raise errors.invalid("expires_after: anchor created_at and 3600 to 2592000 seconds", "expires_after")
        expires = int(seconds)
    created = services.create_file(ctx, purpose=form.get("purpose", ""), filename=upload.name or "input.jsonl",
                                   content=upload.read(), expires_after_seconds=expires)
    return json_response(results.file_json(created))


@api_view("openai", ("GET", "DELETE"))
def file_detail(request: HttpRequest, file_id: str, account_id: str | None = None) -> HttpResponse:
    if request.method == "DELETE":
        ctx = _ctx(request, account_id, ApiKey.Permission.RUN)
        services.delete_file(ctx.account_id, file_id)
        return json_response({"id": file_id, "object": "file", "deleted": True})
    ctx = _ctx(request, account_id, ApiKey.Permission.READ)
    return json_response(results.file_json(services.get_file(ctx.account_id, file_id)))


@api_view("openai", ("GET",))
def file_content(request: HttpRequest, file_id: str, account_id: str | None = None) -> HttpResponse:
    ctx = _ctx(request, account_id, ApiKey.Permission.READ)
    found, content = services.file_content(ctx.account_id, file_id)
    response = HttpResponse(content, content_type="application/jsonl")
    response["Content-Disposition"] = f'attachment; filename="{found.filename}"'
    return response


# ------------------------------------------------------------------------------------------------ batches
@api_view("openai", ("GET", "POST"))
def batches(request: HttpRequest, account_id: str | None = None) -> HttpResponse:
    if request.method == "GET":
        ctx = _ctx(request, account_id, ApiKey.Permission.READ)
        limit, after = _page_args(request)
        rows, more = services.list_batches(ctx.account_id, limit=limit, after=after)
        return json_response(_list([results.batch_json(b) for b in rows], more))
    raw, deferred = _read(request)
    ctx = _ctx(request, account_id, ApiKey.Permission.RUN)
    if deferred is not None:
        raise deferred
    body = parse(BatchCreate, raw or {})
    check_account_limits(ctx)  # as an interactive request: a free account past its allocation waits
    limits.check_rate(ctx)
    batch = services.create_openai_batch(ctx, input_file_id=body.input_file_id, endpoint=body.endpoint,
                                         completion_window=body.completion_window, metadata=body.metadata)
    return json_response(results.batch_json(batch))


@api_view("openai", ("GET",))
def batch_detail(request: HttpRequest, batch_id: str, account_id: str | None = None) -> HttpResponse:
    ctx = _ctx(request, account_id, ApiKey.Permission.READ)
    return json_response(results.batch_json(services.get_batch(ctx.account_id, batch_id)))


@api_view("openai", ("POST",))
def batch_cancel(request: HttpRequest, batch_id: str, account_id: str | None = None) -> HttpResponse:
    ctx = _ctx(request, account_id, ApiKey.Permission.RUN)
    return json_response(results.batch_json(services.cancel_batch(ctx.account_id, batch_id)))


def _read(request: HttpRequest) -> tuple[dict[str, Any] | None, ApiError | None]:
    try:
        return read_json(request), None
    except ApiError as exc:
        return None, exc


# ------------------------------------------------------------------------------------------------ Workers AI
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
        body=lambda entry: _native_requests(raw, deferred, entry, account_id), lora=lambda body: None)
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
    return json_response(envelope(results.native_result(batch, services.items_of(batch))))
