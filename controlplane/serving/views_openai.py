"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/embeddings (also under
/client/v4/accounts/{account_id}/ai/v1/). Each reads the body, admits it and hands it to its endpoint in
`protocol.openai`."""

from __future__ import annotations

import time

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse

from controlplane.api.body import read_body
from controlplane.api.http import AFFINITY_HEADER, api_view
from controlplane.catalog.services import ModelEntry
from controlplane.serving import pipeline
from controlplane.serving.job import Job
from controlplane.serving.protocol import CHAT, COMPLETIONS, EMBEDDINGS, Endpoint


async def _serve(request: HttpRequest, endpoint: Endpoint, account_id: str | None) -> HttpResponse:
    started = time.monotonic()
    raw, deferred = read_body(request)

    def body(entry: ModelEntry | None) -> Job | None:
        if deferred is not None:
            raise deferred
        return endpoint.check(raw, entry)

    adm = await sync_to_async(pipeline.admit)(request.headers.get("Authorization"), account_id=account_id,
                                              model=endpoint.model_of(raw), task=endpoint.task, body=body)
    return await endpoint.respond(adm, affinity=request.headers.get(AFFINITY_HEADER, ""), started=started)


@api_view("openai", ("POST",))
async def chat_completions(request: HttpRequest, account_id: str | None = None) -> HttpResponse:
    return await _serve(request, CHAT, account_id)


@api_view("openai", ("POST",))
async def completions(request: HttpRequest, account_id: str | None = None) -> HttpResponse:
    return await _serve(request, COMPLETIONS, account_id)


@api_view("openai", ("POST",))
async def embeddings(request: HttpRequest, account_id: str | None = None) -> HttpResponse:
    return await _serve(request, EMBEDDINGS, account_id)
