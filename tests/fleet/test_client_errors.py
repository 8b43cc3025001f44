"""How the fleet client maps Ray's errors back to the engine's, without a cluster: Ray's own exception classes."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine, Generator
from typing import Any

import grpc
import pytest
import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, ObjectLostError, RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError, RequestCancelledError

from fleet.actors import note_actor
from fleet.client import TOKENIZER_RETRY_S, FleetClient, LocalTokenizer, ReplicaLostError, _engine_error
from inference import GenerationRequest, RequestOutput
from inference.errors import EngineDeadError, EngineOverloadedError, EngineUnreachableError
from inference.outputs import RequestMetrics, Usage

DIED = ("The actor died unexpectedly before finishing this task.\n\tclass_name: ServeReplica:hearth-smollm2:engine\n"
        "\tactor_id: 7ee8f67c0d6e9b7b1fe9c2fd01000000\n\tpid: 10133\n"
        "\tname: SERVE_REPLICA::hearth-smollm2-135m-instruct#engine#mxfgth0q\n\tnamespace: serve\n"
        "The actor is dead because it was killed by `ray.kill`.")


def test_a_dead_replica_is_named_so_the_retry_can_avoid_it() -> None:
    lost = _engine_error(RayActorError(error_msg=DIED))
    assert isinstance(lost, ReplicaLostError) and isinstance(lost, EngineDeadError)
    assert lost.replica == "mxfgth0q"
    # Wrapped in a task error, as a streamed call raises it.
    wrapped = RayTaskError("stream", "traceback", ActorDiedError())
    assert isinstance(_engine_error(wrapped), ReplicaLostError)
    # No name in the message (a death Ray could not attribute): still lost, nothing to avoid.
    assert _engine_error(ActorDiedError()).replica == ""


def test_an_unavailable_replica_is_known_by_its_actor_id() -> None:
    # Ray's ActorUnavailableError names only the actor id; the router of this process noted which replica it is.
    actor, stranger = ray.ActorID.from_random(), ray.ActorID.from_random()
    note_actor(actor.hex(), "q1w2e3r4")
    lost = _engine_error(ActorUnavailableError("the connection to it was lost", actor.binary()))
    assert isinstance(lost, ReplicaLostError) and lost.replica == "q1w2e3r4"
    assert _engine_error(RayTaskError("stream", "tb", ActorUnavailableError("gone", actor.binary()))).replica == (
        "q1w2e3r4")
    # An actor no router here has seen: still lost, nothing to avoid.
    assert _engine_error(ActorUnavailableError("gone", stranger.binary())).replica == ""


def test_the_engines_own_errors_pass_through_and_others_are_a_dead_engine() -> None:
    busy = EngineOverloadedError("queue full")
    assert _engine_error(RayTaskError("generate", "traceback", busy)) is busy
    other = _engine_error(RayTaskError("generate", "traceback", ValueError("boom")))
    assert type(other) is EngineDeadError and "boom" in str(other)
    plain = KeyError("x")
    assert _engine_error(plain) is plain


class _Response:
    """What a handle's call returns: awaited on an event loop, or `result()` from a worker thread."""

    def __init__(self, answer: Callable[[], Coroutine[Any, Any, object]]) -> None:
        self._answer = answer

    def __await__(self) -> Generator[Any, None, object]:
        return self._answer().__await__()

    def result(self, timeout_s: float | None = None) -> object:
        return asyncio.run(asyncio.wait_for(self._answer(), timeout_s))


class _DyingHandle:
    """A deployment handle whose replica dies under the first call of each method (Ray's own error, as a
    killed replica raises it); later calls answer (`answers` maps a method to its answer). Records each call's
    route."""

    def __init__(self, answers: dict[str, object] | None = None) -> None:
        self.routes: list[tuple[str, object]] = []
        self.answers = answers or {}
        self.by_reference: list[tuple[str, bool]] = []  # each call's method and whether it went by reference
        self._next_by_reference = True

    def options(self, **options: object) -> _DyingHandle:
        """Serve's `options`: the same double, noting the path the next call takes."""
        if "_by_reference" in options:
            self._next_by_reference = bool(options["_by_reference"])
        return self

    def __getattr__(self, method: str) -> object:
        handle = self

        class _Method:
            def remote(self, *args: object, **kwargs: object) -> object:
                first = not any(name == method for name, _ in handle.routes)
                handle.routes.append((method, kwargs.get("route")))
                handle.by_reference.append((method, handle._next_by_reference))
                handle._next_by_reference = True
                if method == "stream":  # one output, then its end
                    return _Stream(1, StopAsyncIteration)

                async def answer() -> object:
                    if first:
                        raise RayActorError(error_msg=DIED)
                    if method in handle.answers:
                        found = handle.answers[method]
                        if isinstance(found, BaseException):
                            raise found
                        return found
                    return (method, args, {k: v for k, v in kwargs.items() if k != "route"})

                return _Response(answer)

        return _Method()


KNOWN = (8192 * 81, 8192)  # SmolLM2's (character limit, context): its longest token has 81 characters


def _client(handle: object, tokenizer_fetched: bool = False, char_limit: tuple[int, int] | None = None) -> FleetClient:
    """A client with no cluster: the handle stands in for Serve's. `tokenizer_fetched`: as if the replicas
    could not give their tokenizer a moment ago, so requests are encoded on them. `char_limit`: as if the
    model's (limit, window) had been asked for already."""
    client = FleetClient.__new__(FleetClient)
    client._handles, client._infos = {"m": handle}, {}
    client._char_limits = {"m": char_limit} if char_limit else {}
    client._lock, client._tokenizer_gates, client._compiled = threading.Lock(), {}, {}
    client._tokenizers = {"m": (None, time.monotonic())} if tokenizer_fetched else {}
    client._revisions, client._epochs, client._metrics, client._embedders = {}, {}, {}, set()
    client._tokenizer_revisions = {}
    return client


class _Words:
    """Just enough of a tokenizer for a raw prompt: one id per word."""

    chat_template = None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [len(word) for word in text.split()]}


def test_the_tokenizer_is_fetched_once_away_from_a_dead_replica_and_requests_are_encoded_here() -> None:
    handle = _DyingHandle({"tokenizer_and_revisions": ("a", "va", _Words())})
    client = _client(handle)
    assert asyncio.run(client.encode("m", prompt="one three", raw=True)) == [3, 5]
    assert asyncio.run(client.encode("m", prompt="a bb ccc", raw=True)) == [1, 2, 3]
    assert [(name, route.avoid) for name, route in handle.routes] == [
        ("tokenizer_and_revisions", frozenset()), ("tokenizer_and_revisions", frozenset({"mxfgth0q"}))]  # nothing
    # encoded on a replica


def test_replicas_that_give_no_tokenizer_encode_until_the_fetch_is_tried_again() -> None:
    old = RayTaskError("tokenizer_and_revisions", "traceback",  # a replica of an earlier release
                       AttributeError("EngineReplica has no attribute 'tokenizer_and_revisions'"))
    handle = _DyingHandle({"tokenizer_and_revisions": old})
    client = _client(handle)
    assert asyncio.run(client.encode("m", prompt="hi", raw=True)) == ("encode", (), {"prompt": "hi", "raw": True})
    asyncio.run(client.encode("m", prompt="again", raw=True))
    assert [name for name, _ in handle.routes].count("tokenizer_and_revisions") == 2  # the death's retry, then no more
    handle.answers["tokenizer_and_revisions"] = ("a", "va", _Words())  # the update finished
    client._tokenizers["m"] = (None, time.monotonic() - TOKENIZER_RETRY_S - 1)
    assert asyncio.run(client.encode("m", prompt="a bb", raw=True)) == [1, 2]


def test_calls_that_change_nothing_are_tried_again_away_from_a_dead_replica() -> None:
    client = _client(_DyingHandle(), tokenizer_fetched=True)
    handle = client._handles["m"]
    got = asyncio.run(client.encode("m", prompt="hello", raw=True))
    assert got == ("encode", (), {"prompt": "hello", "raw": True})
    assert asyncio.run(client.char_limit("m"))[0] == "char_limit"
    assert asyncio.run(client.embed("m", ["a cat"]))[:2] == ("embed", (["a cat"],))  # vectors: nothing sent yet
    assert [(name, route.avoid) for name, route in handle.routes] == [
        ("encode", frozenset()), ("encode", frozenset({"mxfgth0q"})),
        ("char_limit", frozenset()), ("char_limit", frozenset({"mxfgth0q"})),
        ("embed", frozenset()), ("embed", frozenset({"mxfgth0q"}))]
    # A second loss is the caller's 503: one retry only.
    class _AlwaysDead(_DyingHandle):
        def __getattr__(self, method: str) -> object:
            class _Method:
                def remote(self, *args: object, **kwargs: object) -> object:
                    async def fail() -> object:
                        raise RayActorError(error_msg=DIED)
                    return _Response(fail)
            return _Method()

    client._handles["m"] = _AlwaysDead()
    with pytest.raises(ReplicaLostError):
        asyncio.run(client.encode("m", prompt="hello"))
    with pytest.raises(ReplicaLostError):  # the same where the tokenizer's fetch loses two replicas
        asyncio.run(_client(_AlwaysDead()).encode("m", prompt="hello"))


def test_generations_go_on_serves_grpc_path_unless_an_adapter_or_their_size_says_otherwise() -> None:
    """Serve's gRPC path costs less per call than Ray's task path by reference, but refuses a message past its
    limit at either end, and a LoRA request's bundle holds an ObjectRef, which only the path by reference keeps
    alive. A retry after a lost replica takes the same path as its first try; a stream, the same as a call."""
    from types import SimpleNamespace

    from inference import LoRARequest, SamplingParams

    handle = _DyingHandle({"char_limit": KNOWN})
    client = _client(handle, tokenizer_fetched=True)  # the model's window asked by the first generation
    bundle = object()  # the BundleCache's entry: ray.put's ref and the adapter's checksum, in the real thing
    client.adapters = SimpleNamespace(cached=lambda name: bundle if name == "ad" else None)

    def request(prompt: int = 3000, **params: Any) -> GenerationRequest:
        lora = params.pop("lora", None)
        return GenerationRequest(prompt_token_ids=list(range(prompt)), params=SamplingParams(**params), lora=lora)

    async def read(request: GenerationRequest) -> None:
        async for _ in client.stream("m", request):
            pass

    plain = request(max_tokens=256)
    asyncio.run(client.generate("m", plain))
    _, _, sent = asyncio.run(client.generate("m", request(max_tokens=256, lora=LoRARequest("ad", "unused"))))
    assert sent["adapter"] is bundle
    asyncio.run(client.generate("m", request(max_tokens=256, logprobs=0)))  # 21 tokens a token at the most
    asyncio.run(client.generate("m", request(max_tokens=5000)))  # the context leaves 5,192 tokens: 3.3 MB at most
    asyncio.run(client.generate("m", request(100, max_tokens=8000)))  # 5.2 MB at 81 characters a token
    assert handle.by_reference == [("char_limit", True), ("char_limit", True),  # lost its replica, then answered
                                   ("generate", False), ("generate", False), ("generate", True), ("generate", True),
                                   ("generate", False), ("generate", True)]
    assert client._char_limits["m"] == KNOWN  # asked once
    handle.by_reference.clear()
    for one in (plain, request(max_tokens=256, logprobs=2)):
        asyncio.run(read(one))
    assert handle.by_reference == [("stream", False), ("stream", True)]


def test_the_bound_on_a_generations_messages_follows_its_prompt_answer_and_grammar() -> None:
    from fleet.client import GRPC_MESSAGE_BYTES, fits_grpc
    from inference import SamplingParams
    from inference.constrained import Constraint
    from inference.constrained.constraint import MAX_SPEC_CHARS

    def request(prompt: int, max_tokens: int, constraint: Constraint | None = None) -> GenerationRequest:
        return GenerationRequest(prompt_token_ids=[7] * prompt, params=SamplingParams(max_tokens=max_tokens),
                                 constraint=constraint)

    limit = 32768 * 128  # Qwen's: 32k tokens, 128 characters at the longest
    assert fits_grpc(request(100, 256), limit, 32768)
    assert not fits_grpc(request(100, 32768), limit, 32768)  # up to 32k tokens of up to 512 bytes each
    assert fits_grpc(request(32700, 32768), limit, 32768)  # the context leaves room for 68 tokens
    assert not fits_grpc(request(100, 256), limit, 0)  # the window is unknown
    big, small = Constraint.regex("a" * MAX_SPEC_CHARS), Constraint.regex("a" * 1000)  # up to 1 MiB and 4 kB
    assert GRPC_MESSAGE_BYTES == 4 * 1024 * 1024  # Serve's default, which the figures here are for
    assert fits_grpc(request(100, 3000, small), limit, 32768) and not fits_grpc(request(100, 3000, big), limit, 32768)
    # The bound holds: what gRPC carries here is larger than any real answer of that many tokens.
    import pickle

    from inference import RequestOutput
    from inference.outputs import FinishReason, RequestMetrics, Usage

    tokens, text = [151_000 + i for i in range(2000)], "\u4e00" * 2000 * 40
    out = RequestOutput("r", text, tokens, text, tokens, True, FinishReason.LENGTH, Usage(), RequestMetrics())
    assert len(pickle.dumps(out)) <= 2000 * (5 + 2 * 4 * 40) + 64 * 1024


def test_a_constraint_that_compiled_is_not_sent_again_and_a_refused_one_is() -> None:
    from inference.constrained import Constraint
    from inference.errors import InvalidRequestError

    bad = Constraint.regex("(")
    refused = RayTaskError("compile", "traceback", InvalidRequestError("the regex does not compile"))
    handle = _DyingHandle()
    client = _client(handle)
    good, other = Constraint.regex("[a-z]+"), Constraint.json_object()
    for constraint in (good, good, other, good, other):
        asyncio.run(client.compile("m", constraint))
    # good: lost its replica, then compiled elsewhere; other: compiled; then neither is sent again
    assert [(name, route.avoid) for name, route in handle.routes] == [
        ("compile", frozenset()), ("compile", frozenset({"mxfgth0q"})), ("compile", frozenset())]
    handle.answers["compile"] = refused
    for _ in range(2):
        with pytest.raises(InvalidRequestError):
            asyncio.run(client.compile("m", bad))
    assert len(handle.routes) == 5


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """What Serve's gRPC path raises for a call ended by any code but UNAVAILABLE or CANCELLED."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


def test_what_ray_and_serve_raise_on_the_way_is_a_retryable_503_and_a_cancellation_stays_one() -> None:
    for code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNKNOWN):
        mapped = _engine_error(_rpc_error(code, "stream terminated"))
        assert type(mapped) is EngineUnreachableError, mapped
        assert f"gRPC {code.name}: stream terminated" in str(mapped)
    assert type(_engine_error(ObjectLostError("ab" * 14, None, ""))) is EngineUnreachableError
    assert isinstance(_engine_error(BackPressureError(num_queued_requests=9, max_queued_requests=8)),
                      EngineOverloadedError)
    cancelled = RequestCancelledError("r1")
    assert _engine_error(cancelled) is cancelled


class _BrokenWay:
    """A deployment handle whose calls end with gRPC's INTERNAL, as Serve's gRPC path raises it (or with what
    `error` makes): at once, or for a stream after `outputs` outputs. Counts the calls."""

    def __init__(self, outputs: int = 0, error: Callable[[], BaseException] | None = None) -> None:
        self.calls, self.outputs = 0, outputs
        self.error = error or (lambda: _rpc_error(grpc.StatusCode.INTERNAL, "received RST_STREAM"))

    def options(self, **_: object) -> _BrokenWay:
        return self

    def __getattr__(self, method: str) -> object:
        handle = self

        class _Method:
            def remote(self, *args: object, **kwargs: object) -> object:
                handle.calls += 1
                async def fail() -> object:
                    raise handle.error()

                return _Stream(handle.outputs, handle.error) if method == "stream" else _Response(fail)

        return _Method()


class _Stream:
    def __init__(self, outputs: int, error: Callable[[], BaseException]) -> None:
        self.left, self.error = outputs, error

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.left == 0:
            raise self.error()
        self.left -= 1
        return RequestOutput("r", "a", [1], "a", [1], False, None, Usage(), RequestMetrics())

    def cancel(self) -> None:
        pass


def test_a_call_the_way_failed_is_not_sent_again_and_reaches_the_caller_as_the_engines_error() -> None:
    request = GenerationRequest(prompt_token_ids=[1, 2, 3])
    handle = _BrokenWay()
    client = _client(handle, char_limit=KNOWN)
    with pytest.raises(EngineUnreachableError, match="gRPC INTERNAL"):
        asyncio.run(client.generate("m", request))
    assert handle.calls == 1  # it may have run: not sent again, unlike a call whose replica died

    async def read(client: FleetClient) -> list[object]:
        return [out async for out in client.stream("m", request)]

    for outputs in (0, 2):  # before its first output and after some: the stream ends with the engine's error
        handle = _BrokenWay(outputs)
        with pytest.raises(EngineUnreachableError):
            asyncio.run(read(_client(handle, char_limit=KNOWN)))
        assert handle.calls == 1


class _Revising(_DyingHandle):
    """A handle whose replicas report `revisions` (what each serves, and its tokenizer's revision, "t" and the
    same letter unless `tokenizers` says otherwise) to a metrics broadcast; a revision of None is a replica of an
    older release, which reports none."""

    def __init__(self, answers: dict[str, object]) -> None:
        super().__init__(answers)
        self.revisions: list[str | None] = ["a", "a"]
        self.tokenizers: dict[str, str] = {}  # revision -> its tokenizer's, where not "t" + revision

    def broadcast(self, method: str) -> object:
        assert method == "metrics"
        rows = [(f"r{i}", object(), 8) + ((rev, self.tokenizers.get(rev, "t" + rev)) if rev is not None else ())
                for i, rev in enumerate(self.revisions)]

        class _All:
            def results(self, timeout_s: float, return_exceptions: bool) -> list[tuple]:
                return rows

        return _All()


def test_what_is_kept_of_a_model_is_learnt_again_when_its_replicas_serve_another_revision() -> None:
    from inference.constrained import Constraint

    handle = _Revising({"tokenizer_and_revisions": ("ta", "va", _Words()), "char_limit": (400, 100)})
    client = _client(handle)
    regex = Constraint.regex("[a-z]+")

    def use() -> list[str]:
        """A request's calls before it generates; returns the methods that reached a replica."""
        before = len(handle.routes)
        assert asyncio.run(client.encode("m", prompt="a bb", raw=True)) == [1, 2]
        assert asyncio.run(client.char_limit("m")) == (400, 100)
        asyncio.run(client.compile("m", regex))
        return [name for name, _ in handle.routes[before:]]

    def tokenizer_asked() -> str:
        """The tokenizer revision a generation's route names: the router keeps it on replicas with that one."""
        asyncio.run(client.generate("m", GenerationRequest(prompt_token_ids=[1, 2])))
        name, route = handle.routes[-1]
        assert name == "generate"
        # and the revision of its vocabulary, which decides where the ids may go
        assert route.vocabulary_revision == ("v" + route.tokenizer_revision[1:] if route.tokenizer_revision else "")
        return route.tokenizer_revision

    client.refresh_metrics()
    assert use() == ["tokenizer_and_revisions", "tokenizer_and_revisions", "char_limit", "char_limit", "compile",
                     "compile"]  # (a death each)
    assert tokenizer_asked() == "ta"
    client.refresh_metrics()
    assert use() == []  # the same revisions: all kept
    handle.revisions = ["a", "b"]  # a rolling update to another tokenizer begins
    client.refresh_metrics()
    # The tokenizer stays while a replica has it, and its requests ask for such replicas: one fetched now could
    # come from either side.
    assert use() == ["char_limit", "compile"]
    assert tokenizer_asked() == "ta"
    assert [(r.revision, r.tokenizer_revision) for r in client.replica_metrics()] == [("a", "ta"), ("b", "tb")]
    handle.revisions = ["b", "b"]  # and ends: the old tokenizer goes, and what an old replica answered meanwhile
    handle.answers["tokenizer_and_revisions"] = ("tb", "vb", _Words())
    client.refresh_metrics()
    assert tokenizer_asked() == ""  # no tokenizer kept: none to ask for until one is fetched
    assert handle.routes[-2][0] == "char_limit"  # the generation learnt the new revision's window first
    assert use() == ["tokenizer_and_revisions", "compile"]
    assert tokenizer_asked() == "tb"
    client.refresh_metrics()
    assert use() == []
    handle.revisions, handle.tokenizers = ["b", "c"], {"c": "tb"}  # other settings or weights, the same tokenizer
    client.refresh_metrics()
    assert use() == ["char_limit", "compile"] and tokenizer_asked() == "tb"
    handle.revisions = ["c", None]  # a replica of an older release reports no revision
    client.refresh_metrics()
    assert use() == ["char_limit", "compile"]
    handle.revisions, handle.answers["tokenizer_and_revisions"] = ["d", "d"], ("td", "vd", _Words())
    client.refresh_metrics()
    assert use() == ["tokenizer_and_revisions", "char_limit", "compile"] and tokenizer_asked() == "td"


def test_a_fetch_across_a_change_of_revision_is_not_kept() -> None:
    handle = _Revising({"char_limit": (400, 100)})
    client = _client(handle)
    client.refresh_metrics()

    class _ChangesMidCall(_Revising):
        def __getattr__(self, method: str) -> object:
            inner, me = _Revising.__getattr__(self, method), self

            class _Method:
                def remote(self, *args: object, **kwargs: object) -> object:
                    me.revisions = ["c", "c"]  # the redeploy lands while the call is out
                    client.refresh_metrics()
                    return inner.remote(*args, **kwargs)

            return _Method()

    client._handles["m"] = changing = _ChangesMidCall({"char_limit": (900, 300)})
    changing.routes.append(("char_limit", None))  # no death this time
    assert asyncio.run(client.char_limit("m")) == (900, 300)
    assert "m" not in client._char_limits  # answered, not kept: it may come from the revision before
    client._handles["m"] = handle
    handle.revisions = ["c", "c"]
    client.refresh_metrics()  # nothing changed since: what is fetched now is kept
    assert asyncio.run(client.char_limit("m")) == (400, 100) and client._char_limits["m"] == (400, 100)


def test_an_embedding_models_replicas_are_not_asked_for_engine_gauges() -> None:
    """An embedder has no `metrics`: each poll would make every one of its replicas log an error."""
    class _Asked(_Revising):
        def broadcast(self, method: str) -> object:
            self.routes.append(("broadcast", None))
            return super().broadcast(method)

    chat, embedder = _Asked({}), _Asked({"embed": {"vectors": [[0.5]], "replica": "e1"}})
    client = _client(chat)
    client._handles["e"] = embedder
    asyncio.run(client.embed("e", ["a cat"]))
    client.refresh_metrics()
    assert ("broadcast", None) in chat.routes and ("broadcast", None) not in embedder.routes
    assert {r.model for r in client.replica_metrics()} == {"m"}


def test_a_refusal_for_another_tokenizer_drops_the_one_kept_here_and_is_not_sent_again() -> None:
    """A replica refuses a prompt encoded by a tokenizer it does not have (the fleet was redeployed with another
    one and none of the old replicas is left): the caller gets the 503 to retry, and its retry is encoded anew."""
    from inference.errors import TokenizerChangedError

    def refusal() -> BaseException:
        return RayTaskError("generate", "traceback", TokenizerChangedError("tokenizer revision ta; this has tb"))

    request = GenerationRequest(prompt_token_ids=[1, 2, 3])

    async def read(client: FleetClient) -> list[object]:
        return [out async for out in client.stream("m", request)]

    for call in (lambda client: asyncio.run(client.generate("m", request)), lambda client: asyncio.run(read(client))):
        handle = _BrokenWay(error=refusal)
        client = _client(handle, char_limit=KNOWN)
        client._tokenizers["m"] = (LocalTokenizer(_Words(), "ta"), time.monotonic())
        with pytest.raises(TokenizerChangedError):
            call(client)
        assert handle.calls == 1 and "m" not in client._tokenizers  # refused: nothing ran; what encoded it goes
