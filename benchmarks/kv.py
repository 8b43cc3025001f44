"""KV compression benchmark (issue: KV-cache compression): quality vs rate, and throughput at a fixed KV budget.

    python -m benchmarks.kv [--quick] [--throughput-only]

Quality: `inference.eval.kv` on Qwen2.5-Coder-0.5B, contexts of 1-4k tokens, rates 1-64, per-head variable
eviction against the uniform and recent-only baselines.

Throughput: the same long-prompt requests through an engine whose KV pool holds only a few uncompressed
sequences, at compression 1×, 8× and 64×: the most sequences in flight at once and total tokens/s (prompt and
output tokens over wall time, and output tokens alone). The same prompts are also prefilled alone (one output
token each): compression frees memory for decoding but cannot shorten prefill, so 1×'s wall time over that
prefill time bounds what any compression rate can gain in total tok/s on the machine at hand.
"""

from __future__ import annotations

import os
import random
import time

import torch

from benchmarks.engine import generated, where_label
from inference import LLM, EngineConfig, GenerationRequest, SamplingParams
from inference.compression import EvictionMethod, KVCompressionSettings
from inference.eval.kv import METHODS, RATES, build_items, evaluate
from inference.eval.kv import markdown as eval_markdown

QUALITY_MODEL = "@hearth/qwen2.5-coder-0.5b-instruct"
THROUGHPUT_MODEL = "@hearth/smollm2-135m-instruct"


def _throughput(rate: float, prompts: list[list[int]], new_tokens: int, budget: str) -> dict:
    chunk = 8192 if torch.cuda.is_available() else 2048
    llm = LLM(THROUGHPUT_MODEL, EngineConfig(kv_cache_memory=budget, max_num_batched_tokens=chunk,
                                             max_num_seqs=256, enable_prefix_caching=False))
    engine = llm.engine
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    settings = KVCompressionSettings(rate=rate)
    start = time.perf_counter()
    for p in prompts:
        engine.add_request(GenerationRequest(p, params, kv_compression=settings))
    peak, done, output_tokens = 0, 0, 0
    decode_seconds, decode_tokens, batch_sizes = 0.0, 0, []
    while engine.has_unfinished():
        prefilling = {id(s): s.num_computed for s in engine.scheduler.running + engine.scheduler.waiting
                      if s.num_computed < s.prompt_len}
        step_start = time.perf_counter()
        outputs = generated(engine.step())
        step_seconds = time.perf_counter() - step_start
        emitted = sum(len(o.delta_token_ids) for o in outputs)
        seqs = engine.scheduler.running + engine.scheduler.waiting
        if all(prefilling.get(id(s), s.num_computed) == s.num_computed for s in seqs if id(s) in prefilling):
            # No prompt token was computed this step: it is pure decoding, the part memory limits.
            decode_seconds += step_seconds
            decode_tokens += emitted
            batch_sizes.append(emitted)
        for out in outputs:
            if out.finished:
                done += 1
                output_tokens += len(out.token_ids)
        peak = max(peak, len(engine.scheduler.running))
    seconds = time.perf_counter() - start
    prompt_tokens = sum(len(p) for p in prompts)
    return {"rate": rate, "where": where_label(llm), "peak_in_flight": peak, "seconds": seconds, "completed": done,
            "output_tok_s": output_tokens / seconds, "total_tok_s": (prompt_tokens + output_tokens) / seconds,
            "decode_tok_s": decode_tokens / decode_seconds if decode_seconds else 0.0,
            "mean_decode_batch": sum(batch_sizes) / len(batch_sizes) if batch_sizes else 0.0,
            "blocks": engine.blocks.num_blocks, "preemptions": engine.metrics().preemptions_total}


def run(quick: bool = False, quality: bool = True) -> dict:
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    throughput = _throughput_rows(quick)
    if not quality:
        return throughput
    llm = LLM(QUALITY_MODEL, EngineConfig(kv_cache_memory="2GiB", max_num_batched_tokens=2048,
                                          kv_min_prompt_tokens=128))
    lengths = [1000, 2000] if quick else [1000, 2000, 3000, 4000]
    tokenizer = llm.tokenizer
    items = build_items(4 if quick else 48, lengths, lambda text: len(tokenizer.encode(text)))
    rates = [1, 8, 32] if quick else list(RATES)
    methods = [EvictionMethod.VARIABLE, EvictionMethod.UNIFORM] if quick else list(METHODS)
    start = time.perf_counter()
    scores = evaluate(llm, items, rates, methods)
    scores["seconds"] = time.perf_counter() - start
    scores["dtype"] = str(llm.engine.config.resolved_dtype()).split(".")[-1]
    return {"quality": scores, **throughput}


def _throughput_rows(quick: bool) -> dict:
    rng = random.Random(0)
    if torch.cuda.is_available():
        # A card decodes a handful of sequences in the time of its kernel launches: only a pool of many
        # sequences makes the step read enough cache for memory to be what limits it.
        count, length, new_tokens = (64, 1500, 64) if quick else (256, 2500, 128)
        budget = "1GiB" if quick else "4GiB"  # about 64 uncompressed sequences
    else:
        count, length, new_tokens = (6, 1500, 32) if quick else (16, 2500, 256)
        budget = "128MiB" if quick else "224MiB"  # about four uncompressed sequences
    vocab_low, vocab_high = 1000, 40000  # ordinary word pieces of SmolLM2's vocabulary
    prompts = [[rng.randrange(vocab_low, vocab_high) for _ in range(length + rng.randrange(0, 500))]
               for _ in range(count)]
    rows = [_throughput(rate, prompts, new_tokens, budget) for rate in (1.0, 8.0, 64.0)]
    prefill = _throughput(1.0, prompts, 1, budget)
    return {"throughput": rows, "requests": count, "prompt_tokens": length, "new_tokens": new_tokens,
            "budget": budget, "prefill_seconds": prefill["seconds"]}


def markdown(r: dict) -> str:
    lines = _quality_markdown(r["quality"]) if "quality" in r else []
    return "\n".join(lines + _throughput_markdown(r))


def _quality_markdown(q: dict) -> list[str]:
    return [f"Quality: `python -m inference.eval.kv`, {q['items']} items ({', '.join(q['kinds'])}), "
             f"Qwen2.5-Coder-0.5B {q.get('dtype', 'bf16')}, greedy; {q['seconds']:.0f} s. QA score: share of asked facts each "
             "answer states (multi items ask for two); agreement: share of the positions of the full-cache "
             "continuation where the compressed cache, fed that continuation, picks the same next token; run "
             "before first miss: the share it reproduces before its first different pick.", "", eval_markdown(q), ""]


def _throughput_markdown(r: dict) -> list[str]:
    base = r["throughput"][0]
    lines = [f"Throughput: {r['requests']} requests of {r['prompt_tokens']}–{r['prompt_tokens'] + 500} prompt "
              f"tokens and {r['new_tokens']} output tokens, SmolLM2-135M, KV pool {r['budget']}, greedy, "
              f"{base.get('where', 'CPU')}.", "",
              "| compression | peak sequences in flight | total tok/s (ratio) | output tok/s | decode-step tok/s "
              "(ratio) | mean decode batch | preemptions |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in r["throughput"]:
        lines.append(f"| {row['rate']:g}× | {row['peak_in_flight']} | {row['total_tok_s']:.0f} "
                     f"({row['total_tok_s'] / base['total_tok_s']:.2f}×) | {row['output_tok_s']:.1f} | "
                     f"{row['decode_tok_s']:.1f} ({row['decode_tok_s'] / base['decode_tok_s']:.2f}×) | "
                     f"{row['mean_decode_batch']:.1f} | {row['preemptions']} |")
    lines += ["", "Total tok/s counts prompt and output tokens over the wall time; decode-step tok/s counts the "
              "tokens of steps that computed no prompt token, over those steps' time."]
    if "prefill_seconds" in r:
        bound = base["seconds"] / r["prefill_seconds"]
        lines += ["", f"Prefill alone (the same prompts, one output token each, 1×) took {r['prefill_seconds']:.1f} s "
                  f"against {base['seconds']:.1f} s for the 1× run: even if decoding took no time, total tok/s could "
                  f"rise at most {bound:.2f}× on this machine, whatever the compression rate."]
    return lines


if __name__ == "__main__":
    import sys

    print(markdown(run(quick="--quick" in sys.argv, quality="--throughput-only" not in sys.argv)))
