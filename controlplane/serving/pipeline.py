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
from controlplane.serving.dispatch import EmbeddingResult, Load, get_backend
from controlplane.serving.generation import Choice, Run, failed_output
from controlplane.serving.job import Job
from controlplane.usage import limits
from controlplane.usage.models import Source, Status
from controlplane.usage.services import UsageRecord, check_account_limits, record
from inference import LoRARequest, Priority, RequestOutput
from inference.compression import KVCompressionSettings
from inference.errors import EngineError, InvalidRequestError
from inference.spec.settings import SpecMode, SpeculationSettings


@dataclass(slots=True)
class Admission:
    ctx: KeyContext
    entry: ModelEntry
    price: PriceSnapshot | None
    arrived_at: datetime
    body: Any  # what the route parsed: a Job for inference routes
    session: bool = False  # a signed-in user's request (the dashboard's playground), not an API key's

    @property
    def key_id(self) -> str | None:
        """The API key the usage is metered to; None for a session's request."""
        return None if self.session else self.ctx.key_id

    @property
    def job(self) -> Job:
        assert isinstance(self.body, Job)
        return self.body


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


def resolve(job: Job, account_id: str, model_adapter: str | None = None) -> Job:
    """Resolve what a job names against the catalog and the account: its LoRA adapter (`lora`, or the one
    `model: "<base>:<adapter>"` names), speculation and KV compression (the model's defaults when absent)."""
    named = getattr(job.body, "lora", None)
    if model_adapter and named and named != model_adapter:
        raise errors.invalid(f"model names the adapter {model_adapter!r} but lora names {named!r}", "lora")
    job.adapter, job.lora = resolve_adapter(account_id, job.entry, named or model_adapter)
    job.speculation = resolve_speculation(job.entry, getattr(job.body, "speculation", None))
    job.kv_compression = resolve_kv_compression(getattr(job.body, "kv_compression", None), job.entry)
    return job


def admit(auth_header: str | None, *, account_id: str | None, model: str | None,
          body: Callable[[ModelEntry | None], Any], task: str | None = None) -> Admission:
    """Authenticate and authorise, validate the body (now that the model is known), then enforce limits.

    `body(entry)` parses the request body (a Job for inference routes, which is then resolved), raising
    ApiError when it is invalid; it is called after authentication so an anonymous caller learns nothing about
    the API beyond 401.
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
    if entry is None:  # the body's shape was fine, but it names no model ("model": "")
        raise errors.invalid("model: name a model from the catalog", "model")
    if not ctx.may_use(entry.name):
        raise errors.forbidden(f"This API key may not use {entry.name}")
    if task is not None and entry.task != task:
        raise errors.invalid(f"{entry.name} is a {entry.task} model and cannot serve this route", "model")
    if isinstance(parsed, Job):
        resolve(parsed, ctx.account_id, model_adapter)
    now = timezone.now()
    check_account_limits(ctx, now)
    limits.check_rate(ctx, now.timestamp())
    return Admission(ctx=ctx, entry=entry, price=entry.price_at(now.timestamp()), arrived_at=now, body=parsed)


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


def admit_for_account(account_id: str, user_id: int, *, model: str, body: Callable[[ModelEntry], Job],
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
    job = resolve(body(entry), account_id)
    now = timezone.now()
    check_account_limits(ctx, now)
    limits.check_rate(ctx, now.timestamp())
    return Admission(ctx=ctx, entry=entry, price=entry.price_at(now.timestamp()), arrived_at=now, body=job,
                     session=True)


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


def check_capacity(job: Job, load: Load | None) -> None:
    """Backpressure for interactive requests: 429 (3040) at once when the request asked to be refused while
    the model is busy (Workers AI's rejectIfBusy), or when its estimated wait for an engine slot is past
    HEARTH_MAX_QUEUE_WAIT_S. Batch items never come here: they are held back, never refused."""
    if load is None:
        return
    if job.reject_if_busy and load.busy:
        raise errors.out_of_capacity(f"{job.model} is busy ({load.running} running, {load.waiting} waiting) and "
                                     "the request asked not to wait (rejectIfBusy)",
                                     retry_after_s=max(1.0, load.wait_s))
    bound = float(settings.HEARTH_MAX_QUEUE_WAIT_S)
    if bound > 0 and load.wait_s > bound:
        raise errors.out_of_capacity(f"{job.model} is overloaded: a new request would wait about "
                                     f"{load.wait_s:.0f} s for a slot (the bound is {bound:.0f} s); retry later",
                                     retry_after_s=load.wait_s)


@dataclass(slots=True)
class Generation:
    """One admitted text-generation job on the backend, metered: from prompt to usage."""

    adm: Admission
    stream: bool
    session_affinity: str
    started: float  # time.monotonic() at arrival (the engine's clock too)
    run: Run = field(init=False)
    first_token_at: float | None = None
    _iter: AsyncIterator[tuple[Choice, RequestOutput]] | None = None
    _first: tuple[Choice, RequestOutput] | None = None

    def __post_init__(self) -> None:
        self.run = Run(self.adm.job, Priority.INTERACTIVE, session=self.session_affinity)

    @property
    def job(self) -> Job:
        return self.adm.job

    @property
    def request_id(self) -> str:
        return self.run.request_id

    async def prepare(self) -> None:
        """Check capacity, compile the grammar, tokenise and size every prompt; refusals are recorded and
        raised."""
        try:
            check_capacity(self.job, self.run.backend.load(self.job.model))
            await self.run.prepare()
        except EngineError as exc:
            await self.fail(errors.from_engine(exc, self.job.model))
        except ApiError as exc:
            await self.fail(exc)

    async def fail(self, error: ApiError) -> None:
        """Record the failed request (nothing billable) and raise the error for the route to render."""
        await write_usage(self.adm, self._record(Status.ERROR, error))
        raise error

    async def collect(self) -> list[RequestOutput]:
        """Every choice's final output (a non-streaming answer)."""
        try:
            finals = await self.run.collect()
        except EngineError as exc:
            await self.fail(errors.from_engine(exc, self.job.model))
        except asyncio.CancelledError:
            await self._meter_departure()
            raise
        failed = failed_output(self.run)
        if failed is not None:
            raise errors.internal(f"The engine failed this request: {failed.error or 'unknown error'}")
        self.first_token_at = self.run.first_token_time()
        return finals

    async def open_stream(self) -> None:
        """Start the stream and wait for its first output, so engine refusals still get a proper status code
        (once the first byte of a 200 is sent, they could not)."""
        self._iter = aiter(self.run.outputs())
        try:
            self._first = await anext(self._iter)
        except EngineError as exc:
            await self.fail(errors.from_engine(exc, self.job.model))
        except asyncio.CancelledError:
            await self._meter_departure()
            raise

    async def _meter_departure(self) -> None:
        """The client went away before its answer began (the server cancels the request's task; a request still
        queued for a slot ends so). Its engine work is aborted on the way out; the request is metered all the same,
        as aborted."""
        await write_usage(self.adm, self.usage_record())

    async def outputs(self) -> AsyncIterator[tuple[Choice, RequestOutput]]:
        """Every output of an opened stream; metering happens when the stream ends or the client leaves."""
        assert self._iter is not None and self._first is not None
        item: tuple[Choice, RequestOutput] | None = self._first
        try:
            while item is not None:
                if self.first_token_at is None and item[1].delta_token_ids:
                    self.first_token_at = time.monotonic()
                yield item
                item = await anext(self._iter, None)
        finally:
            with suppress(Exception):
                await self._iter.aclose()  # type: ignore[attr-defined]
            await write_usage(self.adm, self.usage_record())

    def usage_record(self) -> UsageRecord:
        if failed_output(self.run) is not None:
            return self._record(Status.ERROR, errors.internal())
        done = bool(self.run.choices) and all(c.final is not None and c.final.finished for c in self.run.choices)
        return self._record(Status.OK if done else Status.ABORTED, None)

    def _record(self, status: str, error: ApiError | None) -> UsageRecord:
        return job_usage(self.job, self.run, account_id=self.adm.ctx.account_id, key_id=self.adm.key_id,
                         source=Source.INTERACTIVE, status=status, error=error, stream=self.stream,
                         started=self.started, first_token_at=self.first_token_at,
                         session_affinity=self.session_affinity, created_at=self.adm.arrived_at)


def job_usage(job: Job, run: Run | None, *, account_id: str, key_id: str | None, source: str, status: str,
              error: ApiError | None, started: float, first_token_at: float | None, created_at: datetime,
              stream: bool = False, session_affinity: str = "", request_id: str = "",
              input_tokens: int = 0, replica: str = "") -> UsageRecord:
    """The usage record of a job, interactive or batch: the one place a job becomes metering."""
    usage = run.usage() if run is not None else None
    spec = run.speculation() if run is not None else {}
    return UsageRecord(
        account_id=account_id, key_id=key_id, model=job.model, route=job.route, status=status,
        http_status=error.status if error else 200, error_code=error.wire_code if error else "",
        adapter=job.adapter, request_id=request_id or (run.request_id if run is not None else ""),
        source=source, stream=stream, input_tokens=usage.prompt_tokens if usage else input_tokens,
        cached_input_tokens=usage.cached_tokens if usage else 0,
        output_tokens=usage.completion_tokens if usage else 0,
        spec_proposed=spec.get("proposed", 0), spec_accepted=spec.get("accepted", 0),
        latency_ms=(time.monotonic() - started) * 1000,
        ttft_ms=(first_token_at - started) * 1000 if first_token_at else None,
        session_affinity=session_affinity, replica=run.replica() if run is not None else replica,
        created_at=created_at)


async def embed(adm: Admission, *, session_affinity: str,
                started: float) -> tuple[EmbeddingResult, Callable[[], None]]:
    """Run an embedding job; returns the result and the metering callback to run once it is sent."""
    job = adm.job

    def rec(status: str, error: ApiError | None, tokens: int, replica: str = "") -> UsageRecord:
        return job_usage(job, None, account_id=adm.ctx.account_id, key_id=adm.key_id, source=Source.INTERACTIVE,
                         status=status, error=error, started=started, first_token_at=None,
                         created_at=adm.arrived_at, session_affinity=session_affinity,
                         request_id=f"req-{uuid.uuid4().hex}", input_tokens=tokens, replica=replica)

    try:
        result = await get_backend().embed(job.model, list(job.texts))
    except EngineError as exc:
        error = errors.from_engine(exc, job.model)
        await write_usage(adm, rec(Status.ERROR, error, 0))
        raise error from None
    done = rec(Status.OK, None, result.prompt_tokens, result.replica)
    return result, lambda: commit_usage(adm, done)
