"""Grammar-constrained decoding: the batched bitmask against a brute-force reference on random schemas, valid
outputs on a tiny random model, free rows untouched, speculation and jump-forward lossless, preemption and the
prefix cache, compile errors and the cache, and the async front end never compiling on its threads."""

from __future__ import annotations

import asyncio
import json
import random
import re
import threading
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from inference import (
    LLM,
    AsyncEngine,
    EngineConfig,
    FinishReason,
    GenerationRequest,
    InvalidRequestError,
    SamplingParams,
)
from inference.constrained import Constraint
from inference.constrained.decoding import ConstrainedDecoding
from inference.scheduler import ScheduledChunk
from inference.spec.settings import SpecMode, SpeculationSettings
from tests.engine.conftest import SMOLLM, require_installed

GREEDY = SamplingParams(max_tokens=96, temperature=0.0)
PROMPTS = ["Hello", "The answer is", "x y z", "Name: Ada Lovelace. Age: 36. Reply in JSON."]


def _llm(path: Path, **kwargs) -> LLM:
    return LLM(path, EngineConfig(**{"dtype": "float32", "kv_cache_memory": "16MiB", **kwargs}))


# ----------------------------------------------------------------- random schemas and instances
def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A JSON schema whose every instance is bounded (strings, numbers, arrays), so a random model ends."""
    kinds = ["string", "integer", "enum", "boolean"] + (["object", "array"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 6)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 300)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "dark blue", "n/a", "é", 'say "hi"'], rng.randint(1, 4))}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "maxItems": rng.randint(1, 3)}
    names = rng.sample(["id", "name", "city", "tags", "score", "first_name", "is_active", "meta", "x"],
                       rng.randint(1, 4))
    properties = {name: random_schema(rng, depth + 1) for name in names}
    required = [name for name in names if rng.random() < 0.6]
    return {"type": "object", "properties": properties, "required": required}


def random_instance(rng: random.Random, schema: dict):
    if "enum" in schema:
        return rng.choice(schema["enum"])
    kind = schema["type"]
    if kind == "string":
        return "".join(rng.choice('ab é"\\/x1\n') for _ in range(rng.randint(0, schema["maxLength"])))
    if kind == "integer":
        return rng.randint(schema["minimum"], schema["maximum"])
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "array":
        return [random_instance(rng, schema["items"]) for _ in range(rng.randint(0, schema["maxItems"]))]
    return {name: random_instance(rng, sub) for name, sub in schema["properties"].items()
            if name in schema["required"] or rng.random() < 0.5}


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path):
    return AutoTokenizer.from_pretrained(tiny_llama)


# ----------------------------------------------------------------- (a) the bitmask against a reference
def _reference_allowed(matcher, vocab_size: int) -> set[int]:
    """Every token a copy of the matcher accepts, tried one by one."""
    probe = matcher.fork()
    allowed = set()
    for token_id in range(vocab_size):
        if probe.is_terminated():
            probe = matcher.fork()  # a stop token ended it: rollback past termination is not needed
        if probe.accept_token(token_id):
            allowed.add(token_id)
            if probe.is_terminated():
                probe = matcher.fork()
            else:
                probe.rollback(1)
    return allowed


def test_batched_mask_equals_token_by_token_acceptance_on_random_schemas(tokenizer) -> None:
    # Wider than the tokenizer, as Qwen's logits are: the extra ids must never be allowed.
    vocab = len(tokenizer) + 64
    decoding = ConstrainedDecoding(tokenizer, vocab, [tokenizer.eos_token_id], cache_memory=2**28)
    # SmolLM2 ends turns with <|im_end|> (its EOS) and documents with <|endoftext|>: a grammar may end on either.
    assert decoding.stops.ids == {tokenizer.convert_tokens_to_ids("<|im_end|>"),
                                  tokenizer.convert_tokens_to_ids("<|endoftext|>")}
    specials = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special} - set(decoding.stops.ids)
    rng = random.Random(1234)
    checked_rows = 0
    for _ in range(6):
        schema = random_schema(rng)
        schema = schema if schema.get("type") == "object" else {"type": "object", "properties": {"v": schema},
                                                                "required": ["v"]}
        state = decoding.start(decoding.grammars.compile(Constraint.json_schema(schema)))
        text = json.dumps(random_instance(rng, schema), ensure_ascii=False)
        tokens = tokenizer.encode(text, add_special_tokens=False)
        cut = rng.randint(0, len(tokens) - 1)
        for token_id in tokens[:cut]:
            assert state.matcher.accept_token(token_id), (schema, text)
        draft = tokens[cut: cut + 2]
        assert state.valid_prefix(draft) == len(draft)
        # One step's rows: a free sequence, then the constrained one with its draft (a row per position).
        free = SimpleNamespace(grammar=None, draft=[])
        constrained = SimpleNamespace(grammar=state, draft=draft)
        chunks = [ScheduledChunk(free, 1), ScheduledChunk(constrained, 1 + len(draft), len(draft))]
        logits = torch.zeros(2 + len(draft), vocab)
        decoding.mask(chunks, logits)
        assert torch.isfinite(logits[0]).all(), "a free row was masked"
        for j in range(len(draft) + 1):
            got = set(torch.isfinite(logits[1 + j]).nonzero().flatten().tolist())
            assert got == _reference_allowed(state.matcher, vocab), (schema, text, cut, j)
            assert got and not got & specials and max(got) < len(tokenizer)
            checked_rows += 1
            if j < len(draft):
                state.matcher.accept_token(draft[j])  # the reference walks the draft as the mask did
        assert state.matcher.is_completed() or cut + len(draft) < len(tokens)
    assert checked_rows >= 12


def test_a_refused_draft_token_cuts_the_draft(tokenizer) -> None:
    decoding = ConstrainedDecoding(tokenizer, len(tokenizer), [tokenizer.eos_token_id], cache_memory=2**28)
    state = decoding.start(decoding.grammars.compile(Constraint.regex(r"ab[0-9]+")))
    good = tokenizer.encode("ab12", add_special_tokens=False)
    seq = SimpleNamespace(grammar=state, draft=good + tokenizer.encode("x", add_special_tokens=False),
                          draft_probs=torch.ones(len(good) + 1, 8), draft_forced=False)
    decoding.check_drafts([seq])
    assert seq.draft == good and seq.draft_probs.shape[0] == len(good)
    assert state.matcher.fork().accept_token(good[0])  # checking rolled the matcher back


# ----------------------------------------------------------------- (b) valid outputs from a random model
def _schemas(seed: int, count: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        schema = random_schema(rng)
        if schema.get("type") == "object":
            out.append(schema)
    return out


@pytest.mark.parametrize("sampled", [False, True])
def test_every_finished_output_matches_its_constraint(tiny_llama, sampled: bool) -> None:
    llm = _llm(tiny_llama)
    schemas = _schemas(7, 6)
    params = SamplingParams(max_tokens=200, temperature=1.0, seed=3) if sampled else \
        SamplingParams(max_tokens=200, temperature=0.0)
    regex = r"(yes|no), [0-9]{1,3}"
    choices = ["apple pie", "banana", 'say "hi"']
    constraints = [Constraint.json_schema(s) for s in schemas] + [
        Constraint.regex(regex), Constraint.choice(choices), Constraint.json_object()]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(constraints))]
    outs = llm.generate(prompts, params, constraint=constraints)
    for schema, out in zip(schemas, outs, strict=False):
        assert out.finish_reason is FinishReason.STOP, (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)
        assert out.text.endswith("}") and out.token_ids[-1] not in llm.info.eos_token_ids  # ends at the brace
    regex_out, choice_out, object_out = outs[len(schemas):]
    assert regex_out.finish_reason is FinishReason.STOP and re.fullmatch(regex, regex_out.text)
    assert choice_out.finish_reason is FinishReason.STOP and choice_out.text in choices
    if object_out.finish_reason is FinishReason.STOP:  # an open object may run to max_tokens
        assert isinstance(json.loads(object_out.text), dict)
    m = llm.engine.metrics()
    assert m.grammar_compiles_total == len(constraints) and m.jump_forward_accepted > 0


def test_logprobs_penalties_and_seeds_with_a_grammar(tiny_llama) -> None:
    llm = _llm(tiny_llama)
    schema = _schemas(11, 1)[0]
    params = SamplingParams(max_tokens=120, temperature=0.8, top_k=40, top_p=0.9, seed=5, logprobs=3,
                            repetition_penalty=1.2, frequency_penalty=0.5)
    first = llm.generate(PROMPTS[0], params, constraint=Constraint.json_schema(schema))[0]
    again = llm.generate(PROMPTS[0], params, constraint=Constraint.json_schema(schema))[0]
    assert first.token_ids == again.token_ids
    jsonschema.validate(json.loads(first.text), schema)
    # Logprobs describe the masked distribution: finite, and every top alternative is a grammar-legal token.
    assert len(first.all_logprobs) == len(first.token_ids)
    state = llm.engine.constrained.start(llm.engine.compile_constraint(Constraint.json_schema(schema)))
    for lp in first.all_logprobs:
        assert lp.logprob > float("-inf") and all(top_lp > float("-inf") for _, _, top_lp in lp.top)
        assert all(state.matcher.fork().accept_token(t) for t, _, _ in lp.top)
        assert state.matcher.accept_token(lp.token_id)


def test_forced_text_that_ends_inside_a_character_is_decoded_not_jumped(tiny_llama, caplog) -> None:
    # The options share "ab" and the first byte of their next character: xgrammar's jump string would end
    # mid-character there, so nothing is jumped and the model decodes those bytes itself.
    llm = _llm(tiny_llama)
    choices = ["ab日本x", "ab日月y", "é1", "è2"]
    with caplog.at_level("ERROR"):
        outs = llm.generate(PROMPTS, GREEDY, constraint=Constraint.choice(choices))
    assert all(o.finish_reason is FinishReason.STOP and o.text in choices for o in outs)
    assert any(o.text.startswith("ab") for o in outs)
    assert not [r for r in caplog.records if "jump-forward failed" in r.getMessage()]


def test_a_grammar_that_fails_fails_its_request_alone(tiny_llama, monkeypatch) -> None:
    from inference.constrained.state import GrammarState

    llm = _llm(tiny_llama)
    engine = llm.engine
    schema = _schemas(5, 1)[0]
    broken = engine.add_request(GenerationRequest(llm.encode(PROMPTS[0], raw=True), GREEDY,
                                                  constraint=Constraint.json_schema(schema)))
    good = engine.add_request(GenerationRequest(llm.encode(PROMPTS[1], raw=True), GREEDY,
                                                constraint=Constraint.json_schema(schema)))
    real = GrammarState._fill_rows

    def failing(self, bitmask, first_row, draft):
        if self is broken.grammar and len(broken.output_token_ids) >= 3:
            raise RuntimeError("simulated matcher failure")
        return real(self, bitmask, first_row, draft)

    monkeypatch.setattr(GrammarState, "_fill_rows", failing)
    final = {}
    while engine.has_unfinished():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    assert final[broken.request_id].finish_reason is FinishReason.ERROR
    assert "simulated matcher failure" in final[broken.request_id].error
    assert len(final[broken.request_id].token_ids) == 4  # three good tokens, then the stop it was left with
    assert final[good.request_id].finish_reason is FinishReason.STOP
    jsonschema.validate(json.loads(final[good.request_id].text), schema)


# ----------------------------------------------------------------- (c) free rows untouched
def test_free_and_constrained_requests_share_a_batch(tiny_llama) -> None:
    llm = _llm(tiny_llama)
    free_params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    schema = _schemas(5, 1)[0]
    alone_free = llm.generate(PROMPTS[1], free_params)[0]
    alone_constrained = llm.generate(PROMPTS[2], GREEDY, constraint=Constraint.json_schema(schema))[0]
    mixed = llm.generate([PROMPTS[2], PROMPTS[1], PROMPTS[2]], [GREEDY, free_params, GREEDY],
                         constraint=[Constraint.json_schema(schema), None, Constraint.regex("[a-z ]{3,40}")])
    assert mixed[1].token_ids == alone_free.token_ids and mixed[1].constrained is None
    assert mixed[0].token_ids == alone_constrained.token_ids
    assert mixed[0].text != alone_free.text


# ----------------------------------------------------------------- (d) speculation and jump-forward lossless
def test_speculation_and_jump_forward_give_identical_greedy_tokens(tiny_llama) -> None:
    schemas = _schemas(21, 4)
    # A loose grammar too: there drafts blind to the grammar are mostly allowed, and cut where they are not.
    constraints = [Constraint.json_schema(s) for s in schemas] + [Constraint.regex(r"[^e\n]{20,60}")]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(constraints))]
    plain = _llm(tiny_llama, grammar_jump_forward=False).generate(prompts, GREEDY, constraint=constraints)
    assert all(o.finish_reason is FinishReason.STOP for o in plain)
    variants = {
        "jump-forward": dict(grammar_jump_forward=True),
        "ngram": dict(grammar_jump_forward=False, speculation="ngram", spec_max_batch=64,
                      spec_min_acceptance=0.0),
        "both": dict(grammar_jump_forward=True, speculation="ngram", spec_max_batch=64, spec_min_acceptance=0.0),
        # The target drafting for itself, blind to the grammar: its drafts are cut where the grammar refuses
        # them (with their draft distributions), and what is left is verified with rejection sampling's rows.
        "draft model": dict(grammar_jump_forward=True, speculation="draft", draft_model=str(tiny_llama),
                            draft_lookup_first=False, draft_min_confidence=0.0, spec_max_batch=64,
                            spec_min_acceptance=0.0),
    }
    for name, settings in variants.items():
        llm = _llm(tiny_llama, **settings)
        outs = llm.generate(prompts, GREEDY, constraint=constraints)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain], name
        assert [o.text for o in outs] == [o.text for o in plain], name
        m = llm.engine.metrics()
        if settings["grammar_jump_forward"]:
            assert 0 < m.jump_forward_accepted <= m.jump_forward_proposed, name
            assert sum(o.constrained["jump_forward_accepted"] for o in outs) == m.jump_forward_accepted
        if name in ("ngram", "draft model"):
            assert m.spec_proposed > 0, name  # drafts were checked against the grammar and verified


def test_jump_forward_works_per_request_without_speculation(tiny_llama) -> None:
    llm = _llm(tiny_llama, speculation="ngram")  # the engine speculates; this request does not
    schema = {"type": "object", "properties": {"a_rather_long_key_name": {"enum": ["first option", "second"]}},
              "required": ["a_rather_long_key_name"]}
    request = GenerationRequest(llm.encode("Hi", raw=True), GREEDY, constraint=Constraint.json_schema(schema),
                                speculation=SpeculationSettings(SpecMode.OFF))
    out = llm.generate_requests([request])[0]
    assert json.loads(out.text)["a_rather_long_key_name"] in ("first option", "second")
    # A random model spells text its own way (often a character a token), so it turns down many of the
    # canonical tokens a jump proposes; some still pass, and none of this is counted as speculation.
    assert out.speculation is None and out.constrained["jump_forward_accepted"] >= 5


# ----------------------------------------------------------------- (e) errors and the cache
def test_bad_constraints_are_refused_with_the_reason(tiny_llama) -> None:
    llm = _llm(tiny_llama)
    cases = [(Constraint.json_schema({"type": "nonsense"}), "Unsupported type"),
             (Constraint.json_schema({"$ref": "#/defs/x"}), "defs"),
             (Constraint.regex("a(b"), "parenthesis"),
             (Constraint.ebnf("root ::= "), "EBNF"),
             (Constraint.structural_tag({"a": 1}), "format")]
    for constraint, reason in cases:
        with pytest.raises(InvalidRequestError, match=reason) as info:
            llm.generate(PROMPTS[0], GREEDY, constraint=[constraint])
        assert "project/cpp" not in str(info.value) and ".cc:" not in str(info.value)  # no C++ log prefix
        assert not llm.engine.has_unfinished()  # refused before anything was queued
    with pytest.raises(InvalidRequestError, match="forced_output"):
        llm.generate_requests([GenerationRequest([1, 2], GREEDY, forced_output=[3],
                                                 constraint=Constraint.regex("a+"))])
    stats = llm.engine.constrained.grammars.stats
    assert stats.failures == len(cases) and stats.compiles == 0


def test_compiling_the_same_constraint_twice_hits_the_cache(tiny_llama) -> None:
    llm = _llm(tiny_llama)
    engine = llm.engine
    schema = _schemas(3, 1)[0]
    first = engine.compile_constraint(Constraint.json_schema(schema))
    again = engine.compile_constraint(Constraint.json_schema(json.loads(json.dumps(schema))))  # equal content
    stats = engine.constrained.grammars.stats
    assert again is first and stats.compiles == 1 and stats.hits == 1
    llm.generate(PROMPTS[0], GREEDY, constraint=Constraint.json_schema(schema))
    assert stats.compiles == 1 and stats.hits == 2 and engine.metrics().grammar_cache_hits_total == 2
    for kind in (Constraint.json_object(), Constraint.ebnf('root ::= "a" | "b"'), Constraint.choice(["x"]),
                 Constraint.structural_tag({"type": "structural_tag", "format": {
                     "type": "triggered_tags", "triggers": ["<tool_call>"], "tags": [{
                         "begin": "<tool_call>", "end": "</tool_call>",
                         "content": {"type": "json_schema", "json_schema": schema}}]}})):
        engine.compile_constraint(kind)
    assert stats.compiles == 5


def test_the_cache_drops_least_recently_used_past_its_memory(tiny_llama) -> None:
    llm = _llm(tiny_llama, grammar_cache_memory=1)  # every entry is over: only the newest stays
    cache = llm.engine.constrained.grammars
    a, b = Constraint.regex("a+"), Constraint.regex("b+")
    cache.compile(a)
    cache.compile(b)
    assert cache.num_cached == 1 and cache.lookup(a) is None and cache.lookup(b) is not None
    assert cache.stats.evictions == 1


# ----------------------------------------------------------------- (f) preemption and the prefix cache
def test_preemption_and_prefix_cache_keep_constrained_outputs(tiny_llama) -> None:
    schemas = _schemas(31, 5)
    constraints = [Constraint.json_schema(s) for s in schemas]
    prompts = [p * 3 for p in PROMPTS] + [PROMPTS[0] * 3]
    reference = _llm(tiny_llama, enable_prefix_caching=False, grammar_jump_forward=False).generate(
        prompts, GREEDY, constraint=constraints)
    probe = _llm(tiny_llama)
    layout = probe.engine.pool.layout
    # Room for 8 blocks of 16 tokens per head: two or three of these sequences at a time, not all five.
    tight = _llm(tiny_llama, kv_cache_memory=8 * layout.heads_per_token * layout.bytes_per_block,
                 max_num_batched_tokens=32)
    for _ in range(2):  # the second round adopts cached prompt blocks
        outs = tight.generate(prompts, GREEDY, constraint=constraints)
        assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    engine = tight.engine
    assert engine.metrics().preemptions_total > 0 and engine.blocks.hit_tokens > 0
    assert engine.metrics().jump_forward_accepted > 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_a_compressed_kv_cache_under_a_grammar(tiny_llama) -> None:
    llm = _llm(tiny_llama)
    schema = _schemas(51, 1)[0]
    prompt = llm.encode(" ".join(PROMPTS) * 12, raw=True)
    assert len(prompt) >= llm.engine.compressor.config.min_prompt_tokens
    request = GenerationRequest(prompt, GREEDY, constraint=Constraint.json_schema(schema),
                                kv_compression={"rate": 4})
    out = llm.generate_requests([request])[0]
    assert out.kv_compression["compressions"] > 0 and out.finish_reason is FinishReason.STOP
    jsonschema.validate(json.loads(out.text), schema)


# ----------------------------------------------------------------- the async front end
async def test_async_engine_compiles_off_its_loop_and_event_loop(tiny_llama) -> None:
    engine = AsyncEngine.from_model(tiny_llama, EngineConfig(dtype="float32", kv_cache_memory="16MiB"))
    try:
        threads: list[str] = []
        real = engine.engine.compile_constraint

        def recording(constraint):
            threads.append(threading.current_thread().name)
            return real(constraint)

        engine.engine.compile_constraint = recording  # type: ignore[method-assign]
        schema = _schemas(41, 1)[0]
        request = GenerationRequest(engine.encode("Hi", raw=True), GREEDY, constraint=Constraint.json_schema(schema))
        final = None
        async for out in engine.stream(request):
            final = out
        assert final is not None and final.finish_reason is FinishReason.STOP
        jsonschema.validate(json.loads(final.text), schema)
        assert len(threads) == 1 and threads[0] != threading.current_thread().name
        assert not threads[0].startswith("hearth-engine")
        # A cached grammar is handed over without a thread hop; a bad one is refused to the caller.
        again = GenerationRequest(engine.encode("Hi", raw=True), GREEDY, constraint=Constraint.json_schema(schema))
        assert (await engine.generate(again)).token_ids == final.token_ids and len(threads) == 1
        with pytest.raises(InvalidRequestError, match="parenthesis"):
            await engine.generate(GenerationRequest([1, 2], GREEDY, constraint=Constraint.regex("(")))
        await asyncio.sleep(0)
    finally:
        engine.shutdown()


# ----------------------------------------------------------------- a real model
@pytest.mark.real_model
def test_smollm2_extracts_valid_json_with_jump_forward() -> None:
    require_installed(SMOLLM)
    llm = LLM(SMOLLM, EngineConfig(dtype="float32", kv_cache_memory="64MiB"))
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                               "city": {"type": "string"}}, "required": ["name", "age", "city"]}
    text = "Marie Curie was 66 years old and lived in Paris."
    out = llm.chat([[{"role": "user", "content": f"Extract name, age and city as JSON.\n{text}"}]],
                   SamplingParams(max_tokens=60, temperature=0.0), constraint=Constraint.json_schema(schema))[0]
    value = json.loads(out.text)
    jsonschema.validate(value, schema)
    assert value["age"] == 66 and "Curie" in value["name"] and value["city"] == "Paris"
    assert out.constrained["jump_forward_accepted"] > 0
