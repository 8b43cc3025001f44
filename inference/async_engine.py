"""The engine loop in a background thread, with asyncio and blocking front ends.

Only the loop thread touches the engine's state: callers post commands into an inbox and receive outputs
through per-request sinks (an asyncio queue fed with call_soon_threadsafe, or a plain queue).

A request's grammar is compiled before it reaches the inbox, never on the loop thread (a compile takes from a
millisecond to seconds, and every running request would wait for it) nor on the event loop: `stream` and
`generate` compile in a worker thread, `submit` in its caller's thread; a cached grammar costs nothing.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from xgrammar import CompiledGrammar

from inference.config import EngineConfig
from inference.constrained.constraint import Constraint
from inference.engine import EngineMetrics, LLMEngine
from inference.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from inference.outputs import RequestOutput
from inference.prompts import encode_prompt
from inference.sequence import GenerationRequest, Priority

log = logging.getLogger(__name__)

Sink = Callable[[RequestOutput | BaseException], None]


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.info = engine.info
        # Callers encode on their own copy of the tokenizer: the loop thread's detokenizers use the engine's,
        # and a shared one would make every request wait for the step in flight before it could even encode.
        self.tokenizer = copy.deepcopy(engine.tokenizer)
        self._inbox: queue.SimpleQueue[tuple[str, Any, Any]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._sinks: dict[str, Sink] = {}
        self._stopped = False
        self._dead: BaseException | None = None
        # The gauges as of the loop's last step, and when (time.time()): a fleet router adds to them only what
        # it sent since. One tuple, so a reader never pairs one snapshot with another's time.
        self._snapshot = (engine.metrics(), time.time())
        self._pending = 0  # submitted, not yet taken in by the loop
        # Interactive requests submitted and taken in by the loop: while the first runs ahead, the engine starts
        # the newcomers between the layers of the step in flight (this object is its FrontEnd).
        self._interactive_in = 0
        self._interactive_taken = 0
        self._submit_lock = threading.Lock()
        self._deferred_aborts: list[str] = []
        if engine.config.serve_arrivals_mid_step:
            engine.front = self
        self._tokenizer_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"hearth-engine-{engine.info.name}", daemon=True)
        self._thread.start()

    @classmethod
    def from_model(cls, name_or_path: str | Path, config: EngineConfig | None = None) -> AsyncEngine:
        return cls(LLMEngine.from_model(name_or_path, config))

    # ----------------------------------------------------------------- front end
    def encode(self, prompt: str | None = None, messages: list | None = None, raw: bool = False,
               tools: list | None = None) -> list[int]:
        with self._tokenizer_lock:
            return encode_prompt(self.tokenizer, prompt=prompt, messages=messages, raw=raw, tools=tools)

    def tokenizer_copy(self) -> Any:
        """A copy of the callers' tokenizer (chat template included), for a process that encodes elsewhere."""
        with self._tokenizer_lock:
            return copy.deepcopy(self.tokenizer)

    async def compile_constraint(self, constraint: Constraint) -> CompiledGrammar:
        """Compile (or find cached) a constraint's grammar in a worker thread; InvalidRequestError names what is
        wrong with it. Callers that build requests ahead (the control plane) refuse bad ones here."""
        cached = self.engine.constrained.grammars.lookup(constraint)
        if cached is not None:
            return cached
        return await asyncio.to_thread(self.engine.compile_constraint, constraint)

    async def _compiled(self, request: GenerationRequest) -> CompiledGrammar | None:
        return None if request.constraint is None else await self.compile_constraint(request.constraint)

    def submit(self, request: GenerationRequest, sink: Sink, grammar: CompiledGrammar | None = None) -> None:
        """Queue a request; sink receives every RequestOutput (or an exception) on the loop thread.

        A constraint not yet compiled is compiled here, in the caller's thread (from an event loop, await
        `compile_constraint` first, or use `stream`/`generate`). grammar: the constraint's compiled form."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped: {self._dead}")
        if self._stopped:
            raise EngineDeadError("the engine is shut down")
        self.engine.validate(request)
        if self._snapshot[0].queue_depth + self._pending >= self.engine.config.max_queue:
            raise EngineOverloadedError("the engine's queue is full; retry later")
        if request.constraint is not None and grammar is None:
            grammar = self.engine.compile_constraint(request.constraint)
        with self._submit_lock:
            self._pending += 1
            if request.priority is Priority.INTERACTIVE:
                self._interactive_in += 1
        self._inbox.put(("add", (request, grammar), sink))
        self._wakeup.set()

    async def stream(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """Outputs as they are produced. Leaving the loop early (or cancelling) aborts the request."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        grammar = await self._compiled(request)
        self.submit(request, lambda item: loop.call_soon_threadsafe(outputs.put_nowait, item), grammar)
        finished = False
        try:
            while True:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request.request_id)  # type: ignore[arg-type]

    async def generate(self, request: GenerationRequest) -> RequestOutput:
        """The final output only. Intermediate ones are dropped on the loop thread, so a caller that waits for
        the end (a batch item, a non-streaming request) costs no cross-thread wake-up per token."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[RequestOutput] = loop.create_future()

        def settle(item: RequestOutput | BaseException) -> None:
            if done.done():
                return
            if isinstance(item, BaseException):
                done.set_exception(item)
            else:
                done.set_result(item)

        def sink(item: RequestOutput | BaseException) -> None:
            if isinstance(item, BaseException) or item.finished:
                loop.call_soon_threadsafe(settle, item)

        self.submit(request, sink, await self._compiled(request))
        try:
            return await done
        finally:
            if not done.done() or done.cancelled():
                self.abort(request.request_id)  # type: ignore[arg-type]

    def generate_blocking(self, request: GenerationRequest, timeout: float | None = None) -> RequestOutput:
        """For threads without an event loop (workers, scripts)."""
        outputs: queue.SimpleQueue[RequestOutput | BaseException] = queue.SimpleQueue()
        self.submit(request, outputs.put)
        while True:
            item = outputs.get(timeout=timeout)
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                return item

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id, None))
        self._wakeup.set()

    def metrics(self) -> EngineMetrics:
        return self._snapshot[0]

    def stamped_metrics(self) -> tuple[EngineMetrics, float]:
        """The gauges and the wall-clock time they were taken (after the loop's last step)."""
        return self._snapshot

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._dead is None

    # ----------------------------------------------------------------- loop thread
    # FrontEnd, called by the engine between layers of a pass on this thread.
    def has_arrivals(self) -> bool:
        return self._interactive_in > self._interactive_taken

    def take_arrivals(self) -> None:
        self._drain_inbox(mid_step=True)

    def deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            if out.finished:
                del self._sinks[out.request_id]
            self._deliver(sink, out)

    def _drain_inbox(self, mid_step: bool = False) -> None:
        """Add what was submitted. Mid-step, aborts wait: the sequence may be in the pass in flight."""
        if not mid_step:
            for request_id in self._deferred_aborts:
                self.engine.abort(request_id)
            self._deferred_aborts.clear()
        while True:
            try:
                kind, payload, sink = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                request, grammar = payload
                with self._submit_lock:
                    self._pending -= 1
                if request.priority is Priority.INTERACTIVE:
                    self._interactive_taken += 1
                try:
                    self.engine.add_request(request, grammar)
                except InvalidRequestError as exc:
                    self._deliver(sink, exc)
                    continue
                self._sinks[request.request_id] = sink
            elif mid_step:
                self._deferred_aborts.append(payload)
            else:
                self.engine.abort(payload)

    def _deliver(self, sink: Sink, item: RequestOutput | BaseException) -> None:
        """A caller's sink failing (say, its event loop closed) costs that caller its request, nobody else."""
        try:
            sink(item)
        except Exception:
            log.exception("a request's output sink failed; aborting that request")
            if isinstance(item, RequestOutput) and not item.finished:
                self._sinks.pop(item.request_id, None)
                self.engine.abort(item.request_id)

    def _run(self) -> None:
        try:
            while not self._stopped:
                self._drain_inbox()
                if not self.engine.has_unfinished():
                    self._snapshot = (self.engine.metrics(), time.time())
                    self._wakeup.wait(timeout=1.0)
                    self._wakeup.clear()
                    continue
                outputs = self.engine.step()
                self._snapshot = (self.engine.metrics(), time.time())
                self.deliver(outputs)
        except BaseException as exc:  # the loop itself broke: fail every waiting caller, loudly
            log.exception("the engine loop stopped")
            self._dead = exc
            for sink in self._sinks.values():
                sink(EngineDeadError(f"the engine stopped: {exc}"))
            self._sinks.clear()
