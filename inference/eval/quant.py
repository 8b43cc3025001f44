"""What weight quantization costs in quality, against the same model in fp32 (no downloads).

    python -m inference.eval.quant [--model NAME] [--variants float32:int8,bfloat16:none,...] [--tokens 128]
                                   [--json FILE]

Two measures, each against the fp32 model without quantization (the reference):
- perplexity on fixed texts (prose, technical prose, Python; written for this evaluation, so no model saw them
  in training): each text is fed token by token after its first token (teacher forcing) and every position's
  log-probability of the true next token is averaged.
- greedy agreement on chat prompts: the reference answers each greedily; every variant is then fed that answer
  and scored on the share of positions where its own greedy choice is the reference's token, and on the share
  it reproduces before its first different choice (what a free-running answer would keep).
Everything runs through the public engine (LLM, forced_output, logprobs), as a served model would.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Sequence

from inference import LLM, EngineConfig, GenerationRequest, SamplingParams
from inference.eval.kv import agreement_scores

DEFAULT_MODEL = "@hearth/smollm2-135m-instruct"
REFERENCE = ("float32", "none")
VARIANTS = (("float32", "int8"), ("bfloat16", "none"), ("bfloat16", "int8"))

TEXTS = [
    # Prose.
    "The ferry left the harbour an hour late, as it did most mornings in winter. Along the rail a few passengers "
    "watched the town shrink behind them: the church with its green copper roof, the row of warehouses that had "
    "become flats, the hill where the old signal station still stood. A woman in a yellow coat was reading a "
    "letter for the third time, folding it and unfolding it as if the words might change. Two boys argued about "
    "whether the gulls followed the boat for the bread or for the wind it made. Below deck the engine settled "
    "into its long, even rhythm, and the smell of diesel and coffee mixed in the narrow passage by the stairs. "
    "By the time the island came into view the fog had lifted, and the cliffs showed their layers of grey and "
    "rust, each one a few thousand years of mud pressed into stone. The captain sounded the horn twice. Nobody "
    "on the pier waved back, but a dog ran the length of the jetty and barked until the ropes were tied.",
    # Technical prose.
    "A hash table stores key and value pairs in an array of buckets. To insert a pair, the table computes a "
    "hash of the key, reduces it modulo the number of buckets, and places the pair in that bucket. Two keys may "
    "land in the same bucket; this is called a collision. Separate chaining keeps a short list in every bucket, "
    "while open addressing probes other buckets in a fixed order until it finds a free one. The load factor is "
    "the number of stored pairs divided by the number of buckets. When it grows past a threshold, typically "
    "between one half and three quarters for open addressing, the table allocates a larger array and inserts "
    "every pair again, which keeps lookups close to constant time on average. A good hash function spreads keys "
    "evenly, is cheap to compute and, for tables exposed to untrusted input, is keyed with a random seed so that "
    "an attacker cannot choose keys that all collide.",
    # Code.
    "import heapq\n\n\ndef shortest_paths(graph, source):\n    \"\"\"Dijkstra's algorithm: the distance from "
    "source to every node reachable from it.\n\n    graph maps a node to a list of (neighbour, weight) pairs with "
    "non-negative weights.\n    \"\"\"\n    distance = {source: 0}\n    queue = [(0, source)]\n    done = set()\n"
    "    while queue:\n        d, node = heapq.heappop(queue)\n        if node in done:\n            continue\n"
    "        done.add(node)\n        for neighbour, weight in graph.get(node, []):\n            candidate = d + "
    "weight\n            if candidate < distance.get(neighbour, float(\"inf\")):\n                distance[neighbour] "
    "= candidate\n                heapq.heappush(queue, (candidate, neighbour))\n    return distance\n\n\n"
    "if __name__ == \"__main__\":\n    roads = {\"a\": [(\"b\", 4), (\"c\", 1)], \"c\": [(\"b\", 2), (\"d\", 7)], "
    "\"b\": [(\"d\", 1)]}\n    print(shortest_paths(roads, \"a\"))\n",
]

PROMPTS = [
    "Explain in a few paragraphs why the sky is blue.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main differences between a list and a tuple in Python? Give examples.",
    "Give me five tips for keeping houseplants healthy in winter.",
    "Describe how a bicycle's gears make climbing hills easier.",
    "Write a Python function that checks whether a string is a palindrome, and explain it.",
    "Summarise the water cycle for a ten-year-old.",
    "What should I consider when choosing a laptop for programming?",
]


def perplexity(llm: LLM, texts: Sequence[str]) -> float:
    """exp of the mean negative log-likelihood of every token after each text's first, over all texts."""
    requests = []
    for text in texts:
        ids = llm.encode(text, raw=True)
        params = SamplingParams(max_tokens=len(ids) - 1, temperature=0.0, ignore_eos=True, logprobs=0)
        requests.append(GenerationRequest(ids[:1], params, forced_output=ids[1:]))
    logprobs = [lp.logprob for out in llm.generate_requests(requests) for lp in out.all_logprobs or []]
    return math.exp(-statistics.fmean(logprobs))


def greedy_answers(llm: LLM, prompts: Sequence[str], tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0)
    return [list(out.token_ids) for out in llm.chat([[{"role": "user", "content": p}] for p in prompts], params)]


def agreement(llm: LLM, prompts: Sequence[str], answers: Sequence[list[int]]) -> tuple[float, float]:
    """Mean (next-token agreement, run before the first miss) of this model fed the reference's answers."""
    requests = [GenerationRequest(llm.encode(messages=[{"role": "user", "content": p}]),
                                  SamplingParams(max_tokens=len(a), temperature=0.0, ignore_eos=True, logprobs=1),
                                  forced_output=a)
                for p, a in zip(prompts, answers, strict=True)]
    scores = [agreement_scores(a, [lp.top[0][0] for lp in out.all_logprobs or []])
              for a, out in zip(answers, llm.generate_requests(requests), strict=True)]
    return statistics.fmean(s[0] for s in scores), statistics.fmean(s[1] for s in scores)


def weight_bytes(llm: LLM) -> int:
    model = llm.engine.model
    return model.lm_head.nbytes + sum(lin.nbytes for layer in model.layers
                                      for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))


def evaluate(model: str, variants: Sequence[tuple[str, str]], tokens: int = 128,
             texts: Sequence[str] = tuple(TEXTS), prompts: Sequence[str] = tuple(PROMPTS)) -> dict:
    rows = []
    answers: list[list[int]] = []
    for dtype, quantization in [REFERENCE, *variants]:
        start = time.perf_counter()
        llm = LLM(model, EngineConfig(dtype=dtype, quantization=quantization, speculation="off"))
        if not answers:
            answers = greedy_answers(llm, prompts, tokens)
        same = sum(a == b for a, b in zip(answers, greedy_answers(llm, prompts, tokens), strict=True))
        agree, run = agreement(llm, prompts, answers)
        rows.append({"dtype": dtype, "quantization": quantization, "weight_bytes": weight_bytes(llm),
                     "perplexity": perplexity(llm, texts), "agreement": agree, "first_miss": run,
                     "identical_answers": same, "seconds": time.perf_counter() - start})
        del llm
    return {"model": model, "tokens": tokens, "prompts": len(prompts), "texts": len(texts), "rows": rows}


def markdown(result: dict) -> str:
    ref = result["rows"][0]
    lines = [f"`{result['model']}`; perplexity over {result['texts']} fixed texts (inference/eval/quant.py); greedy "
             f"agreement on {result['prompts']} chat prompts of up to {result['tokens']} tokens, against "
             "float32 without quantization.", "",
             "| dtype | weights | linear-layer weight bytes | perplexity (vs fp32) | next-token agreement | run before "
             "first miss | identical answers |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in result["rows"]:
        lines.append(f"| {row['dtype']} | {row['quantization']} | {row['weight_bytes'] / 1e6:.0f} MB | "
                     f"{row['perplexity']:.3f} ({row['perplexity'] / ref['perplexity']:.3f}×) | "
                     f"{row['agreement']:.3f} | {row['first_miss']:.3f} | {row['identical_answers']} of "
                     f"{result['prompts']} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--variants", default=",".join(f"{d}:{q}" for d, q in VARIANTS),
                        help="dtype:quantization pairs, compared with float32:none")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--json", help="write the results here as JSON")
    args = parser.parse_args(argv)
    variants = [tuple(v.split(":", 1)) for v in args.variants.split(",") if v]
    result = evaluate(args.model, variants, args.tokens)  # type: ignore[arg-type]
    print(markdown(result))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
