"""The queue-wait estimate behind backpressure counts only the work a new interactive request waits behind."""

from __future__ import annotations

import dataclasses

from controlplane.serving.dispatch import LoadMeter
from inference import EngineMetrics

SLOTS = 64
IDLE = EngineMetrics(queue_depth=0, running=0, kv_blocks_total=100, kv_blocks_free=100, kv_usage=0.0,
                     prefix_cache_hit_rate=0.0, prefix_cache_hit_tokens=0, prompt_tokens_total=0,
                     generation_tokens_total=0, requests_finished_total=0, preemptions_total=0, ttft_s_avg=60.0,
                     tpot_s_avg=0.3, tokens_per_s=0.0)


def test_a_running_batch_does_not_delay_interactive_requests() -> None:
    # 56 batch items running (the engine's cap for them), 24 more waiting, none finished lately, batch TTFTs long.
    busy_with_batch = dataclasses.replace(IDLE, running=56, queue_depth=24, interactive_waiting=0)
    load = LoadMeter().load("m", busy_with_batch, SLOTS)
    assert load.wait_s == 0.0 and not load.busy and load.waiting == 0


def test_interactive_requests_ahead_or_full_slots_make_a_wait() -> None:
    meter = LoadMeter()
    queued = dataclasses.replace(IDLE, running=SLOTS, queue_depth=30, interactive_waiting=5)
    load = meter.load("m", queued, SLOTS)
    assert load.busy and load.waiting == 5
    # Nothing finished lately: each running sequence takes an average request's time (60 s + 0.3 s x 128).
    assert abs(load.wait_s - 6 / (SLOTS / (60.0 + 0.3 * 128))) < 1e-6
    full = dataclasses.replace(IDLE, running=SLOTS, queue_depth=10, interactive_waiting=0)
    assert meter.load("m", full, SLOTS).busy


def test_a_quiet_spell_is_not_taken_for_a_slow_engine(monkeypatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr("controlplane.serving.dispatch.time.monotonic", lambda: clock[0])
    meter = LoadMeter()
    meter.load("m", IDLE, SLOTS)  # the last request before ten quiet minutes
    clock[0] += 600.0
    burst = dataclasses.replace(IDLE, running=SLOTS, queue_depth=3, interactive_waiting=3,
                                requests_finished_total=10, ttft_s_avg=1.0, tpot_s_avg=0.05)
    load = meter.load("m", burst, SLOTS)
    # Not 10 finishes per 600 s (a 240 s wait): the engine's own averages, 64 sequences of 1 + 0.05 x 128 s.
    assert abs(load.wait_s - 4 / (SLOTS / (1.0 + 0.05 * 128))) < 1e-6
