"""How the control plane reaches the fleet: DeploymentHandles per model, errors mapped back to the engine's.

A replica that dies takes its requests with it: they end with ReplicaLostError (an EngineDeadError, so the
control plane answers 503 and batch items are given back and run again). A non-streaming request is retried
once first, routed away from the replica that died (named in Ray's error, or known to the router by its actor
id), so the retry lands on a live one; so are streams that lost their replica before their first output,
embeddings, and the calls that change nothing on a replica (tokenizing a request, the model's facts, a grammar's
compile), which a request makes before it generates. Whatever else Ray, Serve or gRPC raise on the way ends the request
with EngineUnreachableError (a 503 to retry), never as an error the control plane does not know.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import grpc
import ray
from ray import serve
from ray.exceptions import (
    ActorDiedError,
    ActorUnavailableError,
    RayActorError,
    RayError,
    RayTaskError,
    TaskCancelledError,
)
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, RayServeException

from fleet.actors import actor_label
from fleet.adapters import CACHE_MB_ENV, AdapterBundle, BundleCache, budget_bytes
from fleet.app import DEPLOYMENT, app_name, connect
from fleet.routing import RouteHint
from inference import EngineMetrics, GenerationRequest, ModelInfo, RequestOutput
from inference.constrained import Constraint
from inference.errors import (
    EngineDeadError,
    EngineError,
    EngineLostError,
    EngineOverloadedError,
    EngineUnreachableError,
    ModelNotFoundError,
    TokenizerChangedError,
)
from inference.outputs import TokenLogprob
from inference.prompts import encode_prompt

log = logging.getLogger("fleet.client")
METRICS_EVERY_S = 2.0
# Adapters this process keeps in the object store (MiB), the least recently used dropped past it and put again
# when asked for: a control plane serving many tenants' adapters must not pin every one it ever sent.
ADAPTER_CACHE_MB = 1024
ANYWHERE = RouteHint()  # no session, prompt or adapter: the least loaded replica
TOKENIZER_RETRY_S = 60.0  # after a replica could not give its tokenizer, its replicas encode until then
TOKENIZER_WAIT_S = 60.0  # a replica that sends no tokenizer by then is taken as giving none
COMPILED_KEPT = 4096  # constraints per model known to compile, the least recently used forgotten
LOST = (ActorDiedError, ActorUnavailableError, RayActorError, DeploymentUnavailableError)
# Serve's gRPC path refuses a message past this at either end (its own setting, read as Serve reads it)
GRPC_MESSAGE_BYTES = int(os.environ.get("RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH", 4 * 1024 * 1024))
GRPC_SLACK_BYTES = 64 * 1024  # the request's and answer's fixed fields, with room to spare


def fits_grpc(request: GenerationRequest, char_limit: int, window: int) -> bool:
    """Whether a generation's messages stay inside Serve's gRPC limit, by a bound on their size: its prompt and
    grammar going out; coming back (whole, or as a stream's last item, which carries everything so far) its
    token ids and its text twice (the whole and the last delta) at up to 4 bytes a character, each token at most
    as long as the model's longest (`char_limit` is the context `window` times that). Log probabilities
    (21 tokens with their text per output token at the most) are not bounded here: such a request goes by
    reference, with no limit, as does a long answer."""
    if request.params.logprobs is not None or window <= 0:
        return False
    prompt = len(request.prompt_token_ids)
    tokens = max(0, min(request.params.max_tokens, window - prompt))  # the engine stops at its context
    longest_bytes = 4 * max(1, char_limit // window)
    out = 5 * (prompt + len(request.forced_output or ())) + 4 * len(request.constraint.spec if request.constraint else "")
    back = tokens * (5 + 2 * longest_bytes)
    return out + back + GRPC_SLACK_BYTES <= GRPC_MESSAGE_BYTES


class ReplicaLostError(EngineLostError):
    """The replica serving the request died (Serve starts another). `replica`: its label, where Ray named it."""

    def __init__(self, message: str, replica: str = "") -> None:
        super().__init__(message)
        self.replica = replica


# Ray names a replica's actor SERVE_REPLICA::<app>#<deployment>#<unique id>, the id being the router's label.
_REPLICA_NAME = re.compile(r"SERVE_REPLICA::[^\s#]+#[^\s#]+#(\w+)")


def _lost(cause: BaseException) -> ReplicaLostError:
    """The replica is named in the message of an actor's death; an unavailable actor gives only its id, which
    the router of this process has seen."""
    found = _REPLICA_NAME.search(str(cause))
    label = found.group(1) if found else actor_label(str(getattr(cause, "actor_id", None) or ""))
    return ReplicaLostError(f"the replica serving the request died: {cause}", label)


@dataclass(frozen=True, slots=True)
class ReplicaMetrics:
    model: str
    replica: str
    metrics: EngineMetrics
    slots: int  # the engine's sequence slots
    revision: str = ""  # what it serves (fleet.replica.model_revision); "" from a replica of an older release
    tokenizer_revision: str = ""  # its tokenizer's (fleet.replica.tokenizer_revision); "" as revision


def _engine_error(exc: BaseException) -> BaseException:
    """The engine's own error inside a Ray wrapper, ReplicaLostError for a replica that went away, and
    EngineUnreachableError for the rest of what Ray or Serve raise on the way (the control plane's 503, a batch
    item given back): on Serve's gRPC path a call ended by any code but UNAVAILABLE or CANCELLED comes as gRPC's
    own error, which would otherwise reach the caller as an unknown one (a 500). A cancellation stays one."""
    if isinstance(exc, RayTaskError):
        cause = exc.cause
        if isinstance(cause, EngineError):
            return cause
        if isinstance(cause, LOST):
            return _lost(cause)
        return EngineDeadError(f"the replica failed the request: {cause!r}")
    if isinstance(exc, LOST):
        return _lost(exc)
    if isinstance(exc, TaskCancelledError):
        return exc
    if isinstance(exc, BackPressureError):
        return EngineOverloadedError(f"the model's replicas hold as many requests as they queue: {exc}")
    if isinstance(exc, grpc.RpcError | RayError | RayServeException):
        described = _describe(exc)
        log.warning("a fleet call failed on its way (%s)", described)
        return EngineUnreachableError(f"the call to the fleet failed on its way: {described}")
    return exc


def _describe(exc: BaseException) -> str:
    """gRPC's status and details where it has them (its str() is a multi-line debug dump)."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"gRPC {exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


class LocalTokenizer:
    """A model's tokenizer fetched from one of its replicas (chat template included): requests are encoded in
    this process, in a worker thread, so a request costs the fleet one call instead of two (an encode through
    Serve took 5.0-5.6 ms for a 667-token chat on a Zen 4 VM, 1.4 ms here) and the replicas' cores only run
    their engines."""

    def __init__(self, tokenizer: Any, revision: str = "", vocabulary: str = "") -> None:
        self.tokenizer = tokenizer
        self.revision = revision  # its tokenizer_revision, as the replica it came from reported it
        self.vocabulary = vocabulary  # its vocabulary_revision: what the ids it encodes stand for
        self._lock = threading.Lock()  # one thread at a time, as the engine's own

    def encode(self, **kwargs: Any) -> list[int]:
        with self._lock:
            return encode_prompt(self.tokenizer, **kwargs)


class FleetClient:
    def __init__(self, address: str | None = None, adapter_cache_bytes: int | None = None) -> None:
        connect(address)
        self._handles: dict[str, Any] = {}
        self._char_limits: dict[str, tuple[int, int]] = {}
        # model -> its tokenizer here, or None (and when) if its replicas could not give one
        self._tokenizers: dict[str, tuple[LocalTokenizer | None, float]] = {}
        self._tokenizer_gates: dict[str, threading.Lock] = {}
        self._compiled: dict[str, OrderedDict[str, None]] = {}  # model -> keys of constraints that compiled
        self._infos: dict[str, ModelInfo] = {}
        self.adapters = BundleCache(adapter_cache_bytes or budget_bytes(CACHE_MB_ENV, ADAPTER_CACHE_MB), ray.put)
        self._lock = threading.Lock()
        self._metrics: dict[tuple[str, str], ReplicaMetrics] = {}
        self._revisions: dict[str, frozenset[str]] = {}  # model -> what its replicas served at the last poll
        self._tokenizer_revisions: dict[str, frozenset[str]] = {}  # model -> their tokenizers' revisions then
        self._epochs: dict[str, int] = {}  # model -> how many times that changed: a fetch across it is not kept
        self._embedders: set[str] = set()  # embedding models: no engine gauges to poll
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll_metrics, name="hearth-fleet-metrics", daemon=True)
        self._poller.start()

    # ------------------------------------------------------------------ handles
    def handle(self, model: str) -> Any:
        handle = self._handles.get(model)
        if handle is None:
            try:
                handle = serve.get_deployment_handle(DEPLOYMENT, app_name(model))
            except Exception as exc:  # Serve raises a plain error for an application it does not know
                raise ModelNotFoundError(f"{model} is not deployed on the fleet") from exc
            with self._lock:
                self._handles[model] = handle
        return handle

    def _way(self, model: str, by_reference: bool) -> Any:
        """The model's handle for one call: Ray's task path by reference, or Serve's gRPC path (see _by_reference)."""
        handle = self.handle(model)
        return handle if by_reference else handle.options(_by_reference=False)

    async def _by_reference(self, model: str, request: GenerationRequest, bundle: AdapterBundle | None) -> bool:
        """Whether a generation goes by Ray's task path by reference rather than Serve's gRPC path. gRPC costs less
        per call (a bare replica call 7.1 against 8.8 ms on a Zen 3 VM; 16 streams of 128 tokens on 2 replicas ran
        at 0.92x the tokens/s of the same requests unstreamed, against 0.83x), but refuses large messages, and an
        adapter's bundle holds an ObjectRef, which only the path by reference counts as in use. The other calls
        (a model's facts, a grammar's compile, tokenizing there, embeddings of any number of texts) are rare or
        unbounded in size, and go by reference."""
        if bundle is not None:
            return True
        return not fits_grpc(request, *await self.char_limit(model))

    async def _call(self, model: str, method: str, *args: Any, by_reference: bool = True, **kwargs: Any) -> Any:
        try:
            return await getattr(self._way(model, by_reference), method).remote(*args, **kwargs)
        except BaseException as exc:
            mapped = self._seen(model, _engine_error(exc))
            if mapped is exc:
                raise
            raise mapped from None

    def _seen(self, model: str, error: BaseException) -> BaseException:
        """An error of a call about `model`, after learning from it: a replica that refused a prompt encoded by
        a tokenizer it does not have means the one kept here is gone from the fleet (the metrics poll would tell
        within a few seconds): dropped now, so the request sent again is encoded by a tokenizer fetched anew."""
        if isinstance(error, TokenizerChangedError):
            with self._lock:
                self._tokenizers.pop(model, None)
        return error

    async def _call_again_if_lost(self, model: str, method: str, *args: Any, route: RouteHint = ANYWHERE,
                                  by_reference: bool = True, **kwargs: Any) -> Any:
        """A call that has given the caller nothing yet (a non-streaming generation, embeddings) or changes nothing
        on the replica (tokenizing, the model's facts, a grammar's compile), tried once more if its replica dies under it.
        The retry's route avoids the dead replica: Serve drops it from the candidates once it learns of the death,
        which can come after the retry is routed (a session's hash would send it straight back there). Under
        load a tokenizing call can wait in a replica's queue when that replica is killed."""
        try:
            return await self._call(model, method, *args, route=route, by_reference=by_reference, **kwargs)
        except ReplicaLostError as exc:
            log.warning("a %s call lost its replica (%s); retrying once", method, exc)
            retry = replace(route, avoid=route.avoid | ({exc.replica} - {""}))
            return await self._call(model, method, *args, route=retry, by_reference=by_reference, **kwargs)

    # ------------------------------------------------------------------ engine calls
    async def info(self, model: str) -> ModelInfo:
        info = self._infos.get(model)
        if info is None:
            epoch = self._epoch(model)
            info = await self._call_again_if_lost(model, "info")
            self._keep(self._infos, model, info, epoch)
        return info

    async def char_limit(self, model: str) -> tuple[int, int]:
        limit = self._char_limits.get(model)
        if limit is None:
            epoch = self._epoch(model)
            limit = await self._call_again_if_lost(model, "char_limit")
            self._keep(self._char_limits, model, limit, epoch)
        return limit

    async def encode(self, model: str, **kwargs: Any) -> list[int]:
        """Token ids for a request, computed here with the replicas' tokenizer (in a worker thread: a long prompt
        takes a while), or on a replica while this process has none."""
        settled, local = self._settled_tokenizer(model)
        if not settled:
            local = await asyncio.to_thread(self._fetch_tokenizer, model)
        if local is None:
            return await self._call_again_if_lost(model, "encode", **kwargs)
        return await asyncio.to_thread(local.encode, **kwargs)

    def _settled_tokenizer(self, model: str) -> tuple[bool, LocalTokenizer | None]:
        """(True, the tokenizer) once fetched; (True, None) while its replicas encode, after they gave none less
        than TOKENIZER_RETRY_S ago; (False, None) when a fetch is due."""
        known = self._tokenizers.get(model)
        if known is None:
            return False, None
        local, when = known
        return local is not None or time.monotonic() - when < TOKENIZER_RETRY_S, local

    def _fetch_tokenizer(self, model: str) -> LocalTokenizer | None:
        """The model's tokenizer from one of its replicas, once per process (a burst of first requests waits for
        the one fetch). Where none comes (a replica of an older release during an update, say), the replicas
        encode and the fetch is tried again TOKENIZER_RETRY_S later."""
        handle = self.handle(model)
        with self._lock:
            gate = self._tokenizer_gates.setdefault(model, threading.Lock())
        with gate:
            settled, local = self._settled_tokenizer(model)
            if settled:  # fetched (or refused) while this thread waited
                return local
            route, epoch = ANYWHERE, self._epoch(model)
            for attempt in (1, 2):
                try:
                    revision, vocabulary, tokenizer = handle.tokenizer_and_revisions.remote(route=route).result(
                        timeout_s=TOKENIZER_WAIT_S)
                    local = LocalTokenizer(tokenizer, revision, vocabulary)
                    break
                except Exception as exc:
                    mapped = _engine_error(exc)
                    if not isinstance(mapped, ReplicaLostError):
                        log.warning("no tokenizer from the replicas of %s (%r): they encode its requests", model, mapped)
                        break
                    if attempt == 2:
                        raise mapped from None
                    route = replace(route, avoid=route.avoid | ({mapped.replica} - {""}))
            with self._lock:  # a tokenizer names its revision: kept while that is served, whenever it came
                served = self._tokenizer_revisions.get(model, frozenset())
                if self._epoch(model) == epoch or (local is not None and local.revision in served):
                    self._tokenizers[model] = (local, time.monotonic())
            return local

    async def compile(self, model: str, constraint: Constraint) -> None:
        """Refuse a bad constraint before its request goes out (the replica's InvalidRequestError). One that
        compiled for this model is not sent again: a compile depends only on the constraint's content and the
        model, the replica that generates compiles it there if it has not yet (this check ran wherever Serve
        sent it), and agents send the same tools every turn. Refusals are asked again each time."""
        key, epoch = constraint.key, self._epoch(model)
        with self._lock:
            known = self._compiled.get(model)
            if known is not None and key in known:
                known.move_to_end(key)
                return
        await self._call_again_if_lost(model, "compile", constraint)
        with self._lock:
            if self._epoch(model) != epoch:
                return
            known = self._compiled.setdefault(model, OrderedDict())
            known[key] = None
            while len(known) > COMPILED_KEPT:
                known.popitem(last=False)

    async def _bundle(self, request: GenerationRequest) -> AdapterBundle | None:
        lora = request.lora
        if lora is None:
            return None
        return self.adapters.cached(lora.name) or await asyncio.to_thread(self.adapters.get, lora.name, lora.path)

    def _hint(self, model: str, request: GenerationRequest, session: str) -> RouteHint:
        """Where the request would be best served. It names the revisions of the tokenizer kept here, the one that
        encoded it (unless a change of revision dropped that one in between: then, as for a request the replicas
        encoded, none), so that it reaches replicas that read its ids as the same tokens: its vocabulary's decides
        (a new chat template alone changes only the tokenizer's), the tokenizer's for replicas of the release
        before."""
        known = self._tokenizers.get(model)
        local = known[0] if known is not None else None
        return RouteHint(session=session, prompt=tuple(request.prompt_token_ids), extra_keys=request.extra_keys,
                         adapter=request.lora.name if request.lora is not None else None,
                         tokenizer_revision=local.revision if local is not None else "",
                         vocabulary_revision=local.vocabulary if local is not None else "")

    async def generate(self, model: str, request: GenerationRequest, session: str = "") -> RequestOutput:
        bundle = await self._bundle(request)
        return await self._call_again_if_lost(model, "generate", request, route=self._hint(model, request, session),
                                              by_reference=await self._by_reference(model, request, bundle),
                                              adapter=bundle)

    async def stream(self, model: str, request: GenerationRequest, session: str = "") -> AsyncIterator[RequestOutput]:
        """The request's outputs as the replica makes them. A stream whose replica dies before its first output
        has given the caller nothing, so it is tried once more elsewhere, like a non-streaming request; after
        that the caller has text it cannot take back, and the loss is raised."""
        bundle = await self._bundle(request)
        route, begun = self._hint(model, request, session), False
        handle = self._way(model, await self._by_reference(model, request, bundle)).options(stream=True)
        # The replica sends each output's own step's log probabilities, and its text and token ids empty where
        # they are only the last ones plus the step's deltas (EngineReplica.stream): rebuilt here.
        so_far: list[TokenLogprob] = []
        text, ids = "", list[int]()
        for attempt in (1, 2):
            responses = handle.stream.remote(request, route=route, adapter=bundle)
            try:
                async for out in responses:
                    begun = True
                    if out.logprobs is not None:
                        so_far.extend(out.logprobs)
                        out.all_logprobs = list(so_far)
                    if out.text or out.token_ids:  # sent whole
                        text, ids = out.text, list(out.token_ids)
                    else:
                        text += out.delta_text
                        ids.extend(out.delta_token_ids)
                        out.text, out.token_ids = text, list(ids)
                    yield out
                return
            except BaseException as exc:
                mapped = self._seen(model, _engine_error(exc))
                if mapped is exc:
                    raise
                if not (isinstance(mapped, ReplicaLostError) and not begun and attempt == 1):
                    raise mapped from None
                log.warning("a stream lost its replica before its first output (%s); retrying once", mapped)
                route = replace(route, avoid=route.avoid | ({mapped.replica} - {""}))
            finally:
                responses.cancel()  # the client left early: the replica aborts the engine request

    async def embed(self, model: str, texts: list[str]) -> dict[str, Any]:
        """Vectors change nothing on a replica and reach the caller whole: tried once more if the replica dies."""
        self._embedders.add(model)
        return await self._call_again_if_lost(model, "embed", texts)

    # ------------------------------------------------------------------ observation
    def _poll_metrics(self) -> None:
        while not self._stop.wait(METRICS_EVERY_S):
            try:
                self.refresh_metrics()
            except Exception:  # a cluster hiccup must not end the poller
                log.debug("metrics poll failed", exc_info=True)

    def refresh_metrics(self, timeout_s: float = 5.0) -> None:
        """Every replica's engine gauges, from each model this process has reached."""
        fresh: dict[tuple[str, str], ReplicaMetrics] = {}
        for model, handle in list(self._handles.items()):
            if model in self._embedders:  # an embedder has no gauges; asked, each replica would log an error
                continue
            try:
                results = handle.broadcast("metrics").results(timeout_s=timeout_s, return_exceptions=True)
            except Exception:
                continue
            for result in results:
                if isinstance(result, tuple) and len(result) in (3, 4, 5):
                    fresh[(model, result[0])] = ReplicaMetrics(model, *result)
        with self._lock:
            self._metrics = fresh
        for model in {model for model, _ in fresh}:
            mine = [r for (m, _), r in fresh.items() if m == model]
            self._note_revisions(model, frozenset(r.revision for r in mine),
                                 frozenset(r.tokenizer_revision for r in mine))

    def _epoch(self, model: str) -> int:
        return self._epochs.get(model, 0)

    def _keep(self, kept: dict[str, Any], model: str, value: Any, epoch: int) -> None:
        """Keep what was fetched of a model unless its replicas changed revision while the fetch ran."""
        with self._lock:
            if self._epoch(model) == epoch:
                kept[model] = value

    def _note_revisions(self, model: str, revisions: frozenset[str], tokenizers: frozenset[str]) -> None:
        """What this process keeps of a model was learnt from its replicas; when what they serve changes (a
        redeploy under the same name with another checkpoint or other settings), it is learnt again. During a
        rolling update the replicas disagree, and the change is seen again once the old ones are gone. The
        tokenizer stays while replicas with the same tokenizer revision (`tokenizers`) remain, and the requests it
        encodes go to those (`_hint`): a tokenizer fetched anew might come from either side of the update, and its
        ids would reach the other side's replicas as other tokens."""
        with self._lock:
            before = self._revisions.get(model)
            self._revisions[model], self._tokenizer_revisions[model] = revisions, tokenizers
            if before is None or before == revisions:
                return
            for kept in (self._infos, self._char_limits, self._compiled):
                kept.pop(model, None)
            known = self._tokenizers.get(model)
            if known is None or known[0] is None or not known[0].revision or known[0].revision not in tokenizers:
                self._tokenizers.pop(model, None)
            self._epochs[model] = self._epoch(model) + 1
        log.info("the replicas of %s serve another revision (%s, before %s): what was kept of it is fetched again "
                 "(its tokenizer too, unless replicas with it remain)", model, sorted(revisions), sorted(before))

    def replica_metrics(self) -> list[ReplicaMetrics]:
        with self._lock:
            return sorted(self._metrics.values(), key=lambda r: (r.model, r.replica))

    def model_metrics(self) -> Mapping[str, list[ReplicaMetrics]]:
        out: dict[str, list[ReplicaMetrics]] = {}
        for r in self.replica_metrics():
            out.setdefault(r.model, []).append(r)
        return out

    def close(self) -> None:
        self._stop.set()

