"""The fleet's routing policy, without Ray: hash stability, bounded load, minimal remapping, longest cached
prefix, adapter preference, least load."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from fleet.routing import HashRing, Policy, PrefixMemory, ReplicaState, RouteHint, load_cap, short_key
from inference.block_manager import BlockManager, prefix_chain
from inference.kv_cache import KVLayout

BS = 16


def replicas(*loads: int, **extra: dict) -> list[ReplicaState]:
    return [ReplicaState(id=f"r{i}", load=load, slots=8, block_size=BS, **extra.get(f"r{i}", {}))
            for i, load in enumerate(loads)]


def sessions(n: int) -> list[str]:
    return [f"session-{random.Random(i).getrandbits(64):x}" for i in range(n)]


def test_a_session_maps_to_the_same_replica_every_time_and_in_any_process() -> None:
    ids = ["a1", "b2", "c3", "d4"]
    first = {s: HashRing(ids).walk(s)[0] for s in sessions(200)}
    # A ring built again, from the ids in another order, agrees: placement depends on nothing but the ids.
    again = {s: HashRing(list(reversed(ids))).walk(s)[0] for s in sessions(200)}
    assert first == again
    policy = Policy()
    for s, owner in first.items():
        assert policy.decide(RouteHint(session=s), [ReplicaState(i, 0) for i in ids]).ranking[0] == owner


def test_sessions_spread_evenly_over_replicas() -> None:
    ring = HashRing([f"r{i}" for i in range(4)])
    counts = Counter(ring.walk(s)[0] for s in sessions(4000))
    assert set(counts) == {"r0", "r1", "r2", "r3"}
    assert max(counts.values()) / min(counts.values()) < 1.6, counts


def test_a_replica_joining_or_leaving_moves_only_its_own_sessions() -> None:
    keys = sessions(3000)
    before = {s: HashRing(["r0", "r1", "r2"]).walk(s)[0] for s in keys}
    grown = {s: HashRing(["r0", "r1", "r2", "r3"]).walk(s)[0] for s in keys}
    moved = [s for s in keys if before[s] != grown[s]]
    assert all(grown[s] == "r3" for s in moved)  # sessions only move to the newcomer
    assert 0.15 < len(moved) / len(keys) < 0.35  # about a quarter of them, not a reshuffle
    shrunk = {s: HashRing(["r0", "r2"]).walk(s)[0] for s in keys}
    for s in keys:
        if before[s] != "r1":
            assert shrunk[s] == before[s]  # only the dead replica's sessions move


def test_bounded_load_spills_a_session_only_past_the_cap() -> None:
    policy = Policy(load_factor=1.25)
    session = sessions(1)[0]
    home = policy.decide(RouteHint(session=session), replicas(0, 0)).ranking[0]
    other = "r1" if home == "r0" else "r0"
    load = {home: 5, other: 5}
    assert policy.decide(RouteHint(session=session), replicas(load["r0"], load["r1"])).ranking[0] == home
    # mean = (12 + 1 + 1) / 2 = 7, cap = max(1.25 x 7, 7 + 4) = 11: the home replica at 12 is over it.
    load = {home: 12, other: 1}
    assert load_cap(replicas(12, 1), 1.25, 4) == 11
    decision = policy.decide(RouteHint(session=session), replicas(load["r0"], load["r1"]))
    assert decision.ranking[0] == other and decision.reason == "session"


def test_a_spilled_session_stays_where_its_history_is_cached_until_that_replica_dies() -> None:
    policy = Policy(load_factor=1.25)
    for session in sessions(20):
        home = policy.decide(RouteHint(session=session), replicas(0, 0)).ranking[0]
        other = "r1" if home == "r0" else "r0"
        busy = {home: 12, other: 1}
        assert policy.decide(RouteHint(session=session), replicas(busy["r0"], busy["r1"])).ranking[0] == other
        # Home has room again, but the session's last turn was computed on the other replica: it stays there.
        assert policy.decide(RouteHint(session=session), replicas(0, 0)).ranking[0] == other
        # Over the cap there too: it spills again, home this time (the ring's order after the sticky replica).
        busy = {home: 1, other: 12}
        assert policy.decide(RouteHint(session=session), replicas(busy["r0"], busy["r1"])).ranking[0] == home
        policy.decide(RouteHint(session=session), replicas(12, 12, 0))  # a third replica: sessions stay put
        assert policy.decide(RouteHint(session=session), replicas(0, 0, 0)).ranking[0] == home
        policy.forget(home)  # the replica died: back to the ring, which (home gone) now names another
        assert policy.decide(RouteHint(session=session), replicas(0, 0)).ranking[0] == HashRing(["r0", "r1"]).walk(
            session)[0]
    bounded = Policy(max_sessions=4)
    for session in sessions(10):
        bounded.decide(RouteHint(session=session), replicas(0, 0))
    assert bounded.remembered_sessions == 4


def test_a_first_turn_starts_on_the_replica_with_the_fewest_requests_in_flight() -> None:
    for session in sessions(20):
        home = HashRing(["r0", "r1", "r2"]).walk(session)[0]
        quiet, other = sorted({"r0", "r1", "r2"} - {home})
        busy = {home: 2, quiet: 0, other: 1}
        policy = Policy()
        decision = policy.decide(RouteHint(session=session), replicas(busy["r0"], busy["r1"], busy["r2"]))
        assert (decision.ranking[0], decision.reason) == (quiet, "session")
        # Placed: its later turns stay there (its history is cached there), however the loads move.
        busy = {rid: 0 for rid in busy}
        busy[quiet] = 3
        assert policy.decide(RouteHint(session=session), replicas(busy["r0"], busy["r1"], busy["r2"])).ranking[
            0] == quiet
        # Equal loads: the ring decides, so routers that see the same loads agree.
        assert Policy().decide(RouteHint(session=session), replicas(1, 1, 1)).ranking[0] == home


def test_a_cold_prompt_goes_where_the_fewest_prompt_tokens_are_queued() -> None:
    # r0 computes another session's 680-token first turn; r1 only decodes three requests. Counting requests
    # would queue the new prompt behind the long one (the fleet notes of 12-07); the tokens queued say r1.
    state = replicas(1, 3, r0={"prefill_tokens": 680})
    for session in sessions(10):
        decision = Policy().decide(RouteHint(session=session, prompt=list(range(700))), state)
        assert (decision.ranking[0], decision.reason) == ("r1", "session")
    decision = Policy().decide(RouteHint(prompt=list(range(700))), state)
    assert (decision.ranking, decision.reason) == (["r1", "r0"], "least_loaded")
    # Without queued prompts anywhere, requests in flight decide as before.
    assert Policy().decide(RouteHint(prompt=list(range(700))), replicas(1, 3)).ranking == ["r0", "r1"]


def test_a_decision_counts_the_prompt_tokens_its_replica_does_not_hold() -> None:
    rng = random.Random(3)
    turn1 = [rng.randrange(1000) for _ in range(6 * BS + 5)]
    turn2 = turn1 + [rng.randrange(1000) for _ in range(20)]
    held = frozenset(short_key(k) for k in prefix_chain(turn1[:-1], BS))
    decision = Policy().decide(RouteHint(prompt=turn2), replicas(0, 0, r1={"prefix": held}))
    assert (decision.ranking[0], decision.uncached) == ("r1", len(turn2) - 6 * BS)
    cold = Policy().decide(RouteHint(prompt=turn2), replicas(0, 0))
    assert cold.uncached == len(turn2)
    assert Policy().decide(RouteHint(), replicas(0, 0)).uncached == 0


def test_a_session_another_router_placed_is_found_by_its_cached_history() -> None:
    rng = random.Random(2)
    for session in sessions(10):
        turn1 = [rng.randrange(1000) for _ in range(6 * BS + 5)]
        turn2 = turn1 + [rng.randrange(1000) for _ in range(20)]
        home = HashRing(["r0", "r1"]).walk(session)[0]
        away = "r1" if home == "r0" else "r0"
        # Router A placed the first turn away from home (home was busy); router B sees only the published keys.
        held = {short_key(k) for k in prefix_chain(turn1[:-1], BS)}
        state = replicas(0, 0, **{away: {"prefix": frozenset(held)}})
        decision = Policy().decide(RouteHint(session=session, prompt=turn2), state)
        assert (decision.ranking[0], decision.reason) == (away, "session")
        # A prefix every replica holds (a shared system prompt) is no reason to pick one: load, then the ring.
        shared = replicas(0, 0, r0={"prefix": frozenset(held)}, r1={"prefix": frozenset(held)})
        assert Policy().decide(RouteHint(session=session, prompt=turn2), shared).ranking[0] == home


def test_the_longest_cached_prefix_wins_unless_that_replica_is_overloaded() -> None:
    rng = random.Random(0)
    system = [rng.randrange(1000) for _ in range(10 * BS)]
    keys = {short_key(k) for k in prefix_chain(system, BS)}
    partial = {short_key(k) for k in prefix_chain(system[:3 * BS], BS)}
    prompt = system + [rng.randrange(1000) for _ in range(40)]
    policy = Policy()
    state = replicas(3, 0, 1, r0={"prefix": frozenset(keys)}, r2={"prefix": frozenset(partial)})
    decision = policy.decide(RouteHint(prompt=prompt), state)
    assert (decision.ranking[0], decision.reason, decision.matched_blocks) == ("r0", "prefix", 10)
    # The same prefix under other extra keys (an adapter, a cache salt) is a different cache entry.
    assert policy.decide(RouteHint(prompt=prompt, extra_keys=(("lora", "x"),)), state).reason == "least_loaded"
    overloaded = replicas(9, 0, 1, r0={"prefix": frozenset(keys)}, r2={"prefix": frozenset(partial)})
    decision = policy.decide(RouteHint(prompt=prompt), overloaded)
    assert (decision.ranking[0], decision.matched_blocks) == ("r2", 3)


def test_router_memory_finds_a_prefix_before_any_replica_publishes_it() -> None:
    rng = random.Random(1)
    turn1 = [rng.randrange(1000) for _ in range(5 * BS + 3)]
    turn2 = turn1 + [rng.randrange(1000) for _ in range(30)]
    memory = PrefixMemory()
    memory.remember(turn1[:-1], (), BS, "r1")
    decision = Policy().decide(RouteHint(prompt=turn2), replicas(0, 0), memory)
    assert (decision.ranking[0], decision.reason, decision.matched_blocks) == ("r1", "prefix", 5)
    memory.forget("r1")
    assert Policy().decide(RouteHint(prompt=turn2), replicas(0, 0), memory).reason == "least_loaded"
    assert len(memory) == 0


def test_an_adapter_prefers_a_replica_where_it_is_resident() -> None:
    state = replicas(2, 0, 1, r0={"adapters": frozenset({"a:1"})}, r2={"adapters": frozenset({"a:1"})})
    decision = Policy().decide(RouteHint(adapter="a:1"), state)
    assert (decision.ranking[0], decision.reason) == ("r2", "adapter")
    assert Policy().decide(RouteHint(adapter="b:2"), state).ranking[0] == "r1"


def test_otherwise_the_least_loaded_replica_and_a_full_ranking() -> None:
    state = replicas(4, 1, 7, r1={"kv_usage": 0.9}, r0={"kv_usage": 0.1})
    decision = Policy().decide(RouteHint(), state)
    assert decision.reason == "least_loaded"
    # Load per slot plus KV use: 4/8 + 0.1 < 7/8 + 0 < 1/8 + 0.9 (a replica whose KV is nearly full ranks last).
    assert decision.ranking == ["r0", "r2", "r1"]
    # A replica that already failed this request comes last in nothing: it is left out while others live.
    assert "r1" not in Policy().decide(RouteHint(avoid=frozenset({"r1"})), state).ranking


def test_a_prompt_encoded_by_one_tokenizer_stays_on_replicas_with_it_while_there_are_any() -> None:
    """During a rolling update that changes the tokenizer, the same ids are other tokens on the other side: a
    request names the tokenizer revision that encoded it, and every rule ranks only replicas with that one."""
    rng = random.Random(2)
    prompt = [rng.randrange(1000) for _ in range(6 * BS)]
    keys = frozenset(short_key(k) for k in prefix_chain(prompt, BS))
    state = replicas(0, 3, 5, r0={"tokenizer_revision": "new", "prefix": keys, "adapters": frozenset({"a:1"})},
                     r1={"tokenizer_revision": "old"}, r2={"tokenizer_revision": "old"})
    policy = Policy()
    home = next(s for s in sessions(64) if policy.decide(RouteHint(session=s), state).ranking[0] == "r0")
    old = "old"
    for hint in (RouteHint(tokenizer_revision=old), RouteHint(tokenizer_revision=old, prompt=prompt),
                 RouteHint(tokenizer_revision=old, adapter="a:1"),
                 RouteHint(tokenizer_revision=old, session=home, prompt=prompt)):
        decision = Policy().decide(hint, state)
        assert decision.ranking == ["r1", "r2"], (hint, decision)  # least loaded of the old ones; r0 not at all
    assert Policy().decide(RouteHint(tokenizer_revision="new", prompt=prompt), state).ranking[0] == "r0"
    # None with it left (the update ended before the client noticed): all of them, as before.
    assert sorted(Policy().decide(RouteHint(tokenizer_revision="gone"), state).ranking) == ["r0", "r1", "r2"]
    # One that failed the request is avoided first, then the others with its tokenizer are preferred.
    assert Policy().decide(RouteHint(tokenizer_revision=old, avoid=frozenset({"r1"})), state).ranking == ["r2"]


def test_the_vocabulary_decides_where_a_request_names_it() -> None:
    """A rolling update that changes only the chat template: every replica reads the same ids as the same tokens,
    so requests encoded with the old template (the old tokenizer revision) may go anywhere and are not crowded
    onto the last old replicas. One that changes the vocabulary keeps them on its side, as above."""
    state = replicas(0, 3, 5, r0={"tokenizer_revision": "new", "vocabulary_revision": "v"},
                     r1={"tokenizer_revision": "old", "vocabulary_revision": "v"},
                     r2={"tokenizer_revision": "old", "vocabulary_revision": "v"})
    hint = RouteHint(tokenizer_revision="old", vocabulary_revision="v")
    assert Policy().decide(hint, state).ranking[0] == "r0"  # the least loaded, of either side
    assert Policy().decide(RouteHint(tokenizer_revision="old"), state).ranking == ["r1", "r2"]  # an older caller
    changed = replicas(0, 3, 5, r0={"tokenizer_revision": "new", "vocabulary_revision": "w"},
                       r1={"tokenizer_revision": "old", "vocabulary_revision": "v"},
                       r2={"tokenizer_revision": "old", "vocabulary_revision": "v"})
    assert Policy().decide(hint, changed).ranking == ["r1", "r2"]
    assert Policy().decide(RouteHint(tokenizer_revision="new", vocabulary_revision="w"), changed).ranking == ["r0"]
    # None with it left: all of them; the replica refuses what it would read as other tokens.
    assert sorted(Policy().decide(RouteHint(vocabulary_revision="x"), changed).ranking) == ["r0", "r1", "r2"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prefix_chain_is_the_engines_own_cache_key(seed: int) -> None:
    """The router's keys are the block manager's: a prompt the engine cached is found by its chain."""
    rng = random.Random(seed)
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=BS, dtype=None)  # type: ignore[arg-type]
    blocks = BlockManager(layout, num_blocks=256)
    tokens = [rng.randrange(5000) for _ in range(rng.randrange(3, 9) * BS + rng.randrange(BS))]
    extra = (("lora", f"a{seed}"),) if seed else ()
    seq = blocks.new_sequence()
    assert blocks.allocate(seq, len(tokens))
    seq.lens[:] = len(tokens)
    blocks.commit_full_blocks(seq, tokens, extra)
    published = {short_key(k) for k in blocks.cached_keys(10_000)}
    chain = [short_key(k) for k in prefix_chain(tokens, BS, extra)]
    assert chain and set(chain) == published


def test_the_router_adds_what_it_sent_since_a_replica_stamped_its_queue() -> None:
    from fleet.router import Claim, HearthRouter

    router = HearthRouter.__new__(HearthRouter)  # Serve builds it with a deployment; the state is what matters
    router.initialize_state()
    router._sent = {"old": Claim("r0", 500, at=100.0), "new": Claim("r0", 40, at=101.0),
                    "elsewhere": Claim("r1", 300, at=101.0)}
    # The replica's own figure (every router's prompts) covers what arrived before its stamp.
    assert router._prefill_tokens("r0", {"prefill_tokens": 120, "at": 100.5}) == 160
    assert router._prefill_tokens("r1", {"prefill_tokens": 0, "at": 102.0}) == 0
    # A replica that stamps nothing: everything this router has in flight there.
    assert router._prefill_tokens("r0", {}) == 540


def test_the_router_reads_each_replicas_tokenizer_from_its_stats() -> None:
    """Through Serve's interface (its replica and request objects stood in for): a request encoded by the old
    tokenizer reaches the old replica though the new one is idle, and one that names none goes by load."""
    import asyncio
    from types import SimpleNamespace

    import ray

    from fleet.router import ROUTE_KWARG, HearthRouter

    router = HearthRouter.__new__(HearthRouter)
    router.initialize_state()

    def replica(label: str, tokenizer: str) -> SimpleNamespace:
        return SimpleNamespace(replica_id=SimpleNamespace(unique_id=label), actor_id=ray.ActorID.from_random(),
                               routing_stats={"slots": 8, "tokenizer_revision": tokenizer,
                                              "vocabulary_revision": "v" + tokenizer})

    def request(n: int, hint: RouteHint) -> SimpleNamespace:
        return SimpleNamespace(kwargs={ROUTE_KWARG: hint}, routing_context=SimpleNamespace(should_backoff=False),
                               metadata=SimpleNamespace(internal_request_id=f"q{n}"))

    old, new = replica("old1", "ta"), replica("new1", "tb")
    router.inflight["old1"] = 5  # busy
    for n in range(3):
        ranks = asyncio.run(router.choose_replicas([new, old], request(n, RouteHint(tokenizer_revision="ta"))))
        assert [[r.replica_id.unique_id for r in rank] for rank in ranks] == [["old1"]]
    ranks = asyncio.run(router.choose_replicas([new, old], request(9, RouteHint())))
    assert ranks[0][0].replica_id.unique_id == "new1"
    hint = RouteHint(tokenizer_revision="tb", vocabulary_revision="vta")  # the vocabulary's stat is read too
    ranks = asyncio.run(router.choose_replicas([new, old], request(10, hint)))
    assert [[r.replica_id.unique_id for r in rank] for rank in ranks] == [["old1"]]
