"""Deploying the fleet: one Ray Serve application per model, its replicas placed by HearthRouter.

The control plane decides what to deploy (from its catalog) and calls `deploy`; nothing here reads Django.
Serve gets no HTTP ingress of its own: the control plane is the only door, and reaches replicas through
DeploymentHandles.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fleet.adapters import DISK_MB_ENV, budget_bytes

log = logging.getLogger("fleet")

NAMESPACE = "hearth"
DEPLOYMENT = "engine"
STATS_PERIOD_S = 0.5
HEARTH_ROUTER = "fleet.router:HearthRouter"
SERVE_DEFAULT_ROUTER = "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"  # how often replicas publish load and prefix-cache summaries to routers


@dataclass(frozen=True, slots=True)
class ModelDeployment:
    """How one model is served. `replicas` fixed, or autoscaled between min and max when max > min."""

    model: str
    embedding: bool = False
    source: str | None = None  # what the replicas load, when not the bundled model of that name (a checkpoint dir)
    engine_settings: Mapping[str, Any] = field(default_factory=dict)
    replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    router: Mapping[str, Any] = field(default_factory=dict)  # HearthRouter's settings (load_factor, ...)
    request_router: str = HEARTH_ROUTER  # another import path only to compare (Serve's own, in benchmarks)

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.num_cpus <= 0 or self.num_gpus < 0:
            raise ValueError(f"{self.model}: replicas must be >= 1, num_cpus > 0 and num_gpus >= 0")

    @classmethod
    def from_settings(cls, model: str, settings: Mapping[str, Any], *, embedding: bool = False,
                      default_replicas: int = 1, default_num_cpus: float = 1.0) -> ModelDeployment:
        """From a catalog entry's engine settings, whose `fleet` key (if any) holds replicas, min_replicas,
        max_replicas, num_cpus, num_gpus and router; every other key is the engine's."""
        engine = dict(settings)
        fleet = dict(engine.pop("fleet", None) or {})
        unknown = sorted(set(fleet) - {"replicas", "min_replicas", "max_replicas", "num_cpus", "num_gpus", "router"})
        if unknown:
            raise ValueError(f"{model}: unknown fleet settings {unknown}")
        return cls(model=model, embedding=embedding, engine_settings=engine,
                   replicas=int(fleet.get("replicas", default_replicas)), min_replicas=fleet.get("min_replicas"),
                   max_replicas=fleet.get("max_replicas"), num_cpus=float(fleet.get("num_cpus", default_num_cpus)),
                   num_gpus=float(fleet.get("num_gpus", 0.0)), router=dict(fleet.get("router") or {}))

    @property
    def autoscaling(self) -> dict[str, Any] | None:
        if self.max_replicas is None or self.max_replicas <= (self.min_replicas or self.replicas):
            return None
        return {"min_replicas": self.min_replicas or 1, "max_replicas": self.max_replicas,
                "initial_replicas": self.replicas, "target_ongoing_requests": 16}


def app_name(model: str) -> str:
    """A Serve application name for a model id (`@hearth/smollm2-135m-instruct` -> `hearth-smollm2-135m-...`)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", model.lstrip("@")).strip("-")


def build(spec: ModelDeployment) -> Any:
    """The bound Serve application of one model."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from fleet.replica import EmbedderReplica, EngineReplica

    budget_bytes(DISK_MB_ENV, 1)  # a bad budget fails the deploy here, not every replica's start
    env = {k: os.environ[k] for k in ("HEARTH_DATA_DIR", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", DISK_MB_ENV)
           if k in os.environ}
    actor = {"num_cpus": spec.num_cpus, "num_gpus": spec.num_gpus, "runtime_env": {"env_vars": env}}
    slots = int(spec.engine_settings.get("max_num_seqs", 64))
    scale: dict[str, Any] = ({"autoscaling_config": spec.autoscaling} if spec.autoscaling
                             else {"num_replicas": spec.replicas})
    if spec.embedding:
        deployment = serve.deployment(EmbedderReplica).options(
            name=DEPLOYMENT, ray_actor_options=actor, max_ongoing_requests=64, health_check_period_s=2.0,
            **scale)
        return deployment.bind(spec.source or spec.model)
    deployment = serve.deployment(EngineReplica).options(
        name=DEPLOYMENT, ray_actor_options=actor,
        # The engine queues and schedules by itself; Serve only needs to stop feeding a replica that is far
        # behind, so the cap is a few times its sequence slots (calls to encode and compile count too).
        max_ongoing_requests=4 * slots + 16, health_check_period_s=2.0, graceful_shutdown_timeout_s=5.0,
        request_router_config=RequestRouterConfig(
            request_router_class=spec.request_router,
            request_router_kwargs=dict(spec.router) if spec.request_router == HEARTH_ROUTER else {},
            request_routing_stats_period_s=STATS_PERIOD_S, request_routing_stats_timeout_s=5.0),
        **scale)
    return deployment.bind(spec.source or spec.model, dict(spec.engine_settings))


def connect(address: str | None = None, *, num_cpus: int | None = None) -> None:
    """Join the Ray cluster at `address` (RAY_ADDRESS when None; a new local one when neither is set) in the
    Hearth namespace."""
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS") or None
    options: dict[str, Any] = {"namespace": NAMESPACE, "log_to_driver": False, "ignore_reinit_error": True}
    if address is None and num_cpus is not None:
        options["num_cpus"] = num_cpus
    ray.init(address=address, **options)


def deploy(specs: Iterable[ModelDeployment]) -> list[str]:
    """Deploy (or update in place) every model's application, waiting until each runs; returns their names."""
    from ray import serve

    serve.start(proxy_location="Disabled")
    names = []
    for spec in specs:
        name = app_name(spec.model)
        log.info("deploying %s (%s replicas)", name, spec.autoscaling or spec.replicas)
        serve.run(build(spec), name=name, route_prefix=None)
        names.append(name)
    return names


def undeploy(models: Iterable[str]) -> None:
    from ray import serve

    for model in models:
        serve.delete(app_name(model))
