"""KV compression: selection policy, compaction on the paged pool, and the engine end to end (fp32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inference import LLM, EngineConfig, GenerationRequest, InvalidRequestError, SamplingParams
from inference.batch import DecodeGroup
from inference.block_manager import BlockManager
from inference.compression import EvictionMethod, KVCompressionSettings
from inference.compression.compressor import CompressionState
from inference.compression.policy import select_keep
from inference.kv_cache import KVLayout, KVPool
from kernels import kv_compress

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def test_a_steps_observations_reach_each_sequence_layer_by_layer() -> None:
    """Decode attention received in every layer is added to each compressing sequence's scores once per step,
    the layers in order; rows without compression and entries past a sequence's capacity are left out."""
    layers, heads, width = 3, 2, 40
    gen = torch.Generator().manual_seed(5)
    states = [CompressionState(KVCompressionSettings(rate=4.0), torch.rand(layers, heads, 48, generator=gen)), None,
              CompressionState(KVCompressionSettings(rate=8.0), torch.rand(layers, heads, 32, generator=gen))]
    before = [None if s is None else s.scores.clone() for s in states]
    group = DecodeGroup(0, 3, torch.zeros(layers, 3, heads, 5, dtype=torch.int32), torch.zeros(layers, 3, heads),
                        observers=states)
    received = [torch.rand(3, heads, width, generator=gen) for _ in range(layers)]
    group.received.extend(received)
    group.flush_observations()
    assert group.received == []
    for row, state in enumerate(states):
        if state is None:
            continue
        expected = before[row].clone()
        for layer in range(layers):
            keep = min(width, expected.shape[-1])
            expected[layer, :, :keep] += received[layer][row, :, :keep]
        torch.testing.assert_close(state.scores, expected)


# ----------------------------------------------------------------- settings
def test_settings_parse_and_refuse_bad_values() -> None:
    assert KVCompressionSettings.parse({"rate": 8}).budget(800) == 100
    assert KVCompressionSettings.parse({"max_cache_tokens": 64}).budget(800) == 64
    assert not KVCompressionSettings(rate=1).enabled
    for bad in ({}, {"rate": 2, "max_cache_tokens": 3}, {"rate": 0.5}, {"rate": "8"}, {"rate": True},
                {"max_cache_tokens": 0}, {"max_cache_tokens": 2.5}, {"rate": 2, "method": "magic"},
                {"rate": 2, "extra": 1}, [8], "8", {"rate": float("nan")}):
        with pytest.raises(InvalidRequestError):
            KVCompressionSettings.parse(bad)


# ----------------------------------------------------------------- policy
def _inputs(seed: int, layers=2, heads=3, width=40):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(20, width + 1, (layers, heads), generator=gen)
    valid = torch.arange(width) < lens[..., None]
    positions = torch.arange(width).expand(layers, heads, width).clone()
    # Concentrated heads (a few large scores) next to diffuse ones.
    scores = torch.rand(layers, heads, width, generator=gen) ** torch.tensor([1.0, 8.0, 1.0])[None, :, None]
    return scores, positions, valid, int(lens.max())


def test_variable_policy_keeps_the_budget_the_protected_and_the_best() -> None:
    scores, positions, valid, n = _inputs(1)
    keep = select_keep(scores, positions, valid, n, 12, EvictionMethod.VARIABLE, sinks=2, recent=4)
    protected = valid & ((positions < 2) | (positions >= n - 4))
    assert not (keep & ~valid).any() and (keep | ~protected).all()
    assert int(keep.sum()) == 12 * 6
    # Every evicted candidate scores no higher than every kept candidate, across heads.
    candidates = valid & ~protected
    assert scores[keep & candidates].min() >= scores[~keep & candidates].max()
    per_head = keep.sum(-1)
    assert per_head.max() > per_head.min()  # rates vary per head


def test_uniform_and_recent_baselines() -> None:
    scores, positions, valid, n = _inputs(2)
    uniform = select_keep(scores, positions, valid, n, 12, EvictionMethod.UNIFORM, sinks=2, recent=4)
    assert (uniform.sum(-1) == 12).all()
    recent = select_keep(scores, positions, valid, n, 5, EvictionMethod.RECENT, sinks=2, recent=4)
    lens = valid.sum(-1)
    for layer in range(2):
        for head in range(3):
            kept = positions[layer, head][recent[layer, head]].tolist()
            assert kept == list(range(int(lens[layer, head]) - 5, int(lens[layer, head])))


# ----------------------------------------------------------------- compaction on the pool
@pytest.mark.parametrize("shared_prefix", [False, True])
def test_compaction_moves_exactly_the_kept_entries_and_frees_blocks(shared_prefix: bool) -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
    blocks = BlockManager(layout, 64, enable_prefix_caching=True)
    pool = KVPool(layout, 64, torch.device("cpu"))
    gen = torch.Generator().manual_seed(3)
    pool.k.copy_(torch.randn(pool.k.shape, generator=gen))
    pool.v.copy_(torch.randn(pool.v.shape, generator=gen))
    pool.pos.copy_(torch.randint(0, 1000, pool.pos.shape, generator=gen, dtype=torch.int32))
    tokens = list(range(100, 118))  # 18 tokens: 4 full blocks and a partial one
    if shared_prefix:  # another request cached the first 16 tokens; this one adopts them
        other = blocks.new_sequence()
        assert blocks.allocate(other, 18)
        other.lens[:] = 18
        blocks.commit_full_blocks(other, tokens)
        blocks.free(other)
    seq = blocks.new_sequence()
    reused = blocks.match_prefix(seq, tokens)
    assert reused == (16 if shared_prefix else 0)
    assert blocks.allocate(seq, 18 - reused)
    seq.lens[:] = 18
    old_table = seq.table.copy()
    snapshot = pool.k.clone()

    def entry(table, layer, head, i):
        return int(table[layer, head, i // 4]) * 4 + i % 4

    keep = np.zeros((2, 2, 18), dtype=bool)
    keep[0, 0, [0, 5, 17]] = True
    keep[0, 1, :] = True
    keep[1, 0, [17]] = True  # a head with a single entry left
    keep[1, 1, 2:13] = True
    before = [[pool.k.view(-1, 8)[[entry(old_table, la, h, i) for i in np.flatnonzero(keep[la, h])]].clone()
               for h in range(2)] for la in range(2)]
    used_before = blocks.num_used_blocks
    plan = blocks.plan_compaction(seq, keep)
    assert plan is not None
    assert plan.src.size == plan.dst.size and (plan.src != plan.dst).all()  # entries in place are left alone
    # moved: each head's entries from its first eviction on; with the prefix shared, all of them (the shared
    # blocks stay with the cache, so even a head that keeps everything starts over in its one private block)
    assert plan.src.size == (3 + 18 + 1 + 11 if shared_prefix else 2 + 0 + 1 + 11)
    kv_compress.move_entries_ref(pool.k, pool.v, pool.pos, torch.from_numpy(plan.src), torch.from_numpy(plan.dst))
    assert seq.lens.tolist() == [[3, 18], [1, 11]]
    assert seq.head_blocks.tolist() == [[1, 5], [1, 3]]
    for layer in range(2):
        for head in range(2):
            now = pool.k.view(-1, 8)[[entry(seq.table, layer, head, i) for i in range(seq.lens[layer, head])]]
            torch.testing.assert_close(now, before[layer][head])
    if shared_prefix:
        # The shared blocks were not written and stay in the prefix cache, now unreferenced (reclaimable).
        shared_ids = old_table[:, :, :4].reshape(-1)
        torch.testing.assert_close(pool.k[shared_ids], snapshot[shared_ids])
        assert blocks.evictable_blocks == 16 and not set(shared_ids) & set(seq.table.reshape(-1)[:0])
    assert blocks.num_used_blocks < used_before
    # Per-head growth after compaction, then everything comes back.
    assert blocks.allocate(seq, 3)
    assert seq.head_blocks.tolist() == [[2, 6], [1, 4]]
    blocks.free(seq)
    blocks.reset_prefix_cache()
    assert blocks.num_free_blocks == blocks.num_blocks == blocks._num_free


# ----------------------------------------------------------------- the engine
def _llm(path, **kwargs) -> LLM:
    return LLM(path, EngineConfig(**{"dtype": "float32", "kv_cache_memory": "16MiB", "kv_min_prompt_tokens": 64,
                                     **kwargs}))


PROMPT = list(range(5, 205))  # 200 tokens


def _run(llm: LLM, prompts, compression, params=GREEDY):
    engine = llm.engine
    requests = [GenerationRequest(p, params, kv_compression=compression) for p in prompts]
    for r in requests:
        engine.add_request(r)
    done, peak_used = {}, 0
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
        peak_used = max(peak_used, engine.blocks.num_used_blocks)
    return [done[r.request_id] for r in requests], peak_used


def test_rate_one_or_a_big_cap_changes_nothing(tiny_llama) -> None:
    llm = _llm(tiny_llama)
    plain, _ = _run(llm, [PROMPT], None)
    for off in ({"rate": 1}, {"max_cache_tokens": 4096}):
        out, _ = _run(llm, [PROMPT], off)
        assert out[0].token_ids == plain[0].token_ids
        assert llm.engine.metrics().kv_compressions_total == 0


def test_compression_meets_the_target_and_frees_memory(tiny_llama) -> None:
    llm = _llm(tiny_llama, enable_prefix_caching=False)
    engine = llm.engine
    _, peak_full = _run(llm, [PROMPT] * 3, None)
    out, peak_compressed = _run(llm, [PROMPT] * 3, {"rate": 4})
    heads = engine.model.num_layers * engine.model.num_kv_heads
    for o in out:
        report = o.kv_compression
        assert report["compressions"] >= 1 and report["evicted_entries"] > 0
        # The budget (or the protected sinks + recent window), plus at most a block per head of growth and
        # the final token, which finishes the request before the step's compression pass.
        budget = max(-(-report["uncompressed_entries"] // heads // 4), 36)
        assert report["cached_entries"] <= heads * (budget + engine.config.block_size + 1)
        assert report["achieved_rate"] > 2.5
    assert peak_compressed < peak_full
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    m = engine.metrics()
    assert m.kv_compressions_total >= 3 and m.kv_freed_blocks_total > 0


def test_max_cache_tokens_caps_every_head_during_decode(tiny_llama) -> None:
    llm = _llm(tiny_llama)
    params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    out, _ = _run(llm, [PROMPT], {"max_cache_tokens": 48}, params)
    report = out[0].kv_compression
    heads = llm.engine.model.num_layers * llm.engine.model.num_kv_heads
    assert report["compressions"] >= 3  # after the prompt, then again as decoding passes the cap
    assert report["cached_entries"] <= heads * (48 + llm.engine.config.block_size + 1)


def test_seeded_and_greedy_runs_are_reproducible_with_every_feature(tiny_llama) -> None:
    """Prefix-cache hits, chunked prefill, preemption and speculation all run through compressed sequences."""
    prompts = [PROMPT, PROMPT[:150] + list(range(300, 360)), PROMPT[::-1], [7, 8, 9, 10] * 50]
    sampled = SamplingParams(max_tokens=60, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    greedy = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    for params in (greedy, sampled):
        # 30 columns of blocks cannot hold four sequences at rate 1.5: some are preempted and recomputed.
        tight = _llm(tiny_llama, max_num_batched_tokens=256, kv_cache_memory=30 * 6 * 2112,
                     speculation="ngram", spec_max_batch=64)
        first, _ = _run(tight, prompts, {"rate": 1.5}, params)
        again, _ = _run(tight, prompts, {"rate": 1.5}, params)  # now with prefix-cache hits
        assert [o.token_ids for o in again] == [o.token_ids for o in first]
        assert all(o.kv_compression["compressions"] >= 1 for o in first + again)
        assert all(len(o.token_ids) == params.max_tokens for o in first + again)
        engine = tight.engine
        m = engine.metrics()
        assert m.preemptions_total > 0 and engine.blocks.hit_tokens > 0
        if params.greedy:  # sampled text from random weights never repeats itself: nothing to look up
            assert m.spec_proposed > 0
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    chunked = _llm(tiny_llama, max_num_batched_tokens=48)  # the prompt arrives in chunks
    out, _ = _run(chunked, [PROMPT], {"rate": 3})
    assert out[0].kv_compression["compressions"] >= 1


def test_server_switch_and_model_default(tiny_llama) -> None:
    off = _llm(tiny_llama, kv_compression=False)
    out, _ = _run(off, [PROMPT], {"rate": 4})
    assert out[0].kv_compression is None and off.engine.metrics().kv_compressions_total == 0
    default = _llm(tiny_llama, kv_compression_rate=4.0)
    out, _ = _run(default, [PROMPT], None)
    assert out[0].kv_compression["rate"] == 4.0 and out[0].kv_compression["compressions"] >= 1
    short, _ = _run(default, [PROMPT[:40]], None)  # short prompts are left alone
    assert short[0].kv_compression is None
    with pytest.raises(InvalidRequestError):
        EngineConfig(kv_compression_rate=0.5)
    with pytest.raises(InvalidRequestError):
        EngineConfig(kv_spread_skip_prefix=-1)


def test_spread_keeps_the_fact_after_what_was_attended_but_not_the_sinks_neighbours() -> None:
    from inference.compression import ScoreSpread

    scores = torch.zeros(1, 1, 60)
    scores[0, 0, 40] = 1.0  # a question attended to one token of a fact (a name)
    scores[0, 0, 2] = 9.0  # a sink in the prompt's preamble
    valid = torch.ones(1, 1, 60, dtype=torch.bool)
    positions = torch.arange(60).view(1, 1, 60)
    spread = ScoreSpread(before=3, after=1, skip_prefix=8)
    plain = select_keep(scores, positions, valid, 60, 6, EvictionMethod.VARIABLE, sinks=2, recent=2)
    spreading = select_keep(scores, positions, valid, 60, 10, EvictionMethod.VARIABLE, sinks=2, recent=2,
                            spread=spread)
    assert plain[0, 0, 40] and not plain[0, 0, 41]
    assert spreading[0, 0, 39:44].all()  # the name, the token before it and the three after (the digits)
    assert not spreading[0, 0, 44] and not spreading[0, 0, 3]
    spread_scores = spread.apply(scores, positions, valid)[0, 0]
    torch.testing.assert_close(spread_scores[39:44], torch.ones(5))
    assert spread_scores[38] == 0 and spread_scores[44] == 0
    assert spread_scores[3] == 0 and spread_scores[2] == 9.0  # a sink keeps its own score and lends none
    # positions, not logical indices, decide the prefix: after a compaction the sink may sit anywhere
    shifted = ScoreSpread(before=3, after=1, skip_prefix=0).apply(scores, positions, valid)[0, 0]
    assert shifted[3] == 9.0
    with pytest.raises(ValueError):
        ScoreSpread(before=-1)


def test_high_rates_on_short_contexts_keep_scored_entries_beside_the_protected_ones(tiny_llama) -> None:
    """32 sink and recent tokens per head would be the whole budget of 16× on 200 tokens; capped at half of it,
    the target is met and the rest of the budget goes to what attention chose."""
    llm = _llm(tiny_llama, kv_sink_tokens=4, kv_recent_tokens=32)
    compressor = llm.engine.compressor
    # (rate, tokens): (first tokens, recent tokens) kept whatever their scores. A roomy budget keeps the whole
    # opening (32) and window (32); the opening takes at most 1/8 of a budget, but never fewer than 4 sinks.
    expected = {(16.0, 200): (3, 3), (32.0, 1000): (4, 12), (32.0, 1300): (5, 15), (8.0, 1000): (15, 32),
                (2.0, 100): (6, 19), (2.0, 1000): (32, 32)}
    for (rate, tokens), window in expected.items():
        state = compressor.start(KVCompressionSettings(rate=rate), 2048)
        budget = KVCompressionSettings(rate=rate).budget(tokens)
        sinks, recent = compressor.protected(state, tokens)
        assert (sinks, recent) == window
        assert sinks + recent <= max(1, budget // 2) and recent >= 1
        assert compressor.keep_per_head(state, tokens) == budget
    out, _ = _run(llm, [PROMPT], {"rate": 16})
    report = out[0].kv_compression
    heads = llm.engine.model.num_layers * llm.engine.model.num_kv_heads
    assert report["cached_entries"] <= heads * (13 + llm.engine.config.block_size + 1)
    for bad in ({"kv_protected_share": 0.0}, {"kv_prefix_share": 1.5}, {"kv_prefix_tokens": -1}):
        with pytest.raises(InvalidRequestError):
            EngineConfig(**bad)
