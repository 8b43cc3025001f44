"""Long-context quality under KV compression: a self-generated evaluation (no downloads).

    python -m inference.eval.kv [--model NAME] [--items N] [--rates 1,2,4,...] [--methods variable,uniform,recent]
                                [--lengths 1000,2000,4000] [--short] [--json FILE]

Items are built from a seeded generator: filler prose with facts planted at random depths.
- lookup: several "access code" key-value pairs; the question asks for one of them.
- needle: several "secret word" needles; the question asks for one.
- multi: the question asks for two of the key-value pairs at once, one 'name: code' line each.
A QA item scores the share of its expected strings that appear in the greedy answer (1 or 0 for one fact).
Agreement items ask for a free continuation of a long document. The full cache writes it greedily; each
compressed run is then fed that continuation token by token (teacher forcing) and scored on the share of
positions where its own greedy choice is the reference's token (next-token agreement). The share reproduced
before the first miss, what a free-running continuation would keep, is reported beside it.

Every item is prefilled once with the full cache; each (method, rate) run then reuses that prefill through the
prefix cache (recomputing only the final observation window) and compresses right after it, so a sweep costs
little more than decoding.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from inference import LLM, EngineConfig, GenerationRequest, SamplingParams
from inference.compression import EvictionMethod, KVCompressionSettings

DEFAULT_MODEL = "@hearth/qwen2.5-coder-0.5b-instruct"
RATES = (1, 2, 4, 8, 16, 32, 64)
METHODS = (EvictionMethod.VARIABLE, EvictionMethod.UNIFORM, EvictionMethod.RECENT)

_FIRST = ["Alice", "Bruno", "Chiara", "Dmitri", "Elena", "Farid", "Greta", "Hiroshi", "Ingrid", "Jonas", "Kavya",
          "Lorenzo", "Mariam", "Nils", "Olga", "Pedro", "Quentin", "Rosa", "Samir", "Tove", "Ugo", "Vera", "Wanda",
          "Xavier", "Yusuf", "Zofia"]
_LAST = ["Moreno", "Lindqvist", "Okafor", "Brandt", "Castillo", "Novak", "Haddad", "Ferreira", "Kowalski",
         "Tanaka", "Dubois", "Rossi", "Sato", "Jensen", "Petrov", "Nakamura"]
_COLORS = ["red", "green", "blue", "amber", "violet", "silver", "golden", "black", "white", "crimson", "teal"]
_WORDS = ["lantern", "harbor", "meadow", "copper", "falcon", "glacier", "orchid", "saffron", "thimble", "walnut",
          "quartz", "tundra", "marble", "cobalt", "juniper", "pebble"]
_ADJ = ["quiet", "old", "narrow", "busy", "distant", "bright", "crowded", "small", "ancient", "windy", "green"]
_NOUN = ["market", "river", "library", "bridge", "garden", "station", "village", "harbor", "museum", "valley"]
_VERB = ["overlooks", "borders", "faces", "surrounds", "leads to", "hides", "connects", "shelters"]
_EXTRA = ["Visitors often stop there in the morning.", "The weather changed quickly that year.",
          "Nobody remembers when it was first built.", "Local guides tell many stories about it.",
          "It was repainted after the long winter.", "Children play there on weekend afternoons."]


@dataclass(slots=True)
class Item:
    kind: str  # lookup | needle | multi | agreement
    context_tokens: int
    messages: list[dict]
    expected: list[str] = field(default_factory=list)


def _filler(rng: random.Random) -> str:
    sentence = (f"The {rng.choice(_ADJ)} {rng.choice(_NOUN)} {rng.choice(_VERB)} the {rng.choice(_ADJ)} "
                f"{rng.choice(_NOUN)}.")
    return sentence + (" " + rng.choice(_EXTRA) if rng.random() < 0.4 else "")


def _document(rng: random.Random, facts: list[str], target_tokens: int, count_tokens) -> str:
    """Filler prose of about target_tokens tokens with the facts planted at random depths."""
    sentences: list[str] = []
    while count_tokens(" ".join(sentences)) < target_tokens:
        sentences.extend(_filler(rng) for _ in range(20))
    for fact in facts:
        sentences.insert(rng.randrange(len(sentences) + 1), fact)
    return " ".join(sentences)


def build_items(count: int, lengths: Sequence[int], count_tokens, seed: int = 0,
                kinds: Sequence[str] = ("lookup", "needle", "multi", "agreement")) -> list[Item]:
    rng = random.Random(seed)
    items = []
    for n in range(count):
        kind, length = kinds[n % len(kinds)], lengths[(n // len(kinds)) % len(lengths)]
        # Distinct first and last names: "Jonas Novak" beside "Jonas Tanaka" tests name matching, not memory.
        people = [f"{a} {b}" for a, b in zip(rng.sample(_FIRST, 5), rng.sample(_LAST, 5), strict=True)]
        if kind == "lookup":
            codes = [str(rng.randrange(10000, 99999)) for _ in people]
            facts = [f"The access code for {p} is {c}." for p, c in zip(people, codes, strict=True)]
            ask = rng.randrange(len(people))
            question = f"What is the access code for {people[ask]}? Answer with the number only."
            expected = [codes[ask]]
        elif kind == "needle":
            colors = rng.sample(_COLORS, 4)
            words = rng.sample(_WORDS, 4)
            facts = [f"Remember this: the secret word for the {c} vault is {w}." for c, w in zip(colors, words,
                                                                                                 strict=True)]
            ask = rng.randrange(len(colors))
            question = f"What is the secret word for the {colors[ask]} vault? Answer with the word only."
            expected = [words[ask]]
        elif kind == "multi":
            codes = [str(rng.randrange(10000, 99999)) for _ in people]
            facts = [f"The access code for {p} is {c}." for p, c in zip(people, codes, strict=True)]
            first, second = rng.sample(range(len(people)), 2)
            # Naming each person before their code gives each retrieval its own cue.
            question = (f"What are the access codes for {people[first]} and for {people[second]}? "
                        "Answer with one line per person, in the form 'name: code'.")
            expected = [codes[first], codes[second]]
        else:
            facts, expected = [], []
            question = "Continue this document with one more paragraph in the same style."
        text = _document(rng, facts, length, count_tokens)
        items.append(Item(kind, length, [{"role": "user", "content": f"{text}\n\n{question}"}], expected))
    return items


def _score(item: Item, text: str) -> float:
    """The share of the asked facts the answer states (recall).

    All or nothing would make a multi-fact item measure the 0.5B model's trouble with two retrievals in one
    answer (at least one of the two codes wrong in 5 of 12 items with the full cache) more than what compression loses.
    """
    lower = text.lower()
    return sum(e.lower() in lower for e in item.expected) / len(item.expected)


def agreement_scores(reference: list[int], chosen: list[int]) -> tuple[float, float]:
    """(next-token agreement, run before the first miss), both as shares of the reference continuation.

    chosen[t] is the compressed model's greedy choice at position t given the reference's first t tokens, so
    one miss does not decide every later position (a free-running comparison ends at its first difference);
    the run before the first miss is what a free-running continuation would have reproduced.
    """
    if not reference:
        return 1.0, 1.0
    hits = [a == b for a, b in zip(reference, chosen, strict=False)]
    run = next((n for n, hit in enumerate(hits) if not hit), len(hits))
    return sum(hits) / len(reference), run / len(reference)


def evaluate(llm: LLM, items: list[Item], rates: Sequence[float], methods: Sequence[EvictionMethod],
             qa_tokens: int = 20, agreement_tokens: int = 64, progress: bool = False) -> dict:
    """Scores per (method, rate); rate 1 is the full cache."""
    results: dict[tuple[str, float], list[float]] = {}
    achieved: dict[tuple[str, float], list[float]] = {}
    runs: dict[tuple[str, float], list[float]] = {}  # agreement items: the run before the first miss
    per_item: list[dict] = []
    for number, item in enumerate(items):
        ids = llm.encode(messages=item.messages)
        agreement = item.kind == "agreement"
        answer_tokens = qa_tokens * len(item.expected)  # 'name: code' lines take about 20 tokens each
        params = SamplingParams(max_tokens=agreement_tokens if agreement else answer_tokens, temperature=0.0,
                                ignore_eos=agreement)
        configs: list[tuple[str, float, KVCompressionSettings | None]] = [("full", 1.0, None)]
        configs += [(m.value, float(r), KVCompressionSettings(rate=float(r), method=m))
                    for m in methods for r in rates if r > 1]
        # The full-cache run goes first, alone, so every compressed run finds the prompt in the prefix cache.
        outputs = llm.generate_requests([GenerationRequest(ids, params,
                                                           kv_compression=KVCompressionSettings(rate=1))])
        reference = outputs[0].token_ids
        if agreement:  # every compressed run is fed the reference and reports its own choice at each position
            params = replace(params, logprobs=1)
        forced = reference if agreement else None
        outputs += llm.generate_requests([GenerationRequest(ids, params, kv_compression=c, forced_output=forced)
                                          for _, _, c in configs[1:]])
        record: dict = {"kind": item.kind, "tokens": len(ids), "expected": item.expected, "scores": {},
                        "answers": {}}
        per_item.append(record)
        for (method, rate, _), out in zip(configs, outputs, strict=True):
            name = f"{method} {rate:g}"
            if agreement:
                chosen = reference if method == "full" else [lp.top[0][0] for lp in out.all_logprobs or []]
                value, run = agreement_scores(reference, chosen)
                record.setdefault("first_miss", {})[name] = run
                for key in ((method, rate),) if method != "full" else [(m.value, 1.0) for m in methods]:
                    runs.setdefault(key, []).append(run)
            else:
                value = _score(item, out.text)
                record["answers"][name] = out.text
            record["scores"][name] = value
            for key in ((method, rate),) if method != "full" else [(m.value, 1.0) for m in methods]:
                results.setdefault(key, []).append(value)
            if out.kv_compression and out.kv_compression.get("achieved_rate"):
                achieved.setdefault((method, rate), []).append(out.kv_compression["achieved_rate"])
        if progress:
            print(f"item {number + 1}/{len(items)} ({item.kind}, {len(ids)} tokens): full-cache "
                  f"{'agreement' if agreement else 'score'} {results[(methods[0].value, 1.0)][-1]:.0f}",
                  file=sys.stderr, flush=True)
    kinds = sorted({i.kind for i in items})
    table = []
    for method in methods:
        for rate in rates:
            key = (method.value, float(rate))
            row = {"method": method.value, "rate": float(rate),
                   "qa": _mean([v for v, i in zip(results[key], items, strict=True) if i.kind != "agreement"]),
                   "agreement": _mean([v for v, i in zip(results[key], items, strict=True)
                                       if i.kind == "agreement"]),
                   "first_miss": _mean(runs.get(key, [])),
                   "achieved_rate": _mean(achieved.get(key, [])) if rate > 1 else 1.0}
            for kind in kinds:
                row[kind] = _mean([v for v, i in zip(results[key], items, strict=True) if i.kind == kind])
            table.append(row)
    return {"items": len(items), "kinds": kinds, "rows": table, "per_item": per_item}


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def head_to_head(result: dict, first: str = "variable", second: str = "uniform") -> list[dict]:
    """Per rate, on how many items `first` scores above and below `second` (QA and agreement apart).

    Means hide whether a gain is broad or one item's; the counts say it, and a sign test reads straight off them.
    """
    rates = sorted({r["rate"] for r in result["rows"] if r["method"] == first and r["rate"] > 1}
                   & {r["rate"] for r in result["rows"] if r["method"] == second})
    rows = []
    for rate in rates:
        row: dict = {"rate": rate}
        for group in ("qa", "agreement"):
            pairs = [(i["scores"][f"{first} {rate:g}"], i["scores"][f"{second} {rate:g}"])
                     for i in result.get("per_item", []) if (i["kind"] == "agreement") == (group == "agreement")]
            row[group] = {"higher": sum(a > b for a, b in pairs), "lower": sum(a < b for a, b in pairs),
                          "items": len(pairs)}
        rows.append(row)
    return rows


def _head_to_head_markdown(result: dict) -> list[str]:
    rows = head_to_head(result)
    if not rows:
        return []
    lines = ["", "Variable against uniform, item by item (items where variable scores higher / lower):", "",
             "| rate | QA items | agreement items |", "| --- | --- | --- |"]
    for row in rows:
        cells = ["–" if row[g]["items"] == 0 else f"{row[g]['higher']} / {row[g]['lower']} of {row[g]['items']}"
                 for g in ("qa", "agreement")]
        lines.append(f"| {row['rate']:g}× | {cells[0]} | {cells[1]} |")
    return lines


def markdown(result: dict) -> str:
    columns = list(result["kinds"])
    if "agreement" in columns:  # the run before the first miss goes beside next-token agreement
        columns.insert(columns.index("agreement") + 1, "first_miss")
    titles = ["run before first miss" if c == "first_miss" else c for c in columns]
    lines = ["| method | rate | achieved | QA score | " + " | ".join(titles) + " |",
             "| --- | --- | --- | --- | " + " | ".join("---" for _ in columns) + " |"]
    full = {r["method"]: r["qa"] for r in result["rows"] if r["rate"] == 1.0}
    for r in result["rows"]:
        rel = f" ({r['qa'] / full[r['method']]:.0%} of full)" if full.get(r["method"]) and r["qa"] is not None \
            else ""
        qa = "–" if r["qa"] is None else f"{r['qa']:.2f}"  # agreement-only runs (--kinds agreement) ask nothing
        cells = " | ".join("–" if r.get(k) is None else f"{r[k]:.2f}" for k in columns)
        lines.append(f"| {r['method']} | {r['rate']:g}× | {r['achieved_rate'] or 0:.1f}× | "
                     f"{qa}{rel} | {cells} |")
    return "\n".join(lines + _head_to_head_markdown(result))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--items", type=int, default=48)
    parser.add_argument("--rates", default=",".join(str(r) for r in RATES))
    parser.add_argument("--methods", default=",".join(m.value for m in METHODS))
    parser.add_argument("--lengths", default="1000,2000,3000,4000")
    parser.add_argument("--kinds", default="lookup,needle,multi,agreement")
    parser.add_argument("--short", action="store_true", help="a quick run: 4 items of 1000 tokens, rates 1, 8")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the results here as JSON")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--protected-share", type=float,
                        help="the most of a head's budget the sink and recent tokens may take (engine default)")
    args = parser.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    lengths = [int(n) for n in args.lengths.split(",")]
    if args.short:
        args.items, lengths, rates = 4, [1000], [1.0, 8.0]
    methods = [EvictionMethod(m) for m in args.methods.split(",")]
    llm = LLM(args.model, EngineConfig(dtype=args.dtype, kv_cache_memory="2GiB", max_num_batched_tokens=2048,
                                       kv_min_prompt_tokens=128,
                                       **({} if args.protected_share is None
                                          else {"kv_protected_share": args.protected_share})))
    items = build_items(args.items, lengths, lambda text: len(llm.tokenizer.encode(text)), seed=args.seed,
                        kinds=args.kinds.split(","))
    start = time.perf_counter()
    result = evaluate(llm, items, rates, methods, progress=True)
    result["seconds"] = time.perf_counter() - start
    result["model"] = args.model
    print(markdown(result))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
