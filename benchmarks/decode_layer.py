"""One-call decode layers (kernels/cpu_decode_layer) against the Python forward they replace: a single stream,
and 32 concurrent sequences (steps of 32 rows, where the stack takes them: `many_rows`).

    python -m benchmarks.run --only decode_layer

Both paths run in one process on one loaded engine, switched per pass (on, off, on, off, ...), so the weights,
the KV pool and the machine's drift are the same for both; the ratio of each pair is taken and their median and
range reported. The outputs are compared too: the two paths must give the same tokens. Ceiling: copy bandwidth
(measured before and after each model) over the weight bytes a decode step reads.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

import torch

from benchmarks.cpu_peers import QWEN, dtypes
from benchmarks.engine import memory_bandwidth_gbs, weight_bytes_per_token
from benchmarks.machine import cpu_flags
from benchmarks.workloads import concurrent_prompts, switched_passes, text_of_tokens
from inference import LLM, EngineConfig, SamplingParams
from inference.models.catalog import DEFAULT_MODEL

PAIRS = 8
NEW_TOKENS = 128
CONCURRENT_PAIRS = 3


def _measure(model: str, dtype: str, quantization: str, pairs: int, new_tokens: int) -> dict[str, Any]:
    llm = LLM(model, EngineConfig(dtype=dtype, quantization=quantization, kv_cache_memory="1GiB",
                                  speculation="off", num_threads=2))
    decoder = llm.engine.model
    stack = decoder.decode_stack
    if stack is None:
        return {"model": model, "dtype": dtype, "quantization": quantization, "skipped": "no one-call layers here"}
    prompt = text_of_tokens(llm.tokenizer, 32, seed=11)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)

    def tok_s(on: bool) -> tuple[float, list[int]]:
        decoder.decode_stack = stack if on else None
        llm.engine.blocks.reset_prefix_cache()  # every pass computes its prompt
        start = time.perf_counter()
        out = llm.generate_ids([prompt], params)[0]
        return new_tokens / (time.perf_counter() - start), list(out.token_ids)

    tok_s(True), tok_s(False)  # warm-up
    on, off, same = [], [], True
    for _ in range(pairs):
        (a, tokens_on), (b, tokens_off) = tok_s(True), tok_s(False)
        on.append(a)
        off.append(b)
        same &= tokens_on == tokens_off
    ratios = [a / b for a, b in zip(on, off, strict=True)]
    result = {"model": model, "dtype": dtype, "quantization": quantization, "on": statistics.median(on),
              "off": statistics.median(off), "ratio": statistics.median(ratios),
              "ratio_range": [min(ratios), max(ratios)], "same_tokens": same,
              "weight_bytes": weight_bytes_per_token(llm)}
    decoder.decode_stack = stack
    return result


def _concurrent(dtype: str, quantization: str, pairs: int, new_tokens: int) -> dict[str, Any]:
    """SmolLM2, the 32-concurrent workload of benchmarks/peers.py (prompts of 30-300 tokens), whole passes."""
    row: dict[str, Any] = {"dtype": dtype, "quantization": quantization}
    llm = LLM(DEFAULT_MODEL, EngineConfig(dtype=dtype, quantization=quantization, kv_cache_memory="1GiB",
                                          max_num_seqs=64, max_num_batched_tokens=2048, speculation="off",
                                          num_threads=2))
    decoder = llm.engine.model
    stack = decoder.decode_stack
    if stack is None or not stack.many_rows:
        return row | {"skipped": "steps of many rows keep the Python forward here (their products are oneDNN's)"}
    prompts = concurrent_prompts(llm.tokenizer, count=32, low=30, high=300, seed=3)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)

    def switch(on: bool) -> None:
        decoder.decode_stack = stack if on else None

    return row | switched_passes(llm, prompts, params, switch, pairs)


def run(quick: bool = False) -> dict[str, Any]:
    pairs, new_tokens = (3, 32) if quick else (PAIRS, NEW_TOKENS)
    torch.set_num_threads(2)
    flags = cpu_flags()
    models = [DEFAULT_MODEL] + ([] if quick else [QWEN])
    rows, bandwidths = [], [memory_bandwidth_gbs()]
    for model in models:
        for dtype in dtypes(flags):
            for quantization in ("none", "int8"):
                rows.append(_measure(model, dtype, quantization, pairs, new_tokens))
                gc.collect()  # the engine just measured, before the next one loads
        bandwidths.append(memory_bandwidth_gbs())
    concurrent_pairs, concurrent_tokens = (1, 16) if quick else (CONCURRENT_PAIRS, NEW_TOKENS)
    concurrent = []
    for dtype in dtypes(flags):
        for quantization in ("none", "int8"):
            concurrent.append(_concurrent(dtype, quantization, concurrent_pairs, concurrent_tokens))
            gc.collect()
    return {"rows": rows, "pairs": pairs, "new_tokens": new_tokens, "flags": ", ".join(flags),
            "bandwidth_gbs": statistics.median(bandwidths), "torch": torch.__version__, "concurrent": concurrent,
            "concurrent_pairs": concurrent_pairs, "concurrent_tokens": concurrent_tokens}


def markdown(r: dict[str, Any]) -> str:
    bandwidth = r["bandwidth_gbs"]
    lines = [f"Single stream, greedy, {r['new_tokens']} output tokens, 2 threads, torch {r['torch']}; CPU flags: "
             f"{r['flags']}. One process per model and dtype, the two paths switched per pass, {r['pairs']} pairs; "
             f"medians, ratio = median of the per-pair ratios [range]. Ceiling: copy bandwidth {bandwidth:.1f} GB/s "
             "(median over the run) over the weight bytes one decode step reads.", "",
             "| model | dtype | weights | one-call layers (tok/s) | Python forward (tok/s) | ratio | ceiling share "
             "(one-call / Python) | same tokens |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in r["rows"]:
        if "skipped" in row:
            lines.append(f"| {row['model']} | {row['dtype']} | {row['quantization']} | — | — | — | — | "
                         f"{row['skipped']} |")
            continue
        top = bandwidth * 1e9 / row["weight_bytes"]
        low, high = row["ratio_range"]
        lines.append(f"| {row['model']} | {row['dtype']} | {row['quantization']} | {row['on']:.1f} | "
                     f"{row['off']:.1f} | {row['ratio']:.2f}× [{low:.2f}–{high:.2f}] | "
                     f"{row['on'] / top:.0%} / {row['off'] / top:.0%} | {'yes' if row['same_tokens'] else 'NO'} |")
    if r.get("concurrent"):
        lines += ["", f"32 concurrent sequences (SmolLM2, the prompts of 30–300 tokens of `benchmarks/peers.py`, "
                  f"{r['concurrent_tokens']} greedy tokens each: decode steps of 32 rows), whole passes, the two "
                  f"paths switched per pass, {r['concurrent_pairs']} pairs:", "",
                  "| dtype | weights | one-call layers (tok/s) | Python forward (tok/s) | ratio | same tokens |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for row in r["concurrent"]:
            if "skipped" in row:
                lines.append(f"| {row['dtype']} | {row['quantization']} | — | — | — | {row['skipped']} |")
                continue
            low, high = row["ratio_range"]
            lines.append(f"| {row['dtype']} | {row['quantization']} | {row['on_tok_s']:.1f} | {row['off_tok_s']:.1f} | "
                         f"{row['ratio']:.2f}× [{low:.2f}–{high:.2f}] | {row['same']}/{row['sequences']} |")
    return "\n".join(lines)
