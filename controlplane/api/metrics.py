"""Prometheus metrics: HTTP traffic, inference outcomes and tokens, and the engines' own gauges at scrape time.

One registry per process. Behind several worker processes, scrape each (or run one process per pod).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

REGISTRY = CollectorRegistry(auto_describe=True)
ProcessCollector(registry=REGISTRY)

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

HTTP_REQUESTS = Counter("hearth_http_requests", "HTTP requests by route pattern, method and status",
                        ["route", "method", "status"], registry=REGISTRY)
HTTP_LATENCY = Histogram("hearth_http_request_duration_seconds",
                         "Time to the response headers, by route pattern", ["route"],
                         buckets=_LATENCY_BUCKETS, registry=REGISTRY)
INFERENCE_REQUESTS = Counter("hearth_inference_requests", "Inference requests by model, API and outcome",
                             ["model", "api", "status"], registry=REGISTRY)
INFERENCE_LATENCY = Histogram("hearth_inference_duration_seconds", "Whole inference request, end to end",
                              ["model"], buckets=_LATENCY_BUCKETS, registry=REGISTRY)
TTFT = Histogram("hearth_time_to_first_token_seconds", "Arrival to first generated token", ["model"],
                 buckets=_LATENCY_BUCKETS, registry=REGISTRY)
TOKENS = Counter("hearth_tokens", "Tokens metered, by model and kind (input, cached_input, output)",
                 ["model", "kind"], registry=REGISTRY)
NEURONS = Counter("hearth_neurons", "Neurons metered, by model", ["model"], registry=REGISTRY)
SPEC_TOKENS = Counter("hearth_speculative_tokens", "Speculative draft tokens metered, by model and kind "
                      "(proposed, accepted)", ["model", "kind"], registry=REGISTRY)

_ENGINE_GAUGES = {
    "queue_depth": "Requests waiting in the engine queue",
    "running": "Sequences running in the engine",
    "kv_blocks_total": "KV-cache blocks in the pool",
    "kv_blocks_free": "Free KV-cache blocks",
    "kv_usage": "Fraction of the KV cache in use",
    "prefix_cache_hit_rate": "Fraction of prompt tokens served from the prefix cache",
    "tokens_per_s": "Generated tokens per second (recent)",
    "interactive_prefill_tokens": "Interactive prompt tokens still to compute (what a new prompt queues behind)",
    "ttft_s_avg": "Average engine time to first token (seconds)",
    "tpot_s_avg": "Average time per output token (seconds)",
    "spec_acceptance_rate": "Fraction of speculative draft tokens the target accepted",
    "spec_mean_accepted_length": "Draft tokens accepted per verification step",
}
_ENGINE_COUNTERS = {
    "prompt_tokens_total": "Prompt tokens the engine processed",
    "generation_tokens_total": "Tokens the engine generated",
    "requests_finished_total": "Requests the engine finished",
    "spec_proposed": "Speculative draft tokens proposed",
    "spec_accepted": "Speculative draft tokens accepted",
    "preemptions_total": "Sequences preempted for lack of KV-cache blocks",
    "mid_step_admissions_total": "Interactive prompts started between the layers of a step in flight",
}


class EngineCollector(Collector):
    """Reads the backend's engine metrics when scraped, so idle engines cost nothing between scrapes."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        from controlplane.serving.dispatch import current_backend

        backend = current_backend()
        snapshot = backend.metrics() if backend is not None else {}
        for field, doc in {**_ENGINE_GAUGES, **_ENGINE_COUNTERS}.items():
            family = GaugeMetricFamily(f"hearth_engine_{field}", doc, labels=["model"])
            for model, metrics in snapshot.items():
                value = getattr(metrics, field, None)
                if value is not None:
                    family.add_metric([model], float(value))
            yield family
        positions = GaugeMetricFamily("hearth_engine_spec_position_acceptance",
                                      "Acceptance rate of the draft token at each position (1 = first)",
                                      labels=["model", "position"])
        for model, metrics in snapshot.items():
            for i, rate in enumerate(getattr(metrics, "spec_per_position_acceptance", None) or (), start=1):
                positions.add_metric([model, str(i)], float(rate))
        yield positions
        # The same gauges per engine replica: on a fleet, which replica is hot, full or cold.
        replicas = backend.replica_metrics() if backend is not None else []
        for field, doc in {**_ENGINE_GAUGES, **_ENGINE_COUNTERS}.items():
            family = GaugeMetricFamily(f"hearth_replica_{field}", f"{doc}, per engine replica",
                                       labels=["model", "replica"])
            for model, replica, metrics in replicas:
                value = getattr(metrics, field, None)
                if value is not None:
                    family.add_metric([model, replica], float(value))
            yield family


REGISTRY.register(EngineCollector())
