"""Interruptible batch steps: an interactive arrival stops a batch-only step between layers; the abandoned work
reruns and nothing it touched is committed, so every output is exactly what an uninterrupted run gives."""

from __future__ import annotations

import threading

import pytest

from inference import AsyncEngine, EngineConfig, GenerationRequest, LLMEngine, Priority, SamplingParams
from inference.spec.settings import SpecMode, SpeculationSettings

PROMPTS = ["The capital of France is", "def add(a, b):", "Red, green,", "SELECT * FROM users WHERE",
           "Once upon a time there was", "1, 2, 3, 4,"]


def _engine(path) -> LLMEngine:
    # A small budget per step: long prompts take several chunked-prefill steps, which get interrupted too.
    return LLMEngine.from_model(path, EngineConfig(dtype="float32", kv_cache_memory="16MiB",
                                                   max_num_batched_tokens=32, block_size=16))


def _requests(engine: LLMEngine, priority: Priority, tag: str) -> list[GenerationRequest]:
    off = SpeculationSettings(SpecMode.OFF)
    return [GenerationRequest(engine.tokenizer.encode(p * 3), SamplingParams(max_tokens=24, temperature=0.0,
                                                                             ignore_eos=True),
                              request_id=f"{tag}-{i}", priority=priority, speculation=off)
            for i, p in enumerate(PROMPTS)]


def _run(engine: LLMEngine, requests: list[GenerationRequest], late: GenerationRequest | None = None
         ) -> dict[str, list[int]]:
    for r in requests:
        engine.add_request(r)
    done: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished():
        steps += 1
        if late is not None and steps == 5:
            engine.add_request(late)
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return done


def test_interrupted_batch_steps_change_no_output(tiny_llama) -> None:
    reference = _run(_engine(tiny_llama), _requests(_engine(tiny_llama), Priority.BATCH, "b"))

    engine = _engine(tiny_llama)
    calls = 0

    def every_seventh() -> bool:  # a fresh interactive arrival now and then, mid-pass
        nonlocal calls
        calls += 1
        return calls % 7 == 0

    engine.interrupt = every_seventh
    late = GenerationRequest(engine.tokenizer.encode("An interactive question:"),
                             SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), request_id="i-0")
    got = _run(engine, _requests(engine, Priority.BATCH, "b"), late)
    assert engine.metrics().steps_interrupted_total > 0
    assert {k: v for k, v in got.items() if k.startswith("b-")} == reference
    solo = _engine(tiny_llama)
    assert got["i-0"] == _run(solo, [GenerationRequest(solo.tokenizer.encode("An interactive question:"),
                                                       late.params, request_id="i-0")])["i-0"]


def test_steps_with_interactive_work_are_never_interrupted(tiny_llama) -> None:
    engine = _engine(tiny_llama)
    engine.interrupt = lambda: True  # an interactive request always "waiting"
    got = _run(engine, _requests(engine, Priority.INTERACTIVE, "i"))
    assert engine.metrics().steps_interrupted_total == 0 and len(got) == len(PROMPTS)


@pytest.mark.parametrize("enabled", [True, False])
def test_async_engine_flags_a_waiting_interactive_request(tiny_llama, enabled: bool) -> None:
    eng = AsyncEngine.from_model(tiny_llama, EngineConfig(dtype="float32", kv_cache_memory="16MiB",
                                                          interrupt_batch_steps=enabled))
    in_step, release = threading.Event(), threading.Event()
    try:
        if not enabled:
            assert eng.engine.interrupt is None
            return
        real_step = eng.engine.step

        def held_step():
            in_step.set()
            release.wait(10)
            return real_step()

        eng.engine.step = held_step  # type: ignore[method-assign]
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        eng.submit(GenerationRequest(eng.encode("batch work", raw=True), params, priority=Priority.BATCH),
                   lambda _out: None)
        assert in_step.wait(10)
        assert not eng.engine.interrupt()  # batch arrivals never interrupt
        finished = threading.Event()
        eng.submit(GenerationRequest(eng.encode("a question", raw=True), params),
                   lambda out: out.finished and finished.set())
        assert eng.engine.interrupt()  # the step in flight would stop at its next layer
        release.set()
        assert finished.wait(10)
        assert not eng.engine.interrupt()  # taken in by the loop
    finally:
        release.set()
        eng.shutdown()
