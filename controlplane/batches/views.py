"""Batch routes. OpenAI: /v1/files and /v1/batches (also under /client/v4/accounts/{id}/ai/v1/). Workers AI:
the queueRequest branch of the native run route (submit and poll). Views parse and delegate to services."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse
from django.http.multipartparser import MultiPartParserError

from controlplane.accounts.models import ApiKey
from controlplane.accounts.services import KeyContext, authenticate_key, parse_bearer
from controlplane.api import errors
from controlplane.api.auth import require_account, require_permission
from controlplane.api.body import parse, read_body
from controlplane.api.http import api_view, ascii_int, json_response
from controlplane.batches import file_services, results, services
from controlplane.batches.schemas import BatchCreate
from controlplane.usage import limits
from controlplane.usage.services import check_account_limits

MAX_PAGE = 100


def _ctx(request: HttpRequest, account_id: str | None, permission: str) -> KeyContext:
    ctx = authenticate_key(parse_bearer(request.headers.get("Authorization")))
    require_account(ctx, account_id)
    require_permission(ctx, permission)
    return ctx


def _page_args(request: HttpRequest) -> tuple[int, str | None]:
    limit = ascii_int(request.GET.get("limit", "20"))
    if limit is None or not 1 <= limit <= MAX_PAGE:
        raise errors.invalid(f"limit: an integer from 1 to {MAX_PAGE}", "limit")
    return limit, request.GET.get("after") or None


def _list(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


# ------------------------------------------------------------------------------------------------ files
@api_view("openai", ("GET", "POST"))
def files(request: HttpRequest, account_id: str | None = None) -> HttpResponse:
    if request.method == "GET":
        ctx = _ctx(request, account_id, ApiKey.Permission.READ)
        limit, after = _page_args(request)
        rows, more = file_services.list_files(ctx.account_id, purpose=request.GET.get("purpose"), limit=limit,
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
        seconds = ascii_int(form.get("expires_after[seconds]", ""))
        if form.get("expires_after[anchor]", "created_at") != "created_at" or seconds is None or not (
                3600 <= seconds <= 30 * 86400):
            raise errors.invalid("expires_after: anchor created_at and 3600 to 2592000 seconds", "expires_after")
        expires = seconds
    created = file_services.create_file(ctx, purpose=form.get("purpose", ""), filename=upload.name or "input.jsonl",
                                   content=upload.read(), expires_after_seconds=expires)
    return json_response(results.file_json(created))


@api_view("openai", ("GET", "DELETE"))
def file_detail(request: HttpRequest, file_id: str, account_id: str | None = None) -> HttpResponse:
    if request.method == "DELETE":
        ctx = _ctx(request, account_id, ApiKey.Permission.RUN)
        file_services.delete_file(ctx.account_id, file_id)
        return json_response({"id": file_id, "object": "file", "deleted": True})
    ctx = _ctx(request, account_id, ApiKey.Permission.READ)
    return json_response(results.file_json(file_services.get_file(ctx.account_id, file_id)))


@api_view("openai", ("GET",))
def file_content(request: HttpRequest, file_id: str, account_id: str | None = None) -> HttpResponse:
    ctx = _ctx(request, account_id, ApiKey.Permission.READ)
    found, content = file_services.file_content(ctx.account_id, file_id)
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
    raw, deferred = read_body(request)
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


