"""`make bench`: run every benchmark and rewrite its section of docs/benchmarks.md with the figures, the command
and the CPU (family, model and the flags that pick the kernels), each section as soon as it is done.

    python -m benchmarks.run [--only engine|speculation|api|db_pool|batch|kv|kernels|dashboard|lora|constrained|fleet|fleet_scaling|cpu_peers|decode_layer|cpu_attention|cpu_gemm|quant] [--quick]

Each benchmark runs in its own process so one's memory and threads never colour another's figures.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from benchmarks.machine import describe

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
HEADER = ("# Benchmarks\n\nFigures from `make bench` (`python -m benchmarks.run`). The machine is shared and noisy:"
          " every comparison is side by side in one run, and ratios are what to read. Medians of repeated runs.\n")
SECTIONS = {"engine": "Engine (SmolLM2-135M, CPU)", "speculation": "Speculative decoding (CPU)",
            "api": "Control plane API", "db_pool": "PostgreSQL's session pool: request latency",
            "batch": "Batches: interactive latency and batch throughput",
            "kv": "KV-cache compression (CPU)", "dashboard": "Dashboard pages with 1,000,000 usage events",
            "lora": "LoRA adapters: many in one batch (CPU)",
            "constrained": "Grammar-constrained decoding (CPU)",
            "fleet": "Fleet: replicas on Ray Serve and the request router (CPU)",
            "fleet_scaling": "Fleet: 4 CPU replicas against one",
            "cpu_peers": "CPU engines side by side: Hearth, vLLM's CPU backend, transformers",
            "decode_layer": "One-call decode layers against the Python forward (CPU)",
            "cpu_attention": "CPU attention kernels against the torch references",
            "cpu_gemm": "CPU GEMM of many rows against oneDNN (fp32, bf16)",
            "quant": "Weight-only int8: quality against fp32 (CPU)",
            "kernels": "Triton kernels against their torch references (CUDA)"}


def _run_one(name: str, quick: bool) -> dict:
    code = (f"import json, benchmarks.{name} as b; r = b.run({'quick=True' if quick and name != 'api' else ''});"
            f" print('@@RESULT@@' + json.dumps({{'result': r, 'markdown': b.markdown(r)}}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False)
    for line in out.stdout.splitlines():
        if line.startswith("@@RESULT@@"):
            return json.loads(line.removeprefix("@@RESULT@@"))
    raise RuntimeError(f"benchmark {name} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")


def _replace_section(text: str, name: str, body: str) -> str:
    start, end = f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"
    block = f"{start}\n{body}\n{end}"
    if start in text and end in text:
        return text[: text.index(start)] + block + text[text.index(end) + len(end):]
    return text.rstrip() + f"\n\n## {SECTIONS[name]}\n\n{block}\n"


def run_sections(names: list[str], quick: bool, doc: Path = DOC,
                 run_one: Callable[[str, bool], dict] = _run_one) -> list[str]:
    """Run each benchmark and put its section into `doc` as soon as it is done: `make bench` takes hours, and a
    section that fails (or a Ctrl-C) must not cost the figures of those before it. A failed section keeps its old
    figures and the others go on. Returns the names that failed."""
    failed: list[str] = []
    for name in names:
        try:
            report = run_one(name, quick)
        except Exception as error:  # noqa: BLE001 - any failure of one benchmark is reported, then the rest run
            print(f"benchmark {name} failed; its section keeps its old figures:\n{error}", file=sys.stderr)
            failed.append(name)
            continue
        stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
        command = f"python -m benchmarks.run --only {name}" + (" --quick" if quick else "")
        body = f"Run {stamp} on {describe()} with `{command}`.\n\n{report['markdown']}"
        text = doc.read_text() if doc.exists() else HEADER
        doc.write_text(_replace_section(text, name, body))
        print(body, "\n", flush=True)
    return failed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", choices=sorted(SECTIONS), action="append")
    parser.add_argument("--quick", action="store_true", help="smaller engine workloads (a smoke run)")
    args = parser.parse_args()
    failed = run_sections(args.only or list(SECTIONS), args.quick)
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
