"""The engine's counts behind its metrics (EngineCounters): totals, means and the tokens/s window, on random times."""

from __future__ import annotations

import random

from inference.counters import TOKENS_PER_S_WINDOW_S, EngineCounters


def test_counts_means_and_a_rate_over_the_last_ten_seconds() -> None:
    rng = random.Random()
    counters = EngineCounters()
    empty = counters.metrics(now=100.0)
    assert empty["tokens_per_s"] == 0.0 and empty["ttft_s_avg"] is None and empty["tpot_s_avg"] is None
    prompts = [rng.randint(1, 500) for _ in range(5)]
    now = 0.0
    times: list[float] = []
    for prompt in prompts:  # each request: its first token counts its prompt, then more tokens
        for i in range(rng.randint(1, 20)):
            now += rng.uniform(0.01, 0.5)
            times.append(now)
            counters.token(now, prompt if i == 0 else None)
    ttfts, tpots = [rng.uniform(0.01, 2.0) for _ in prompts], [rng.uniform(0.001, 0.1) for _ in prompts]
    for ttft, tpot in zip(ttfts, tpots, strict=True):
        counters.request_finished(ttft, tpot)
    counters.request_finished(None, None)  # a request that failed before its first token
    got = counters.metrics(now)
    assert got["prompt_tokens_total"] == sum(prompts) and got["generation_tokens_total"] == len(times)
    assert got["requests_finished_total"] == len(prompts) + 1
    assert abs(got["ttft_s_avg"] - sum(ttfts) / len(ttfts)) < 1e-12
    assert abs(got["tpot_s_avg"] - sum(tpots) / len(tpots)) < 1e-12
    recent = [t for t in times if t >= now - TOKENS_PER_S_WINDOW_S]
    expected = len(recent) / (now - recent[0]) if now > recent[0] else 0.0
    assert abs(got["tokens_per_s"] - expected) < 1e-9
    assert counters.metrics(now + 2 * TOKENS_PER_S_WINDOW_S)["tokens_per_s"] == 0.0  # all of them forgotten
