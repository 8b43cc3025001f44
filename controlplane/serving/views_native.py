"""Workers AI native route: POST /client/v4/accounts/{account_id}/ai/run/{model}. It reads the body, sends a
queueRequest to the batch queue, and hands everything else, admitted, to `protocol.native`."""

from __future__ import annotations

import time
from urllib.parse import unquote

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse

from controlplane.api import errors
from controlplane.api.body import read_body
from controlplane.api.http import AFFINITY_HEADER, api_view
from controlplane.batches import native_queue
from controlplane.catalog.services import ModelEntry
from controlplane.serving import pipeline
from controlplane.serving.job import Job
from controlplane.serving.protocol import NATIVE


@api_view("native", ("POST",))
async def run_model(request: HttpRequest, account_id: str, model: str) -> HttpResponse:
    started = time.monotonic()
    # The model name has slashes; clients may percent-encode them (and the '@'), once or twice.
    model = unquote(model)
    raw, deferred = read_body(request)
    if native_queue.wants_queue(request, raw):
        return await native_queue.native_queue(request, account_id, model, raw, deferred)
    if raw is not None and "requests" in raw and "prompt" not in raw and "messages" not in raw:
        deferred = deferred or errors.invalid(
            "requests: a list of requests is an async batch; add ?queueRequest=true", "requests")

    def body(entry: ModelEntry | None) -> Job | None:
        if deferred is not None:
            raise deferred
        return NATIVE.check(raw, entry)

    adm = await sync_to_async(pipeline.admit)(request.headers.get("Authorization"), account_id=account_id,
                                              model=model, body=body)
    return await NATIVE.respond(adm, affinity=request.headers.get(AFFINITY_HEADER, ""), started=started)
