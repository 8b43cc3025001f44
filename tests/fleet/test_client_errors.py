"""How the fleet client maps Ray's errors back to the engine's, without a cluster: Ray's own exception classes."""

from __future__ import annotations

import asyncio

import pytest
import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError

from fleet.actors import note_actor
from fleet.client import FleetClient, ReplicaLostError, _engine_error
from inference.errors import EngineDeadError, EngineOverloadedError

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


class _DyingHandle:
    """A deployment handle whose replica dies under the first call of each method (Ray's own error, as a
    killed replica raises it); later calls answer. Records each call's route."""

    def __init__(self) -> None:
        self.routes: list[tuple[str, object]] = []

    def __getattr__(self, method: str) -> object:
        handle = self

        class _Method:
            def remote(self, *args: object, **kwargs: object) -> object:
                first = not any(name == method for name, _ in handle.routes)
                handle.routes.append((method, kwargs.get("route")))

                async def answer() -> object:
                    if first:
                        raise RayActorError(error_msg=DIED)
                    return (method, args, {k: v for k, v in kwargs.items() if k != "route"})

                return answer()

        return _Method()


def test_calls_that_change_nothing_are_tried_again_away_from_a_dead_replica() -> None:
    client = FleetClient.__new__(FleetClient)  # no cluster: the handle stands in for Serve's
    client._handles, client._infos, client._char_limits = {"m": _DyingHandle()}, {}, {}
    handle = client._handles["m"]
    got = asyncio.run(client.encode("m", prompt="hello", raw=True))
    assert got == ("encode", (), {"prompt": "hello", "raw": True})
    assert asyncio.run(client.char_limit("m"))[0] == "char_limit"
    assert [(name, route.avoid) for name, route in handle.routes] == [
        ("encode", frozenset()), ("encode", frozenset({"mxfgth0q"})),
        ("char_limit", frozenset()), ("char_limit", frozenset({"mxfgth0q"}))]
    # A second loss is the caller's 503: one retry only.
    class _AlwaysDead(_DyingHandle):
        def __getattr__(self, method: str) -> object:
            class _Method:
                def remote(self, *args: object, **kwargs: object) -> object:
                    async def fail() -> object:
                        raise RayActorError(error_msg=DIED)
                    return fail()
            return _Method()

    client._handles["m"] = _AlwaysDead()
    with pytest.raises(ReplicaLostError):
        asyncio.run(client.encode("m", prompt="hello"))
