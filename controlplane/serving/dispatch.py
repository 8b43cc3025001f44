"""The one seam between the control plane and inference.

Views talk only to a Backend. InProcessBackend holds one lazily loaded AsyncEngine per generation model and one
Embedder per embedding model inside this process; a remote backend (scale-out workers) implements the same
protocol, and nothing else in the control plane changes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from inference import AsyncEngine, EngineConfig, EngineMetrics, GenerationRequest, ModelInfo, RequestOutput
from inference.constrained import Constraint
from inference.errors import PromptTooLongError
from inference.models.bert import Embedder
from inference.prompts import prompt_char_limit

log = logging.getLogger("controlplane.serving")


@dataclass(frozen=True, slots=True)
class EmbeddingResult:
    vectors: list[list[float]]
    dim: int
    prompt_tokens: int
    token_counts: list[int]
    replica: str = ""  # the fleet replica that computed them ("" in this process)


@dataclass(frozen=True, slots=True)
class Load:
    """How busy a model's engine is for a new interactive request, and how long it would wait for a sequence
    slot. Batch items waiting do not count: they queue behind interactive requests (and the engine caps how many
    slots they hold), so a running batch never makes an interactive request look late."""

    running: int
    waiting: int  # interactive requests waiting
    slots: int
    wait_s: float  # estimated; 0 when a slot is free now

    @property
    def busy(self) -> bool:
        """A new request would wait for capacity (Workers AI's rejectIfBusy refuses it)."""
        return self.waiting > 0 or self.running >= self.slots


LOCAL_REPLICA = "local"  # the replica label of an engine in this process

# Requests finish at an unknown rate until some have; estimate one's length from the engine's averages.
ASSUMED_OUTPUT_TOKENS = 128


class LoadMeter:
    """Estimates queue wait from the rate at which an engine finishes requests over the last 30 s."""

    WINDOW_S = 30.0

    def __init__(self) -> None:
        self._samples: dict[str, deque[tuple[float, int]]] = {}
        self._lock = threading.Lock()

    def load(self, model: str, metrics: EngineMetrics, slots: int) -> Load:
        now = time.monotonic()
        with self._lock:
            samples = self._samples.setdefault(model, deque())
            samples.append((now, metrics.requests_finished_total))
            while len(samples) > 2 and samples[0][0] < now - self.WINDOW_S:
                samples.popleft()
            (t0, f0), (t1, f1) = samples[0], samples[-1]
        running, waiting = metrics.running, metrics.interactive_waiting
        if waiting == 0 and running < slots:
            return Load(running, waiting, slots, 0.0)
        # The samples come with requests, so after a quiet spell the oldest one kept is from before it: a rate over
        # that span would count the quiet time as slowness.
        recent = t1 - t0 >= 1.0 and t0 >= now - 2 * self.WINDOW_S
        rate = (f1 - f0) / (t1 - t0) if recent and f1 > f0 else 0.0
        if rate <= 0.0:  # nothing finished lately: every running sequence takes an average request's time
            each = (metrics.ttft_s_avg or 1.0) + (metrics.tpot_s_avg or 0.05) * ASSUMED_OUTPUT_TOKENS
            rate = max(running, 1) / each
        return Load(running, waiting, slots, (waiting + 1) / rate)


@runtime_checkable
class Backend(Protocol):
    """What the control plane needs from inference, wherever it runs."""

    async def model_info(self, model: str) -> ModelInfo: ...

    async def encode(self, model: str, *, prompt: str | None = None, messages: list[Any] | None = None,
                     raw: bool = False, tools: list[dict[str, Any]] | None = None) -> list[int]: ...

    async def prepare_constraint(self, model: str, constraint: Constraint) -> None:
        """Compile the grammar where the model runs (cached by content); InvalidRequestError names what is
        wrong with it."""

    def stream(self, model: str, request: GenerationRequest, session: str = "") -> AsyncIterator[RequestOutput]:
        """The request's outputs as they come. `session` (the x-session-affinity header) lets a fleet keep a
        conversation on the replica holding its KV cache."""

    async def generate(self, model: str, request: GenerationRequest, session: str = "") -> RequestOutput: ...

    async def embed(self, model: str, texts: list[str]) -> EmbeddingResult: ...

    def metrics(self) -> Mapping[str, EngineMetrics]:
        """Each running model's engine gauges (over all its replicas, on a fleet)."""

    def replica_metrics(self) -> list[tuple[str, str, EngineMetrics]]:
        """(model, replica, gauges) for every engine replica; one per model in process, replica "local"."""

    def load(self, model: str) -> Load | None:
        """The model's load now; None when its engine is not running here (nothing is waiting for it)."""

    def shutdown(self) -> None: ...


def catalog_settings(model: str) -> Mapping[str, Any]:
    from django.db import connection

    from controlplane.catalog.services import get_model

    try:
        entry = get_model(model)
    finally:
        # Engines load in a pool thread that never serves a request; don't leave a connection open there.
        if not connection.in_atomic_block:
            connection.close()
    # Batch work may fill only part of the engine's sequence slots unless the model's settings say otherwise;
    # the rest stay free for interactive requests. HEARTH_KV_COMPRESSION=0 switches compression off server-wide,
    # whatever a model's settings or a request ask for.
    chosen = {"max_batch_class_seqs": settings.HEARTH_BATCH_ENGINE_SEQS,
              **(dict(entry.engine_settings) if entry else {})}
    if not settings.HEARTH_KV_COMPRESSION:
        chosen["kv_compression"] = False
    return chosen


def _message_chars(message: Any) -> int:
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p.get("text") or "") for p in content if isinstance(p, dict))
    return 0


def check_prompt_chars(prompt: str | None, messages: list[Any] | None, limit: int, window: int) -> None:
    """Refuse a prompt too long to fit the context whatever its tokens, before spending seconds tokenising it."""
    chars = len(prompt or "") + sum(_message_chars(m) for m in messages or ())
    if chars > limit:
        # prompt_tokens: a lower bound (a token stands for at most limit / window characters).
        raise PromptTooLongError(f"the prompt is {chars:,} characters, more than a context of {window:,} "
                                 "tokens can hold", prompt_tokens=chars * window // limit, limit=window)


class InProcessBackend:
    """Engines in this process, loaded on first use (loading happens in a worker thread, off the event loop)."""

    def __init__(self, settings_for: Callable[[str], Mapping[str, Any]] = catalog_settings) -> None:
        self._settings_for = settings_for
        self._engines: dict[str, AsyncEngine] = {}
        self._embedders: dict[str, Embedder] = {}
        self._load_lock = threading.Lock()
        # The embedder runs its forward pass in the calling thread; one at a time keeps CPU threads sane.
        self._embed_lock = threading.Lock()
        self._meter = LoadMeter()
        self._char_limits: dict[str, int] = {}

    # ------------------------------------------------------------------ loading
    def _load_engine(self, model: str) -> AsyncEngine:
        with self._load_lock:
            engine = self._engines.get(model)
            if engine is None or not engine.alive:
                if engine is not None:
                    log.error("engine for %s died; loading a fresh one", model)
                log.info("loading engine for %s", model)
                engine = AsyncEngine.from_model(model, EngineConfig.from_settings(self._settings_for(model)))
                self._engines[model] = engine
            return engine

    def _load_embedder(self, model: str) -> Embedder:
        with self._load_lock:
            embedder = self._embedders.get(model)
            if embedder is None:
                log.info("loading embedder for %s", model)
                embedder = Embedder.from_model(model)
                self._embedders[model] = embedder
            return embedder

    async def engine(self, model: str) -> AsyncEngine:
        engine = self._engines.get(model)
        if engine is not None and engine.alive:
            return engine
        return await asyncio.to_thread(self._load_engine, model)

    def engine_sync(self, model: str) -> AsyncEngine:
        """For callers outside an event loop (benchmarks, management commands)."""
        return self._load_engine(model)

    # ------------------------------------------------------------------ Backend
    async def model_info(self, model: str) -> ModelInfo:
        return (await self.engine(model)).info

    async def encode(self, model: str, *, prompt: str | None = None, messages: list[Any] | None = None,
                     raw: bool = False, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids, computed in a worker thread: a multi-megabyte prompt takes seconds to tokenise, and the
        event loop serves every other tenant meanwhile. A prompt too long to fit the context whatever its
        tokens is refused before tokenising."""
        engine = await self.engine(model)
        limit = self._char_limits.get(model)
        if limit is None:
            limit = await asyncio.to_thread(prompt_char_limit, engine.tokenizer, engine.engine.max_model_len)
            self._char_limits[model] = limit
        check_prompt_chars(prompt, messages, limit, engine.engine.max_model_len)
        return await asyncio.to_thread(engine.encode, prompt=prompt, messages=messages, raw=raw, tools=tools)

    async def prepare_constraint(self, model: str, constraint: Constraint) -> None:
        await (await self.engine(model)).compile_constraint(constraint)

    async def stream(self, model: str, request: GenerationRequest, session: str = "") -> AsyncIterator[RequestOutput]:
        engine = await self.engine(model)
        async for out in engine.stream(request):
            yield out

    async def generate(self, model: str, request: GenerationRequest, session: str = "") -> RequestOutput:
        return await (await self.engine(model)).generate(request)

    async def embed(self, model: str, texts: list[str]) -> EmbeddingResult:
        embedder = self._embedders.get(model) or await asyncio.to_thread(self._load_embedder, model)

        def run() -> EmbeddingResult:
            with self._embed_lock:
                out = embedder.embed(texts)
            # Row by row: one tolist() of thousands of vectors holds the interpreter from every other thread.
            return EmbeddingResult(vectors=[row.tolist() for row in out.embeddings.numpy()], dim=embedder.dim,
                                   prompt_tokens=out.prompt_tokens, token_counts=list(out.token_counts))

        return await asyncio.to_thread(run)

    def metrics(self) -> Mapping[str, EngineMetrics]:
        return {name: engine.metrics() for name, engine in list(self._engines.items())}

    def replica_metrics(self) -> list[tuple[str, str, EngineMetrics]]:
        return [(model, LOCAL_REPLICA, m) for model, m in sorted(self.metrics().items())]

    def load(self, model: str) -> Load | None:
        engine = self._engines.get(model)
        if engine is None or not engine.alive:
            return None
        return self._meter.load(model, engine.metrics(), engine.engine.config.max_num_seqs)

    def shutdown(self) -> None:
        with self._load_lock:
            engines, self._engines = self._engines, {}
            self._embedders = {}
        for engine in engines.values():
            engine.shutdown()


_backend: Backend | None = None
_backend_lock = threading.Lock()


def get_backend() -> Backend:
    """The process-wide backend named by HEARTH_ENGINE: `inprocess` (engines in this process, the default) or
    `ray` (the fleet's replicas, at RAY_ADDRESS)."""
    global _backend
    if _backend is None:
        with _backend_lock:
            if _backend is None:
                kind = os.environ.get("HEARTH_ENGINE") or settings.HEARTH_ENGINE
                if kind == "inprocess":
                    _backend = InProcessBackend()
                elif kind == "ray":
                    from controlplane.serving.fleet_backend import RayBackend

                    _backend = RayBackend()
                else:
                    raise ImproperlyConfigured(f"HEARTH_ENGINE={kind!r}: use 'inprocess' or 'ray'")
    return _backend


def current_backend() -> Backend | None:
    """The backend if one was created; never creates one (metrics scrapes must not load engines)."""
    return _backend


def set_backend(backend: Backend | None) -> Backend | None:
    """Install another backend (tests, benchmarks, a future remote dispatcher); returns the previous one."""
    global _backend
    with _backend_lock:
        previous, _backend = _backend, backend
    return previous

