"""The CPU attention kernels (kernels/cpu_paged_attention) against the torch references they replace.

    python -m benchmarks.run --only cpu_attention

Three views, all in one process with 2 threads:
- prompt: a fresh prompt's causal attention (C kernel against `causal_attention_ref`, torch SDPA) at SmolLM2's
  shape (9 query heads, 3 kv heads, head_dim 64; q, k, v as views of one fused product), rounds alternating;
- decode over a pool: one decode step's attention for 32 sequences of 94-430 entries (the 32-concurrent
  workload's shape) over 30 layer pools, blocks placed at random on huge pages: µs a layer and the bytes read per
  second, against the same entries kept cache-resident (one layer's pool read 30 times) and a copy's bandwidth;
- whole passes: the 32-concurrent workload of `benchmarks/peers.py`, the kernels switched on and off per pass on
  one loaded engine (off = the torch references), ratio of each pair, and the seconds spent in attention.
"""

from __future__ import annotations

import functools
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.cpu_peers import dtypes
from benchmarks.engine import memory_bandwidth_gbs
from benchmarks.machine import cpu_flags
from benchmarks.workloads import alternating_pairs, concurrent_prompts, mean_seconds
from inference import LLM, EngineConfig, SamplingParams, memory
from inference.models.catalog import DEFAULT_MODEL
from kernels import cpu_paged_attention as cpa
from kernels import paged_attention as pa

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS, SEQUENCES = 9, 3, 64, 16, 30, 32
PROMPT_LENGTHS = (40, 165, 300, 2048)


def _prompt_rows(dtype: torch.dtype, rounds: int) -> list[dict[str, Any]]:
    rows = []
    for tokens in PROMPT_LENGTHS:
        fused = torch.randn(tokens, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM).to(dtype)
        heads = fused.view(tokens, Q_HEADS + 2 * KV_HEADS, HEAD_DIM)
        q, k, v = heads[:, :Q_HEADS], heads[:, Q_HEADS: Q_HEADS + KV_HEADS], heads[:, Q_HEADS + KV_HEADS:]
        positions, scale = torch.arange(tokens), HEAD_DIM ** -0.5
        kernel = functools.partial(cpa.causal_attention, q, k, v, scale)
        reference = functools.partial(pa.causal_attention_ref, q, k, v, positions, scale)
        repeat = max(3, 2000 // tokens)
        mean_seconds(kernel, repeat), mean_seconds(reference, repeat)  # a whole untimed round: first calls run slow
        times: dict[str, list[float]] = {"kernel": [], "reference": []}
        for _ in range(rounds):
            times["kernel"].append(mean_seconds(kernel, repeat))
            times["reference"].append(mean_seconds(reference, repeat))
        ratios = [r / k for k, r in zip(times["kernel"], times["reference"], strict=True)]
        rows.append({"tokens": tokens, "kernel_us": statistics.median(times["kernel"]) * 1e6,
                     "reference_us": statistics.median(times["reference"]) * 1e6,
                     "ratio": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)]})
    return rows


def _decode_pool(dtype: torch.dtype, rounds: int) -> dict[str, Any]:
    """One decode step's attention in the 32-concurrent shape over LAYERS pools of blocks scattered at random."""
    rng = random.Random(0)
    lens = [rng.randint(30, 300) + 64 for _ in range(SEQUENCES)]  # prompt plus half the output
    per_seq = [-(-n // BLOCK) for n in lens]
    count = sum(per_seq) * KV_HEADS * LAYERS
    order = iter(torch.randperm(count, generator=torch.Generator().manual_seed(0)).tolist())
    k = memory.zeros((count, BLOCK, HEAD_DIM), dtype)
    v = memory.zeros((count, BLOCK, HEAD_DIM), dtype)
    k.copy_(torch.randn(count, BLOCK, HEAD_DIM))
    v.copy_(torch.randn(count, BLOCK, HEAD_DIM))
    pos = memory.zeros((count, BLOCK), torch.int32)
    tables = []
    for _ in range(LAYERS):
        table = torch.zeros(SEQUENCES, KV_HEADS, max(per_seq), dtype=torch.int64)
        for b in range(SEQUENCES):
            for h in range(KV_HEADS):
                for j in range(per_seq[b]):
                    block = next(order)
                    table[b, h, j] = block
                    pos[block] = torch.arange(j * BLOCK, (j + 1) * BLOCK, dtype=torch.int32)
        tables.append(table)
    kv_lens = torch.tensor(lens, dtype=torch.int32).view(-1, 1).expand(-1, KV_HEADS).contiguous()
    q_pos = torch.tensor(lens, dtype=torch.int64) - 1
    q = torch.randn(SEQUENCES, Q_HEADS, HEAD_DIM).to(dtype)

    def sweep(cached: bool) -> None:
        for layer in range(LAYERS):
            cpa.paged_decode_attention(q, k, v, pos, tables[0 if cached else layer], kv_lens, q_pos, HEAD_DIM ** -0.5)

    sweep(False), sweep(True)
    spread, cached = [], []
    for _ in range(rounds):
        spread.append(mean_seconds(lambda: sweep(False), 3) / LAYERS)
        cached.append(mean_seconds(lambda: sweep(True), 3) / LAYERS)
    layer_bytes = sum(lens) * KV_HEADS * HEAD_DIM * 2 * k.element_size()
    return {"layer_us": statistics.median(spread) * 1e6, "cached_us": statistics.median(cached) * 1e6,
            "layer_mb": layer_bytes / 1e6, "gbs": layer_bytes / statistics.median(spread) / 1e9}


def _passes(dtype: str, pairs: int, new_tokens: int) -> dict[str, Any]:
    llm = LLM(DEFAULT_MODEL, EngineConfig(dtype=dtype, kv_cache_memory="1GiB", max_num_seqs=64,
                                          max_num_batched_tokens=2048, speculation="off", num_threads=2))
    prompts = concurrent_prompts(llm.tokenizer, count=32, low=30, high=300, seed=3)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    model = llm.engine.model
    spent = [0.0]
    names = ("paged_decode_attention", "causal_attention")
    originals = {name: getattr(cpa, name) for name in names}
    originals.update({f"{name}_ref": getattr(pa, f"{name}_ref") for name in names})

    def timed(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def run(*args: Any, **kwargs: Any) -> torch.Tensor:
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            spent[0] += time.perf_counter() - start
            return out
        return run

    for name, fn in originals.items():
        setattr(cpa if not name.endswith("_ref") else pa, name, timed(fn))
    switches = (model.cpu_attention, model.cpu_causal)

    def one(on: bool) -> tuple[float, float, list[list[int]]]:
        model.cpu_attention, model.cpu_causal = switches if on else (False, False)
        llm.engine.blocks.reset_prefix_cache()
        spent[0] = 0.0
        start = time.perf_counter()
        out = llm.generate_ids(prompts, params)
        return time.perf_counter() - start, spent[0], [list(o.token_ids) for o in out]

    try:
        on, off = alternating_pairs(one, pairs)
        same = min(sum(x == y for x, y in zip(a[2], b[2], strict=True)) for a, b in zip(on, off, strict=True))
    finally:
        for name, fn in originals.items():
            setattr(cpa if not name.endswith("_ref") else pa, name, fn)
        model.cpu_attention, model.cpu_causal = switches
    ratios = [b[0] / a[0] for a, b in zip(on, off, strict=True)]
    tokens = len(prompts) * new_tokens
    return {"on_tok_s": tokens / statistics.median(a[0] for a in on),
            "off_tok_s": tokens / statistics.median(b[0] for b in off),
            "ratio": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
            "on_attention_s": statistics.median(a[1] for a in on),
            "off_attention_s": statistics.median(b[1] for b in off), "same": same, "sequences": len(prompts)}


def run(quick: bool = False) -> dict[str, Any]:
    torch.set_num_threads(2)
    flags = cpu_flags()
    rounds, pairs, new_tokens = (3, 1, 16) if quick else (7, 3, 128)
    if not cpa.available():
        return {"skipped": "no C compiler or no AVX2 + FMA here", "flags": ", ".join(flags)}
    result: dict[str, Any] = {"flags": ", ".join(flags), "torch": torch.__version__, "rows": [],
                              "bandwidth_gbs": memory_bandwidth_gbs(), "pairs": pairs, "new_tokens": new_tokens}
    for dtype in dtypes(flags):
        result["rows"].append({"dtype": dtype, "prompt": _prompt_rows(getattr(torch, dtype), rounds),
                               "decode": _decode_pool(getattr(torch, dtype), rounds),
                               "passes": _passes(dtype, pairs, new_tokens)})
    return result


def markdown(r: dict[str, Any]) -> str:
    if "skipped" in r:
        return f"Not run: {r['skipped']} (CPU flags: {r['flags']})."
    lines = [f"2 threads, torch {r['torch']}; CPU flags: {r['flags']}; copy bandwidth {r['bandwidth_gbs']:.1f} GB/s.",
             "", "Prompt attention (fresh prompt, causal; 9 query heads, 3 kv heads, head_dim 64), medians of "
             "alternating rounds, ratio = median of the per-round ratios [range]:", "",
             "| dtype | tokens | C kernel (µs) | torch SDPA reference (µs) | ratio |", "| --- | --- | --- | --- | --- |"]
    for row in r["rows"]:
        for p in row["prompt"]:
            low, high = p["ratio_range"]
            lines.append(f"| {row['dtype']} | {p['tokens']} | {p['kernel_us']:.1f} | {p['reference_us']:.1f} | "
                         f"{p['ratio']:.2f}× [{low:.2f}–{high:.2f}] |")
    lines += ["", "Decode attention, one step of 32 sequences of 94–430 entries over 30 layer pools (blocks of 16 "
              "at random on huge pages):", "",
              "| dtype | KV read a layer | µs a layer | GB/s | µs a layer, cache-resident |", "| --- | --- | --- | --- | --- |"]
    for row in r["rows"]:
        d = row["decode"]
        lines.append(f"| {row['dtype']} | {d['layer_mb']:.2f} MB | {d['layer_us']:.1f} | {d['gbs']:.1f} | "
                     f"{d['cached_us']:.1f} |")
    lines += ["", f"Whole passes of the 32-concurrent workload (SmolLM2, {r['new_tokens']} greedy tokens each), "
              f"the kernels on and off (torch references) per pass, {r['pairs']} pairs:", "",
              "| dtype | kernels (tok/s) | torch references (tok/s) | ratio | attention s a pass (kernels / "
              "references) | same tokens |", "| --- | --- | --- | --- | --- | --- |"]
    for row in r["rows"]:
        p = row["passes"]
        low, high = p["ratio_range"]
        lines.append(f"| {row['dtype']} | {p['on_tok_s']:.1f} | {p['off_tok_s']:.1f} | {p['ratio']:.2f}× "
                     f"[{low:.2f}–{high:.2f}] | {p['on_attention_s']:.2f} / {p['off_attention_s']:.2f} | "
                     f"{p['same']}/{p['sequences']} |")
    return "\n".join(lines)
