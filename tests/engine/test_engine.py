"""The engine's behaviour through LLM / LLMEngine on a tiny random Llama (fast) and SmolLM2 (real)."""

from __future__ import annotations

import pytest
import torch

from inference import (
    LLM,
    EngineConfig,
    FinishReason,
    GenerationRequest,
    InvalidRequestError,
    LLMEngine,
    Priority,
    PromptTooLongError,
    SamplingParams,
)
from tests.engine.conftest import SMOLLM, counting_layer_rows, require_installed

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "List three colours: red,",
    "1, 2, 3, 5, 8, 13,",
]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _llm(path, **kwargs) -> LLM:
    settings = {"dtype": "float32", "kv_cache_memory": "16MiB", **kwargs}
    return LLM(path, EngineConfig(**settings))


@pytest.fixture(scope="module")
def reference(tiny_llama) -> list[list[int]]:
    """Greedy outputs with caching off, a big budget and no memory pressure: what every variant must match."""
    llm = _llm(tiny_llama, enable_prefix_caching=False)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_each_prompt_alone_matches_the_batch(tiny_llama, reference) -> None:
    llm = _llm(tiny_llama)
    for prompt, expected in zip(PROMPTS, reference, strict=True):
        assert llm.generate(prompt, GREEDY)[0].token_ids == expected


def test_chunked_prefill_gives_the_same_tokens(tiny_llama, reference) -> None:
    llm = _llm(tiny_llama, max_num_batched_tokens=16, enable_prefix_caching=False)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference


@pytest.mark.parametrize("path", ["python", "one_call"])
def test_chunks_after_a_cached_start_take_the_cpu_prompt_kernel(tiny_llama, reference, path: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU a prompt split over steps attends with the C prompt kernel from its second chunk on, reading the
    earlier chunks from the paged pool (kernels/cpu_paged_attention.prefill_attention, called by the Python
    forward or from the one-call layers): the same tokens."""
    from kernels import cpu_paged_attention as cpa

    if not cpa.available():
        pytest.skip("the CPU attention kernels cannot be built here")
    chunks: list[int] = []
    llm = _llm(tiny_llama, device="cpu", max_num_batched_tokens=16, enable_prefix_caching=False)
    stack = llm.engine.runner.model.decode_stack
    if path == "python" or stack is None:
        llm.engine.runner.model.decode_stack = None
        kernel = cpa.prefill_attention
        monkeypatch.setattr(cpa, "prefill_attention",
                            lambda q, *args, **kwargs: (chunks.append(q.shape[0]), kernel(q, *args, **kwargs))[1])
    else:
        start = stack.start
        stack.start = lambda *args, **kwargs: (chunks.extend(p.end - p.start for p in kwargs.get("prompts", ())
                                                             if p.context > 0), start(*args, **kwargs))[1]
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    assert chunks, "the longest prompt took several chunks"


@pytest.mark.parametrize("path", ["python", "one_call"])
def test_prompt_tokens_that_sample_nothing_skip_the_last_layers_products(tiny_model, path: str) -> None:
    """Only sampled rows read final states, so a prompt's other tokens write their keys and values in the last
    layer and stop there (in the Python forward and in the one-call layers): prompts split into chunks beside
    decodes give, at every sampled token, the logprob that scoring the whole sequence at every position gives."""
    llm = _llm(tiny_model, max_num_batched_tokens=16, enable_prefix_caching=False)
    model = llm.engine.model
    rows = {"first": 0, "last": 0}
    counting_layer_rows(model, path, rows)
    prompts = [llm.encode(p, raw=True) for p in PROMPTS]
    outs = llm.generate_ids(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1))
    assert rows["last"] < rows["first"] - sum(map(len, prompts)) // 2
    for prompt, out in zip(prompts, outs, strict=True):
        logits = llm.engine.prompt_logits(prompt + out.token_ids[:-1])[len(prompt) - 1:]
        scored = torch.log_softmax(logits, dim=-1)[torch.arange(len(out.token_ids)), out.token_ids]
        assert [lp.logprob for lp in out.all_logprobs] == pytest.approx(scored.tolist(), abs=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_steps_take_their_tokens_from_the_head_without_logits(tiny_model, dtype: str) -> None:
    """Steps whose every sampled row is plain greedy ask the model for argmax tokens (the head keeps each row's
    maximum instead of storing logits); a step with any row that reads its logits (logprobs, sampling) computes
    them. Both give the same greedy tokens."""
    llm = _llm(tiny_model, dtype=dtype, enable_prefix_caching=False)
    model = llm.engine.model
    calls = {"logits": 0, "greedy": 0}

    def counting(fn, name: str):
        def run(hidden):
            calls[name] += 1
            return fn(hidden)
        return run

    model.logits = counting(model.logits, "logits")
    model.greedy_tokens = counting(model.greedy_tokens, "greedy")
    prompts = [llm.encode(p, raw=True) for p in PROMPTS]
    plain = [o.token_ids for o in llm.generate_ids(prompts, GREEDY)]
    assert calls == {"logits": 0, "greedy": GREEDY.max_tokens}  # 24 steps: prompts together, then decodes
    scored = llm.generate_ids(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1))
    assert calls["greedy"] == GREEDY.max_tokens and calls["logits"] == GREEDY.max_tokens
    assert [o.token_ids for o in scored] == plain
    sampled = SamplingParams(max_tokens=24, temperature=0.9, seed=1, ignore_eos=True)
    mixed = llm.generate_ids(prompts, [GREEDY, sampled, GREEDY, sampled, GREEDY])
    assert [mixed[i].token_ids for i in (0, 2, 4)] == [plain[i] for i in (0, 2, 4)]
    assert calls["greedy"] == GREEDY.max_tokens and calls["logits"] == 2 * GREEDY.max_tokens


def test_preemption_by_recompute_gives_the_same_tokens(tiny_llama, reference) -> None:
    llm = _llm(tiny_llama, kv_cache_memory="1MiB", enable_prefix_caching=False)
    layout = llm.engine.pool.layout
    # Room for 7 blocks of 16 tokens per head: two or three of these sequences at a time, not all five.
    llm = _llm(tiny_llama, kv_cache_memory=7 * layout.heads_per_token * layout.bytes_per_block,
               enable_prefix_caching=False)
    engine = llm.engine
    per_token = engine.pool.layout.bytes_per_token
    assert engine.pool.capacity_tokens < sum(len(llm.encode(p, raw=True)) + 24 for p in PROMPTS), \
        f"the pool ({engine.pool.capacity_tokens} tokens, {per_token} B each) must be too small for all at once"
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert engine.metrics().preemptions_total > 0
    assert sum(o.metrics.preemptions for o in outs) > 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_prefix_cache_hits_and_outputs_are_identical(tiny_llama, reference) -> None:
    llm = _llm(tiny_llama)
    shared = "You are a helpful assistant. Answer briefly and precisely. " * 4
    first = llm.generate(shared + PROMPTS[0], GREEDY)[0]
    second = llm.generate(shared + PROMPTS[1], GREEDY)[0]
    assert first.usage.cached_tokens == 0
    prefix_tokens = len(llm.encode(shared, raw=True))
    assert second.usage.cached_tokens >= (prefix_tokens // 16 - 1) * 16 > 0
    assert llm.engine.metrics().prefix_cache_hit_rate > 0
    off = _llm(tiny_llama, enable_prefix_caching=False)
    assert second.token_ids == off.generate(shared + PROMPTS[1], GREEDY)[0].token_ids
    # The same prompt again is served almost entirely from cache and decodes the same.
    again = llm.generate(shared + PROMPTS[1], GREEDY)[0]
    assert again.token_ids == second.token_ids
    assert again.usage.cached_tokens > second.usage.cached_tokens


def test_max_tokens_and_finish_reasons(tiny_llama) -> None:
    llm = _llm(tiny_llama)
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and out.finish_reason is FinishReason.LENGTH
    first = out.token_ids[2]
    stopped = llm.generate(PROMPTS[0], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True,
                                                      stop_token_ids=[first]))[0]
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.token_ids == out.token_ids[: out.token_ids.index(first) + 1]


def test_stop_string_across_token_boundaries(tiny_llama) -> None:
    llm = _llm(tiny_llama)
    full = llm.generate(PROMPTS[2], GREEDY)[0]
    text = full.text
    # Pick a stop string that starts inside one token's text and ends inside a later one.
    pieces = [llm.tokenizer.decode(full.token_ids[: i + 1]) for i in range(len(full.token_ids))]
    boundary = len(pieces[3])
    stop = text[boundary - 2: boundary + 3]
    assert len(stop) == 5 and stop in text
    out = llm.generate(PROMPTS[2], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                  stop=[stop]))[0]
    assert out.finish_reason is FinishReason.STOP
    assert out.text == text[: text.index(stop)]
    kept = llm.generate(PROMPTS[2], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop],
                                                   include_stop_str_in_output=True))[0]
    assert kept.text == text[: text.index(stop) + len(stop)]


def test_mixed_sampling_parameters_in_one_batch(tiny_llama, reference) -> None:
    llm = _llm(tiny_llama)
    params = [
        GREEDY,
        SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=1.2, top_k=5, min_p=0.05, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.7, frequency_penalty=1.0, presence_penalty=0.5, seed=3,
                       ignore_eos=True, logprobs=3),
    ]
    batch = llm.generate(PROMPTS, params)
    assert batch[0].token_ids == reference[0]  # greedy is unaffected by its neighbours
    for prompt, p, out in zip(PROMPTS, params, batch, strict=True):
        assert len(out.token_ids) == 24
        if p.seed is not None:  # seeded requests reproduce alone, whatever shared their batch
            assert llm.generate(prompt, p)[0].token_ids == out.token_ids
    assert batch[3].token_ids != reference[3]  # the penalty changed something
    logprobs = batch[4].all_logprobs
    assert logprobs is not None and len(logprobs) == 24
    assert all(len(lp.top) == 3 and lp.logprob <= 0 for lp in logprobs)


@pytest.mark.parametrize("speculation", ["off", "ngram"])
def test_forced_output_scores_a_given_continuation(tiny_llama, reference, speculation: str) -> None:
    llm = _llm(tiny_llama, speculation=speculation)
    prompt = llm.encode(PROMPTS[2], raw=True)
    scoring = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1)
    other = [(t * 7 + 3) % 1000 for t in reference[2][:10]]  # a continuation the model would not write
    own, given, free = llm.generate_requests([
        GenerationRequest(prompt, scoring, forced_output=reference[2]),
        GenerationRequest(prompt, scoring, forced_output=other),
        GenerationRequest(prompt, scoring)])
    # Fed its own greedy continuation, the model picks every token it is given.
    assert own.token_ids == reference[2] == free.token_ids
    assert [lp.top[0][0] for lp in own.all_logprobs] == reference[2]
    assert [lp.logprob for lp in own.all_logprobs] == pytest.approx([lp.logprob for lp in free.all_logprobs],
                                                                    abs=1e-5)
    # Fed another, it emits that one and reports what it would have chosen; past its end, sampling resumes.
    assert given.token_ids[:10] == other and len(given.token_ids) == 24
    assert given.all_logprobs[0].top[0][0] == reference[2][0]
    assert all(lp.logprob <= lp.top[0][2] + 1e-6 for lp in given.all_logprobs)
    assert sum(lp.top[0][0] == t for lp, t in zip(given.all_logprobs[:10], other, strict=True)) < 10
    assert given.token_ids[10:] == llm.generate_requests(
        [GenerationRequest(prompt + other, SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True))]
    )[0].token_ids
    with pytest.raises(InvalidRequestError, match="forced_output"):
        GenerationRequest(prompt, scoring, forced_output=[1, "two"])
    with pytest.raises(InvalidRequestError, match="forced_output"):  # past the vocabulary: refused, not failed
        llm.generate_requests([GenerationRequest(prompt, scoring, forced_output=[10**9])])
    assert not llm.engine.has_unfinished()


def test_seeds_differ_and_unseeded_requests_vary(tiny_llama) -> None:
    llm = _llm(tiny_llama)
    outs = llm.generate([PROMPTS[0]] * 3, [SamplingParams(max_tokens=16, temperature=1.5, seed=s,
                                                          ignore_eos=True) for s in (1, 2, 1)])
    assert outs[0].token_ids == outs[2].token_ids != outs[1].token_ids


def test_a_bad_request_among_good_ones(tiny_llama, reference) -> None:
    llm = _llm(tiny_llama, kv_cache_memory="2MiB")
    engine: LLMEngine = llm.engine
    good = [GenerationRequest(llm.encode(p, raw=True), GREEDY) for p in PROMPTS[:3]]
    for request in good[:2]:
        engine.add_request(request)
    with pytest.raises(InvalidRequestError, match="token ids"):
        engine.add_request(GenerationRequest([1, 2, engine.model.vocab_size + 5], GREEDY))
    with pytest.raises(PromptTooLongError) as too_long:
        engine.add_request(GenerationRequest([5] * (engine.token_limit + 10), GREEDY))
    assert too_long.value.prompt_tokens == engine.token_limit + 10
    with pytest.raises(InvalidRequestError, match="temperature"):
        engine.add_request(GenerationRequest([1, 2], SamplingParams(temperature=-1)))
    engine.add_request(good[2])
    final = {}
    while engine.has_unfinished():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    assert [final[r.request_id].token_ids for r in good] == reference[:3]


def test_abort_at_any_time(tiny_llama) -> None:
    llm = _llm(tiny_llama)
    engine = llm.engine
    waiting = GenerationRequest(llm.encode(PROMPTS[0], raw=True), GREEDY)
    running = GenerationRequest(llm.encode(PROMPTS[1], raw=True), GREEDY)
    finished = {}

    def step() -> None:
        finished.update({o.request_id: o for o in engine.step() if o.finished})

    engine.add_request(running)
    step()
    engine.add_request(waiting)
    assert engine.abort(waiting.request_id)
    step()
    assert engine.abort(running.request_id)
    assert not engine.abort(running.request_id)  # already finished
    while engine.has_unfinished():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished[running.request_id].finish_reason is FinishReason.ABORT
    assert finished[waiting.request_id].finish_reason is FinishReason.ABORT
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_interactive_requests_are_scheduled_before_batch(tiny_llama) -> None:
    llm = _llm(tiny_llama, max_num_seqs=1)
    engine = llm.engine
    ids = llm.encode(PROMPTS[0], raw=True)
    batch = GenerationRequest(ids, SamplingParams(max_tokens=4, temperature=0), priority=Priority.BATCH)
    interactive = GenerationRequest(ids, SamplingParams(max_tokens=4, temperature=0))
    engine.add_request(batch)
    engine.add_request(interactive)
    order = []
    while engine.has_unfinished():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == [interactive.request_id, batch.request_id]


def test_metrics_count_the_interactive_requests_waiting_apart(tiny_llama) -> None:
    llm = _llm(tiny_llama, max_num_seqs=1)
    engine = llm.engine
    ids = llm.encode(PROMPTS[0], raw=True)
    params = SamplingParams(max_tokens=4, temperature=0)
    for priority in (Priority.BATCH, Priority.INTERACTIVE, Priority.BATCH, Priority.BATCH, Priority.INTERACTIVE):
        engine.add_request(GenerationRequest(ids, params, priority=priority))
    metrics = engine.metrics()
    assert (metrics.queue_depth, metrics.interactive_waiting) == (5, 2)
    engine.step()  # one interactive request starts: the other is still ahead of every batch item
    metrics = engine.metrics()
    assert (metrics.running, metrics.queue_depth, metrics.interactive_waiting) == (1, 4, 1)


def _batch_admissions(tiny_llama, group: int) -> tuple[list[int], int]:
    """Six BATCH sequences finishing one step apart, four more BATCH prompts waiting behind them: how many of those
    four start at each step where some start; then, with BATCH prompts held, the steps an interactive one waits."""
    llm = _llm(tiny_llama, max_num_seqs=6, max_batch_class_seqs=6, batch_admission_group=group)
    engine = llm.engine
    ids = llm.encode(PROMPTS[0], raw=True)
    for i in range(6):
        engine.add_request(GenerationRequest(ids, SamplingParams(max_tokens=2 + i, temperature=0, ignore_eos=True),
                                             priority=Priority.BATCH))
    engine.step()  # nothing ran: all six start at once
    later = [GenerationRequest(ids, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                               priority=Priority.BATCH) for _ in range(4)]
    for request in later:
        engine.add_request(request)
    waiting, admitted = {r.request_id for r in later}, []
    while waiting:
        engine.step()
        still = waiting & {s.request_id for s in engine.scheduler.waiting}
        if waiting - still:
            admitted.append(len(waiting - still))
        waiting = still
    # Every slot is taken by BATCH work again; one more BATCH prompt waits, held until slots free.
    engine.add_request(GenerationRequest(ids, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                                         priority=Priority.BATCH))
    interactive = GenerationRequest(ids, SamplingParams(max_tokens=2, temperature=0), priority=Priority.INTERACTIVE)
    engine.add_request(interactive)
    steps = 0
    while interactive.request_id in {s.request_id for s in engine.scheduler.waiting}:
        engine.step()
        steps += 1
    return admitted, steps


def test_batch_prompts_join_running_batch_work_in_groups(tiny_llama) -> None:
    """While BATCH sequences run, waiting BATCH prompts start in groups (every step that computes prompts pays the
    Python forward's fixed cost), not one by one as slots free; fewer than a group start once they all fit. An
    interactive prompt never waits for a group."""
    grouped, interactive_wait = _batch_admissions(tiny_llama, group=3)
    assert grouped == [3, 1]
    one_by_one, interactive_alone = _batch_admissions(tiny_llama, group=1)
    assert one_by_one == [1, 1, 1, 1]
    # The interactive prompt starts at the first step with a free slot, as it does without groups.
    assert interactive_wait == interactive_alone >= 1


def test_batch_decodes_sit_out_the_steps_that_compute_an_interactive_prompt(tiny_llama) -> None:
    llm = _llm(tiny_llama, max_num_batched_tokens=16)
    engine = llm.engine
    ids = llm.encode(PROMPTS[2], raw=True)
    long_params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    batch = [GenerationRequest(ids, long_params, priority=Priority.BATCH) for _ in range(3)]
    for request in batch:
        engine.add_request(request)
    batch_ids = {r.request_id for r in batch}
    producing: set[str] = set()
    while producing != batch_ids:  # until every batch sequence decodes
        producing |= {o.request_id for o in engine.step() if o.delta_token_ids}
    interactive = GenerationRequest(ids * 3, SamplingParams(max_tokens=3, temperature=0))
    engine.add_request(interactive)
    prompt_steps = 0
    while True:
        produced = {o.request_id for o in engine.step() if o.delta_token_ids}
        prompt_steps += 1
        assert not produced & batch_ids  # batch tokens wait while the interactive prompt is computed
        if interactive.request_id in produced:
            break
    assert prompt_steps > 2  # the prompt took several chunks, and the batch sat out every one
    produced = {o.request_id for o in engine.step() if o.delta_token_ids}
    assert batch_ids <= produced  # interactive decodes alone never pause the batch


def test_metrics_report_the_work_done(tiny_llama) -> None:
    llm = _llm(tiny_llama)
    llm.generate(PROMPTS, GREEDY)
    m = llm.engine.metrics()
    assert m.generation_tokens_total == 24 * len(PROMPTS)
    assert m.requests_finished_total == len(PROMPTS)
    assert m.prompt_tokens_total == sum(len(llm.encode(p, raw=True)) for p in PROMPTS)
    assert m.queue_depth == 0 and m.running == 0
    assert 0 < m.kv_blocks_free <= m.kv_blocks_total
    assert m.ttft_s_avg is not None and m.ttft_s_avg > 0
    assert m.tpot_s_avg is not None and m.tpot_s_avg > 0


@pytest.mark.real_model
def test_smollm2_chat_answers_in_bf16() -> None:
    require_installed(SMOLLM)
    llm = LLM(SMOLLM, EngineConfig(dtype="bfloat16", kv_cache_memory="128MiB"))
    out = llm.chat([[{"role": "user", "content": "What is the capital of France? Answer in one word."}]],
                   SamplingParams(max_tokens=16, temperature=0.0))[0]
    assert "Paris" in out.text
    assert out.finish_reason is FinishReason.STOP  # the model ends its turn with <|im_end|>
