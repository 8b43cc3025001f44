"""OpenAI's Responses routes: POST /v1/responses, GET and DELETE /v1/responses/{id}, POST .../cancel (also under
/client/v4/accounts/{account_id}/ai/v1/). Reading, admitting and handing over; storing is response_store's."""

from __future__ import annotations

import time
from typing import Any

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse

from controlplane.accounts.services import authenticate_key, parse_bearer
from controlplane.api.auth import require_account
from controlplane.api.body import read_body
from controlplane.api.http import AFFINITY_HEADER, api_view, json_response
from controlplane.catalog.services import ModelEntry
from controlplane.serving import pipeline, response_store, tasks
from controlplane.serving.protocol.responses import RESPONSES, use_conversation


@api_view("openai", ("POST",))
async def responses(request: HttpRequest, account_id: str | None = None) -> HttpResponse:
    started = time.monotonic()
    raw, deferred = read_body(request)

    def body(entry: ModelEntry | None) -> Any:
        if deferred is not None:
            raise deferred
        return RESPONSES.check(raw, entry)

    adm = await sync_to_async(pipeline.admit)(request.headers.get("Authorization"), account_id=account_id,
                                              model=RESPONSES.model_of(raw), task=RESPONSES.task, body=body)
    job = adm.job
    owner = adm.ctx.account_id
    if job.body.previous_response_id:
        prior = await sync_to_async(response_store.prior_conversation)(owner, job.body.previous_response_id)
        use_conversation(job, [*prior, *job.extra["input"]])
    if job.body.background:
        def queue() -> dict[str, Any]:
            queued = response_store.queue(owner, adm.key_id, job, raw or {})
            tasks.send(queued["id"])
            return queued

        return json_response(await sync_to_async(queue)())

    async def keep(answer: dict[str, Any]) -> None:
        if job.body.store:
            await sync_to_async(response_store.save)(owner, adm.key_id, job, raw or {}, answer)

    return await RESPONSES.respond(adm, affinity=request.headers.get(AFFINITY_HEADER, ""), started=started,
                                   on_answer=keep)


def _owner(request: HttpRequest, account_id: str | None) -> str:
    ctx = authenticate_key(parse_bearer(request.headers.get("Authorization")))
    require_account(ctx, account_id)
    return ctx.account_id


@api_view("openai", ("GET", "DELETE"))
def response_detail(request: HttpRequest, response_id: str, account_id: str | None = None) -> HttpResponse:
    owner = _owner(request, account_id)
    if request.method == "DELETE":
        response_store.delete(owner, response_id)
        return json_response({"id": response_id, "object": "response.deleted", "deleted": True})
    return json_response(response_store.get(owner, response_id))


@api_view("openai", ("POST",))
def response_cancel(request: HttpRequest, response_id: str, account_id: str | None = None) -> HttpResponse:
    return json_response(response_store.cancel(_owner(request, account_id), response_id))
