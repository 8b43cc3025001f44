"""Interactive arrivals start between the layers of the step in flight: their first token comes out before that
step ends, and nothing else changes — every output is what running each request on its own gives."""

from __future__ import annotations

import threading

from inference import (
    AsyncEngine,
    EngineConfig,
    FinishReason,
    GenerationRequest,
    LLMEngine,
    Priority,
    RequestOutput,
    SamplingParams,
)
from inference.spec.settings import SpecMode, SpeculationSettings
from tests.engine.conftest import hold_steps

PROMPTS = ["The capital of France is", "def add(a, b):", "Red, green,", "SELECT * FROM users WHERE",
           "Once upon a time there was", "1, 2, 3, 4,"]
OFF = SpeculationSettings(SpecMode.OFF)


def _engine(path) -> LLMEngine:
    # A small token budget: long prompts take several chunked-prefill steps, which see arrivals too.
    return LLMEngine.from_model(path, EngineConfig(dtype="float32", kv_cache_memory="16MiB",
                                                   max_num_batched_tokens=32))


def _batch(engine: LLMEngine) -> list[GenerationRequest]:
    return [GenerationRequest(engine.tokenizer.encode(p * 3), SamplingParams(max_tokens=24, temperature=0.0,
                                                                             ignore_eos=True),
                              request_id=f"b-{i}", priority=Priority.BATCH, speculation=OFF)
            for i, p in enumerate(PROMPTS)]


def _interactive(engine: LLMEngine, n: int) -> GenerationRequest:
    return GenerationRequest(engine.tokenizer.encode(f"Question {n}: why is the sky"),
                             SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), request_id=f"i-{n}",
                             speculation=OFF)


def _solo(path, make) -> list[int]:
    engine = _engine(path)
    request = make(engine)
    engine.add_request(request)
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                return out.token_ids
    raise AssertionError("no output")


class ScriptedFront:
    """Hands the engine an interactive request mid-pass, on a chosen layer call of chosen steps."""

    def __init__(self, engine: LLMEngine, arrivals: dict[int, GenerationRequest], on_call: int) -> None:
        self.engine, self.arrivals, self.on_call = engine, arrivals, on_call
        self.step = 0
        self.calls = 0
        self.delivered: list[tuple[int, RequestOutput]] = []  # (step, output) handed over mid-step

    def has_arrivals(self) -> bool:
        self.calls += 1
        return self.step in self.arrivals and self.calls == self.on_call

    def take_arrivals(self) -> None:
        self.engine.add_request(self.arrivals.pop(self.step))

    def deliver(self, outputs: list[RequestOutput]) -> None:
        self.delivered += [(self.step, out) for out in outputs]


def _drive(engine: LLMEngine, front: ScriptedFront) -> dict[str, list[int]]:
    """Run the batch to the end, the front handing over its arrivals on their steps; final tokens by id."""
    for request in _batch(engine):
        engine.add_request(request)
    finished: dict[str, list[int]] = {}
    while engine.has_unfinished() or front.arrivals:
        front.step += 1
        front.calls = 0
        finished.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return finished


def test_arrivals_get_their_first_token_inside_the_step_in_flight(tiny_llama) -> None:
    engine = _engine(tiny_llama)
    arrivals = {3: _interactive(engine, 0), 9: _interactive(engine, 1)}
    front = ScriptedFront(engine, dict(arrivals), on_call=2)  # before the second layer of the pass
    engine.front = front
    finished = _drive(engine, front)
    # Each arrival's first token was handed over during the very step it arrived in.
    firsts = {out.request_id: step for step, out in front.delivered}
    assert firsts == {"i-0": 3, "i-1": 9}
    assert all(len(out.token_ids) == 1 for _, out in front.delivered)
    assert engine.metrics().mid_step_admissions_total == 2
    # Nothing changed: the batch and the arrivals produce what they produce alone (fp32, greedy).
    for i in range(len(PROMPTS)):
        assert finished[f"b-{i}"] == _solo(tiny_llama, lambda e, i=i: _batch(e)[i])
    for n in (0, 1):
        assert finished[f"i-{n}"] == _solo(tiny_llama, lambda e, n=n: _interactive(e, n))


def test_without_free_blocks_an_arrival_waits_for_the_next_step(tiny_llama) -> None:
    engine = LLMEngine.from_model(tiny_llama, EngineConfig(dtype="float32", kv_cache_memory="16MiB",
                                                           max_num_seqs=len(PROMPTS)))
    front = ScriptedFront(engine, {4: _interactive(engine, 0)}, on_call=1)
    engine.front = front
    finished = _drive(engine, front)
    # Every slot was taken by the batch: the arrival was added mid-step but started only once a slot freed.
    assert front.delivered == [] and engine.metrics().mid_step_admissions_total == 0
    assert finished["i-0"] == _solo(tiny_llama, lambda e: _interactive(e, 0))


def _long(engine: LLMEngine, name: str, text: str) -> GenerationRequest:
    return GenerationRequest(engine.tokenizer.encode(text), SamplingParams(max_tokens=4, temperature=0.0,
                                                                          ignore_eos=True),
                             request_id=name, speculation=OFF)


def _first_tokens(engine: LLMEngine, front: ScriptedFront,
                  opening: list[GenerationRequest]) -> tuple[dict[str, int], dict[str, list[int]]]:
    """Run opening and the front's arrivals to the end: the step in which each request got its first token, and
    each one's final tokens."""
    for request in opening:
        engine.add_request(request)
    firsts: dict[str, int] = {}
    finals: dict[str, list[int]] = {}
    while engine.has_unfinished() or front.arrivals:
        front.step += 1
        front.calls = 0
        for out in engine.step():
            firsts.setdefault(out.request_id, front.step)
            if out.finished:
                finals[out.request_id] = out.token_ids
    for step, out in front.delivered:
        firsts[out.request_id] = min(firsts.get(out.request_id, step), step)
    return firsts, finals


LONG_A = " ".join(f"alpha {i} beta" for i in range(30))
LONG_B = " ".join(f"gamma {i} delta" for i in range(30))


def test_a_long_arrival_waits_while_another_interactive_prompt_is_computed(tiny_llama) -> None:
    engine = _engine(tiny_llama)  # 32 tokens a step: each long prompt takes several
    front = ScriptedFront(engine, {2: _long(engine, "second", LONG_B)}, on_call=2)
    engine.front = front
    firsts, finals = _first_tokens(engine, front, [_long(engine, "first", LONG_A)])
    # Not started between the layers: sharing the steps would only have made the first prompt finish later.
    assert engine.metrics().mid_step_admissions_total == 0 and front.delivered == []
    assert firsts["first"] < firsts["second"]
    for name, text in (("first", LONG_A), ("second", LONG_B)):
        assert finals[name] == _solo(tiny_llama, lambda e, n=name, t=text: _long(e, n, t))


def test_a_short_arrival_or_a_long_one_mostly_cached_still_starts_mid_step(tiny_llama) -> None:
    engine = _engine(tiny_llama)
    # Cache LONG_B's prompt first: an arrival that extends it has only a few uncached tokens.
    engine.add_request(_long(engine, "warm", LONG_B))
    while engine.has_unfinished():
        engine.step()
    extended = _long(engine, "extended", LONG_B + " and one more")
    arrivals = {2: _interactive(engine, 0), 4: extended}
    front = ScriptedFront(engine, dict(arrivals), on_call=2)
    engine.front = front
    firsts, _ = _first_tokens(engine, front, [_long(engine, "first", LONG_A)])
    assert firsts["first"] > 4 and (firsts["i-0"], firsts["extended"]) == (2, 4)
    assert engine.metrics().mid_step_admissions_total == 2


def test_a_long_arrival_still_starts_mid_step_beside_batch_work(tiny_llama) -> None:
    engine = _engine(tiny_llama)
    front = ScriptedFront(engine, {3: _long(engine, "long", LONG_A)}, on_call=2)
    engine.front = front
    _drive(engine, front)
    # Its first chunk ran between the layers (batch prompts sit out from then on); its first token needs more.
    assert engine.metrics().mid_step_admissions_total == 1


def test_the_gauge_of_queued_prompt_tokens_counts_what_is_left_to_compute(tiny_llama) -> None:
    engine = _engine(tiny_llama)  # 32 tokens a step
    warm = _long(engine, "warm", LONG_B)
    engine.add_request(warm)
    while engine.has_unfinished():
        engine.step()
    assert engine.metrics().interactive_prefill_tokens == 0
    first = _long(engine, "first", LONG_A)
    engine.add_request(first)
    engine.step()  # its first chunk
    extended = _long(engine, "extended", LONG_B + " and one more")
    fresh = _long(engine, "fresh", LONG_A + " again")  # its first two blocks are first's, computed already
    assert extended.prompt_token_ids[:len(warm.prompt_token_ids)] == warm.prompt_token_ids
    for request in (extended, fresh, _batch(engine)[0]):  # batch prompts are not an interactive queue
        engine.add_request(request)
    cached = len(warm.prompt_token_ids) // 16 * 16  # LONG_B's full blocks
    assert engine.metrics().interactive_prefill_tokens == (len(first.prompt_token_ids) - 32) + (
        len(extended.prompt_token_ids) - cached) + (len(fresh.prompt_token_ids) - 32)


def test_async_engine_defers_aborts_taken_mid_step(tiny_llama) -> None:
    eng = AsyncEngine.from_model(tiny_llama, EngineConfig(dtype="float32", kv_cache_memory="16MiB"))
    in_step, release = hold_steps(eng)
    try:
        assert eng.engine.front is eng
        params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
        outputs: list[RequestOutput] = []
        batch = GenerationRequest(eng.encode("batch work", raw=True), params, priority=Priority.BATCH)
        eng.submit(batch, outputs.append)
        assert in_step.wait(10)
        assert not eng.has_arrivals()  # batch arrivals never count
        eng.abort(batch.request_id)
        question = GenerationRequest(eng.encode("a question", raw=True), SamplingParams(max_tokens=2))
        eng.submit(question, outputs.append)
        assert eng.has_arrivals()
        eng.take_arrivals()  # as the engine would between layers: the abort must not land mid-pass
        assert not eng.has_arrivals()
        assert batch.request_id in eng.engine._sequences and question.request_id in eng.engine._sequences
        assert not eng.engine._sequences[batch.request_id].finished
        release.set()
        for _ in range(200):
            if any(o.request_id == batch.request_id and o.finished for o in outputs) and \
                    any(o.request_id == question.request_id and o.finished for o in outputs):
                break
            threading.Event().wait(0.05)
        final = {o.request_id: o for o in outputs if o.finished}
        assert final[batch.request_id].finish_reason is FinishReason.ABORT
        assert len(final[question.request_id].token_ids) == 2
    finally:
        release.set()
        eng.shutdown()


def test_the_switch_turns_mid_step_admission_off(tiny_llama) -> None:
    eng = AsyncEngine.from_model(tiny_llama, EngineConfig(dtype="float32", kv_cache_memory="16MiB",
                                                          serve_arrivals_mid_step=False))
    try:
        assert eng.engine.front is None
    finally:
        eng.shutdown()
