"""Speculative decoding benchmark (issue: speculative decoding), same prompts, same run, greedy.

    python -m benchmarks.speculation [--quick]
    python -m benchmarks.speculation --no-draft   (everything but the 1.5B draft-model rows)
    python -m benchmarks.speculation --chat-only [--runs N]   (the must-not-cost rows alone, N alternating runs)
    python -m benchmarks.speculation --step-cost   (decode-step time against tokens per step, 32 sequences)
    python -m benchmarks.speculation --step-grid MODEL   (step time for 1-64 sequences x k = 0-8 pinned drafts)

Rows: prompt lookup vs no speculation (Qwen2.5-Coder-0.5B and SmolLM2-135M) on input-grounded tasks; the
1.5B target with the 0.5B draft vs the 1.5B alone (when `make models-extra` installed it); open-ended chat
with the adaptive default; 32 concurrent requests; and transformers' own prompt lookup and assisted
generation on the same prompts. Each Hearth pair alternates runs (off, on, off, on, ...) and takes medians,
so drift on a shared machine hits both sides alike.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from benchmarks.engine import generated, where_label
from benchmarks.spec_tasks import GROUNDED, OPEN_CHAT
from inference import LLM, EngineConfig, GenerationRequest, SamplingParams
from inference.config import default_dtype
from inference.models.catalog import model_path
from inference.spec.drafter import Draft, DraftRequest
from inference.spec.settings import SpecMode, SpeculationSettings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
QWEN = "@hearth/qwen2.5-coder-0.5b-instruct"
QWEN_15 = "@hearth/qwen2.5-coder-1.5b-instruct"
SMOLLM = "@hearth/smollm2-135m-instruct"
K = 8


def _generate(llm: LLM, prompts: list[list[int]], params: SamplingParams,
              spec: SpeculationSettings | None) -> tuple[float, list]:
    engine = llm.engine
    requests = [GenerationRequest(p, params, speculation=spec) for p in prompts]
    start = time.perf_counter()
    for r in requests:
        engine.add_request(r)
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return time.perf_counter() - start, [done[r.request_id] for r in requests]


def _pair(llm: LLM, prompts: list[list[int]], params: SamplingParams, spec: SpeculationSettings | None,
          runs: int) -> dict:
    """Tokens/s without and with speculation over `runs` pairs of runs; acceptance from the last run.

    The order inside a pair alternates (off/on, then on/off), so whatever favours the first or the second run
    of a pair (caches, clocks) cancels; the ratio is the median of the per-pair ratios, and the spread is their
    range."""
    _generate(llm, prompts, params, None)  # warm up
    base_t, spec_t, ratios = [], [], []
    off = SpeculationSettings(SpecMode.OFF)
    for i in range(runs):
        if i % 2 == 0:
            t_base, base = _generate(llm, prompts, params, off)
            t_spec, with_spec = _generate(llm, prompts, params, spec)
        else:
            t_spec, with_spec = _generate(llm, prompts, params, spec)
            t_base, base = _generate(llm, prompts, params, off)
        base_t.append(t_base)
        spec_t.append(t_spec)
        ratios.append(sum(len(o.token_ids) for o in with_spec) / t_spec
                      / (sum(len(o.token_ids) for o in base) / t_base))
    base_tokens = sum(len(o.token_ids) for o in base)
    spec_tokens = sum(len(o.token_ids) for o in with_spec)
    proposed = sum((o.speculation or {}).get("proposed", 0) for o in with_spec)
    accepted = sum((o.speculation or {}).get("accepted", 0) for o in with_spec)
    steps = sum((o.speculation or {}).get("steps", 0) for o in with_spec)
    base_rate = base_tokens / statistics.median(base_t)
    spec_rate = spec_tokens / statistics.median(spec_t)
    return {"base_tok_s": base_rate, "spec_tok_s": spec_rate, "ratio": statistics.median(ratios),
            "ratio_min": min(ratios), "ratio_max": max(ratios), "pairs": runs,
            "base_tokens": base_tokens, "spec_tokens": spec_tokens, "proposed": proposed, "accepted": accepted,
            "steps": steps,
            "acceptance": accepted / proposed if proposed else 0.0,
            "mean_accepted": accepted / steps if steps else 0.0,
            "same_tokens": [o.token_ids for o in base] == [o.token_ids for o in with_spec]}


def _overall(rows: list[dict], drafter: str) -> dict:
    """All tasks of a drafter as one workload: total tokens over total (median) time, each side."""
    base_tokens = sum(r["base_tokens"] for r in rows)
    spec_tokens = sum(r["spec_tokens"] for r in rows)
    base_rate = base_tokens / sum(r["base_tokens"] / r["base_tok_s"] for r in rows)
    spec_rate = spec_tokens / sum(r["spec_tokens"] / r["spec_tok_s"] for r in rows)
    proposed, accepted, steps = (sum(r[key] for r in rows) for key in ("proposed", "accepted", "steps"))
    return {"model": rows[0]["model"], "workload": "grounded: all of the above", "drafter": drafter,
            "base_tok_s": base_rate, "spec_tok_s": spec_rate, "ratio": spec_rate / base_rate,
            "acceptance": accepted / proposed if proposed else 0.0, "mean_accepted": accepted / steps if steps else 0.0}


def _hf_rates(name: str, prompts: list[list[int]], new_tokens: int, assistant: str | None) -> dict:
    from transformers import AutoModelForCausalLM

    dtype = default_dtype("cpu")  # what the engine runs in on this CPU, so both sides compare alike
    model = AutoModelForCausalLM.from_pretrained(model_path(name), dtype=dtype).eval()
    helper = (AutoModelForCausalLM.from_pretrained(model_path(assistant), dtype=dtype).eval()
              if assistant else None)

    def run(**kwargs) -> float:
        tokens, seconds = 0, 0.0
        for p in prompts:
            ids = torch.tensor([p])
            start = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                     do_sample=False, **kwargs)
            seconds += time.perf_counter() - start
            tokens += out.shape[1] - ids.shape[1]
        return tokens / seconds

    run()
    plain = run()
    lookup = run(prompt_lookup_num_tokens=K)
    result = {"plain_tok_s": plain, "lookup_tok_s": lookup}
    if helper is not None:
        result["assisted_tok_s"] = run(assistant_model=helper)
    return result


def run(quick: bool = False, draft: bool = True) -> dict:
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    runs = 1 if quick else 2
    # Ratios near 1 (open chat, a full batch) need more pairs than the clear wins before noise stops deciding
    # their sign.
    close_runs = 1 if quick else 6
    new_tokens = 48 if quick else 128
    greedy = SamplingParams(max_tokens=new_tokens, temperature=0.0)
    ngram = SpeculationSettings(SpecMode.NGRAM, K)
    results: dict = {"new_tokens": new_tokens, "k": K, "rows": [], "dtype": str(default_dtype("cpu")).split(".")[-1]}
    tasks = GROUNDED[:2] if quick else GROUNDED
    chats = OPEN_CHAT[:1] if quick else OPEN_CHAT

    for name in (QWEN, SMOLLM):
        llm = LLM(name, EngineConfig(kv_cache_memory="1GiB", speculation="ngram", num_speculative_tokens=K))
        encode = [llm.encode(messages=[{"role": "user", "content": p}]) for _, p in tasks]
        for (task, _), ids in zip(tasks, encode, strict=True):
            results["rows"].append({"model": name, "workload": f"grounded: {task}", "drafter": "prompt lookup",
                                    **_pair(llm, [ids], greedy, ngram, runs)})
        if name == QWEN:
            for task, prompt in chats:
                ids = llm.encode(messages=[{"role": "user", "content": prompt}])
                results["rows"].append({"model": name, "workload": f"open chat: {task}",
                                        "drafter": "prompt lookup (adaptive)",
                                        **_pair(llm, [ids], greedy, None, close_runs)})
            batch = [llm.encode(messages=[{"role": "user", "content": p}]) for _, p in (GROUNDED + OPEN_CHAT)]
            batch = (batch * 8)[: 8 if quick else 32]
            results["rows"].append({"model": name, "workload": f"{len(batch)} concurrent (mixed)",
                                    "drafter": "prompt lookup (adaptive)",
                                    **_pair(llm, batch, greedy, None, close_runs)})
            results["hf_qwen"] = _hf_rates(QWEN, encode[:2], new_tokens, None)
        del llm

    if not draft:
        results["draft_skipped"] = True
    elif (model_path(QWEN_15) / "config.json").exists():
        draft = SpeculationSettings(SpecMode.DRAFT, K)
        for lookup_first, label in ((False, "0.5B draft"), (True, "0.5B draft, lookup first (default)")):
            llm = LLM(QWEN_15, EngineConfig(kv_cache_memory="1GiB", draft_model=QWEN, num_speculative_tokens=K,
                                            draft_lookup_first=lookup_first))
            encode = [llm.encode(messages=[{"role": "user", "content": p}]) for _, p in tasks]
            rows = [{"model": QWEN_15, "workload": f"grounded: {task}", "drafter": label,
                     **_pair(llm, [ids], greedy, draft, runs)} for (task, _), ids in zip(tasks, encode, strict=True)]
            results["rows"] += rows + [_overall(rows, label)]
            del llm
        results["hf_qwen15"] = _hf_rates(QWEN_15, encode[:1], new_tokens, QWEN)
    else:
        results["qwen15_missing"] = True
    return results


def _spread(row: dict) -> str:
    if "ratio_min" not in row:  # a workload summed over tasks
        return "–"
    return f"{row['ratio_min']:.2f}–{row['ratio_max']:.2f} ({row['pairs']})"


def markdown(r: dict) -> str:
    lines = [f"Greedy, {r['new_tokens']} output tokens, k = {r['k']}, single stream unless noted; "
             f"{r.get('dtype', 'bfloat16')} on CPU. Ratio: the median over pairs of runs (off/on, then on/off) of tokens/s with speculation "
             "over without, same prompts; its range over the pairs beside it. tok/s columns: median runs.", "",
             "| model | workload | drafter | no spec (tok/s) | spec (tok/s) | ratio | range (pairs) | acceptance "
             "| mean accepted |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in r["rows"]:
        lines.append(f"| {row['model'].split('/')[-1]} | {row['workload']} | {row['drafter']} | "
                     f"{row['base_tok_s']:.1f} | {row['spec_tok_s']:.1f} | {row['ratio']:.2f}× | {_spread(row)} | "
                     f"{row['acceptance']:.2f} | {row['mean_accepted']:.2f} |")
    hf = r.get("hf_qwen")
    if hf:
        lines += ["", f"transformers on the first two grounded prompts (Qwen2.5-Coder-0.5B): plain "
                  f"{hf['plain_tok_s']:.1f} tok/s, prompt_lookup_num_tokens={r['k']} {hf['lookup_tok_s']:.1f} tok/s "
                  f"({hf['lookup_tok_s'] / hf['plain_tok_s']:.2f}×)."]
    hf15 = r.get("hf_qwen15")
    if hf15:
        lines += [f"transformers, Qwen2.5-Coder-1.5B on the first grounded prompt: plain {hf15['plain_tok_s']:.1f} "
                  f"tok/s, assisted generation with the 0.5B {hf15['assisted_tok_s']:.1f} tok/s "
                  f"({hf15['assisted_tok_s'] / hf15['plain_tok_s']:.2f}×)."]
    if r.get("qwen15_missing"):
        lines += ["", "Qwen2.5-Coder-1.5B is not installed (`make models-extra`): the draft-model rows are missing."]
    return "\n".join(lines)


def chat_rows(runs: int) -> dict:
    """Only the rows where speculation must not cost: open-ended chat and 32 concurrent requests, with more
    alternating runs than the full benchmark takes (their ratios sit near 1, where noise decides the sign)."""
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    greedy = SamplingParams(max_tokens=128, temperature=0.0)
    llm = LLM(QWEN, EngineConfig(kv_cache_memory="1GiB", speculation="ngram", num_speculative_tokens=K))
    results: dict = {"new_tokens": 128, "k": K, "rows": [], "dtype": str(default_dtype("cpu")).split(".")[-1]}
    for task, prompt in OPEN_CHAT:
        ids = llm.encode(messages=[{"role": "user", "content": prompt}])
        results["rows"].append({"model": QWEN, "workload": f"open chat: {task}", "drafter": "prompt lookup (adaptive)",
                                **_pair(llm, [ids], greedy, None, runs)})
    batch = [llm.encode(messages=[{"role": "user", "content": p}]) for _, p in (GROUNDED + OPEN_CHAT)]
    results["rows"].append({"model": QWEN, "workload": "32 concurrent (mixed)", "drafter": "prompt lookup (adaptive)",
                            **_pair(llm, (batch * 8)[:32], greedy, None, runs)})
    return results


def step_cost(rounds: int = 2) -> dict:
    """What a verified draft token costs in a full batch: the 32-concurrent workload with the batch gate lifted
    and half the sequences (the grounded ones) drafting k = 8, timing every decode step against the tokens it
    computed. Where the step time grows in proportion to its tokens, a draft token costs as much as the token it
    might save and speculation can only lose."""
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    llm = LLM(QWEN, EngineConfig(kv_cache_memory="1GiB", speculation="ngram", num_speculative_tokens=K,
                                 spec_max_batch=64, spec_min_acceptance=0.0))
    engine, scheduler = llm.engine, llm.engine.scheduler
    prompts = [llm.encode(messages=[{"role": "user", "content": p}]) for _, p in (GROUNDED + OPEN_CHAT)]
    prompts = (prompts * 8)[:32]
    schedule, planned = scheduler.schedule, {}

    def recording_schedule():
        plan = schedule()
        planned.update(tokens=sum(c.num_tokens for c in plan.chunks), seqs=len(plan.chunks),
                       prefill=any(c.num_draft == 0 and c.num_tokens > 1 for c in plan.chunks))
        return plan

    scheduler.schedule = recording_schedule
    params = SamplingParams(max_tokens=128, temperature=0.0)
    off, ngram = SpeculationSettings(SpecMode.OFF), SpeculationSettings(SpecMode.NGRAM, K)
    steps: dict[int, list[float]] = {}
    _generate(llm, prompts, params, off)  # warm up
    for _ in range(rounds):
        for n, p in enumerate(prompts):
            engine.add_request(GenerationRequest(p, params, speculation=ngram if n % 8 < 4 else off))
        while engine.has_unfinished():
            start = time.perf_counter()
            engine.step()
            seconds = time.perf_counter() - start
            if planned.get("seqs", 0) >= 28 and not planned["prefill"]:
                steps.setdefault(planned["tokens"] // 16 * 16, []).append(seconds)
    return {"buckets": [{"tokens": f"{n}–{n + 15}", "steps": len(v), "ms": 1000 * statistics.median(v),
                         "ms_per_token": 1000 * statistics.median(v) / (n + 8)}
                        for n, v in sorted(steps.items()) if len(v) >= 3]}


class _PinnedDrafter:
    """Proposes exactly k tokens (the sequence's last token repeated) every step. What verifying a draft costs does
    not depend on whether it is accepted, so the step-cost grid pins the draft length instead of letting
    acceptance (noise, with random weights) decide it."""

    name = "pinned"

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        return [Draft([int(r.token_ids[-1])] * r.k) for r in requests]

    def release(self, seq_id: str) -> None:
        pass


def step_cost_grid(model: str = SMOLLM, batches: tuple[int, ...] = (1, 4, 16, 64),
                   ks: tuple[int, ...] = (0, 1, 2, 4, 8), new_tokens: int = 24) -> dict:
    """Decode-step time for every (sequences decoding, draft tokens each): each step computes batch x (1 + k)
    tokens. Read a row as the price of k drafts at that batch size: speculation gains where the tokens a step
    keeps (1 + accepted) outgrow the step's cost over the plain step's."""
    llm = LLM(model, EngineConfig(kv_cache_memory="2GiB", speculation="ngram", num_speculative_tokens=max(ks),
                                  spec_max_batch=max(batches), spec_min_acceptance=0.0,
                                  max_num_seqs=max(batches)))
    engine = llm.engine
    engine.spec.drafters[SpecMode.NGRAM] = _PinnedDrafter()
    engine.spec.policy.adaptive_k = False  # no adaptive shortening: the grid sets k
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in batches:
        prompts = [torch.randint(1000, 20000, (128,), generator=gen).tolist() for _ in range(batch)]
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        times: dict[int, float] = {}
        for k in ks:
            spec = SpeculationSettings(SpecMode.NGRAM, k) if k else SpeculationSettings(SpecMode.OFF)
            steps: list[float] = []
            for _ in range(2):  # the first pass warms this shape up (on CUDA: Triton's compiles)
                steps = []
                for p in prompts:
                    engine.add_request(GenerationRequest(p, params, speculation=spec))
                while engine.has_unfinished():
                    running = engine.scheduler.running
                    decoding = (len(running) == batch and not engine.scheduler.waiting
                                and all(s.num_computed >= s.prompt_len for s in running))
                    start = time.perf_counter()
                    generated(engine.step())
                    if decoding:
                        steps.append(time.perf_counter() - start)
            times[k] = statistics.median(steps)
        rows.append({"batch": batch, "ms": {k: 1000 * t for k, t in times.items()},
                     "ratio": {k: t / times[0] for k, t in times.items()}})
    return {"model": model, "where": where_label(llm), "dtype": str(llm.engine.model.dtype).split(".")[-1],
            "ks": list(ks), "rows": rows}


def step_cost_markdown(r: dict) -> str:
    ks = r["ks"]
    lines = [f"{r['model']}, {r['dtype']}, {r['where']}: median decode-step time with every sequence drafting k "
             "tokens (pinned), relative to the plain step (k = 0).", "",
             "| sequences | plain step (ms) | " + " | ".join(f"k = {k}" for k in ks if k) + " |",
             "| --- | --- | " + " | ".join("---" for k in ks if k) + " |"]
    for row in r["rows"]:
        lines.append(f"| {row['batch']} | {row['ms'][0]:.2f} | "
                     + " | ".join(f"{row['ratio'][k]:.2f}× ({row['ms'][k]:.2f})" for k in ks if k) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    if "--step-grid" in sys.argv:
        print(step_cost_markdown(step_cost_grid(sys.argv[sys.argv.index("--step-grid") + 1])))
    elif "--step-cost" in sys.argv:
        print("| tokens in the step | steps | median step (ms) | ms per token |\n| --- | --- | --- | --- |")
        for b in step_cost()["buckets"]:
            print(f"| {b['tokens']} | {b['steps']} | {b['ms']:.0f} | {b['ms_per_token']:.2f} |")
    elif "--chat-only" in sys.argv:
        print(markdown(chat_rows(runs=int(sys.argv[sys.argv.index("--runs") + 1]) if "--runs" in sys.argv else 5)))
    else:
        print(markdown(run(quick="--quick" in sys.argv, draft="--no-draft" not in sys.argv)))
