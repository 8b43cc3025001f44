"""How the fleet client maps Ray's errors back to the engine's, without a cluster: Ray's own exception classes."""

from __future__ import annotations

from ray.exceptions import ActorDiedError, RayActorError, RayTaskError

from fleet.client import ReplicaLostError, _engine_error
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


def test_the_engines_own_errors_pass_through_and_others_are_a_dead_engine() -> None:
    busy = EngineOverloadedError("queue full")
    assert _engine_error(RayTaskError("generate", "traceback", busy)) is busy
    other = _engine_error(RayTaskError("generate", "traceback", ValueError("boom")))
    assert type(other) is EngineDeadError and "boom" in str(other)
    plain = KeyError("x")
    assert _engine_error(plain) is plain
