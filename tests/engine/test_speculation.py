"""Speculative decoding in the engine: lossless for greedy, seeded-deterministic for sampling, adaptive."""

from __future__ import annotations

import pytest

from inference import LLM, EngineConfig, InvalidRequestError, SamplingParams
from inference.spec.drafter import Draft, DraftRequest
from inference.spec.settings import SpecMode, SpeculationSettings
from tests.engine.conftest import SMOLLM, build_tiny_model, require_installed

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "List three colours: red, green, blue. List three colours: red,",
    "1, 2, 3, 5, 8, 13,",
    "a b c d e f g a b c d e f g a b c",
]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
NGRAM = SpeculationSettings(SpecMode.NGRAM, k=4)


def _llm(path, **kwargs) -> LLM:
    return LLM(path, EngineConfig(**{"dtype": "float32", "kv_cache_memory": "16MiB", **kwargs}))


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """A second tiny llama (other weights, same tokenizer) to act as a draft model."""
    return build_tiny_model("llama", tmp_path_factory.mktemp("tiny-draft"), seed=1)


def test_ngram_greedy_is_token_for_token_identical(tiny_llama) -> None:
    plain = _llm(tiny_llama).generate(PROMPTS, GREEDY)
    spec_llm = _llm(tiny_llama, speculation="ngram", spec_max_batch=64, spec_min_acceptance=0.0)
    spec = spec_llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert [o.text for o in spec] == [o.text for o in plain]
    m = spec_llm.engine.metrics()
    assert m.spec_proposed > 0 and m.spec_accepted > 0  # it really speculated, and some drafts survived
    assert 0 < m.spec_acceptance_rate <= 1 and m.spec_per_position_acceptance
    assert any(o.speculation and o.speculation["accepted"] > 0 for o in spec)


def _counted(fn, calls: dict[str, int], name: str):
    def run(hidden):
        calls[name] += 1
        return fn(hidden)
    return run


def test_greedy_verification_from_the_heads_argmax_keeps_what_the_logits_keep(tiny_llama) -> None:
    """Greedy sequences that report no logprobs verify their drafts from the head's argmax tokens alone (no
    logits computed); with logprobs the same steps compute logits. Same tokens, same drafts kept."""
    runs = []
    for params in (GREEDY, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=1)):
        llm = _llm(tiny_llama, speculation="ngram", spec_max_batch=64, spec_min_acceptance=0.0)
        model, calls = llm.engine.model, {"logits": 0, "greedy": 0}
        model.logits = _counted(model.logits, calls, "logits")
        model.greedy_tokens = _counted(model.greedy_tokens, calls, "greedy")
        outs = llm.generate(PROMPTS, params)
        m = llm.engine.metrics()
        runs.append(([o.token_ids for o in outs], m.spec_proposed, m.spec_accepted, calls))
    (plain, proposed, accepted, calls), (scored, proposed_l, accepted_l, calls_l) = runs
    assert plain == scored and (proposed, accepted) == (proposed_l, accepted_l) and accepted > 0
    assert calls["logits"] == 0 < calls["greedy"] and calls_l["greedy"] == 0 < calls_l["logits"]


@pytest.mark.parametrize(("target_as_draft", "draft_vocab", "min_confidence", "lookup_first"), [
    (False, 32768, 0.5, True),  # the defaults: lookup first, a reduced head (of 49,152 ids), early stops
    (False, 49152, 0.0, False),
    (True, 49152, 0.0, False),
    (True, 4096, 0.0, False),
])
def test_draft_model_greedy_is_token_for_token_identical(tiny_llama, draft_dir, target_as_draft, draft_vocab,
                                                         min_confidence, lookup_first) -> None:
    plain = _llm(tiny_llama).generate(PROMPTS, GREEDY)
    draft = str(tiny_llama if target_as_draft else draft_dir)
    llm = _llm(tiny_llama, speculation="draft", draft_model=draft, spec_max_batch=64, spec_min_acceptance=0.0,
               draft_vocab=draft_vocab, draft_min_confidence=min_confidence, draft_lookup_first=lookup_first)
    spec = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    m = llm.engine.metrics()
    assert m.spec_proposed > 0
    if target_as_draft and draft_vocab == 49152:  # the target drafting for itself over its whole vocabulary
        assert m.spec_accepted == m.spec_proposed
    if target_as_draft and draft_vocab == 4096:  # ids outside the draft's reach are rejected, never emitted
        assert 0 < m.spec_accepted < m.spec_proposed


def test_draft_stops_extending_after_an_unsure_token(tiny_llama) -> None:
    from inference.spec.drafter import DraftRequest

    sure = _llm(tiny_llama, speculation="draft", draft_model=str(tiny_llama), draft_min_confidence=0.0,
                draft_lookup_first=False)
    unsure = _llm(tiny_llama, speculation="draft", draft_model=str(tiny_llama), draft_min_confidence=1.0,
                  draft_lookup_first=False)
    ids = sure.encode(PROMPTS[0], raw=True)
    requests = [DraftRequest("a", ids, 6), DraftRequest("b", ids[:-1], 3)]
    full = sure.engine.spec.drafters[SpecMode.DRAFT].propose(requests)
    cut = unsure.engine.spec.drafters[SpecMode.DRAFT].propose(requests)
    assert [len(d.tokens) for d in full] == [6, 3]
    # No token is certain, so each draft stops after its first: the same first token, at no extra passes.
    assert [d.tokens for d in cut] == [d.tokens[:1] for d in full]


def test_lookup_first_uses_a_match_when_there_is_one_and_the_model_otherwise() -> None:
    from inference.spec.drafter import Draft, DraftRequest
    from inference.spec.hybrid import LookupFirst
    from inference.spec.ngram import NgramDrafter

    class Model:
        name = "model"

        def __init__(self) -> None:
            self.asked: list[str] = []
            self.released: list[str] = []

        def propose(self, requests):
            self.asked += [r.seq_id for r in requests]
            return [Draft(tokens=[7] * r.k) for r in requests]

        def release(self, seq_id):
            self.released.append(seq_id)

    model = Model()
    drafter = LookupFirst(NgramDrafter(min_n=3), model)
    repeating = [1, 2, 3, 4, 5, 1, 2, 3]  # "1 2 3" occurred before, followed by 4 5
    short = [1, 2, 9, 1, 2]  # only a 2-token match: below min_n
    drafts = drafter.propose([DraftRequest("a", repeating, 4), DraftRequest("b", short, 4),
                              DraftRequest("c", [5, 6], 2)])
    assert [d.tokens for d in drafts] == [[4, 5, 1, 2], [7, 7, 7, 7], [7, 7]]
    assert model.asked == ["b", "c"] and drafter.name == "ngram+model"
    drafter.release("a")
    assert model.released == ["a"]
    with pytest.raises(ValueError):
        LookupFirst(NgramDrafter(), model, min_tokens=0)


def test_speculation_with_prefix_cache_chunked_prefill_and_preemption(tiny_llama) -> None:
    plain = [o.token_ids for o in _llm(tiny_llama, enable_prefix_caching=False).generate(PROMPTS, GREEDY)]
    llm = _llm(tiny_llama, speculation="ngram", spec_max_batch=64, max_num_batched_tokens=16,
               kv_cache_memory=9 * 6 * 2112)  # tight: forces preemption while drafts are in flight
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == plain
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == plain  # now with prefix-cache hits
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_seeded_sampling_with_speculation_is_reproducible(tiny_llama) -> None:
    llm = _llm(tiny_llama, speculation="ngram", spec_max_batch=64, spec_min_acceptance=0.0)
    params = [SamplingParams(max_tokens=24, temperature=0.7, top_k=20, seed=s, ignore_eos=True,
                             repetition_penalty=1.1, logprobs=2) for s in (1, 2, 3)]
    first = llm.generate(PROMPTS[-1:] * 3, params)
    again = llm.generate(PROMPTS[-1:] * 3, params)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert all(len(o.all_logprobs) == 24 and all(len(lp.top) == 2 for lp in o.all_logprobs) for o in first)


def test_per_request_override_and_unknown_drafter(tiny_llama) -> None:
    llm = _llm(tiny_llama)  # engine default: off
    ids = llm.encode(PROMPTS[-1], raw=True)
    from inference import GenerationRequest

    engine = llm.engine
    on = GenerationRequest(ids, GREEDY, speculation=NGRAM)
    off = GenerationRequest(ids, GREEDY)
    engine.add_request(on)
    engine.add_request(off)
    final = {}
    while engine.has_unfinished():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    assert final[on.request_id].token_ids == final[off.request_id].token_ids
    assert final[on.request_id].speculation is not None and final[off.request_id].speculation is None
    with pytest.raises(InvalidRequestError, match="draft"):
        engine.add_request(GenerationRequest(ids, GREEDY, speculation=SpeculationSettings(SpecMode.DRAFT)))
    with pytest.raises(InvalidRequestError):
        SpeculationSettings("eagle")
    with pytest.raises(InvalidRequestError):
        SpeculationSettings(SpecMode.NGRAM, k=0)


def test_speculation_switches_off_for_large_batches_and_poor_acceptance(tiny_llama, draft_dir) -> None:
    big = _llm(tiny_llama, speculation="ngram", spec_max_batch=2)
    big.generate(PROMPTS, GREEDY)  # six sequences decode together: above the batch threshold
    assert big.engine.metrics().spec_proposed == 0 and big.engine.spec.batch_paused_steps > 0
    # A draft model that disagrees with the target gets paused after a few poor rounds.
    poor = _llm(tiny_llama, speculation="draft", draft_model=str(draft_dir), spec_min_acceptance=0.9)
    out = poor.generate(PROMPTS[2], SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))[0]
    stats = out.speculation
    assert stats is not None and stats["steps"] < 64 // 2  # most steps ran without drafting


@pytest.mark.real_model
def test_smollm2_ngram_greedy_identical_on_input_grounded_prompt() -> None:
    require_installed(SMOLLM)
    text = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
            "def mul(a, b):\n    return a * b\n")
    messages = [{"role": "user", "content": f"Repeat this code exactly, adding a docstring to each function:\n{text}"}]
    params = SamplingParams(max_tokens=64, temperature=0.0)
    plain = LLM(SMOLLM, EngineConfig(dtype="float32")).chat([messages], params)[0]
    spec_llm = LLM(SMOLLM, EngineConfig(dtype="float32", speculation="ngram"))
    spec = spec_llm.chat([messages], params)[0]
    assert spec.token_ids == plain.token_ids
    assert spec_llm.engine.metrics().spec_accepted > 0


class _NextId:
    """Drafts k copies of the id after the last token's: mostly rejected, so an adaptive k shrinks."""

    name = "next-id"

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        return [Draft([int(r.token_ids[-1]) + 1] * r.k) for r in requests]

    def release(self, seq_id: str) -> None:
        pass


@pytest.mark.parametrize("adaptive", [True, False])
def test_a_fixed_draft_length_when_the_policy_is_not_adaptive(tiny_llama, adaptive: bool) -> None:
    llm = _llm(tiny_llama, speculation="ngram", num_speculative_tokens=4, spec_min_acceptance=0.0)
    llm.engine.spec.drafters[SpecMode.NGRAM] = _NextId()
    llm.engine.spec.policy.adaptive_k = adaptive
    stats = llm.generate(PROMPTS[0], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))[0].speculation
    assert stats is not None and stats["steps"] > 10
    per_step = stats["proposed"] / stats["steps"]
    # adaptive: after the first rejections one token a step; fixed: k = 4 but where max_tokens leaves less room
    assert per_step < 1.5 if adaptive else per_step > 3.5
