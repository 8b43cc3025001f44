"""Which replica serves a request: the policy, free of Ray so it can be tested (and reasoned about) alone.

In order of preference:
1. A session (the `x-session-affinity` header) hashes onto a ring of replicas; it stays on its replica while
   that replica is alive and under the load cap (consistent hashing with bounded loads: Mirrokni, Thorup and
   Zadimoghaddam, 2018). When a replica joins or leaves, only the sessions whose ring arc changed move. A
   session that had to spill stays where it spilled to: its history is cached there now, not at home.
   A session's first turn is placed, not hashed blindly: nothing of it is cached yet, so it starts on the
   replica with the fewest requests in flight (its ring home among equals, so routers agree at rest), unless a
   replica holds more of its prompt than the rest (its history, placed there by another router).
2. Otherwise, of the replicas under the cap, the one holding the longest cached prefix of the prompt (the
   engine's own prefix-cache hash chain).
3. A request naming a LoRA adapter prefers a replica where that adapter is resident.
4. Otherwise the least loaded replica.
"Least loaded", wherever load decides (a cold first turn, rule 4), means first the fewest interactive prompt
tokens queued there to compute, then requests in flight per slot and KV use: a new prompt waits for the prompts
ahead of it, while requests that are only decoding cost it little (they share its steps a row each). Counting
requests alone sent a new ~600-token prompt behind another one being computed while the other replica only
decoded (the fleet notes of 12-07 in docs/benchmarks.md).
Every answer is a full ranking: the caller (Ray Serve's router) falls through it when a replica refuses.
Before all of these, a request whose prompt was encoded with one revision of the model's vocabulary
(fleet.replica.vocabulary_revision: the tokenizer without its chat template) goes only to replicas with that
vocabulary while there are any: during a rolling update that changes it, the same ids mean other tokens to the
other replicas. (A caller of the release before names the whole tokenizer's revision: the same rule on that.)
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from inference.block_manager import prefix_chain

KEY_BYTES = 8  # prefix keys travel truncated: 2^-64 collisions only cost a mis-route, never wrong output
VNODES = 64  # ring points per replica: smooths arc sizes so each replica gets ~1/n of the sessions


def short_key(key: bytes) -> bytes:
    return key[:KEY_BYTES]


@dataclass(frozen=True, slots=True)
class ReplicaState:
    """What the router knows of one replica: its own published stats and the router's in-flight count."""

    id: str
    load: int  # requests in flight there from this router
    slots: int = 1  # the engine's sequence slots
    kv_usage: float = 0.0
    prefix: frozenset[bytes] = frozenset()  # short keys of the prefix-cache groups it holds
    adapters: frozenset[str] = frozenset()  # adapters resident in its slots
    block_size: int = 16
    prefill_tokens: int = 0  # interactive prompt tokens queued there to compute (published, plus sent since)
    tokenizer_revision: str = ""  # its tokenizer's (fleet.replica.tokenizer_revision); "" before it reports one
    vocabulary_revision: str = ""  # what its ids stand for (fleet.replica.vocabulary_revision); "" as above

    @property
    def pressure(self) -> float:
        """Comparable across replicas of different sizes: load per slot, KV use breaking ties."""
        return self.load / max(self.slots, 1) + self.kv_usage

    @property
    def queued(self) -> tuple[int, float]:
        """How long a new prompt would wait there, as a sort key: prompt tokens ahead of it, then pressure."""
        return self.prefill_tokens, self.pressure


@dataclass(frozen=True, slots=True)
class RouteHint:
    """What the request says about where it would be best served."""

    session: str = ""
    prompt: Sequence[int] = ()
    extra_keys: tuple = ()  # mixed into the prefix keys, as the engine does (adapter, cache salt)
    adapter: str | None = None
    avoid: frozenset[str] = frozenset()  # replicas that already failed this request
    tokenizer_revision: str = ""  # that of the tokenizer that encoded the prompt ("": not known, any replica)
    # What its ids stand for (that tokenizer's vocabulary_revision): where given, it decides instead. Last, so a
    # replica of the release before, which unpickles the fields it knows in order, reads the rest as it did.
    vocabulary_revision: str = ""


@dataclass(frozen=True, slots=True)
class Decision:
    ranking: list[str]
    reason: str  # session | prefix | adapter | least_loaded
    matched_blocks: int = 0
    uncached: int = 0  # prompt tokens the first choice does not hold, as far as the router knows: its work there


class HashRing:
    """Replicas placed at VNODES points each on a 64-bit ring; a key belongs to the first point clockwise."""

    def __init__(self, replica_ids: Iterable[str]) -> None:
        points = sorted((_h64(f"{rid}#{v}"), rid) for rid in set(replica_ids) for v in range(VNODES))
        self._hashes = [h for h, _ in points]
        self._owners = [rid for _, rid in points]
        self.members = frozenset(self._owners)

    def walk(self, key: str) -> list[str]:
        """Every replica, in the order a key meets them going clockwise from its own point."""
        if not self._hashes:
            return []
        start = bisect.bisect(self._hashes, _h64(key))
        seen: list[str] = []
        for i in range(len(self._hashes)):
            rid = self._owners[(start + i) % len(self._hashes)]
            if rid not in seen:
                seen.append(rid)
                if len(seen) == len(self.members):
                    break
        return seen


def _h64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def load_cap(replicas: Sequence[ReplicaState], factor: float, slack: int) -> int:
    """Bounded loads: no replica takes a new request once it holds factor × the mean load (counting the new
    one), so a hot session or prefix spills instead of queueing behind itself. At light load the cap is at
    least the mean plus `slack` requests: there, reusing a cache is worth more than perfect balance."""
    mean = (sum(r.load for r in replicas) + 1) / max(len(replicas), 1)
    return max(1, math.ceil(max(factor * mean, mean + slack)))


@dataclass(slots=True)
class Policy:
    load_factor: float = 1.25
    load_slack: int = 4
    min_prefix_blocks: int = 1  # a match shorter than this is no reason to leave the least loaded replica
    max_sessions: int = 1 << 16  # sessions whose last replica is remembered (least recently seen forgotten first)
    _ring: HashRing | None = field(default=None, init=False)
    _placed: OrderedDict[str, str] = field(default_factory=OrderedDict, init=False)

    def ring(self, ids: Iterable[str]) -> HashRing:
        members = frozenset(ids)
        if self._ring is None or self._ring.members != members:
            self._ring = HashRing(members)
        return self._ring

    def decide(self, hint: RouteHint, replicas: Sequence[ReplicaState],
               routed: PrefixMemory | None = None) -> Decision:
        usable = [r for r in replicas if r.id not in hint.avoid] or list(replicas)
        if hint.vocabulary_revision:  # its ids are that vocabulary's tokens (none left: the client learns anew)
            usable = [r for r in usable if r.vocabulary_revision == hint.vocabulary_revision] or usable
        elif hint.tokenizer_revision:  # a caller of the release before
            usable = [r for r in usable if r.tokenizer_revision == hint.tokenizer_revision] or usable
        if not usable:
            return Decision([], "none")
        by_load = sorted(usable, key=lambda r: (r.queued, r.id))
        cap = load_cap(usable, self.load_factor, self.load_slack)
        keys = self._keys(hint, usable)

        def first(chosen: str, reason: str, matched: int = 0) -> Decision:
            state = next(r for r in usable if r.id == chosen)
            held = self._held_blocks(keys, state, routed)
            uncached = max(0, len(hint.prompt) - held * state.block_size)
            return Decision([chosen] + [r.id for r in by_load if r.id != chosen], reason, matched, uncached)

        if hint.session:
            rid = self._session_replica(hint, usable, cap, routed, keys)
            if rid is not None:
                self._place(hint.session, rid)
                return first(rid, "session")
        under_cap = [r for r in usable if r.load < cap]
        if hint.prompt and under_cap:
            best, matched = self.longest_prefix(hint, under_cap, routed, keys)
            if best is not None:
                return first(best.id, "prefix", matched)
        if hint.adapter:
            holders = [r for r in by_load if hint.adapter in r.adapters and r.load < cap]
            if holders:
                return first(holders[0].id, "adapter")
        return first(by_load[0].id, "least_loaded")

    def _session_replica(self, hint: RouteHint, usable: Sequence[ReplicaState], cap: int,
                         routed: PrefixMemory | None, keys: Sequence[bytes]) -> str | None:
        """Where a session's request goes, or None when every replica is at the cap.

        A session placed before goes to the replica that served it last while that one lives and is under the
        cap, else along the ring (without a spill the two agree; after one, following the cache beats going home
        to an empty one). A session this router has not placed (a first turn, or one whose replica died, or one
        another router placed) has no cache of its own to follow: it goes where most of its prompt is cached,
        then to the replica with the fewest prompt tokens queued, then the fewest requests in flight, then by
        the ring. A first turn usually matches nothing anywhere, so load decides: the ring alone placed cold
        turns by hash whatever the loads, and in the fleet benchmark their TTFT was the least-loaded placement's
        plus ~5% (docs/benchmarks.md, the fleet). With equal loads the ring decides, so routers that see the
        same loads agree."""
        loads = {r.id: r.load for r in usable}
        ring = self.ring(loads).walk(hint.session)
        last = self._placed.get(hint.session)
        if last is not None and last in loads:
            order = [last] + [rid for rid in ring if rid != last]
            return next((rid for rid in order if loads[rid] < cap), None)
        open_ = [r for r in usable if r.load < cap]
        if not open_:
            return None
        matched = self.matched_blocks(hint, open_, routed, keys)
        place = {rid: i for i, rid in enumerate(ring)}
        return min(open_, key=lambda r: (-matched[r.id], r.prefill_tokens, r.load, place[r.id])).id

    def _place(self, session: str, replica_id: str) -> None:
        self._placed[session] = replica_id
        self._placed.move_to_end(session)
        while len(self._placed) > self.max_sessions:
            self._placed.popitem(last=False)

    @property
    def remembered_sessions(self) -> int:
        return len(self._placed)

    def forget(self, replica_id: str) -> None:
        """A replica died: its sessions go back to the ring (their caches died with it)."""
        for session in [s for s, rid in self._placed.items() if rid == replica_id]:
            del self._placed[session]

    def matched_blocks(self, hint: RouteHint, replicas: Sequence[ReplicaState], routed: PrefixMemory | None,
                       keys: Sequence[bytes] | None = None) -> dict[str, int]:
        """Per replica, how many leading blocks of the prompt it holds, by its published summary or by where
        this router sent the same prefix before; runs shorter than min_prefix_blocks count as none."""
        matched = dict.fromkeys((r.id for r in replicas), 0)
        if not hint.prompt or not replicas:
            return matched
        keys = self._keys(hint, replicas) if keys is None else keys
        for r in replicas:
            n = self._held_blocks(keys, r, routed)
            matched[r.id] = n if n >= self.min_prefix_blocks else 0
        return matched

    @staticmethod
    def _keys(hint: RouteHint, replicas: Sequence[ReplicaState]) -> list[bytes]:
        """The short keys of the prompt's full blocks. As the engine does, the last token is never cached."""
        if not hint.prompt or not replicas:
            return []
        return [short_key(k) for k in prefix_chain(hint.prompt[:-1], replicas[0].block_size, hint.extra_keys)]

    @staticmethod
    def _held_blocks(keys: Sequence[bytes], replica: ReplicaState, routed: PrefixMemory | None) -> int:
        n = 0
        for key in keys:
            if key in replica.prefix or (routed is not None and routed.holds(key, replica.id)):
                n += 1
            else:
                break
        return n

    def longest_prefix(self, hint: RouteHint, replicas: Sequence[ReplicaState], routed: PrefixMemory | None,
                       keys: Sequence[bytes] | None = None) -> tuple[ReplicaState | None, int]:
        """The replica holding the most leading blocks of the prompt (see matched_blocks); ties go to the less
        loaded. None where no replica holds min_prefix_blocks of it."""
        matched = self.matched_blocks(hint, replicas, routed, keys)
        best = min(replicas, key=lambda r: (-matched[r.id], r.queued), default=None)
        if best is None or matched[best.id] == 0:
            return None, 0
        return best, matched[best.id]


class PrefixMemory:
    """Where this router recently sent each prefix block: replicas publish their cache only every so often, and
    a conversation's next turn usually arrives before the next summary does."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self.capacity = capacity
        self._where: OrderedDict[bytes, set[str]] = OrderedDict()

    def remember(self, prompt: Sequence[int], extra_keys: tuple, block_size: int, replica_id: str) -> None:
        for key in prefix_chain(prompt, block_size, extra_keys):
            k = short_key(key)
            holders = self._where.pop(k, None) or set()
            holders.add(replica_id)
            self._where[k] = holders
        while len(self._where) > self.capacity:
            self._where.popitem(last=False)

    def holds(self, key: bytes, replica_id: str) -> bool:
        holders = self._where.get(key)
        return holders is not None and replica_id in holders

    def forget(self, replica_id: str) -> None:
        """A replica died: nothing it held survives it."""
        for k in [k for k, holders in self._where.items() if replica_id in holders]:
            holders = self._where[k]
            holders.discard(replica_id)
            if not holders:
                del self._where[k]

    def __len__(self) -> int:
        return len(self._where)
