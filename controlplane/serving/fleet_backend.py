"""The Backend on the fleet (HEARTH_ENGINE=ray): the same protocol as the in-process engines, through Ray Serve.

Requests go to `fleet.client.FleetClient`, which reaches each model's replicas through DeploymentHandles and
our request router; this module only adapts its answers to what the control plane expects, and reads which
models to deploy from the catalog (`deploy_specs`, used by `manage.py deploy_fleet`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Mapping
from typing import Any

from controlplane.serving.dispatch import (
    EmbeddingResult,
    Load,
    LoadMeter,
    catalog_settings,
    check_prompt_chars,
)
from fleet.app import ModelDeployment
from fleet.client import FleetClient
from inference import EngineMetrics, GenerationRequest, ModelInfo, RequestOutput
from inference.constrained import Constraint

# Gauges that add up over replicas; every other field is taken from the busiest replica (ratios, averages).
_SUMMED = ("queue_depth", "running", "kv_blocks_total", "kv_blocks_free", "prefix_cache_hit_tokens",
           "prompt_tokens_total", "generation_tokens_total", "requests_finished_total", "preemptions_total",
           "tokens_per_s", "spec_proposed", "spec_accepted", "kv_compressions_total", "kv_evicted_entries_total",
           "kv_freed_blocks_total", "mid_step_admissions_total", "lora_slots", "lora_disk_loads_total",
           "lora_slot_loads_total", "grammar_compiles_total", "grammar_cache_hits_total", "jump_forward_proposed",
           "jump_forward_accepted", "interactive_waiting", "interactive_prefill_tokens")


def combined(replicas: list[EngineMetrics]) -> EngineMetrics:
    """A model's gauges over all its replicas."""
    busiest = max(replicas, key=lambda m: (m.running + m.queue_depth, m.kv_usage))
    sums = {name: sum(getattr(m, name) for m in replicas) for name in _SUMMED}
    total = sums["kv_blocks_total"]
    return dataclasses.replace(busiest, **sums, kv_usage=(total - sums["kv_blocks_free"]) / total if total else 0.0,
                               prefix_cache_hit_rate=max(m.prefix_cache_hit_rate for m in replicas))


class RayBackend:
    def __init__(self, client: FleetClient | None = None) -> None:
        self.client = client or FleetClient()
        self._meter = LoadMeter()

    async def model_info(self, model: str) -> ModelInfo:
        return await self.client.info(model)

    async def encode(self, model: str, *, prompt: str | None = None, messages: list[Any] | None = None,
                     raw: bool = False, tools: list[dict[str, Any]] | None = None) -> list[int]:
        limit, window = await self.client.char_limit(model)
        check_prompt_chars(prompt, messages, limit, window)
        return await self.client.encode(model, prompt=prompt, messages=messages, raw=raw, tools=tools)

    async def prepare_constraint(self, model: str, constraint: Constraint) -> None:
        await self.client.compile(model, constraint)

    def stream(self, model: str, request: GenerationRequest, session: str = "") -> AsyncIterator[RequestOutput]:
        return self.client.stream(model, request, session)

    async def generate(self, model: str, request: GenerationRequest, session: str = "") -> RequestOutput:
        return await self.client.generate(model, request, session)

    async def embed(self, model: str, texts: list[str]) -> EmbeddingResult:
        out = await self.client.embed(model, texts)
        return EmbeddingResult(vectors=out["vectors"], dim=out["dim"], prompt_tokens=out["prompt_tokens"],
                               token_counts=out["token_counts"], replica=out.get("replica", ""))

    def metrics(self) -> Mapping[str, EngineMetrics]:
        return {model: combined([r.metrics for r in rs]) for model, rs in self.client.model_metrics().items()}

    def replica_metrics(self) -> list[tuple[str, str, EngineMetrics]]:
        return [(r.model, r.replica, r.metrics) for r in self.client.replica_metrics()]

    def load(self, model: str) -> Load | None:
        """Over every replica, from the last metrics poll (never a call on the request's path)."""
        replicas = self.client.model_metrics().get(model)
        if not replicas:
            return None
        return self._meter.load(model, combined([r.metrics for r in replicas]), sum(r.slots for r in replicas))

    def shutdown(self) -> None:
        self.client.close()


def deploy_specs(entries: list[Any], *, replicas: int = 1, num_cpus: float = 1.0) -> list[ModelDeployment]:
    """What to deploy for the catalog's installed models: each generation model with its engine settings
    (the `fleet` key of them sizes its deployment), each embedding model on its own. `replicas` and
    `num_cpus` (Ray's CPUs per replica) apply where a model's settings name none."""
    specs = []
    for entry in entries:
        if not entry.installed:
            continue
        settings = dict(catalog_settings(entry.name))
        if entry.is_embedding:  # an embedder takes no engine settings, only the fleet's
            settings = {"fleet": settings["fleet"]} if "fleet" in settings else {}
        specs.append(ModelDeployment.from_settings(entry.name, settings, embedding=entry.is_embedding,
                                                   default_replicas=replicas, default_num_cpus=num_cpus))
    return specs
