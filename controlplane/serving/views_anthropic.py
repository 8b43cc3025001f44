"""Anthropic's Messages routes: /v1/messages and /v1/messages/count_tokens (also under
/client/v4/accounts/{account_id}/ai/v1/). The key comes as `x-api-key` (Anthropic's header) or a bearer token;
`anthropic-version` is accepted whatever its value."""

from __future__ import annotations

import time
from typing import Any

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse, JsonResponse

from controlplane.api import errors
from controlplane.api.body import read_body
from controlplane.api.http import AFFINITY_HEADER, api_view
from controlplane.catalog.models import Task
from controlplane.catalog.services import ModelEntry
from controlplane.serving import pipeline
from controlplane.serving.dispatch import get_backend
from controlplane.serving.protocol.anthropic import MESSAGES, chat_messages, count_tokens_job
from inference.errors import EngineError


def _auth(request: HttpRequest) -> str | None:
    header = request.headers.get("Authorization")
    if header:
        return header
    key = request.headers.get("x-api-key")
    return f"Bearer {key}" if key else None


@api_view("anthropic", ("POST",))
async def messages(request: HttpRequest, account_id: str | None = None) -> HttpResponse:
    started = time.monotonic()
    raw, deferred = read_body(request)

    def body(entry: ModelEntry | None) -> Any:
        if deferred is not None:
            raise deferred
        return MESSAGES.check(raw, entry)

    adm = await sync_to_async(pipeline.admit)(_auth(request), account_id=account_id, model=MESSAGES.model_of(raw),
                                              task=MESSAGES.task, body=body)
    return await MESSAGES.respond(adm, affinity=request.headers.get(AFFINITY_HEADER, ""), started=started)


@api_view("anthropic", ("POST",))
async def count_tokens(request: HttpRequest, account_id: str | None = None) -> HttpResponse:
    """The prompt's tokens as the model would see them: the chat template, the system turn and the tools."""
    raw, deferred = read_body(request)

    def body(entry: ModelEntry | None) -> Any:
        if deferred is not None:
            raise deferred
        return count_tokens_job(raw, entry)

    adm = await sync_to_async(pipeline.admit)(_auth(request), account_id=account_id, model=MESSAGES.model_of(raw),
                                              task=Task.TEXT_GENERATION, body=body)
    parsed, tools = adm.body
    offered = [spec.as_openai() for spec in tools.specs] if tools is not None else None
    try:
        ids = await get_backend().encode(adm.entry.name, messages=chat_messages(parsed), tools=offered)
    except EngineError as exc:
        raise errors.from_engine(exc, adm.entry.name) from None
    return JsonResponse({"input_tokens": len(ids)})
