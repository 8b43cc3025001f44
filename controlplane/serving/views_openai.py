"""OpenAI-compatible API: /v1/chat/completions, /v1/completions, /v1/embeddings (also under
/client/v4/accounts/{account_id}/ai/v1/)."""

from __future__ import annotations

import base64
import struct
import time
from contextlib import aclosing
from typing import Any

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse

from controlplane.api import errors
from controlplane.api.http import SSE_DONE, ResponseWithAfterClose, api_view, dumps, sse
from controlplane.catalog.models import Task
from controlplane.catalog.services import ModelEntry
from controlplane.serving import pipeline
from controlplane.serving.dispatch import EmbeddingResult
from controlplane.serving.schemas import ChatCompletionRequest, CompletionRequest, EmbeddingRequest, parse
from controlplane.serving.views_native import AFFINITY_HEADER, event_stream, read_body
from inference import FinishReason, RequestOutput, TokenLogprob, Usage

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
FINGERPRINT = "hearth"


def usage_json(usage: Usage) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens, "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def finish_reason(out: RequestOutput) -> str:
    return "length" if out.finish_reason == FinishReason.LENGTH else "stop"


def _model_of(raw: dict[str, Any] | None) -> str | None:
    value = raw.get("model") if raw is not None else None
    return value if isinstance(value, str) and value else None


def _common_checks(body: Any) -> None:
    if body.n not in (None, 1):
        raise errors.invalid("n: only 1 choice per request is supported", "n")


def _chat_body(raw: dict[str, Any] | None, deferred: Any, entry: ModelEntry | None) -> ChatCompletionRequest:
    if deferred is not None:
        raise deferred
    body = parse(ChatCompletionRequest, raw or {})
    _common_checks(body)
    if body.tools:
        raise errors.invalid("tools: tool calling is not supported", "tools")
    if body.response_format and body.response_format.get("type", "text") != "text":
        raise errors.invalid("response_format: only {\"type\": \"text\"} is supported", "response_format")
    if body.top_logprobs is not None and not body.logprobs:
        raise errors.invalid("top_logprobs needs logprobs: true", "top_logprobs")
    return body


def _completion_body(raw: dict[str, Any] | None, deferred: Any, entry: ModelEntry | None) -> CompletionRequest:
    if deferred is not None:
        raise deferred
    body = parse(CompletionRequest, raw or {})
    _common_checks(body)
    if isinstance(body.prompt, list) and len(body.prompt) != 1:
        raise errors.invalid("prompt: give one string (batches of prompts are not supported)", "prompt")
    if body.echo:
        raise errors.invalid("echo is not supported", "echo")
    if body.suffix:
        raise errors.invalid("suffix is not supported", "suffix")
    if body.best_of not in (None, 1):
        raise errors.invalid("best_of: only 1 is supported", "best_of")
    return body


def _embedding_body(raw: dict[str, Any] | None, deferred: Any, entry: ModelEntry | None) -> EmbeddingRequest:
    if deferred is not None:
        raise deferred
    body = parse(EmbeddingRequest, raw or {})
    texts = [body.input] if isinstance(body.input, str) else body.input
    if not texts:
        raise errors.invalid("input must not be empty", "input")
    if any(not t.strip() for t in texts):
        raise errors.invalid("input: every string must be non-empty", "input")
    dim = dict(entry.properties).get("dimensions") if entry else None
    if body.dimensions is not None and body.dimensions != dim:
        raise errors.invalid(f"dimensions: this model only produces {dim}-dimensional embeddings", "dimensions")
    return body


def _chat_logprobs(items: list[TokenLogprob] | None) -> dict[str, Any] | None:
    if items is None:
        return None

    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {"content": [{**entry(t.token, t.logprob), "top_logprobs": [entry(tok, lp) for _, tok, lp in t.top]}
                        for t in items]}


def _completion_logprobs(items: list[TokenLogprob] | None, offset: int) -> dict[str, Any] | None:
    if items is None:
        return None
    offsets, position = [], offset
    for t in items:
        offsets.append(position)
        position += len(t.token)
    return {"tokens": [t.token for t in items], "token_logprobs": [t.logprob for t in items],
            "top_logprobs": [{tok: lp for _, tok, lp in t.top} for t in items], "text_offset": offsets}


def chat_payload(completion_id: str, created: int, model: str, final: RequestOutput) -> dict[str, Any]:
    return {
        "id": completion_id, "object": "chat.completion", "created": created, "model": model,
        "system_fingerprint": FINGERPRINT,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": final.text},
                     "logprobs": _chat_logprobs(final.logprobs), "finish_reason": finish_reason(final)}],
        "usage": usage_json(final.usage),
    }


def completion_payload(completion_id: str, created: int, model: str, final: RequestOutput) -> dict[str, Any]:
    return {
        "id": completion_id, "object": "text_completion", "created": created, "model": model,
        "system_fingerprint": FINGERPRINT,
        "choices": [{"index": 0, "text": final.text, "logprobs": _completion_logprobs(final.logprobs, 0),
                     "finish_reason": finish_reason(final)}],
        "usage": usage_json(final.usage),
    }


def embedding_payload(model: str, result: EmbeddingResult, encoding_format: str) -> dict[str, Any]:
    encode = _base64_floats if encoding_format == "base64" else (lambda v: v)
    return {
        "object": "list", "model": model,
        "data": [{"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(result.vectors)],
        "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens},
    }


async def _admit(request: HttpRequest, account_id: str | None, body_fn: Any, task: str) -> pipeline.Admission:
    raw, deferred = read_body(request)
    return await sync_to_async(pipeline.admit)(
        request.headers.get("Authorization"), account_id=account_id, model=_model_of(raw), task=task,
        body=lambda entry: body_fn(raw, deferred, entry))


@api_view("openai", ("POST",))
async def chat_completions(request: HttpRequest, account_id: str | None = None) -> HttpResponse:
    started = time.monotonic()
    adm = await _admit(request, account_id, _chat_body, Task.TEXT_GENERATION)
    body: ChatCompletionRequest = adm.body
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = pipeline.sampling_params(body.model_copy(update={"max_tokens": max_tokens}), logprobs=logprobs)
    gen = pipeline.Generation(adm=adm, route="openai.chat", stream=body.stream,
                              session_affinity=request.headers.get(AFFINITY_HEADER, ""), started=started)
    await gen.prepare(params, max_tokens=max_tokens, default_max_tokens=None,
                      messages=[m.model_dump() for m in body.messages])
    completion_id = f"chatcmpl-{gen.request.request_id}"  # type: ignore[union-attr]
    created = int(time.time())
    model = adm.entry.name
    if not body.stream:
        final = await gen.run()
        record = gen.usage_record()
        payload = chat_payload(completion_id, created, model, final)
        return ResponseWithAfterClose(dumps(payload), content_type="application/json",
                                      after_close=lambda: pipeline.commit_usage(adm, record))
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    await gen.open_stream()

    def chunk(delta: dict[str, Any], reason: str | None = None, logprobs: Any = None) -> bytes:
        data: dict[str, Any] = {
            "id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": FINGERPRINT,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}]}
        if include_usage:
            data["usage"] = None
        return sse(data)

    async def events():
        yield chunk({"role": "assistant", "content": ""})
        async with aclosing(gen.outputs()) as outputs:
            async for out in outputs:
                if out.delta_text or out.logprobs:
                    yield chunk({"content": out.delta_text}, logprobs=_chat_logprobs(out.logprobs))
                if out.finished:
                    yield chunk({}, finish_reason(out))
                    if include_usage:
                        yield sse({"id": completion_id, "object": "chat.completion.chunk", "created": created,
                                   "model": model, "system_fingerprint": FINGERPRINT, "choices": [],
                                   "usage": usage_json(out.usage)})
                    yield SSE_DONE

    return event_stream(events())


@api_view("openai", ("POST",))
async def completions(request: HttpRequest, account_id: str | None = None) -> HttpResponse:
    started = time.monotonic()
    adm = await _admit(request, account_id, _completion_body, Task.TEXT_GENERATION)
    body: CompletionRequest = adm.body
    prompt = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
    params = pipeline.sampling_params(body, logprobs=body.logprobs)
    gen = pipeline.Generation(adm=adm, route="openai.completions", stream=body.stream,
                              session_affinity=request.headers.get(AFFINITY_HEADER, ""), started=started)
    await gen.prepare(params, max_tokens=body.max_tokens, default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS,
                      prompt=prompt, raw=True)
    completion_id = f"cmpl-{gen.request.request_id}"  # type: ignore[union-attr]
    created = int(time.time())
    model = adm.entry.name
    if not body.stream:
        final = await gen.run()
        record = gen.usage_record()
        payload = completion_payload(completion_id, created, model, final)
        return ResponseWithAfterClose(dumps(payload), content_type="application/json",
                                      after_close=lambda: pipeline.commit_usage(adm, record))
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    await gen.open_stream()

    def chunk(text: str, reason: str | None, logprobs: Any) -> bytes:
        data: dict[str, Any] = {
            "id": completion_id, "object": "text_completion", "created": created, "model": model,
            "system_fingerprint": FINGERPRINT,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}]}
        if include_usage:
            data["usage"] = None
        return sse(data)

    async def events():
        async with aclosing(gen.outputs()) as outputs:
            async for out in outputs:
                offset = len(out.text) - len(out.delta_text)
                logprobs = _completion_logprobs(out.logprobs, offset)
                if out.finished:
                    yield chunk(out.delta_text, finish_reason(out), logprobs)
                    if include_usage:
                        yield sse({"id": completion_id, "object": "text_completion", "created": created,
                                   "model": model, "choices": [], "usage": usage_json(out.usage)})
                    yield SSE_DONE
                elif out.delta_text:
                    yield chunk(out.delta_text, None, logprobs)

    return event_stream(events())


def _base64_floats(vector: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


@api_view("openai", ("POST",))
async def embeddings(request: HttpRequest, account_id: str | None = None) -> HttpResponse:
    started = time.monotonic()
    adm = await _admit(request, account_id, _embedding_body, Task.TEXT_EMBEDDINGS)
    body: EmbeddingRequest = adm.body
    texts = [body.input] if isinstance(body.input, str) else list(body.input)
    result, after = await pipeline.embed(adm, texts, route="openai.embeddings",
                                         session_affinity=request.headers.get(AFFINITY_HEADER, ""),
                                         started=started)
    payload = embedding_payload(adm.entry.name, result, body.encoding_format)
    return ResponseWithAfterClose(dumps(payload), content_type="application/json", after_close=after)


# What the batch API accepts per line: endpoint -> (body parser, the model task it needs, usage route, kind).
BATCH_ENDPOINTS: dict[str, tuple[Any, str, str, str]] = {
    "/v1/chat/completions": (_chat_body, Task.TEXT_GENERATION, "openai.chat", "chat"),
    "/v1/completions": (_completion_body, Task.TEXT_GENERATION, "openai.completions", "completions"),
    "/v1/embeddings": (_embedding_body, Task.TEXT_EMBEDDINGS, "openai.embeddings", "embeddings"),
}
