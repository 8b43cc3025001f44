"""Grammar-constrained decoding benchmark: what a grammar costs, what jump-forward saves, what it buys.

    python -m benchmarks.constrained [--quick]      # prints markdown; benchmarks.run writes docs/benchmarks.md

1. Throughput: 32 concurrent extraction requests, each with its own JSON schema, constrained (jump-forward off,
   then on) against the same prompts unconstrained. The unconstrained run is held to each request's constrained
   output length (max_tokens = that length, ignore_eos), so both sides compute the same number of tokens over
   the same prompts and sample each one the same way (greedy argmax): the difference is the grammar's own work
   (matchers, mask fills, the masking pass). forced_output would skip sampling and so flatter the baseline. The
   same for a single stream (requests one at a time).
2. Compile time of 20 distinct schemas on a fresh cache (p50, p95), a cache hit, and the one-time tokenizer
   setup, for each model's vocabulary.
3. Jump-forward on vs off on an extraction workload whose schemas have long fixed keys: tokens/s, single
   stream and 32 concurrent, with the share of jump-forward tokens the model kept.
4. Validity and accuracy over extraction tasks (the text states every answer), SmolLM2-135M and
   Qwen2.5-Coder-0.5B: constrained vs unconstrained with the schema in the prompt. Valid: the answer parses as
   JSON (the unconstrained answer may sit in a code fence or after prose: its first '{' to its last '}') and
   validates; exact: every field equals the text's value; fields: the share of fields that do.

Every on/off pair alternates its order run by run and the figures are medians, so drift on a shared machine
hits both sides alike.
"""

from __future__ import annotations

import gc
import json
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jsonschema
import torch

from benchmarks.machine import cpu_label
from inference import LLM, EngineConfig, GenerationRequest, RequestOutput, SamplingParams
from inference.constrained import Constraint
from inference.constrained.grammar import GrammarCache

os.environ.setdefault("HF_HUB_OFFLINE", "1")
SMOLLM = "@hearth/smollm2-135m-instruct"
QWEN = "@hearth/qwen2.5-coder-0.5b-instruct"
MAX_TOKENS = 200

# ----------------------------------------------------------------- extraction tasks
NAMES = ["Maria Gonzalez", "Tom Becker", "Aiko Tanaka", "Lars Nilsson", "Fatima Haddad", "Peter O'Neill",
         "Chen Wei", "Ana Costa", "David Miller", "Ingrid Berg", "Kofi Mensah", "Sofia Rossi"]
CITIES = ["Valencia", "Hamburg", "Osaka", "Uppsala", "Beirut", "Dublin", "Shanghai", "Porto", "Denver", "Bergen"]
PRODUCTS = ["kettle", "desk lamp", "backpack", "coffee grinder", "rain jacket", "bicycle pump", "teapot"]
COUNTRIES = ["Spain", "Germany", "Japan", "Sweden", "Lebanon", "Ireland", "China", "Portugal", "Norway"]
JOBS = ["teacher", "nurse", "engineer", "farmer", "lawyer", "chef"]
COLOURS = ["red", "green", "blue", "black", "white"]
TAGS = ["gift", "fragile", "priority", "returning", "bulk", "discount"]


@dataclass(frozen=True, slots=True)
class Field:
    key: str
    long_key: str
    schema: dict
    value: Callable[[random.Random], Any]
    sentence: Callable[[Any], str]


FIELDS = [
    Field("name", "customer_full_legal_name", {"type": "string"}, lambda r: r.choice(NAMES),
          lambda v: f"The customer is {v}."),
    Field("age", "customer_age_in_completed_years", {"type": "integer"}, lambda r: r.randint(18, 90),
          lambda v: f"The customer is {v} years old."),
    Field("city", "shipping_address_city_name", {"type": "string"}, lambda r: r.choice(CITIES),
          lambda v: f"The parcel goes to {v}."),
    Field("occupation", "customer_primary_occupation", {"enum": JOBS}, lambda r: r.choice(JOBS),
          lambda v: f"The customer works as a {v}."),
    Field("member", "customer_is_loyalty_programme_member", {"type": "boolean"}, lambda r: r.random() < 0.5,
          lambda v: "The customer is a loyalty member." if v else "The customer is not a loyalty member."),
    Field("order_id", "order_reference_number", {"type": "integer"}, lambda r: r.randint(1000, 9999),
          lambda v: f"The order number is {v}."),
    Field("product", "ordered_product_description", {"type": "string"}, lambda r: r.choice(PRODUCTS),
          lambda v: f"The order is for a {v}."),
    Field("quantity", "ordered_product_quantity", {"type": "integer"}, lambda r: r.randint(1, 12),
          lambda v: f"The quantity ordered is {v}."),
    Field("colour", "ordered_product_colour", {"enum": COLOURS}, lambda r: r.choice(COLOURS),
          lambda v: f"The colour chosen is {v}."),
    Field("price", "total_price_in_whole_euros", {"type": "integer"}, lambda r: r.randint(5, 500),
          lambda v: f"The total price is {v} euros."),
    Field("express", "delivery_is_express_service", {"type": "boolean"}, lambda r: r.random() < 0.5,
          lambda v: "Delivery is express." if v else "Delivery is standard, not express."),
    Field("country", "destination_country_name", {"type": "string"}, lambda r: r.choice(COUNTRIES),
          lambda v: f"It ships to {v}."),
    Field("rating", "customer_service_rating_out_of_five", {"type": "integer", "minimum": 1, "maximum": 5},
          lambda r: r.randint(1, 5), lambda v: f"The customer rated the service {v} out of 5."),
    Field("tags", "order_handling_tags", {"type": "array", "items": {"type": "string"}},
          lambda r: r.sample(TAGS, 2), lambda v: f"The order is tagged {v[0]} and {v[1]}."),
]


@dataclass(frozen=True, slots=True)
class Task:
    text: str
    schema: dict
    answer: dict

    def prompt(self) -> list[dict]:
        return [{"role": "user", "content": "Extract the fields of this JSON schema from the text. Answer with "
                 f"the JSON object only.\nSchema: {json.dumps(self.schema)}\nText: {self.text}"}]


def make_tasks(count: int, seed: int, long_keys: bool = False) -> list[Task]:
    """Distinct schemas (3 to 7 fields, in random order) with texts that state every value."""
    rng = random.Random(seed)
    tasks: list[Task] = []
    seen: set[str] = set()
    while len(tasks) < count:
        fields = rng.sample(FIELDS, rng.randint(3, 7))
        keys = [f.long_key if long_keys else f.key for f in fields]
        schema = {"type": "object", "properties": {k: f.schema for k, f in zip(keys, fields, strict=True)},
                  "required": keys}
        if json.dumps(schema) in seen:
            continue
        seen.add(json.dumps(schema))
        answer = {k: f.value(rng) for k, f in zip(keys, fields, strict=True)}
        sentences = [f.sentence(answer[k]) for k, f in zip(keys, fields, strict=True)]
        rng.shuffle(sentences)
        tasks.append(Task(" ".join(sentences), schema, answer))
    return tasks


def _parse(text: str) -> Any:
    """The answer's JSON: the whole text, else its first '{' to its last '}' (code fences, prose around it)."""
    try:
        return json.loads(text)
    except ValueError:
        start, end = text.find("{"), text.rfind("}")
        if start < 0 or end <= start:
            return None
        try:
            return json.loads(text[start: end + 1])
        except ValueError:
            return None


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, str):
        return isinstance(got, str) and got.strip().lower() == want.lower()
    if isinstance(want, list):
        return isinstance(got, list) and sorted(str(g).strip().lower() for g in got) == sorted(want)
    return type(got) is type(want) and got == want


def score(task: Task, text: str) -> dict:
    value = _parse(text)
    try:
        jsonschema.validate(value, task.schema)
        valid = True
    except jsonschema.ValidationError:
        valid = False
    fields = [isinstance(value, dict) and _same(value.get(k), v) for k, v in task.answer.items()]
    return {"valid": valid, "exact": valid and all(fields), "fields": sum(fields) / len(fields)}


# ----------------------------------------------------------------- running
def _llm(model: str, jump_forward: bool = True) -> LLM:
    return LLM(model, EngineConfig(kv_cache_memory="1GiB", grammar_jump_forward=jump_forward))


def _run(llm: LLM, requests: list[GenerationRequest], jump_forward: bool = True) -> tuple[float, list[RequestOutput]]:
    """All requests at once through the engine; (seconds, outputs in order)."""
    engine = llm.engine
    engine.constrained.jump_forward = jump_forward
    for r in requests:  # compile first: compile time is measured on its own (section 2)
        if r.constraint is not None:
            engine.compile_constraint(r.constraint)
    start = time.perf_counter()
    for r in requests:
        engine.add_request(r)
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return time.perf_counter() - start, [done[r.request_id] for r in requests]  # type: ignore[index]


def _requests(llm: LLM, tasks: list[Task], constrained: bool, lengths: list[int] | None = None
              ) -> list[GenerationRequest]:
    out = []
    for n, task in enumerate(tasks):
        ids = llm.encode(messages=task.prompt())
        if lengths is None:
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
        else:  # held to the constrained run's length, EOS or not
            params = SamplingParams(max_tokens=lengths[n], temperature=0.0, ignore_eos=True)
        out.append(GenerationRequest(ids, params, constraint=Constraint.json_schema(task.schema) if constrained
                                     else None))
    return out


def _tok_s(seconds: float, outs: list[RequestOutput]) -> float:
    return sum(len(o.token_ids) for o in outs) / seconds


def _alternating(runs: int, variants: dict[str, Callable[[], tuple[float, list[RequestOutput]]]]) -> dict:
    """Tokens/s per variant, medians over runs whose order rotates, so no variant always runs first."""
    names = list(variants)
    speeds: dict[str, list[float]] = {name: [] for name in names}
    last: dict[str, list[RequestOutput]] = {}
    for run in range(runs):
        for name in names[run % len(names):] + names[: run % len(names)]:
            seconds, outs = variants[name]()
            speeds[name].append(_tok_s(seconds, outs))
            last[name] = outs
    return {"tok_s": {n: statistics.median(v) for n, v in speeds.items()}, "outputs": last}


def throughput(llm: LLM, tasks: list[Task], runs: int, concurrent: bool) -> dict:
    """Constrained (jump-forward off, on) against unconstrained at the same output lengths."""
    groups = [tasks] if concurrent else [[t] for t in tasks]

    def run_all(constrained: bool, jump_forward: bool, lengths: list[list[int]] | None = None):
        seconds, outs = 0.0, []
        for g, group in enumerate(groups):
            s, o = _run(llm, _requests(llm, group, constrained, None if lengths is None else lengths[g]),
                        jump_forward)
            seconds += s
            outs += o
        return seconds, outs

    _, reference = run_all(True, False)  # warm-up; fixes each request's output length
    lengths, at = [], 0
    for group in groups:
        lengths.append([len(o.token_ids) for o in reference[at: at + len(group)]])
        at += len(group)
    result = _alternating(runs, {
        "free": lambda: run_all(False, False, lengths),
        "constrained": lambda: run_all(True, False),
        "constrained_jf": lambda: run_all(True, True),
    })
    tok_s = result["tok_s"]
    outs = result["outputs"]["constrained_jf"]
    proposed = sum(o.constrained["jump_forward_proposed"] for o in outs)
    accepted = sum(o.constrained["jump_forward_accepted"] for o in outs)
    return {"requests": len(tasks), "tokens": sum(len(o.token_ids) for o in reference), **tok_s,
            "overhead_ratio": tok_s["constrained"] / tok_s["free"],
            "jf_ratio": tok_s["constrained_jf"] / tok_s["free"],
            "jf_share": accepted / max(1, sum(len(o.token_ids) for o in outs)),
            "jf_acceptance": accepted / proposed if proposed else 0.0}


def jump_forward(llm: LLM, tasks: list[Task], runs: int, concurrent: bool) -> dict:
    groups = [tasks] if concurrent else [[t] for t in tasks]

    def run_all(jf: bool):
        seconds, outs = 0.0, []
        for group in groups:
            s, o = _run(llm, _requests(llm, group, True), jf)
            seconds += s
            outs += o
        return seconds, outs

    run_all(True)  # warm-up
    result = _alternating(runs, {"off": lambda: run_all(False), "on": lambda: run_all(True)})
    on, off = result["outputs"]["on"], result["outputs"]["off"]
    proposed = sum(o.constrained["jump_forward_proposed"] for o in on)
    accepted = sum(o.constrained["jump_forward_accepted"] for o in on)
    return {"requests": len(tasks), **result["tok_s"], "ratio": result["tok_s"]["on"] / result["tok_s"]["off"],
            "identical": [o.token_ids for o in on] == [o.token_ids for o in off],
            "jf_share": accepted / max(1, sum(len(o.token_ids) for o in on)),
            "jf_acceptance": accepted / proposed if proposed else 0.0}


def compile_times(llm: LLM, count: int) -> dict:
    engine = llm.engine
    cache = GrammarCache(engine.tokenizer, engine.model.vocab_size, engine.info.eos_token_ids, 2**30)
    start = time.perf_counter()
    cache.compiler  # noqa: B018 - the one-time tokenizer setup, timed on its own
    setup = time.perf_counter() - start
    schemas = [t.schema for t in make_tasks(count, seed=99)]
    misses, hits = [], []
    for schema in schemas:
        start = time.perf_counter()
        cache.compile(Constraint.json_schema(schema))
        misses.append(time.perf_counter() - start)
    for schema in schemas:
        start = time.perf_counter()
        cache.compile(Constraint.json_schema(schema))
        hits.append(time.perf_counter() - start)
    misses.sort()
    return {"schemas": count, "setup_s": setup, "p50_ms": 1000 * statistics.median(misses),
            "p95_ms": 1000 * misses[min(len(misses) - 1, round(0.95 * (len(misses) - 1)))],
            "hit_us": 1e6 * statistics.median(hits)}


def validity(llm: LLM, tasks: list[Task], batch: int = 32) -> dict:
    out: dict[str, dict] = {}
    for constrained in (False, True):
        scores, stopped = [], []
        for at in range(0, len(tasks), batch):
            group = tasks[at: at + batch]
            _, outs = _run(llm, _requests(llm, group, constrained))
            scores += [score(t, o.text) for t, o in zip(group, outs, strict=True)]
            stopped += [o.finish_reason == "stop" for o in outs]
        finished = [s for s, done in zip(scores, stopped, strict=True) if done]
        out["constrained" if constrained else "free"] = {
            "valid": sum(s["valid"] for s in scores) / len(scores),
            "exact": sum(s["exact"] for s in scores) / len(scores),
            "fields": statistics.mean(s["fields"] for s in scores),
            # An answer cut at max_tokens cannot be whole JSON; the grammar's promise is about the others.
            "stopped": sum(stopped) / len(stopped),
            "valid_when_stopped": sum(s["valid"] for s in finished) / len(finished) if finished else 0.0}
    return {"tasks": len(tasks), **out}


def run(quick: bool = False) -> dict:
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    runs = 1 if quick else 3
    concurrent = 8 if quick else 32
    single = 2 if quick else 4
    eval_tasks = 8 if quick else 50
    result: dict[str, Any] = {"cpu": cpu_label(), "threads": torch.get_num_threads(), "quick": quick, "models": {}}
    for model in (SMOLLM, QWEN):
        llm = _llm(model)
        entry: dict[str, Any] = {"dtype": str(llm.engine.model.dtype).removeprefix("torch."),
                                 "compile": compile_times(llm, 20)}
        if model == SMOLLM:  # the throughput sections on the small model (the engine benchmark's)
            tasks = make_tasks(concurrent, seed=1)
            entry["concurrent"] = throughput(llm, tasks, runs, concurrent=True)
            entry["single"] = throughput(llm, tasks[:single], runs, concurrent=False)
            long_tasks = make_tasks(concurrent, seed=2, long_keys=True)
            entry["jf_single"] = jump_forward(llm, long_tasks[:single], runs, concurrent=False)
            entry["jf_concurrent"] = jump_forward(llm, long_tasks, runs, concurrent=True)
        entry["validity"] = validity(llm, make_tasks(eval_tasks, seed=3))
        result["models"][model] = entry
        del llm
        gc.collect()
    return result


def markdown(r: dict) -> str:
    lines = [f"{r['cpu']}, {r['threads']} threads, greedy; {'quick settings' if r['quick'] else 'full settings'}. "
             "Ratios are tokens/s against the unconstrained run held to the same output lengths, or jump-forward "
             "on over off; medians of alternating runs.", ""]
    small = r["models"][SMOLLM]
    lines += [f"Throughput, `{SMOLLM}` ({small['dtype']}), extraction prompts with one JSON schema each:", "",
              "| workload | unconstrained (tok/s) | constrained (tok/s) | ratio | + jump-forward (tok/s) | ratio "
              "| jump-forward tokens kept / share of output |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for key, label in (("concurrent", "concurrent requests"), ("single", "single stream")):
        t = small[key]
        lines.append(f"| {t['requests']} {label} | {t['free']:.1f} | {t['constrained']:.1f} | "
                     f"{t['overhead_ratio']:.2f}× | {t['constrained_jf']:.1f} | {t['jf_ratio']:.2f}× | "
                     f"{t['jf_acceptance']:.0%} / {t['jf_share']:.0%} |")
    lines += ["", "Jump-forward on vs off, schemas with long fixed keys:", "",
              "| workload | off (tok/s) | on (tok/s) | ratio | tokens kept / share of output | same tokens |",
              "| --- | --- | --- | --- | --- | --- |"]
    for key, label in (("jf_single", "single stream"), ("jf_concurrent", "concurrent requests")):
        t = small[key]
        lines.append(f"| {t['requests']} {label} | {t['off']:.1f} | {t['on']:.1f} | {t['ratio']:.2f}× | "
                     f"{t['jf_acceptance']:.0%} / {t['jf_share']:.0%} | {'yes' if t['identical'] else 'NO'} |")
    lines += ["", "Grammar compile (20 distinct schemas, fresh cache) and extraction quality (the text states every "
              "answer; the unconstrained prompt shows the schema too):", "",
              "| model | dtype | tokenizer setup (s) | compile p50 / p95 (ms) | cache hit (µs) | tasks "
              "| valid: free / constrained | valid of those that stopped (constrained) | stopped before max_tokens "
              "(constrained) | exact: free / constrained | fields: free / constrained |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for model, m in r["models"].items():
        c, v = m["compile"], m["validity"]
        lines.append(f"| `{model}` | {m['dtype']} | {c['setup_s']:.2f} | {c['p50_ms']:.1f} / {c['p95_ms']:.1f} | "
                     f"{c['hit_us']:.1f} | {v['tasks']} | {v['free']['valid']:.0%} / {v['constrained']['valid']:.0%} "
                     f"| {v['constrained']['valid_when_stopped']:.0%} | {v['constrained']['stopped']:.0%} "
                     f"| {v['free']['exact']:.0%} / {v['constrained']['exact']:.0%} | "
                     f"{v['free']['fields']:.0%} / {v['constrained']['fields']:.0%} |")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    print(markdown(run(quick="--quick" in sys.argv)))
