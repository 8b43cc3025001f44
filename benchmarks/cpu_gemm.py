"""The GEMM of many rows (kernels/csrc/gemm.c) against oneDNN's packed products it replaces: fp32 on every
build, bf16 where the CPU has AVX-512 BF16 dot products (on AMX tiles where it has those: csrc/gemm_amx.h).

    python -m benchmarks.run --only cpu_gemm

- products: GFLOP/s of both on the layer shapes of SmolLM2-135M and Qwen2.5-0.5B (fused qkv and gate/up, as the
  engine runs them) at 8-2048 rows (the LM head at the 8 and 32 rows a step computes logits for), random
  weights, both in one process, alternating rounds; ratio = median of the per-round ratios [range].
- whole passes: the 32-concurrent workload of `benchmarks/peers.py` on SmolLM2, every layer's GEMM switched on
  and off per pass (oneDNN's packed product of the same weights when off), alternating. Both sides run steps of
  many rows through the Python forward, so only the products differ (the one-call layers, which need the GEMM,
  have their own benchmark: decode_layer).
"""

from __future__ import annotations

import functools
import os
import statistics
from typing import Any

import torch

from benchmarks.machine import cpu_flags
from benchmarks.workloads import concurrent_prompts, mean_seconds, switched_passes
from inference import LLM, EngineConfig, SamplingParams
from inference.models import layers
from inference.models.catalog import DEFAULT_MODEL
from kernels import cpu_gemv

# (model, layer, out features n, in features k): hidden 576 / 896, MLP 1536 / 4864, 9+3+3 / 14+2+2 heads of 64.
SHAPES = [("SmolLM2-135M", "qkv", 960, 576), ("SmolLM2-135M", "o", 576, 576),
          ("SmolLM2-135M", "gate_up", 3072, 576), ("SmolLM2-135M", "down", 576, 1536),
          ("SmolLM2-135M", "lm_head", 49152, 576),
          ("Qwen2.5-0.5B", "qkv", 1152, 896), ("Qwen2.5-0.5B", "o", 896, 896),
          ("Qwen2.5-0.5B", "gate_up", 9728, 896), ("Qwen2.5-0.5B", "down", 896, 4864)]
ROWS = (8, 32, 128, 512, 2048)
HEAD_ROWS = (8, 32)


def _dtypes() -> list[torch.dtype]:
    """fp32, and bf16 where the build has the GEMM's bf16 entry point."""
    bf16 = cpu_gemv.gemm_kernel(cpu_gemv.pack(torch.zeros(2, 2, dtype=torch.bfloat16))) is not None
    return [torch.float32] + ([torch.bfloat16] if bf16 else [])


def _products(rounds: int, rows: tuple[int, ...], dtype: torch.dtype) -> list[dict[str, Any]]:
    out = []
    gen = torch.Generator().manual_seed(0)
    for model, name, n, k in SHAPES:
        w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
        packed, onednn = cpu_gemv.pack(w), torch.ops.mkldnn._reorder_linear_weight(w, None)
        for m in (r for r in rows if name != "lm_head" or r in HEAD_ROWS):
            x = torch.randn(m, k, generator=gen).to(dtype)
            calls = {"gemm": functools.partial(cpu_gemv.gemm, x, packed),
                     "onednn": functools.partial(torch.ops.mkldnn._linear_pointwise, x, onednn, None, "none", [], "")}
            repeat = max(2, int(4e8 / (2 * m * n * k)))
            for fn in calls.values():
                mean_seconds(fn, repeat)  # untimed: the first calls of a shape run slow
            times: dict[str, list[float]] = {"gemm": [], "onednn": []}
            for i in range(rounds):
                for side in (("gemm", "onednn") if i % 2 == 0 else ("onednn", "gemm")):
                    times[side].append(mean_seconds(calls[side], repeat))
            ratios = [o / g for g, o in zip(times["gemm"], times["onednn"], strict=True)]
            flops = 2 * m * n * k
            out.append({"dtype": str(dtype).removeprefix("torch."), "model": model, "layer": name, "n": n, "k": k, "rows": m,
                        "gemm_gflops": flops / statistics.median(times["gemm"]) / 1e9,
                        "onednn_gflops": flops / statistics.median(times["onednn"]) / 1e9,
                        "ratio": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)]})
    return out


def _passes(pairs: int, new_tokens: int, dtype: torch.dtype) -> dict[str, Any]:
    name = str(dtype).removeprefix("torch.")
    # Every product the GEMM can take is put on it, also where the engine itself sends them to oneDNN (bf16 on a
    # CPU with AMX), so the passes compare the two wherever both exist.
    saved = os.environ.get("HEARTH_CPU_GEMM")
    os.environ["HEARTH_CPU_GEMM"] = "on"
    try:
        llm = LLM(DEFAULT_MODEL, EngineConfig(dtype=name, kv_cache_memory="1GiB", max_num_seqs=64,
                                              max_num_batched_tokens=2048, speculation="off", num_threads=2))
    finally:
        if saved is None:
            del os.environ["HEARTH_CPU_GEMM"]
        else:
            os.environ["HEARTH_CPU_GEMM"] = saved
    prompts = concurrent_prompts(llm.tokenizer, count=32, low=30, high=300, seed=3)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    model = llm.engine.model
    linears = [getattr(layer, f) for layer in model.layers for f in ("qkv", "o", "gate_up", "down")] + [model.lm_head]
    routed = [lin for lin in linears if isinstance(lin, layers.Linear) and lin.gemm]
    if not routed:
        return {"dtype": name, "skipped": "this build sends no product to the GEMM"}
    # A layer on the GEMM keeps no oneDNN copy: the comparison packs one from the same weights.
    onednn = [torch.ops.mkldnn._reorder_linear_weight(lin.gemv_weight.unpacked(), None) for lin in routed]

    def switch(on: bool) -> None:
        for lin, packed in zip(routed, onednn, strict=True):
            lin.gemm, lin.packed, lin.weight = on, not on, None if on else packed

    # Steps of many rows in the Python forward on both sides: the one-call layers cannot call oneDNN.
    stack = model.decode_stack
    many_rows = stack is not None and stack.many_rows
    if stack is not None:
        stack.many_rows = False
    try:
        passes = switched_passes(llm, prompts, params, switch, pairs)
    finally:
        if stack is not None:
            stack.many_rows = many_rows
    amx = dtype == torch.bfloat16 and cpu_gemv.amx_bf16()
    engine = ("GEMM (AMX tiles)" if cpu_gemv.gemm_amx() else "oneDNN (AMX tiles)") if amx else "GEMM"
    return passes | {"dtype": name, "layers": len(routed), "of": len(linears), "engine_default": engine}


def run(quick: bool = False) -> dict[str, Any]:
    torch.set_num_threads(2)
    flags = cpu_flags()
    if cpu_gemv._gemm_library() is None:
        return {"skipped": "no C compiler or no AVX2 + FMA here", "flags": ", ".join(flags)}
    rounds, rows, pairs, new_tokens = (3, (8, 128), 1, 16) if quick else (7, ROWS, 3, 128)
    kinds = _dtypes()
    return {"flags": ", ".join(flags), "torch": torch.__version__, "rounds": rounds, "pairs": pairs,
            "new_tokens": new_tokens, "products": [p for d in kinds for p in _products(rounds, rows, d)],
            "passes": [_passes(pairs, new_tokens, d) for d in kinds]}


def markdown(r: dict[str, Any]) -> str:
    if "skipped" in r:
        return f"Not run: {r['skipped']} (CPU flags: {r['flags']})."
    lines = [f"2 threads, torch {r['torch']}; CPU flags: {r['flags']}. Products: GFLOP/s, medians of "
             f"{r['rounds']} alternating rounds, ratio = median of the per-round ratios [range]:", "",
             "| dtype | model | layer (n × k) | rows | GEMM (GFLOP/s) | oneDNN packed (GFLOP/s) | GEMM / oneDNN |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for p in r["products"]:
        low, high = p["ratio_range"]
        lines.append(f"| {p['dtype']} | {p['model']} | {p['layer']} ({p['n']} × {p['k']}) | {p['rows']} | "
                     f"{p['gemm_gflops']:.0f} | {p['onednn_gflops']:.0f} | {p['ratio']:.2f}× [{low:.2f}–{high:.2f}] |")
    lines += ["", f"Whole passes of the 32-concurrent workload (SmolLM2, {r['new_tokens']} greedy tokens each), the "
              f"GEMM on and off (oneDNN when off) per pass, {r['pairs']} pairs, steps of many rows in the Python "
              "forward on both sides:", "",
              "| dtype | products on the GEMM | GEMM (tok/s) | oneDNN (tok/s) | ratio | same tokens | the engine "
              "uses |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for passes in r["passes"]:
        if "skipped" in passes:
            lines.append(f"| {passes['dtype']} | not run ({passes['skipped']}) | | | | | |")
            continue
        low, high = passes["ratio_range"]
        lines.append(f"| {passes['dtype']} | {passes['layers']} of {passes['of']} | {passes['on_tok_s']:.1f} | "
                     f"{passes['off_tok_s']:.1f} | {passes['ratio']:.2f}× [{low:.2f}–{high:.2f}] | "
                     f"{passes['same']}/{passes['sequences']} | {passes.get('engine_default', 'GEMM')} |")
    return "\n".join(lines)
