"""The background-thread engine: streaming, abort by closing a stream, isolation between callers."""

from __future__ import annotations

import asyncio
import threading

import pytest

from inference import (
    AsyncEngine,
    EngineConfig,
    FinishReason,
    GenerationRequest,
    InvalidRequestError,
    PromptTooLongError,
    SamplingParams,
)
from tests.engine.conftest import SMOLLM, hold_steps, require_installed


@pytest.fixture(scope="module")
def engine(tiny_llama):
    eng = AsyncEngine.from_model(tiny_llama, EngineConfig(dtype="float32", kv_cache_memory="16MiB"))
    yield eng
    eng.shutdown()


def _request(engine: AsyncEngine, prompt: str, **params) -> GenerationRequest:
    settings = {"max_tokens": 20, "temperature": 0.0, "ignore_eos": True, **params}
    return GenerationRequest(engine.encode(prompt, raw=True), SamplingParams(**settings))


async def test_streamed_deltas_add_up_to_the_final_text(engine: AsyncEngine) -> None:
    request = _request(engine, "Once upon a time", stop=["zzz"])
    deltas, final = [], None
    async for out in engine.stream(request):
        deltas.append(out.delta_text)
        final = out
    assert final is not None and final.finished
    assert "".join(deltas) == final.text
    assert len(final.token_ids) == 20 and final.finish_reason is FinishReason.LENGTH
    assert final.usage.completion_tokens == 20 and final.metrics.ttft_s is not None


async def test_concurrent_streams_match_their_solo_runs(engine: AsyncEngine) -> None:
    prompts = ["The capital of France is", "def add(a, b):", "Red, green,", "SELECT * FROM"]
    solo = [(await engine.generate(_request(engine, p))).token_ids for p in prompts]
    together = await asyncio.gather(*(engine.generate(_request(engine, p)) for p in prompts))
    assert [o.token_ids for o in together] == solo


async def test_closing_a_stream_aborts_the_request(engine: AsyncEngine) -> None:
    request = _request(engine, "Count with me: one, two,", max_tokens=200)
    stream = engine.stream(request)
    async for _ in stream:
        break
    await stream.aclose()
    for _ in range(100):
        if engine.metrics().running == 0 and engine.metrics().queue_depth == 0:
            break
        await asyncio.sleep(0.02)
    assert engine.metrics().running == 0
    # The engine still serves.
    assert (await engine.generate(_request(engine, "Hello", max_tokens=3))).finished


async def test_cancelling_generate_aborts_the_request(engine: AsyncEngine) -> None:
    task = asyncio.ensure_future(engine.generate(_request(engine, "Count with me: one, two,", max_tokens=400)))
    for _ in range(200):
        if engine.metrics().running:
            break
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(100):
        if engine.metrics().running == 0 and engine.metrics().queue_depth == 0:
            break
        await asyncio.sleep(0.02)
    assert engine.metrics().running == 0
    final = await engine.generate(_request(engine, "Hello", max_tokens=3))
    assert final.finished and len(final.token_ids) == 3 and final.text  # the final output carries it all


async def test_bad_requests_fail_alone_with_clear_errors(engine: AsyncEngine) -> None:
    good = asyncio.ensure_future(engine.generate(_request(engine, "The capital of France is")))
    with pytest.raises(InvalidRequestError, match="token ids"):
        await engine.generate(GenerationRequest([10**9], SamplingParams()))
    with pytest.raises(PromptTooLongError):
        await engine.generate(GenerationRequest([7] * 100_000, SamplingParams()))
    with pytest.raises(InvalidRequestError):
        engine.encode(messages=[{"role": "wizard", "content": "hi"}])
    assert (await good).finish_reason is FinishReason.LENGTH


def test_a_failing_caller_sink_does_not_hurt_others(engine: AsyncEngine) -> None:
    def broken_sink(item) -> None:
        raise RuntimeError("this caller went away")

    engine.submit(_request(engine, "Once upon a time", max_tokens=50), broken_sink)
    out = engine.generate_blocking(_request(engine, "Once upon a time"), timeout=60)
    assert out.finished and len(out.token_ids) == 20
    assert engine.alive


def test_blocking_callers_from_many_threads(engine: AsyncEngine) -> None:
    results: dict[int, list[int]] = {}

    def worker(i: int) -> None:
        results[i] = engine.generate_blocking(_request(engine, f"Number {i}:", max_tokens=8), timeout=60).token_ids

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == list(range(6)) and all(len(v) == 8 for v in results.values())


@pytest.mark.real_model
async def test_smollm2_streams_multibyte_text_intact() -> None:
    require_installed(SMOLLM)
    engine = AsyncEngine.from_model(SMOLLM, EngineConfig(kv_cache_memory="64MiB"))
    try:
        ids = engine.encode(messages=[{"role": "user", "content": "Write three emoji and the word café."}])
        request = GenerationRequest(ids, SamplingParams(max_tokens=40, temperature=0.0))
        outs = [out async for out in engine.stream(request)]
        pieces = [out.delta_text for out in outs]
        # A character is never split across deltas: only a reply cut off by max_tokens in the middle of a
        # multi-byte character may end with U+FFFD, exactly as decoding all its tokens at once does.
        assert all("\ufffd" not in p for p in pieces[:-1])
        assert "".join(pieces) == engine.tokenizer.decode(outs[-1].token_ids, skip_special_tokens=True)
        assert "".join(pieces).strip()
    finally:
        engine.shutdown()


def test_encoding_does_not_wait_for_the_step_in_flight(tiny_llama) -> None:
    """The loop thread detokenizes with the engine's tokenizer while callers encode on their own copy: a request
    arriving during a long step is encoded at once (it used to queue behind the whole step)."""
    eng = AsyncEngine.from_model(tiny_llama, EngineConfig(dtype="float32", kv_cache_memory="16MiB"))
    in_step, release = hold_steps(eng)
    try:
        eng.submit(_request(eng, "Once upon a time", max_tokens=2), lambda _out: None)
        assert in_step.wait(10)
        encoded = threading.Event()
        ids: list[int] = []
        worker = threading.Thread(target=lambda: (ids.extend(eng.encode("Hello there", raw=True)), encoded.set()))
        worker.start()
        assert encoded.wait(5), "encode() waited for the engine step in flight"
        release.set()
        worker.join(5)
        assert ids and ids == eng.encode("Hello there", raw=True)
    finally:
        release.set()
        eng.shutdown()
