"""One engine, one workload, one JSON line: the same measurement under any interpreter.

    python benchmarks/peers.py ENGINE WORKLOAD --model-dir DIR [--model-id ID] [--dtype float32] [--threads 2]
                               [--quantization int8]

ENGINE is hearth (this checkout's engine), vllm (vLLM's CPU build, in its own venv) or transformers
(`generate`); `--quantization int8` gives Hearth weight-only int8 weights. WORKLOAD is `single` (one stream,
128 greedy tokens) or `concurrent` (32 requests, prompts of 30-300 tokens, 128 greedy tokens each). Prompts are token ids cut from fixed English text with the model's own
tokenizer, so every engine sees the identical work. The script needs only the standard library, the engine
under test and a tokenizer: it must run in vLLM's venv, which has none of Hearth's dependencies.

Each process loads, warms up on the same workload, then times RUNS passes and prints their median. Next to every
timed pass it measures the memory's speed (a read and a copy, `memory_probe`), so a single stream's share of the
bandwidth ceiling is taken against what the machine gave that very process: on a VM the rate can swing by 1.7x
within minutes. `benchmarks/cpu_peers.py` alternates these processes and keeps the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.workloads import concurrent_prompts, text_of_tokens  # noqa: E402

RUNS = 3
# Far past any L3 of these machines, so the probe measures memory, not cache (tests set less).
PROBE_MIB = int(os.environ.get("HEARTH_PEERS_PROBE_MIB", "512"))


def memory_probe(threads: int, rounds: int = 5) -> Callable[[], dict[str, float]]:
    """A probe of the memory's speed on `threads` threads, GB/s over the median of `rounds`: `read` sums a buffer
    (a decode step only reads its weights, so this is its ceiling), `copy` counts bytes read plus written (the
    issue's first measure; it leaves out the destination lines a store reads first, so it reads low). The buffers
    are made once, so probing between passes neither grows the process nor faults in fresh pages."""
    import torch

    src = torch.ones(PROBE_MIB * 2**20 // 4, dtype=torch.float32)
    dst = torch.zeros_like(src)

    def probe() -> dict[str, float]:
        before = torch.get_num_threads()  # vLLM sets its own; put it back so its passes are not changed
        torch.set_num_threads(threads)
        try:
            rates: dict[str, list[float]] = {"read": [], "copy": []}
            for _ in range(rounds):
                start = time.perf_counter()
                src.sum()
                rates["read"].append(src.nbytes / (time.perf_counter() - start) / 1e9)
                start = time.perf_counter()
                dst.copy_(src)
                rates["copy"].append(2 * src.nbytes / (time.perf_counter() - start) / 1e9)
            return {kind: statistics.median(values) for kind, values in rates.items()}
        finally:
            torch.set_num_threads(before)

    return probe


def prompts_for(tokenizer, workload: str) -> list[list[int]]:
    if workload == "single":
        return [text_of_tokens(tokenizer, 32, seed=11)]
    return concurrent_prompts(tokenizer, count=32, low=30, high=300, seed=3)


def hearth(args: argparse.Namespace, prompts: list[list[int]]) -> tuple[Callable[[], list[list[int]]], str]:
    import torch

    from inference import LLM, EngineConfig, SamplingParams

    torch.set_num_threads(args.threads)
    llm = LLM(args.model_id, EngineConfig(dtype=args.dtype, kv_cache_memory="1GiB", max_num_seqs=64,
                                          max_num_batched_tokens=2048, speculation="off", num_threads=args.threads,
                                          quantization=args.quantization))
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)

    def go() -> list[list[int]]:
        llm.engine.blocks.reset_prefix_cache()  # every pass computes its prompts, as the peers' do
        return [list(o.token_ids) for o in llm.generate_ids(prompts, params)]

    return go, f"torch {torch.__version__}"


def vllm(args: argparse.Namespace, prompts: list[list[int]]) -> tuple[Callable[[], list[list[int]]], str]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import vllm as v

    llm = v.LLM(model=args.model_dir, dtype=args.dtype, max_model_len=2048, seed=0, max_num_seqs=64,
                max_num_batched_tokens=2048, enable_prefix_caching=False)  # each pass computes its prompts
    params = v.SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]

    def go() -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in llm.generate(inputs, params, use_tqdm=False)]

    return go, f"vllm {v.__version__}"


def transformers(args: argparse.Namespace, prompts: list[list[int]]) -> tuple[Callable[[], list[list[int]]], str]:
    import torch
    import transformers as hf
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=getattr(torch, args.dtype)).eval()
    pad = model.config.pad_token_id or 0

    def go() -> list[list[int]]:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens,
                                 min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=pad)
        return out[:, width:].tolist()

    return go, f"transformers {hf.__version__}"


ENGINES = {"hearth": hearth, "vllm": vllm, "transformers": transformers}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("engine", choices=sorted(ENGINES))
    parser.add_argument("workload", choices=["single", "concurrent"])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--model-id", default="@hearth/smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--quantization", default="none", help="hearth only: none or int8")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    prompts = prompts_for(AutoTokenizer.from_pretrained(args.model_dir), args.workload)
    go, version = ENGINES[args.engine](args, prompts)
    first = go()  # warm-up: kernels chosen, caches sized, pages touched
    memory_gbs = memory_probe(args.threads)
    seconds, probes = [], [memory_gbs()]
    for _ in range(RUNS):
        start = time.perf_counter()
        out = go()
        seconds.append(time.perf_counter() - start)
        probes.append(memory_gbs())
    tokens = sum(len(o) for o in out)
    print(json.dumps({"engine": args.engine, "workload": args.workload, "version": version, "dtype": args.dtype,
                      "quantization": args.quantization,
                      "threads": args.threads, "requests": len(prompts), "output_tokens": tokens,
                      "tok_s": tokens / statistics.median(seconds), "runs_s": seconds,
                      "read_gbs": statistics.median(p["read"] for p in probes),
                      "copy_gbs": statistics.median(p["copy"] for p in probes),
                      "greedy_first": first[0][:16]}))


if __name__ == "__main__":
    main()
