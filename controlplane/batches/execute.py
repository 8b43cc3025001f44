"""Running one claimed item on the backend at the BATCH priority class, with its lease kept alive.

The task thread stays synchronous (claims, renewals and the result write are plain ORM calls); the engine
work runs as a coroutine on one event loop per process shared by every batch item, so a worker with 40
threads costs one loop, not 40.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.utils import timezone

from controlplane.api import errors
from controlplane.api.errors import ApiError
from controlplane.batches.models import Batch, Item
from controlplane.batches.services import Claim, Outcome, error_json, renew
from controlplane.batches.validation import check_native_body, check_openai_body, sampling
from controlplane.catalog.services import ModelEntry, get_model
from controlplane.serving import pipeline
from controlplane.serving.dispatch import get_backend
from controlplane.serving.views_native import DEFAULT_MAX_TOKENS
from controlplane.serving.views_native import usage_json as native_usage_json
from controlplane.serving.views_openai import (
    BATCH_ENDPOINTS,
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    chat_payload,
    completion_payload,
    embedding_payload,
)
from controlplane.usage.models import Source
from controlplane.usage.models import Status as UsageStatus
from controlplane.usage.services import UsageRecord
from inference import FinishReason, GenerationRequest, LoRARequest, Priority, RequestOutput
from inference.errors import EngineDeadError, EngineError, EngineOverloadedError


class Busy(Exception):
    """The platform cannot take the item now (engine queue full, engine restarting): retry later."""


class LeaseLost(Exception):
    """Another worker took the item over; this one's work is void."""


@dataclass(slots=True)
class Plan:
    """A checked item, ready for the engine."""

    item: Item
    batch: Batch
    entry: ModelEntry
    body: Any  # the parsed pydantic body
    kind: str  # chat | completions | embeddings | native
    route: str
    adapter: str = ""  # the LoRA adapter's name, "" for the base model
    lora: LoRARequest | None = None


def plan(item: Item, batch: Batch) -> Plan | Outcome:
    """Re-check the request against the catalog as it is now (a model may have gone since the batch was
    accepted); a request that no longer passes fails alone."""
    try:
        if batch.api == Batch.Api.OPENAI:
            checked = check_openai_body(batch.endpoint, item.body or {}, tuple(batch.allowed_models),
                                        batch.account_id)
            _parser, _task, route, kind = BATCH_ENDPOINTS[batch.endpoint]
        else:
            entry = get_model(item.model)
            if entry is None or not entry.installed:
                raise errors.unknown_model(item.model)
            checked = check_native_body(entry, item.body or {}, batch.account_id)
            route = kind = "native"
        return Plan(item, batch, checked.entry, checked.body, kind, route, checked.adapter, checked.lora)
    except ApiError as exc:
        return Outcome(Item.Status.FAILED, error=error_json(exc))


# ------------------------------------------------------------------------------------------------ event loop
_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def batch_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _loop_lock:
        if _loop is None or _loop.is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="hearth-batch-loop", daemon=True).start()
            _loop = loop
        return _loop


def run_claimed(claim: Claim, item: Item, batch: Batch) -> Outcome:
    """Run the item to its outcome, renewing the lease every third of it. Raises Busy (give it back and retry)
    or LeaseLost; a batch cancelled or expired meanwhile stops the work (outcome `cancelled`)."""
    checked = plan(item, batch)
    if isinstance(checked, Outcome):
        return checked
    future = asyncio.run_coroutine_threadsafe(_run(checked), batch_loop())
    every = max(0.2, settings.HEARTH_BATCH_LEASE_SECONDS / 3)
    while True:
        try:
            return future.result(timeout=every)
        except concurrent.futures.TimeoutError:
            state = renew(claim)
            if state == "ok":
                continue
            future.cancel()  # aborts the engine request
            if state == "lost":
                raise LeaseLost() from None
            return Outcome(Item.Status.CANCELLED, error={
                "status": 400, "openai_status": 400, "code": errors.CODE_INVALID_INPUT,
                "openai_code": "batch_cancelled", "message": "The batch was stopped while this request ran",
                "param": None})


async def _run(p: Plan) -> Outcome:
    started = time.monotonic()
    try:
        if p.kind == "embeddings" or (p.kind == "native" and p.entry.is_embedding):
            return await _embed(p, started)
        return await _generate(p, started)
    except (EngineOverloadedError, EngineDeadError) as exc:
        raise Busy(str(exc)) from None


def _usage(p: Plan, started: float, *, status: str = UsageStatus.OK, error: ApiError | None = None,
           final: RequestOutput | None = None, input_tokens: int = 0, request_id: str = "") -> UsageRecord:
    usage = final.usage if final is not None else None
    spec = (final.speculation if final is not None else None) or {}
    first = final.metrics.first_token_time if final is not None else None
    return UsageRecord(
        account_id=p.batch.account_id, key_id=p.batch.api_key_id, model=p.entry.name, adapter=p.adapter,
        route=p.route,
        status=status, http_status=error.status if error else 200, error_code=error.wire_code if error else "",
        request_id=request_id or p.item.request_id, source=Source.BATCH,
        input_tokens=usage.prompt_tokens if usage else input_tokens,
        cached_input_tokens=usage.cached_tokens if usage else 0,
        output_tokens=usage.completion_tokens if usage else 0,
        spec_proposed=spec.get("proposed", 0), spec_accepted=spec.get("accepted", 0),
        latency_ms=(time.monotonic() - started) * 1000,
        ttft_ms=(first - started) * 1000 if first else None, created_at=timezone.now())


def _failed(p: Plan, started: float, error: ApiError, final: RequestOutput | None = None) -> Outcome:
    """An engine refusal after the request was accepted: recorded, never billable (as interactively)."""
    return Outcome(Item.Status.FAILED, error=error_json(error),
                   usage=_usage(p, started, status=UsageStatus.ERROR, error=error, final=final))


async def _embed(p: Plan, started: float) -> Outcome:
    body = p.body
    texts = body.text if p.kind == "native" else body.input
    texts = [texts] if isinstance(texts, str) else list(texts)
    try:
        result = await get_backend().embed(p.entry.name, texts)
    except (EngineOverloadedError, EngineDeadError):
        raise
    except EngineError as exc:
        return _failed(p, started, errors.from_engine(exc, p.entry.name))
    if p.kind == "native":
        response = {"shape": [len(result.vectors), result.dim], "data": result.vectors, "pooling": "mean"}
    else:
        response = embedding_payload(p.entry.name, result, body.encoding_format)
    return Outcome(Item.Status.SUCCEEDED, response=response,
                   usage=_usage(p, started, input_tokens=result.prompt_tokens))


async def _generate(p: Plan, started: float) -> Outcome:
    body = p.body
    backend = get_backend()
    model = p.entry.name
    prompt, messages, raw = None, None, False
    if p.kind == "chat":
        messages = [m.model_dump() for m in body.messages]
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        default_max = None
    elif p.kind == "completions":
        prompt, raw = (body.prompt if isinstance(body.prompt, str) else body.prompt[0]), True
        max_tokens, default_max = body.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS
    else:
        prompt, raw = body.prompt, body.raw
        messages = [m.model_dump() for m in body.messages] if body.messages is not None else None
        max_tokens, default_max = body.max_tokens, DEFAULT_MAX_TOKENS
    try:
        params = sampling(body, p.kind)
    except ApiError as exc:  # checked at submission; only a changed engine could refuse it now
        return Outcome(Item.Status.FAILED, error=error_json(exc))
    request_id = f"breq-{uuid.uuid4().hex}"
    try:
        ids = await backend.encode(model, prompt=prompt, messages=messages, raw=raw)
        params.max_tokens = pipeline.output_budget(p.entry, len(ids), max_tokens, default_max)
        request = GenerationRequest(
            prompt_token_ids=ids, params=params, request_id=request_id, priority=Priority.BATCH, lora=p.lora,
            speculation=pipeline.resolve_speculation(p.entry, getattr(body, "speculation", None)),
            kv_compression=pipeline.resolve_kv_compression(getattr(body, "kv_compression", None), p.entry))
        if params.logprobs is None:
            final = await backend.generate(model, request)
        else:
            final = await pipeline.collect_logprobs(backend, model, request)
    except ApiError as exc:
        return _failed(p, started, exc)
    except (EngineOverloadedError, EngineDeadError):
        raise
    except EngineError as exc:
        return _failed(p, started, errors.from_engine(exc, model))
    if final.finish_reason == FinishReason.ERROR:
        return _failed(p, started, errors.internal(f"The engine failed this request: {final.error or 'unknown'}"),
                       final)
    created = int(time.time())
    if p.kind == "chat":
        response = chat_payload(f"chatcmpl-{request_id}", created, model, final)
    elif p.kind == "completions":
        response = completion_payload(f"cmpl-{request_id}", created, model, final)
    else:
        response = {"response": final.text, "usage": native_usage_json(final.usage)}
    return Outcome(Item.Status.SUCCEEDED, response=response, usage=_usage(p, started, final=final,
                                                                          request_id=request_id))
