"""Hearth's Ray Serve request router: `fleet.routing.Policy` on Serve's replica set.

Serve runs one router per deployment handle, in the caller's process (the control plane's web server or a
batch worker). It hands us the live replicas; we rank them; Serve sends the request to the first of the best
rank whose queue has room, and falls through the ranks otherwise.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from fleet.actors import note_actor
from fleet.routing import KEY_BYTES, Policy, PrefixMemory, ReplicaState, RouteHint

ROUTE_KWARG = "route"  # the keyword argument of a replica call that carries its RouteHint


def replica_label(replica_id: ReplicaID) -> str:
    return replica_id.unique_id


@dataclass(frozen=True, slots=True)
class Claim:
    """A request this router sent and that has not completed."""

    replica: str
    uncached: int  # its prompt tokens the replica did not hold, as the router reckoned
    at: float  # when it was sent (time.time(), the clock replicas stamp their stats with)


class HearthRouter(RequestRouter):
    """Session affinity with bounded loads, then the longest cached prefix, then adapter residency, then the
    least loaded replica. Deliberately not FIFOMixin: a replica chosen for one request must not be handed to
    another, or affinity would mean nothing."""

    def initialize_state(self, load_factor: float = 1.25, load_slack: int = 4, min_prefix_blocks: int = 1,
                         memory_blocks: int = 1 << 16, **kwargs: Any) -> None:
        self.policy = Policy(load_factor=load_factor, load_slack=load_slack, min_prefix_blocks=min_prefix_blocks)
        self.memory = PrefixMemory(memory_blocks)
        self.inflight: Counter[str] = Counter()  # requests this router sent and that have not completed
        self._sent: dict[str, Claim] = {}  # internal request id -> where it went
        self._summaries: dict[str, tuple[bytes, frozenset[bytes]]] = {}  # label -> (raw summary, parsed)
        self.decisions: Counter[str] = Counter()  # reason -> count, for tests and the dashboard

    # ------------------------------------------------------------------ what we know of a replica
    def _prefix(self, label: str, raw: bytes) -> frozenset[bytes]:
        cached = self._summaries.get(label)
        if cached is not None and cached[0] is raw:
            return cached[1]
        parsed = frozenset(raw[i: i + KEY_BYTES] for i in range(0, len(raw), KEY_BYTES))
        self._summaries[label] = (raw, parsed)
        return parsed

    def _state(self, replica: RunningReplica) -> ReplicaState:
        label = replica_label(replica.replica_id)
        stats = replica.routing_stats or {}
        # Load is what this router has in flight there: exact and current, where the replica's own count is up
        # to a stats period old (a burst would all go to the replica that looked idle half a second ago).
        # Other routers' requests show in the replica's KV use, and Serve's per-replica cap bounds the total.
        return ReplicaState(
            id=label, load=self.inflight[label], slots=int(stats.get("slots", 1)),
            kv_usage=float(stats.get("kv_usage", 0.0)), prefix=self._prefix(label, stats.get("prefix", b"")),
            adapters=frozenset(stats.get("adapters", ())), block_size=int(stats.get("block_size", 16)),
            prefill_tokens=self._prefill_tokens(label, stats),
            tokenizer_revision=str(stats.get("tokenizer_revision", "")),
            vocabulary_revision=str(stats.get("vocabulary_revision", "")))

    def _prefill_tokens(self, label: str, stats: dict[str, Any]) -> int:
        """Prompt tokens queued at a replica: what it published (every router's requests), plus what this
        router sent it since it stamped that figure (all it sent and has in flight, if it stamps nothing)."""
        stamped = stats.get("at")
        since = float(stamped) if stamped is not None else float("-inf")
        ours = sum(c.uncached for c in self._sent.values() if c.replica == label and c.at >= since)
        return int(stats.get("prefill_tokens", 0)) + ours

    # ------------------------------------------------------------------ Serve's interface
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        hint = _hint(pending_request)
        by_label = {replica_label(r.replica_id): r for r in candidate_replicas}
        for label, replica in by_label.items():
            note_actor(replica.actor_id.hex(), label)  # so a retry can avoid it by its id
        decision = self.policy.decide(hint, [self._state(r) for r in candidate_replicas], self.memory)
        self.decisions[decision.reason] += 1
        ranked = [by_label[label] for label in decision.ranking]
        if pending_request is not None:
            self._claim(pending_request, hint, ranked[0], decision.uncached)
            # Every rank was full: wait a little before asking again instead of spinning.
            pending_request.routing_context.should_backoff = True
        return [ranked[:1], ranked[1:]] if len(ranked) > 1 else [ranked]

    def _claim(self, pending_request: PendingRequest, hint: RouteHint, replica: RunningReplica,
               uncached: int) -> None:
        """Count the request against its first choice now, and remember where its prefix goes. Serve calls
        on_request_routed only in its strict queue mode, and a burst of requests is routed before any of them
        is sent: counting at choice time is what spreads a burst. The first rank is one replica whose queue
        is far from Serve's cap, so the choice is almost always where the request goes; a re-choice (after
        a backoff) moves the count."""
        internal = pending_request.metadata.internal_request_id
        label = replica_label(replica.replica_id)
        previous = self._sent.get(internal)
        if previous is not None and previous.replica == label:
            return
        if previous is not None and self.inflight[previous.replica] > 0:
            self.inflight[previous.replica] -= 1
        self._sent[internal] = Claim(label, uncached, time.time())
        self.inflight[label] += 1
        if hint.prompt:
            block_size = int((replica.routing_stats or {}).get("block_size", 16))
            self.memory.remember(hint.prompt[:-1], hint.extra_keys, block_size, label)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        claim = self._sent.pop(internal_request_id, None)
        if claim is not None and self.inflight[claim.replica] > 0:
            self.inflight[claim.replica] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        label = replica_label(replica_id)
        self.memory.forget(label)
        self.policy.forget(label)
        self.inflight.pop(label, None)
        self._summaries.pop(label, None)


def _hint(pending_request: PendingRequest | None) -> RouteHint:
    hint = pending_request.kwargs.get(ROUTE_KWARG) if pending_request is not None else None
    return hint if isinstance(hint, RouteHint) else RouteHint()
