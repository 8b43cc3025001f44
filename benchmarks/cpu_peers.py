"""Hearth against vLLM's CPU backend (and transformers) on the identical workloads, alternating processes.

    python -m benchmarks.run --only peers

vLLM lives in its own venv (VLLM_PYTHON, default /tmp/vllm-venv/bin/python; see docs/benchmarks.md for how to
make it): it is large and never a dependency of Hearth. Without it the table says so and shows Hearth alone.
Each engine runs `benchmarks/peers.py` in a fresh process; pairs alternate (hearth, vllm, hearth, vllm, ...)
so drift on a shared machine hits both alike; ratios are taken within each pair, and the median and the range
of those ratios are reported.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "peers.py"
MODELS = ["@hearth/smollm2-135m-instruct"]
QWEN = "@hearth/qwen2.5-coder-0.5b-instruct"  # HEARTH_PEERS_QWEN=1 adds it (about three times the run time)
PAIRS = int(os.environ.get("HEARTH_PEERS_PAIRS", "3"))


def vllm_python() -> str | None:
    path = os.environ.get("VLLM_PYTHON", "/tmp/vllm-venv/bin/python")
    return path if Path(path).exists() else None


def _once(python: str, engine: str, workload: str, model: str, model_dir: str, threads: int,
          new_tokens: int, dtype: str) -> dict[str, Any]:
    cmd = [python, str(SCRIPT), engine, workload, "--model-dir", model_dir, "--model-id", model,
           "--threads", str(threads), "--new-tokens", str(new_tokens), "--dtype", dtype]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False, env=env)
    for line in reversed(out.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"{engine} {workload} failed:\n{out.stdout[-1500:]}\n{out.stderr[-3000:]}")


def cpu_flags() -> list[str]:
    try:
        line = next(row for row in Path("/proc/cpuinfo").read_text().splitlines() if row.startswith("flags"))
    except (OSError, StopIteration):
        return [platform.machine()]
    have = set(line.split(":", 1)[-1].split())
    return [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in have]


def dtypes(flags: list[str]) -> list[str]:
    """fp32 everywhere; bf16 too where the CPU computes it natively (AVX-512 BF16 or AMX)."""
    return ["float32"] + (["bfloat16"] if {"avx512_bf16", "amx_bf16"} & set(flags) else [])


def weight_bytes(model_dir: str, dtype: str) -> int:
    """Bytes a decode step reads, in `dtype`: every parameter once, except that an embedding table with a head of
    its own (untied) is read one row per token, not whole; a tied table is read whole, as the head."""
    from safetensors import safe_open

    sizes: dict[str, int] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():  # noqa: SIM118  (safe_open is not a mapping)
                sizes[key] = math.prod(f.get_slice(key).get_shape())
    if any(key.endswith("lm_head.weight") for key in sizes):
        sizes = {key: n for key, n in sizes.items() if not key.endswith("embed_tokens.weight")}
    return sum(sizes.values()) * (4 if dtype == "float32" else 2)


def run(quick: bool = False) -> dict[str, Any]:
    from benchmarks.engine import memory_bandwidth_gbs
    from inference.models.catalog import model_path

    pairs = 1 if quick else PAIRS
    new_tokens = 32 if quick else 128
    threads = max(1, min(2, os.cpu_count() or 1))
    peer = vllm_python()
    flags = cpu_flags()
    rows: list[dict[str, Any]] = []
    models = MODELS + ([QWEN] if os.environ.get("HEARTH_PEERS_QWEN") == "1" else [])
    bandwidths = [memory_bandwidth_gbs()]
    for model, dtype in ((m, d) for m in models for d in dtypes(flags)):
        model_dir = str(model_path(model))
        for workload in ("single", "concurrent"):
            runs: dict[str, list[float]] = {"hearth": [], "vllm": [], "transformers": []}
            versions: dict[str, str] = {}
            for _ in range(pairs):
                engines = [("hearth", sys.executable)] + ([("vllm", peer)] if peer else [])
                if workload == "single":
                    engines.append(("transformers", sys.executable))
                for engine, python in engines:
                    r = _once(python, engine, workload, model, model_dir, threads, new_tokens, dtype)
                    runs[engine].append(r["tok_s"])
                    versions[engine] = r["version"]
            ratios = [h / v for h, v in zip(runs["hearth"], runs["vllm"], strict=False)]
            bandwidths.append(memory_bandwidth_gbs())
            rows.append({"model": model, "dtype": dtype, "workload": workload, "runs": runs, "versions": versions,
                         "weight_bytes": weight_bytes(model_dir, dtype),
                         "median": {k: statistics.median(v) for k, v in runs.items() if v},
                         "ratio": statistics.median(ratios) if ratios else None,
                         "ratio_range": [min(ratios), max(ratios)] if ratios else None})
    return {"rows": rows, "pairs": pairs, "threads": threads, "new_tokens": new_tokens, "flags": ", ".join(flags),
            "peer": bool(peer), "bandwidth_gbs": statistics.median(bandwidths)}


def markdown(r: dict[str, Any]) -> str:
    names = {"single": "single stream (tok/s)", "concurrent": "32 concurrent requests, prompts 30-300 tokens (tok/s)"}
    versions = {k: v for row in r["rows"] for k, v in row["versions"].items()}
    lines = [f"Greedy, {r['new_tokens']} output tokens, {r['threads']} threads; CPU flags: {r['flags']}; "
             f"{r['pairs']} alternating pairs of fresh processes, medians (ratio: median of the per-pair ratios, "
             f"range in brackets). Engines: {', '.join(sorted(versions.values()))}.", ""]
    if not r["peer"]:
        lines += ["vLLM's CPU venv was not found (VLLM_PYTHON), so Hearth runs alone here.", ""]
    bandwidth = r.get("bandwidth_gbs")
    if bandwidth:
        lines += [f"Ceiling of a single stream: copy bandwidth (bytes read + written, median over the run: "
                  f"{bandwidth:.1f} GB/s) over the weight bytes one decode step reads; the share is Hearth's.", ""]
    lines += ["| model | dtype | workload | Hearth | vLLM CPU | Hearth / vLLM | transformers | ceiling (share) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in r["rows"]:
        m = row["median"]
        ratio = (f"{row['ratio']:.2f}× [{row['ratio_range'][0]:.2f}–{row['ratio_range'][1]:.2f}]"
                 if row["ratio"] else "—")
        peer = f"{m['vllm']:.1f}" if "vllm" in m else "—"
        hf = f"{m['transformers']:.1f}" if "transformers" in m else "—"
        ceiling = "—"
        if bandwidth and row["workload"] == "single" and row.get("weight_bytes"):
            top = bandwidth * 1e9 / row["weight_bytes"]
            ceiling = f"{top:.0f} ({m['hearth'] / top:.0%})"
        lines.append(f"| {row['model']} | {row.get('dtype', 'float32')} | {names[row['workload']]} | {m['hearth']:.1f} | "
                     f"{peer} | {ratio} | {hf} | {ceiling} |")
    return "\n".join(lines)
