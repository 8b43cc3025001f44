"""Workers AI native API: POST /client/v4/accounts/{account_id}/ai/run/{model}."""

from __future__ import annotations

import time
from contextlib import aclosing
from typing import Any
from urllib.parse import unquote

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse

from controlplane.api import errors
from controlplane.api.errors import ApiError
from controlplane.api.http import SSE_DONE, ResponseWithAfterClose, api_view, dumps, envelope, read_json, sse
from controlplane.batches import views as batch_views
from controlplane.catalog.services import ModelEntry
from controlplane.serving import pipeline
from controlplane.serving.schemas import NativeEmbeddings, NativeTextGeneration, parse
from inference import FinishReason, Usage

DEFAULT_MAX_TOKENS = 256  # Workers AI's default for text generation
DEFAULT_TEMPERATURE = 0.6  # Workers AI's default for its chat models
AFFINITY_HEADER = "x-session-affinity"


def usage_json(usage: Usage) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens, "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def read_body(request: HttpRequest) -> tuple[dict[str, Any] | None, ApiError | None]:
    """The JSON body, or the error to raise once the caller is authenticated."""
    try:
        return read_json(request), None
    except ApiError as exc:
        return None, exc


def _native_body(raw: dict[str, Any] | None, deferred: ApiError | None, entry: ModelEntry | None) -> Any:
    if deferred is not None:
        raise deferred
    if entry is None:
        return None
    assert raw is not None
    if entry.is_embedding:
        body = parse(NativeEmbeddings, raw)
        texts = [body.text] if isinstance(body.text, str) else body.text
        if not texts or any(not t.strip() for t in texts):
            raise errors.invalid("text must be a non-empty string or a non-empty list of them", "text")
        return body
    body = parse(NativeTextGeneration, raw)
    if (body.prompt is None) == (body.messages is None):
        raise errors.invalid("Give exactly one of prompt or messages", "prompt")
    if body.prompt is not None and not body.prompt:
        raise errors.invalid("prompt must not be empty", "prompt")
    if body.messages is not None and not body.messages:
        raise errors.invalid("messages must not be empty", "messages")
    return body


def _messages(entry: ModelEntry) -> list[str]:
    if entry.deprecated:
        return [f"{entry.name} is deprecated since {entry.deprecated_on.isoformat()}"]  # type: ignore[union-attr]
    return []


@api_view("native", ("POST",))
async def run_model(request: HttpRequest, account_id: str, model: str) -> HttpResponse:
    started = time.monotonic()
    # The model name has slashes; clients may percent-encode them (and the '@'), once or twice.
    model = unquote(model)
    raw, deferred = read_body(request)
    if batch_views.wants_queue(request, raw):
        return await batch_views.native_queue(request, account_id, model, raw, deferred)
    if raw is not None and "requests" in raw and "prompt" not in raw and "messages" not in raw:
        deferred = deferred or errors.invalid(
            "requests: a list of requests is an async batch; add ?queueRequest=true", "requests")
    adm = await sync_to_async(pipeline.admit)(
        request.headers.get("Authorization"), account_id=account_id, model=model,
        body=lambda entry: _native_body(raw, deferred, entry))
    affinity = request.headers.get(AFFINITY_HEADER, "")
    if adm.entry.is_embedding:
        return await _embed(adm, affinity, started)
    return await _generate(adm, affinity, started)


async def _embed(adm: pipeline.Admission, affinity: str, started: float) -> HttpResponse:
    texts = [adm.body.text] if isinstance(adm.body.text, str) else list(adm.body.text)
    result, after = await pipeline.embed(adm, texts, route="native", session_affinity=affinity, started=started)
    payload = envelope({"shape": [len(result.vectors), result.dim], "data": result.vectors, "pooling": "mean"},
                       messages=_messages(adm.entry))
    return ResponseWithAfterClose(dumps(payload), content_type="application/json", after_close=after)


async def _generate(adm: pipeline.Admission, affinity: str, started: float) -> HttpResponse:
    body: NativeTextGeneration = adm.body
    params = pipeline.sampling_params(body, temperature=DEFAULT_TEMPERATURE)
    gen = pipeline.Generation(adm=adm, route="native", stream=body.stream, session_affinity=affinity,
                              started=started)
    messages = [m.model_dump() for m in body.messages] if body.messages is not None else None
    await gen.prepare(params, max_tokens=body.max_tokens, default_max_tokens=DEFAULT_MAX_TOKENS,
                      prompt=body.prompt, messages=messages, raw=body.raw)
    if not body.stream:
        final = await gen.run()
        record = gen.usage_record()
        payload = envelope({"response": final.text, "usage": usage_json(final.usage)},
                           messages=_messages(adm.entry))
        return ResponseWithAfterClose(dumps(payload), content_type="application/json",
                                      after_close=lambda: pipeline.commit_usage(adm, record))
    await gen.open_stream()

    async def events():
        async with aclosing(gen.outputs()) as outputs:
            async for out in outputs:
                if out.delta_text:
                    yield sse({"response": out.delta_text})
                if out.finished:
                    if out.finish_reason == FinishReason.ERROR:
                        yield sse({"error": {"code": errors.CODE_INTERNAL, "message": out.error or "engine error"}})
                    else:
                        yield sse({"response": "", "usage": usage_json(out.usage)})
                    yield SSE_DONE

    return event_stream(events())


def event_stream(events: Any) -> StreamingHttpResponse:
    response = StreamingHttpResponse(events, content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"  # proxies must pass each event on at once
    return response
