"""The fleet's scaling: N CPU engine replicas against one, on a parallel workload.

Many independent requests (distinct prompts, so no replica can reuse another's cache and routing decides only
by load) arrive at once; the figure is output tokens/s over the wall time from the first request sent to the
last answered. Each replica holds 1 CPU and decodes with one torch thread, so N replicas can at best be N times
as fast; what falls short is what the fleet costs (routing, Ray's transport, one driver feeding N replicas) or
what the machine cannot give (memory bandwidth shared by N engines). Configurations alternate, each on freshly
deployed replicas.

    python -m benchmarks.fleet_scaling [--replicas 1 4] [--rounds 2] [--requests 128] [--max-tokens 32]

It needs at least as many free cores as the largest fleet has replicas, plus one for this process: on a 2-core
machine it says so and measures nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from typing import Any

from benchmarks.fleet import MODEL, WORDS

ENGINE = {"dtype": "float32", "device": "cpu", "num_threads": 1, "kv_cache_memory": "1GiB", "max_num_seqs": 32,
          "speculation": "off", "max_num_batched_tokens": 512}


def prompts(tokenizer: Any, n: int, words: int) -> list[list[int]]:
    """n prompts, each opening with its own number and then seeded words: no two share a first cache block."""
    rng = random.Random("fleet-scaling")
    return [tokenizer.encode(f"{i} " + " ".join(rng.choice(WORDS) for _ in range(words)), add_special_tokens=False)
            for i in range(n)]


async def _workload(client: Any, app: str, prompt_ids: list[list[int]], max_tokens: int) -> dict[str, Any]:
    from inference import GenerationRequest, SamplingParams

    async def one(ids: list[int]) -> Any:
        request = GenerationRequest(prompt_token_ids=ids, params=SamplingParams(
            max_tokens=max_tokens, temperature=0, ignore_eos=True))
        return await client.generate(app, request)

    started = time.perf_counter()
    outs = await asyncio.gather(*(one(ids) for ids in prompt_ids))
    wall = time.perf_counter() - started
    output = sum(o.usage.completion_tokens for o in outs)
    if output != len(prompt_ids) * max_tokens:  # a failed or cut request must not be timed as work done
        raise RuntimeError(f"{output} output tokens, expected {len(prompt_ids) * max_tokens}")
    replicas: dict[str, int] = {}
    for o in outs:
        replicas[o.replica] = replicas.get(o.replica, 0) + 1
    return {"wall_s": wall, "output_tokens_per_s": output / wall,
            "total_tokens_per_s": (output + sum(len(ids) for ids in prompt_ids)) / wall,
            "busiest_share": max(replicas.values()) / len(outs), "replicas_used": len(replicas)}


def _deploy(app: str, replicas: int) -> None:
    from ray import serve

    from fleet.app import ModelDeployment, deploy

    for name in list(serve.status().applications):
        serve.delete(name)
    deploy([ModelDeployment(model=app, source=MODEL, replicas=replicas, num_cpus=1.0, engine_settings=ENGINE)])


def run(replica_counts: tuple[int, ...] = (1, 4), rounds: int = 2, requests: int = 128, max_tokens: int = 32,
        prompt_words: int = 60, quick: bool = False) -> dict[str, Any]:
    if quick:
        rounds, requests = 1, 32
    import ray
    from transformers import AutoTokenizer

    from fleet.app import connect
    from fleet.client import FleetClient
    from inference.models.catalog import model_path

    cpus = os.cpu_count() or 1
    largest = max(replica_counts)
    if cpus < largest + 1:
        return {"skipped": f"{largest} replicas need {largest + 1} CPUs (one for this process); this machine has "
                           f"{cpus}"}
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    connect(num_cpus=largest)
    tokenizer = AutoTokenizer.from_pretrained(model_path(MODEL))
    prompt_ids = prompts(tokenizer, requests, prompt_words)
    client = FleetClient()
    runs: dict[int, list[dict[str, Any]]] = {n: [] for n in replica_counts}
    try:
        for i in range(rounds):
            for n in replica_counts:
                app = f"scale-{n}-{i}"
                _deploy(app, n)
                asyncio.run(_workload(client, app, prompt_ids[: 2 * n], 4))  # every replica loaded and warm
                runs[n].append(asyncio.run(_workload(client, app, prompt_ids, max_tokens)))
                print(json.dumps({"replicas": n, "round": i, **runs[n][-1]}), file=sys.stderr, flush=True)
    finally:
        client.close()
        from ray import serve

        serve.shutdown()
        ray.shutdown()
    base = min(replica_counts)
    ratios = {n: [r["output_tokens_per_s"] / b["output_tokens_per_s"] for r, b in zip(runs[n], runs[base],
                                                                                       strict=True)]
              for n in replica_counts}
    median = {n: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for n, rows in runs.items()}
    return {"replica_counts": list(replica_counts), "rounds": rounds, "requests": requests, "max_tokens": max_tokens,
            "prompt_tokens_mean": statistics.fmean(len(p) for p in prompt_ids), "cpus": cpus, "runs": runs,
            "median": median, "ratios": ratios}


def markdown(r: dict[str, Any]) -> str:
    if "skipped" in r:
        return f"Not measured: {r['skipped']}."
    base = min(r["replica_counts"])
    lines = [
        f"{r['requests']} requests at once, distinct prompts of ~{r['prompt_tokens_mean']:.0f} tokens, "
        f"{r['max_tokens']} output tokens each (greedy, ignore_eos); SmolLM2-135M fp32, each replica 1 CPU "
        f"(torch 1 thread) behind HearthRouter on a local Ray, {r['cpus']} CPUs on the machine; fresh replicas per "
        f"configuration, {r['rounds']} alternating rounds, medians; ratios are per round against {base} replica"
        f"{'s' if base > 1 else ''} of the same round.",
        "",
        "| replicas | output tok/s | total tok/s | wall (s) | busiest replica's share | ratio [rounds] | per replica |",
        "| --- | --- | --- | --- | --- | --- | --- |"]
    for n in r["replica_counts"]:
        m, ratios = r["median"][n], r["ratios"][n]
        ratio = statistics.median(ratios)
        lines.append(f"| {n} | {m['output_tokens_per_s']:.1f} | {m['total_tokens_per_s']:.1f} | {m['wall_s']:.1f} | "
                     f"{m['busiest_share']:.0%} | {ratio:.2f}x [{min(ratios):.2f}-{max(ratios):.2f}] | "
                     f"{ratio / (n / base):.0%} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    result = run(tuple(args.replicas), args.rounds, args.requests, args.max_tokens)
    print(markdown(result))
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}))


if __name__ == "__main__":
    main()
