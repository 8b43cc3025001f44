"""Engine benchmark (issue: engine core), side by side with Hugging Face transformers in one run.

    python -m benchmarks.engine            # prints a markdown table; benchmarks.run writes docs/benchmarks.md
    python -m benchmarks.engine --model @hearth/qwen2.5-coder-0.5b-instruct --concurrent 32 256   (on CUDA too)

1. Single-stream decode of 128 tokens: Hearth vs transformers.generate, and the physical ceiling (weight bytes
   read per token over measured memory bandwidth).
2. 32 concurrent requests (prompts 50-500 tokens, 128 output tokens; more counts with --concurrent): Hearth total
   throughput vs transformers batched generate (left padding) and vs transformers one request at a time.
3. Shared 1,500-token prefix: time to first token of the second request vs the first; throughput of a
   0%-hit workload with prefix caching on vs off.

The engine runs where `EngineConfig` puts it (CUDA when there is one, in bf16) and transformers runs on the same
device in the same dtype. On CUDA the pool and batch limits are sized for the card and 256 concurrent requests.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.workloads import concurrent_prompts, text_of_tokens
from inference import LLM, EngineConfig, FinishReason, RequestOutput, SamplingParams
from inference.models.catalog import DEFAULT_MODEL, model_path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def generated(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """The outputs, or an error naming the first request that failed: a benchmark must never time failures (the
    engine answers a failed request at once, so a broken kernel would read as a fast one)."""
    for out in outputs:
        if out.finish_reason == FinishReason.ERROR:
            raise RuntimeError(f"request {out.request_id} failed inside the engine: {out.error}")
    return outputs


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median_time(fn: Callable[[], object], runs: int) -> float:
    return statistics.median(_timed(fn) for _ in range(runs))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory_bandwidth_gbs(megabytes: int = 512, device: torch.device | str = "cpu") -> float:
    """Copy bandwidth counting bytes read plus written, the same way a decode step streams weights."""
    device = torch.device(device)
    if device.type == "cuda":
        megabytes *= 8  # far past the card's L2, so the copy measures its memory
    src = torch.empty(megabytes * 2**20 // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    dst.copy_(src)

    def copy() -> None:
        dst.copy_(src)
        _synchronize(device)

    seconds = median_time(copy, 7)
    return 2 * src.numel() * 4 / seconds / 1e9


def weight_bytes_per_token(llm: LLM) -> int:
    """Bytes of weights a decode step must read: every layer matrix and norm, the final norm and the LM head
    (the embedding table is only gathered by row, so a tied head counts once)."""
    model = llm.engine.model
    total = model.lm_head.nbytes + model.final_norm.numel() * model.final_norm.element_size()
    for layer in model.layers:
        total += sum(lin.nbytes for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
        for t in (layer.input_norm, layer.post_attn_norm, layer.pre_ffn_norm, layer.post_ffn_norm,
                  layer.q_norm, layer.k_norm):
            if t is not None:
                total += t.numel() * t.element_size()
    return total


def where_label(llm: LLM) -> str:
    """How a figure's machine is named beside it: the CPU threads, or the card."""
    device = llm.engine.model.device
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} threads"


def _hf_model(model: str, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path(model), dtype=dtype).to(device).eval()


def _hf_generate(hf, prompts: list[list[int]], new_tokens: int, pad_id: int) -> None:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=hf.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=hf.device)
    with torch.inference_mode():
        hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                    do_sample=False, pad_token_id=pad_id)
    _synchronize(hf.device)


def _progress(label: str, value: object) -> None:
    """Each figure as soon as it is measured, on stderr: a run cut by a time limit (a lent GPU's) still leaves
    what it measured; the table on stdout comes at the end."""
    import sys

    print(f"[engine] {label}: {value}", file=sys.stderr, flush=True)


def _config(device: str, **overrides: object) -> EngineConfig:
    """CPU: the sizes the CPU figures were always taken with. CUDA: room for 256 concurrent requests of up to
    628 tokens (SmolLM2's cache is 23 KB a token) and prompt chunks that fill the card."""
    sizes = (dict(kv_cache_memory="8GiB", max_num_seqs=256, max_num_batched_tokens=8192) if device == "cuda"
             else dict(kv_cache_memory="1GiB", max_num_seqs=64, max_num_batched_tokens=2048))
    return EngineConfig(**{**sizes, **overrides})


def run(quick: bool = False, model: str = DEFAULT_MODEL, concurrent: tuple[int, ...] = (32,),
        runs: int | None = None) -> dict:
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    runs = runs or (1 if quick else 3)
    new_tokens = 32 if quick else 128
    device = EngineConfig().resolved_device().type
    llm = LLM(model, _config(device))
    dtype, where = llm.engine.model.dtype, llm.engine.model.device
    tok = llm.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    greedy = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    results: dict = {"model": model, "dtype": str(dtype).removeprefix("torch."), "new_tokens": new_tokens,
                     "where": where_label(llm), "threads": torch.get_num_threads()}

    # 1. Single stream.
    prompt = llm.encode("Write a long story about a dragon who learns to cook.")
    generated(llm.generate_ids([prompt], greedy))  # warm up
    hearth_single = new_tokens / median_time(lambda: generated(llm.generate_ids([prompt], greedy)), runs)
    _progress("hearth single-stream tok/s", round(hearth_single, 1))
    hf = _hf_model(model, dtype, where)
    _hf_generate(hf, [prompt], 4, pad)
    hf_single = new_tokens / median_time(lambda: _hf_generate(hf, [prompt], new_tokens, pad), runs)
    _progress("transformers single-stream tok/s", round(hf_single, 1))
    bandwidth = memory_bandwidth_gbs(device=where)
    weights = weight_bytes_per_token(llm)
    ceiling = bandwidth * 1e9 / weights
    results["single"] = {"hearth_tok_s": hearth_single, "hf_tok_s": hf_single, "ratio": hearth_single / hf_single,
                         "bandwidth_gbs": bandwidth, "weight_mb": weights / 1e6, "ceiling_tok_s": ceiling,
                         "share_of_ceiling": hearth_single / ceiling}

    # 2. Concurrent requests.
    results["concurrent"] = []
    for count in concurrent:
        prompts = concurrent_prompts(tok, count=8 if quick else count)
        total_out = len(prompts) * new_tokens
        generated(llm.generate_ids(prompts[:8], greedy))  # warm up this batch size's shapes
        hearth_batch = total_out / median_time(lambda p=prompts: generated(llm.generate_ids(p, greedy)), runs)
        _progress(f"hearth {len(prompts)} concurrent tok/s", round(hearth_batch, 1))
        _hf_generate(hf, prompts, 4, pad)
        hf_batched = total_out / median_time(lambda p=prompts: _hf_generate(hf, p, new_tokens, pad), 1)
        _progress(f"transformers batched {len(prompts)} tok/s", round(hf_batched, 1))
        row = {"requests": len(prompts), "hearth_tok_s": hearth_batch, "hf_batched_tok_s": hf_batched,
               "vs_batched": hearth_batch / hf_batched}
        if not results["concurrent"]:  # one-at-a-time transformers once: it is the slowest thing here
            sequential = prompts[:2 if quick else 4]
            hf_serial = len(sequential) * new_tokens / _timed(
                lambda s=sequential: [_hf_generate(hf, [p], new_tokens, pad) for p in s])
            row |= {"hf_serial_tok_s": hf_serial, "vs_serial": hearth_batch / hf_serial}
            _progress("transformers one at a time tok/s", round(hf_serial, 1))
        results["concurrent"].append(row)
    hf = None  # free its weights before the prefix-cache runs
    gc.collect()

    # 3. Prefix caching.
    prefix = text_of_tokens(tok, 1500, seed=42)
    first_token = SamplingParams(max_tokens=1, temperature=0.0)
    cold, warm = [], []
    for trial in range(runs):
        llm.engine.blocks.reset_prefix_cache()
        q1 = text_of_tokens(tok, 20, seed=100 + trial)
        q2 = text_of_tokens(tok, 20, seed=200 + trial)
        cold.append(_timed(lambda q=q1: generated(llm.generate_ids([prefix + q], first_token))))
        warm.append(_timed(lambda q=q2: generated(llm.generate_ids([prefix + q], first_token))))
    ttft_cold, ttft_warm = statistics.median(cold), statistics.median(warm)
    _progress("TTFT cold / warm s", (round(ttft_cold, 4), round(ttft_warm, 4)))

    miss_prompts = concurrent_prompts(tok, count=8 if quick else 32, seed=7)
    short = SamplingParams(max_tokens=new_tokens // 2, temperature=0.0, ignore_eos=True)
    off = LLM.__new__(LLM)
    from inference.engine import LLMEngine

    off.engine = LLMEngine(llm.engine.loaded, _config(device, enable_prefix_caching=False))
    on_times, off_times = [], []
    for _ in range(runs + 2):  # alternate so drift on a shared machine hits both alike
        llm.engine.blocks.reset_prefix_cache()
        on_times.append(_timed(lambda: generated(llm.generate_ids(miss_prompts, short))))
        off_times.append(_timed(lambda: generated(off.generate_ids(miss_prompts, short))))
    miss_tokens = len(miss_prompts) * short.max_tokens
    on_rate, off_rate = miss_tokens / statistics.median(on_times), miss_tokens / statistics.median(off_times)
    results["prefix"] = {"prefix_tokens": len(prefix), "ttft_cold_s": ttft_cold, "ttft_warm_s": ttft_warm,
                         "ttft_speedup": ttft_cold / ttft_warm, "miss_on_tok_s": on_rate,
                         "miss_off_tok_s": off_rate, "miss_ratio": on_rate / off_rate}
    return results


def markdown(r: dict) -> str:
    s, p = r["single"], r["prefix"]
    where = r.get("where", f"{r['threads']} threads")
    where += "" if where.endswith("threads") else ", transformers on the same card"
    lines = [
        f"Model `{r['model']}`, {r['dtype']}, {where}, greedy, {r['new_tokens']} output tokens.",
        "",
        "| benchmark | Hearth | peer | ratio | goal |",
        "| --- | --- | --- | --- | --- |",
        f"| single-stream decode (tok/s) | {s['hearth_tok_s']:.1f} | transformers.generate {s['hf_tok_s']:.1f} "
        f"| {s['ratio']:.2f}× | ≥ 1.5× |",
        f"| physical ceiling (tok/s) | {s['hearth_tok_s']:.1f} | {s['weight_mb']:.0f} MB of weights per token / "
        f"{s['bandwidth_gbs']:.1f} GB/s = {s['ceiling_tok_s']:.1f} | {s['share_of_ceiling']:.0%} of ceiling | — |",
    ]
    for c in r["concurrent"] if isinstance(r["concurrent"], list) else [r["concurrent"]]:
        lines.append(f"| {c['requests']} concurrent requests (tok/s) | {c['hearth_tok_s']:.1f} | transformers "
                     f"batched {c['hf_batched_tok_s']:.1f} | {c['vs_batched']:.2f}× | ≥ 1.5× |")
        if "hf_serial_tok_s" in c:
            lines.append(f"| {c['requests']} concurrent requests (tok/s) | {c['hearth_tok_s']:.1f} | transformers "
                         f"one at a time {c['hf_serial_tok_s']:.1f} | {c['vs_serial']:.2f}× | ≥ 8× |")
    lines += [
        f"| TTFT, shared {p['prefix_tokens']}-token prefix (s) | 2nd request {p['ttft_warm_s']:.3f} | "
        f"1st request {p['ttft_cold_s']:.3f} | {p['ttft_speedup']:.1f}× lower | ≥ 5× |",
        f"| 0%-hit workload, caching on vs off (tok/s) | {p['miss_on_tok_s']:.1f} | {p['miss_off_tok_s']:.1f} "
        f"| {p['miss_ratio']:.3f}× | ≥ 0.97× |",
    ]
    return "\n".join(lines)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--concurrent", type=int, nargs="+", default=[32])
    parser.add_argument("--runs", type=int)
    args = parser.parse_args()
    print(markdown(run(args.quick, args.model, tuple(args.concurrent), args.runs)))


if __name__ == "__main__":
    main()
