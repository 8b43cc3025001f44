"""Hearth against vLLM's CPU backend (and transformers) on the identical workloads, alternating processes.

    python -m benchmarks.run --only peers

vLLM lives in its own venv (VLLM_PYTHON, default /tmp/vllm-venv/bin/python; see docs/benchmarks.md for how to
make it): it is large and never a dependency of Hearth. Without it the table says so and shows Hearth alone.
Each engine runs `benchmarks/peers.py` in a fresh process; pairs alternate (hearth, vllm, hearth, vllm, ...)
so drift on a shared machine hits both alike; ratios are taken within each pair, and the median and the range
of those ratios are reported. Hearth also runs with weight-only int8 weights (`quantization: "int8"`) in the same
pairs, as rows of their own against the same vLLM runs (HEARTH_PEERS_INT8=0 leaves them out); their quality cost
is measured by `python -m inference.eval.quant`.

A single stream's ceiling is the memory's read rate over the weight bytes a decode step reads, each process's
tokens/s against the rate measured next to its own passes (`peers.memory_probe`), and the median of those shares.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.machine import cpu_flags

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "peers.py"
MODELS = ["@hearth/smollm2-135m-instruct"]
# HEARTH_PEERS_QWEN=1 adds it (about three times the run time); =single adds its single-stream rows alone.
QWEN = "@hearth/qwen2.5-coder-0.5b-instruct"
WORKLOADS = ("single", "concurrent")
PAIRS = int(os.environ.get("HEARTH_PEERS_PAIRS", "3"))
BYTES_PER_WEIGHT = {"float32": 4, "bfloat16": 2, "int8": 1}


def vllm_python() -> str | None:
    path = os.environ.get("VLLM_PYTHON", "/tmp/vllm-venv/bin/python")
    return path if Path(path).exists() else None


def _once(python: str, engine: str, workload: str, model: str, model_dir: str, threads: int,
          new_tokens: int, dtype: str) -> dict[str, Any]:
    """One process of peers.py; engine `hearth_int8` is Hearth with int8 weights."""
    quantization = "int8" if engine == "hearth_int8" else "none"
    cmd = [python, str(SCRIPT), engine.removesuffix("_int8"), workload, "--model-dir", model_dir, "--model-id",
           model, "--threads", str(threads), "--new-tokens", str(new_tokens), "--dtype", dtype,
           "--quantization", quantization]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False, env=env)
    for line in reversed(out.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"{engine} {workload} failed:\n{out.stdout[-1500:]}\n{out.stderr[-3000:]}")


def dtypes(flags: list[str]) -> list[str]:
    """fp32 everywhere; bf16 too where the CPU computes it natively (AVX-512 BF16 or AMX)."""
    return ["float32"] + (["bfloat16"] if {"avx512_bf16", "amx_bf16"} & set(flags) else [])


def weight_bytes(model_dir: str, dtype: str) -> int:
    """Bytes a decode step reads with weights in `dtype` (float32, bfloat16 or int8): every parameter once, except
    that an embedding table with a head of its own (untied) is read one row per token, not whole; a tied table is
    read whole, as the head. int8's per-row scales are a rounding error here."""
    from safetensors import safe_open

    sizes: dict[str, int] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():  # noqa: SIM118  (safe_open is not a mapping)
                sizes[key] = math.prod(f.get_slice(key).get_shape())
    if any(key.endswith("lm_head.weight") for key in sizes):
        sizes = {key: n for key, n in sizes.items() if not key.endswith("embed_tokens.weight")}
    return sum(sizes.values()) * BYTES_PER_WEIGHT[dtype]


def ceiling_shares(probes: list[dict[str, float]], weight_bytes: int) -> dict[str, float] | None:
    """Median share of the ceiling over processes, each process against the rates measured beside its own passes:
    `read` (the memory's read rate: a decode step only reads) and `copy` (bytes read + written), and the read
    ceiling itself in tokens/s. None when no process measured (an older peers.py)."""
    if not probes:
        return None
    per = {kind: [p["tok_s"] * weight_bytes / (p[kind] * 1e9) for p in probes] for kind in ("read", "copy")}
    return {"read": statistics.median(per["read"]), "copy": statistics.median(per["copy"]),
            "ceiling_tok_s": statistics.median(p["read"] * 1e9 / weight_bytes for p in probes),
            "read_gbs": statistics.median(p["read"] for p in probes)}


def run(quick: bool = False) -> dict[str, Any]:
    from benchmarks.engine import memory_bandwidth_gbs
    from inference.models.catalog import model_path

    pairs = 1 if quick else PAIRS
    new_tokens = 32 if quick else 128
    threads = max(1, min(2, os.cpu_count() or 1))
    peer = vllm_python()
    flags = cpu_flags()
    rows: list[dict[str, Any]] = []
    qwen = os.environ.get("HEARTH_PEERS_QWEN", "0")
    models = MODELS + ([QWEN] if qwen != "0" else [])
    int8 = os.environ.get("HEARTH_PEERS_INT8", "1") != "0"
    bandwidths = [memory_bandwidth_gbs()]
    for model, dtype in ((m, d) for m in models for d in dtypes(flags)):
        model_dir = str(model_path(model))
        workloads = WORKLOADS if model != QWEN or qwen == "1" else [w for w in WORKLOADS if w in qwen.split(",")]
        for workload in workloads:
            runs: dict[str, list[float]] = {"hearth": [], "hearth_int8": [], "vllm": [], "transformers": []}
            probes: dict[str, list[dict[str, float]]] = {"hearth": [], "hearth_int8": [], "vllm": []}
            versions: dict[str, str] = {}
            for _ in range(pairs):
                engines = [("hearth", sys.executable)] + ([("hearth_int8", sys.executable)] if int8 else []) \
                    + ([("vllm", peer)] if peer else [])
                if workload == "single":
                    engines.append(("transformers", sys.executable))
                for engine, python in engines:
                    r = _once(python, engine, workload, model, model_dir, threads, new_tokens, dtype)
                    runs[engine].append(r["tok_s"])
                    if engine in probes and "read_gbs" in r:
                        probes[engine].append({"tok_s": r["tok_s"], "read": r["read_gbs"], "copy": r["copy_gbs"]})
                    versions[engine] = r["version"]
            bandwidths.append(memory_bandwidth_gbs())
            for engine, bytes_as in (("hearth", dtype), ("hearth_int8", "int8")):
                if not runs[engine]:
                    continue
                ratios = [h / v for h, v in zip(runs[engine], runs["vllm"], strict=False)]
                own = {"hearth": runs[engine], "vllm": runs["vllm"],
                       "transformers": runs["transformers"] if engine == "hearth" else []}
                rows.append({"model": model, "dtype": dtype, "workload": workload, "versions": versions,
                             "quantization": "int8" if engine == "hearth_int8" else "none", "runs": own,
                             "weight_bytes": weight_bytes(model_dir, bytes_as),
                             "probes": {"hearth": probes[engine], "vllm": probes["vllm"]},
                             "median": {k: statistics.median(v) for k, v in own.items() if v},
                             "ratio": statistics.median(ratios) if ratios else None,
                             "ratio_range": [min(ratios), max(ratios)] if ratios else None})
    return {"rows": rows, "pairs": pairs, "threads": threads, "new_tokens": new_tokens, "flags": ", ".join(flags),
            "peer": bool(peer), "bandwidth_gbs": statistics.median(bandwidths),
            "malloc": os.environ.get("GLIBC_TUNABLES", "")}


def _ceiling_cell(row: dict[str, Any], bandwidth: float | None) -> str:
    probes = row.get("probes", {})
    ours = ceiling_shares(probes.get("hearth", []), row["weight_bytes"])
    if ours is None:  # a run from before the probes: the run's median copy rate, as then
        if not bandwidth:
            return "—"
        top = bandwidth * 1e9 / row["weight_bytes"]
        return f"{top:.0f} ({row['median']['hearth'] / top:.0%} of copy)"
    # vLLM reads its weights in the row's dtype; int8 rows' byte count is Hearth's, so vLLM's share is left out.
    theirs = ceiling_shares(probes.get("vllm", []), row["weight_bytes"]) if row.get("quantization") != "int8" else None
    vllm = f" / {theirs['read']:.0%}" if theirs else ""
    return (f"{ours['ceiling_tok_s']:.0f} at {ours['read_gbs']:.0f} GB/s ({ours['read']:.0%}{vllm}; "
            f"copy {ours['copy']:.0%})")


def markdown(r: dict[str, Any]) -> str:
    names = {"single": "single stream (tok/s)", "concurrent": "32 concurrent requests, prompts 30-300 tokens (tok/s)"}
    versions = {k: v for row in r["rows"] for k, v in row["versions"].items()}
    lines = [f"Greedy, {r['new_tokens']} output tokens, {r['threads']} threads; CPU flags: {r['flags']}; "
             f"{r['pairs']} alternating pairs of fresh processes, medians (ratio: median of the per-pair ratios, "
             f"range in brackets). Engines: {', '.join(sorted(set(versions.values())))}.", ""]
    # Every engine's process inherits the allocator's settings (`make bench` sets those `make run` serves with).
    lines += [f"Allocator (every engine's process): GLIBC_TUNABLES={r['malloc']}." if r.get("malloc") else
              "Allocator: glibc's defaults (GLIBC_TUNABLES unset; `make bench` sets it as `make run` does).", ""]
    if not r["peer"]:
        lines += ["vLLM's CPU venv was not found (VLLM_PYTHON), so Hearth runs alone here.", ""]
    bandwidth = r.get("bandwidth_gbs")
    if bandwidth:
        lines += ["Ceiling of a single stream: the memory's read rate, measured in each engine's process beside its "
                  "timed passes, over the weight bytes one decode step reads; shares are medians over processes, "
                  "Hearth's then vLLM's, each against its own process's rate (the share of the copy rate, bytes "
                  "read + written, follows; it reads high because a copy's count leaves out the lines its stores "
                  f"read first). Copy rate between workloads, median over the run: {bandwidth:.1f} GB/s.", ""]
    lines += ["Rows marked int8 weights are Hearth with weight-only int8 weights (activations in the row's dtype) against "
              "vLLM unquantized in that dtype, from the same pairs; their ceiling counts one byte per weight.", "",
              "| model | dtype | workload | Hearth | vLLM CPU | Hearth / vLLM | transformers | "
              "ceiling (share: Hearth / vLLM; Hearth of copy) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in r["rows"]:
        m = row["median"]
        ratio = (f"{row['ratio']:.2f}× [{row['ratio_range'][0]:.2f}–{row['ratio_range'][1]:.2f}]"
                 if row["ratio"] else "—")
        peer = f"{m['vllm']:.1f}" if "vllm" in m else "—"
        hf = f"{m['transformers']:.1f}" if "transformers" in m else "—"
        ceiling = "—"
        if row["workload"] == "single" and row.get("weight_bytes"):
            ceiling = _ceiling_cell(row, bandwidth)
        dtype = row.get("dtype", "float32") + (", int8 weights" if row.get("quantization") == "int8" else "")
        lines.append(f"| {row['model']} | {dtype} | {names[row['workload']]} | {m['hearth']:.1f} | "
                     f"{peer} | {ratio} | {hf} | {ceiling} |")
    return "\n".join(lines)
