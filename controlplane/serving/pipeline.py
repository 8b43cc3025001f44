"""The path every inference request takes, whatever its API: admit, run on the backend, meter.

Admission (key, account, model, scopes, free allocation, budget, rate limits) is one synchronous step run in a
worker thread, so a request costs a single thread hop before it reaches the engine. Usage is written after the
answer: for a stream once the last chunk has been handed to the server, never between tokens.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.utils import timezone

from controlplane.accounts.models import Account, ApiKey
from controlplane.accounts.services import KeyContext, authenticate_key, parse_bearer
from controlplane.api import errors
from controlplane.api.auth import require_account, require_permission
from controlplane.api.errors import ApiError
from controlplane.api.metrics import (
    INFERENCE_LATENCY,
    INFERENCE_REQUESTS,
    NEURONS,
    SPEC_TOKENS,
    TOKENS,
    TTFT,
)
from controlplane.catalog.models import Task
from controlplane.catalog.services import ModelEntry, PriceSnapshot, get_model
from controlplane.serving.dispatch import Backend, EmbeddingResult, get_backend
from controlplane.usage import limits
from controlplane.usage.models import Source, Status
from controlplane.usage.services import UsageRecord, check_account_limits, record
from inference import FinishReason, GenerationRequest, LoRARequest, Priority, RequestOutput, SamplingParams
from inference.compression import KVCompressionSettings
from inference.errors import EngineError, InvalidRequestError
from inference.spec.settings import SpecMode, SpeculationSettings


@dataclass(slots=True)
class Admission:
    ctx: KeyContext
    entry: ModelEntry
    price: PriceSnapshot | None
    arrived_at: datetime
    adapter: str  # the adapter's name, recorded with the usage; "" for the base model
    body: Any
    lora: LoRARequest | None = None  # what the engine serves the adapter from
    speculation: SpeculationSettings | None = None  # None: the engine's start-up default
    kv_compression: KVCompressionSettings | None = None  # None: the engine's start-up default
    session: bool = False  # a signed-in user's request (the dashboard's playground), not an API key's

    @property
    def key_id(self) -> str | None:
        """The API key the usage is metered to; None for a session's request."""
        return None if self.session else self.ctx.key_id


def resolve_adapter(account_id: str, entry: ModelEntry, lora: str | None) -> tuple[str, LoRARequest | None]:
    """The adapter a request names (its id or name; the account's own or a public one), checked against the
    model: its name for usage and what the engine loads. 400 for a model without LoRA (5005), an unknown
    adapter, one made for another model, and one whose files are missing (3039)."""
    if not lora:
        return "", None
    if not entry.supports_lora:
        raise errors.lora_unsupported(entry.name)
    from controlplane.adapters import services as adapters

    adapter = adapters.find_adapter(account_id, lora, entry.name)
    return adapter.name, LoRARequest(adapters.adapter_key(adapter), adapters.adapter_dir(adapter))


def split_model_adapter(model: str | None) -> tuple[str | None, str | None]:
    """`<base>:<adapter>` names a model and a LoRA adapter at once (OpenAI routes carry no `lora` field).
    A name that is itself in the catalog is never split."""
    if not model or ":" not in model or get_model(model) is not None:
        return model, None
    base, _, adapter = model.rpartition(":")
    return (base, adapter) if base and adapter else (model, None)


def default_speculation(entry: ModelEntry) -> SpeculationSettings | None:
    """The catalog's current default, passed to the engine with each request: an engine reads its own default
    only when it loads, and an operator's edit must apply to the next request, not the next restart. None for
    settings edited by hand into something no engine loads (the engine's own default applies then)."""
    default = entry.speculation
    if default["mode"] == SpecMode.DRAFT and not default["draft_model"]:
        return None
    try:
        return SpeculationSettings(default["mode"], default["k"])
    except InvalidRequestError:
        return None


def resolve_speculation(entry: ModelEntry, value: Any) -> SpeculationSettings | None:
    """A request's `speculation` ("off" | "ngram" | "draft", or {mode, k}) checked against the model; k defaults
    to the model's own, and no `speculation` at all means the model's current default. 400 for a bad mode or
    k, or for draft on a model that has no draft model."""
    if value is None:
        return default_speculation(entry)
    default = entry.speculation
    mode, k = (value, None) if isinstance(value, str) else (value.mode, value.k)
    try:
        settings = SpeculationSettings(mode, default["k"] if k is None else k)  # type: ignore[arg-type]
    except InvalidRequestError as exc:
        raise errors.invalid(str(exc), "speculation") from None
    if settings.mode is SpecMode.DRAFT and not default["draft_model"]:
        raise errors.invalid(f"speculation 'draft' is not available on {entry.name}: it has no draft model; "
                             "use ngram or off", "speculation")
    return settings


# What "no compression" is when said explicitly: an engine started with a default would otherwise apply it.
KV_COMPRESSION_OFF = KVCompressionSettings(rate=1.0)


def resolve_kv_compression(value: Any, entry: ModelEntry | None = None) -> KVCompressionSettings | None:
    """A request's `kv_compression` ({rate} or {max_cache_tokens}); 400 unless exactly one, in range. Without
    one, the model's current catalog default (explicitly off when it has none), when the entry is given: like
    speculation, an edited default must not wait for an engine restart."""
    if value is None:
        if entry is None:
            return None
        try:
            return KVCompressionSettings.parse(entry.kv_compression) if entry.kv_compression else KV_COMPRESSION_OFF
        except InvalidRequestError:
            return None
    try:
        return KVCompressionSettings.parse(value.model_dump(exclude_none=True))
    except InvalidRequestError as exc:
        raise errors.invalid(str(exc), "kv_compression") from None


def admit(auth_header: str | None, *, account_id: str | None, model: str | None,
          body: Callable[[ModelEntry | None], Any], task: str | None = None,
          lora: Callable[[Any], str | None] = lambda body: getattr(body, "lora", None)) -> Admission:
    """Authenticate and authorise, validate the body (now that the model is known), then enforce limits.

    `body(entry)` parses the request body, raising ApiError when it is invalid; it is called after
    authentication so an anonymous caller learns nothing about the API beyond 401.
    """
    ctx = authenticate_key(parse_bearer(auth_header))
    require_account(ctx, account_id)
    require_permission(ctx, ApiKey.Permission.RUN)
    model, model_adapter = split_model_adapter(model)
    entry = get_model(model) if model else None
    if model and (entry is None or not entry.installed):
        body(None)  # a malformed body is still reported as such first
        raise errors.unknown_model(model)
    parsed = body(entry)
    assert entry is not None
    if not ctx.may_use(entry.name):
        raise errors.forbidden(f"This API key may not use {entry.name}")
    if task is not None and entry.task != task:
        raise errors.invalid(f"{entry.name} is a {entry.task} model and cannot serve this route", "model")
    named = lora(parsed)
    if model_adapter and named and named != model_adapter:
        raise errors.invalid(f"model names the adapter {model_adapter!r} but lora names {named!r}", "lora")
    adapter, lora_request = resolve_adapter(ctx.account_id, entry, named or model_adapter)
    speculation = resolve_speculation(entry, getattr(parsed, "speculation", None))
    kv_compression = resolve_kv_compression(getattr(parsed, "kv_compression", None), entry)
    now = timezone.now()
    check_account_limits(ctx, now)
    limits.check_rate(ctx, now.timestamp())
    return Admission(ctx=ctx, entry=entry, price=entry.price_at(now.timestamp()), arrived_at=now,
                     adapter=adapter, lora=lora_request, body=parsed, speculation=speculation,
                     kv_compression=kv_compression)


def session_context(account: Account, user_id: int) -> KeyContext:
    """The principal of a signed-in user's request on an account: the account's limits, the default per-minute
    limits counted per user (in a namespace no key id can collide with), every model, no key."""
    return KeyContext(
        key_id=f"session-user-{user_id}", key_name="dashboard session", prefix="", account_id=account.pk,
        account_name=account.name, permission=ApiKey.Permission.RUN, allowed_models=(),
        requests_per_minute=int(settings.HEARTH_DEFAULT_REQUESTS_PER_MINUTE),
        tokens_per_minute=int(settings.HEARTH_DEFAULT_TOKENS_PER_MINUTE), expires_at=None,
        paid_plan=account.paid_plan, free_neurons_per_day=account.free_neurons_per_day,
        monthly_budget_usd=account.monthly_budget_usd)


def admit_for_account(account_id: str, user_id: int, *, model: str, body: Callable[[ModelEntry], Any],
                      task: str | None = Task.TEXT_GENERATION) -> Admission:
    """admit() for a signed-in user instead of an API key (the caller has checked the user may act for the
    account): the same model, body and default checks, the account's free allocation and budget, and per-user
    rate limits. Its usage is billed to the account with no key."""
    account = Account.objects.filter(pk=account_id).first()
    if account is None:
        raise errors.not_found(f"No account {account_id}")
    if not account.is_active:
        raise errors.forbidden("This account is disabled")
    ctx = session_context(account, user_id)
    entry = get_model(model)
    if entry is None or not entry.installed:
        raise errors.unknown_model(model)
    if task is not None and entry.task != task:
        raise errors.invalid(f"{entry.name} is a {entry.task} model and cannot serve this route", "model")
    parsed = body(entry)
    speculation = resolve_speculation(entry, getattr(parsed, "speculation", None))
    kv_compression = resolve_kv_compression(getattr(parsed, "kv_compression", None), entry)
    now = timezone.now()
    check_account_limits(ctx, now)
    limits.check_rate(ctx, now.timestamp())
    return Admission(ctx=ctx, entry=entry, price=entry.price_at(now.timestamp()), arrived_at=now, adapter="",
                     body=parsed, speculation=speculation, kv_compression=kv_compression, session=True)


def commit_usage(adm: Admission, rec: UsageRecord) -> None:
    """Write the event (with rollups), charge tokens to the key's rate window, count for Prometheus."""
    event = record(rec, adm.price)
    limits.add_tokens(adm.ctx, rec.input_tokens + rec.output_tokens)
    model = rec.model
    INFERENCE_REQUESTS.labels(model, rec.route, rec.status).inc()
    INFERENCE_LATENCY.labels(model).observe(rec.latency_ms / 1000)
    if rec.ttft_ms is not None:
        TTFT.labels(model).observe(rec.ttft_ms / 1000)
    if event.input_tokens:
        TOKENS.labels(model, "input").inc(event.input_tokens)
    if event.cached_input_tokens:
        TOKENS.labels(model, "cached_input").inc(event.cached_input_tokens)
    if event.output_tokens:
        TOKENS.labels(model, "output").inc(event.output_tokens)
    if event.neurons:
        NEURONS.labels(model).inc(float(event.neurons))
    if event.spec_proposed:
        SPEC_TOKENS.labels(model, "proposed").inc(event.spec_proposed)
        SPEC_TOKENS.labels(model, "accepted").inc(event.spec_accepted)


async def write_usage(adm: Admission, rec: UsageRecord) -> None:
    """commit_usage from async code. Shielded: a client that disconnects while the write is queued (a stream
    client may hang up right after [DONE]) cancels the request's task, and must not cancel its metering."""
    await asyncio.shield(sync_to_async(commit_usage)(adm, rec))


def sampling_params(body: Any, *, temperature: float | None = None, logprobs: int | None = None) -> SamplingParams:
    """The engine's SamplingParams from a parsed body; its range checks become 400s. max_tokens is set later,
    once the prompt length is known."""
    kwargs: dict[str, Any] = {}
    for name in ("temperature", "top_p", "top_k", "seed", "repetition_penalty", "frequency_penalty",
                 "presence_penalty"):
        value = getattr(body, name, None)
        if value is not None:
            kwargs[name] = value
    if "temperature" not in kwargs and temperature is not None:
        kwargs["temperature"] = temperature
    stop = getattr(body, "stop", None)
    if stop:
        kwargs["stop"] = [stop] if isinstance(stop, str) else list(stop)
    if logprobs is not None:
        kwargs["logprobs"] = logprobs
    max_tokens = getattr(body, "max_tokens", None)
    try:
        return SamplingParams(max_tokens=max_tokens if max_tokens is not None else 1, **kwargs)
    except InvalidRequestError as exc:
        raise errors.invalid(str(exc)) from None


def output_budget(entry: ModelEntry, prompt_tokens: int, max_tokens: int | None,
                  default_max_tokens: int | None) -> int:
    """max_tokens for a prompt of this length: an explicit value is clamped to what the context leaves; a
    prompt that leaves no room is refused (413 / 3006 natively, context_length_exceeded on /v1)."""
    window = entry.context_window
    room = window - prompt_tokens
    if room < 1:
        raise errors.prompt_too_long(
            f"The prompt is {prompt_tokens:,} tokens; {entry.name} has a context window of {window:,} tokens "
            "(prompt and output together)")
    wanted = max_tokens if max_tokens is not None else default_max_tokens
    return min(wanted, room) if wanted is not None else room


async def collect_logprobs(backend: Backend, model: str, request: GenerationRequest) -> RequestOutput:
    """Each output carries the logprobs of its delta tokens only; a whole answer needs all of them."""
    collected = []
    final = None
    async for out in backend.stream(model, request):
        collected.extend(out.logprobs or ())
        final = out
    assert final is not None
    final.logprobs = collected
    return final


@dataclass(slots=True)
class Generation:
    """One text-generation request on the backend, from prompt to metered usage."""

    adm: Admission
    route: str
    stream: bool
    session_affinity: str
    started: float  # time.monotonic() at arrival (the engine's clock too)
    backend: Backend = field(default_factory=get_backend)
    request: GenerationRequest | None = None
    final: RequestOutput | None = None
    first_token_at: float | None = None
    _iter: AsyncIterator[RequestOutput] | None = None

    @property
    def model(self) -> str:
        return self.adm.entry.name

    async def prepare(self, params: SamplingParams, *, max_tokens: int | None, default_max_tokens: int | None,
                      prompt: str | None = None, messages: list[Any] | None = None, raw: bool = False) -> None:
        """Tokenise and size the request: an explicit max_tokens is clamped to what the context leaves; a
        prompt that leaves no room is refused (413 / 3006 natively, context_length_exceeded on /v1)."""
        ids = await self._engine_call(self.backend.encode(self.model, prompt=prompt, messages=messages, raw=raw))
        try:
            params.max_tokens = output_budget(self.adm.entry, len(ids), max_tokens, default_max_tokens)
        except ApiError as exc:
            await self.fail(exc)
        self.request = GenerationRequest(
            prompt_token_ids=ids, params=params, request_id=f"req-{uuid.uuid4().hex}",
            priority=Priority.INTERACTIVE, lora=self.adm.lora,
            speculation=self.adm.speculation, kv_compression=self.adm.kv_compression)

    async def _engine_call(self, awaitable: Any) -> Any:
        try:
            return await awaitable
        except EngineError as exc:
            await self.fail(errors.from_engine(exc, self.model))

    async def fail(self, error: ApiError) -> None:
        """Record the failed request (nothing billable) and raise the error for the route to render."""
        await write_usage(self.adm, self._record(Status.ERROR, error))
        raise error

    async def run(self) -> RequestOutput:
        assert self.request is not None
        if self.request.params.logprobs is None:
            final = await self._engine_call(self.backend.generate(self.model, self.request))
        else:
            final = await self._engine_call(collect_logprobs(self.backend, self.model, self.request))
        self._check_final(final)
        self.first_token_at = final.metrics.first_token_time
        self.final = final
        return final

    def _check_final(self, out: RequestOutput) -> None:
        if out.finish_reason == FinishReason.ERROR:
            raise errors.internal(f"The engine failed this request: {out.error or 'unknown error'}")

    async def open_stream(self) -> None:
        """Start the stream and wait for its first output, so engine refusals still get a proper status code
        (once the first byte of a 200 is sent, they could not)."""
        assert self.request is not None
        self._iter = aiter(self.backend.stream(self.model, self.request))
        first = await self._engine_call(anext(self._iter))
        self.final = first

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Every output of an opened stream; metering happens when the stream ends or the client leaves."""
        assert self._iter is not None and self.final is not None
        out = self.final
        try:
            while True:
                if self.first_token_at is None and out.delta_token_ids:
                    self.first_token_at = time.monotonic()
                self.final = out
                yield out
                if out.finished:
                    return
                out = await anext(self._iter)
        finally:
            with suppress(Exception):
                await self._iter.aclose()  # type: ignore[attr-defined]
            await write_usage(self.adm, self.usage_record())

    def usage_record(self) -> UsageRecord:
        final = self.final
        if final is not None and final.finish_reason == FinishReason.ERROR:
            return self._record(Status.ERROR, errors.internal())
        status = Status.OK if final is not None and final.finished else Status.ABORTED
        return self._record(status, None)

    def _record(self, status: str, error: ApiError | None) -> UsageRecord:
        usage = self.final.usage if self.final is not None else None
        spec = (self.final.speculation if self.final is not None else None) or {}
        now = time.monotonic()
        return UsageRecord(
            account_id=self.adm.ctx.account_id, key_id=self.adm.key_id, model=self.model, route=self.route,
            status=status, http_status=error.status if error else 200,
            error_code=error.wire_code if error else "", adapter=self.adm.adapter,
            request_id=self.request.request_id if self.request else "", source=Source.INTERACTIVE,
            stream=self.stream, input_tokens=usage.prompt_tokens if usage else 0,
            cached_input_tokens=usage.cached_tokens if usage else 0,
            output_tokens=usage.completion_tokens if usage else 0,
            spec_proposed=spec.get("proposed", 0), spec_accepted=spec.get("accepted", 0),
            latency_ms=(now - self.started) * 1000,
            ttft_ms=(self.first_token_at - self.started) * 1000 if self.first_token_at else None,
            session_affinity=self.session_affinity, created_at=self.adm.arrived_at)


async def embed(adm: Admission, texts: list[str], *, route: str, session_affinity: str,
                started: float) -> tuple[EmbeddingResult, Callable[[], None]]:
    """Run an embedding request; returns the result and the metering callback to run once it is sent."""
    if not texts:
        raise errors.invalid("Give at least one text to embed", "input")
    if any(not isinstance(t, str) or not t.strip() for t in texts):
        raise errors.invalid("Every text to embed must be a non-empty string", "input")
    backend = get_backend()

    def rec(status: str, error: ApiError | None, tokens: int) -> UsageRecord:
        return UsageRecord(
            account_id=adm.ctx.account_id, key_id=adm.key_id, model=adm.entry.name, route=route,
            status=status, http_status=error.status if error else 200,
            error_code=error.wire_code if error else "", request_id=f"req-{uuid.uuid4().hex}",
            input_tokens=tokens, latency_ms=(time.monotonic() - started) * 1000,
            session_affinity=session_affinity, created_at=adm.arrived_at)

    try:
        result = await backend.embed(adm.entry.name, texts)
    except EngineError as exc:
        error = errors.from_engine(exc, adm.entry.name)
        await write_usage(adm, rec(Status.ERROR, error, 0))
        raise error from None
    done = rec(Status.OK, None, result.prompt_tokens)
    return result, lambda: commit_usage(adm, done)
