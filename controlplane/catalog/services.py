"""Catalog reads (a cached, immutable snapshot), pricing arithmetic and seeding from the installed models."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from datetime import date, datetime, timedelta
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.core.cache import cache
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from controlplane.catalog.models import AiModel, Price, Task
from inference.compression import KVCompressionSettings
from inference.config import EngineConfig
from inference.errors import InvalidRequestError
from inference.spec.settings import MAX_SPECULATIVE_TOKENS, SpecMode

_VERSION_KEY = "catalog:version"
_MILLION = Decimal(1_000_000)

# Neurons per million tokens for the bundled models (input, cached input, output); cached input is billed at a
# quarter of fresh input, since the prefix cache skips its prefill. Operators change these as Price rows.
DEFAULT_PRICES: dict[str, tuple[int, int, int]] = {
    "@hearth/smollm2-135m-instruct": (1_500, 375, 6_000),
    "@hearth/qwen2.5-coder-0.5b-instruct": (3_000, 750, 12_000),
    "@hearth/gemma-3-270m": (2_000, 500, 8_000),
    "@hearth/all-minilm-l6-v2": (1_000, 1_000, 0),
}
DEFAULT_PRICE_BY_TASK: dict[str, tuple[int, int, int]] = {
    Task.TEXT_GENERATION: (3_000, 750, 12_000),
    Task.TEXT_EMBEDDINGS: (1_000, 1_000, 0),
}

# EngineConfig fields a model's catalog row starts with; operators edit them per model afterwards. Prompt lookup
# (k=8, the benchmark's setting) pays off on input-grounded work and the engine's adaptive policy switches it
# off where it does not, so the small chat models default to it. The 1.5B drafts with the 0.5B (same tokenizer).
DEFAULT_ENGINE_SETTINGS: dict[str, dict[str, Any]] = {
    "@hearth/qwen2.5-coder-0.5b-instruct": {"speculation": "ngram", "num_speculative_tokens": 8},
    "@hearth/smollm2-135m-instruct": {"speculation": "ngram", "num_speculative_tokens": 8},
    "@hearth/qwen2.5-coder-1.5b-instruct": {"speculation": "draft",
                                            "draft_model": "@hearth/qwen2.5-coder-0.5b-instruct"},
}
# A model without its own settings speculates as the engine does by default.
ENGINE_SPECULATION_DEFAULTS: dict[str, Any] = {
    f.name: f.default for f in fields(EngineConfig) if f.name in ("speculation", "num_speculative_tokens",
                                                                   "draft_model")}


def default_engine_settings(name: str, installed: set[str]) -> dict[str, Any]:
    """The engine settings a newly seeded model starts with. A draft model that is not installed would stop
    the engine from loading, so such a model falls back to prompt lookup, which needs nothing."""
    settings = dict(DEFAULT_ENGINE_SETTINGS.get(name, {}))
    draft = settings.get("draft_model")
    if draft is not None and draft not in installed:
        settings = {"speculation": "ngram", "num_speculative_tokens": 8}
    return settings


@dataclass(frozen=True, slots=True)
class PriceSnapshot:
    price_id: int
    effective_at: float  # unix time
    neurons_per_m_input: Decimal
    neurons_per_m_cached_input: Decimal
    neurons_per_m_output: Decimal
    usd_per_1k_neurons: Decimal
    batch_discount_percent: Decimal | None = None  # None: the HEARTH_BATCH_DISCOUNT_PERCENT setting
    lora_surcharge_percent: Decimal = Decimal(0)  # added to the neurons of a request served with an adapter

    def neurons(self, input_tokens: int, cached_input_tokens: int, output_tokens: int) -> Decimal:
        fresh = max(0, input_tokens - cached_input_tokens)
        total = (fresh * self.neurons_per_m_input + cached_input_tokens * self.neurons_per_m_cached_input
                 + output_tokens * self.neurons_per_m_output)
        return total / _MILLION

    def batch_discount(self) -> Decimal:
        """Percent off neurons for batch work: the price row's own, else the deployment's default."""
        if self.batch_discount_percent is not None:
            return self.batch_discount_percent
        return Decimal(settings.HEARTH_BATCH_DISCOUNT_PERCENT)

    def cost_usd(self, neurons: Decimal) -> Decimal:
        return neurons * self.usd_per_1k_neurons / 1000

    def as_json(self) -> dict[str, Any]:
        def usd_per_m(neurons_per_m: Decimal) -> float:
            return float(self.cost_usd(neurons_per_m))

        return {
            "effective_at": int(self.effective_at),
            "neurons_per_m_input_tokens": float(self.neurons_per_m_input),
            "neurons_per_m_cached_input_tokens": float(self.neurons_per_m_cached_input),
            "neurons_per_m_output_tokens": float(self.neurons_per_m_output),
            "usd_per_1k_neurons": float(self.usd_per_1k_neurons),
            "usd_per_m_input_tokens": usd_per_m(self.neurons_per_m_input),
            "usd_per_m_cached_input_tokens": usd_per_m(self.neurons_per_m_cached_input),
            "usd_per_m_output_tokens": usd_per_m(self.neurons_per_m_output),
            "batch_discount_percent": float(self.batch_discount()),
            "lora_surcharge_percent": float(self.lora_surcharge_percent),
        }


@dataclass(frozen=True, slots=True)
class ModelEntry:
    pk: int
    name: str
    task: str
    description: str
    architecture: str
    context_window: int
    has_chat_template: bool
    supports_lora: bool
    supports_batch: bool
    engine_settings: tuple[tuple[str, Any], ...]
    properties: tuple[tuple[str, Any], ...]
    installed: bool
    deprecated_on: date | None
    created: int
    prices: tuple[PriceSnapshot, ...]  # newest effective time first

    @property
    def is_embedding(self) -> bool:
        return self.task == Task.TEXT_EMBEDDINGS

    @property
    def supports_json_mode(self) -> bool:
        """Structured outputs: any text-generation model can be held to a grammar, unless the operator
        says otherwise (property json_mode: false)."""
        return self.task == Task.TEXT_GENERATION and bool(dict(self.properties).get("json_mode", True))

    @property
    def supports_tools(self) -> bool:
        """Tool calling needs chat messages (tools are rendered into the chat template, or into a system turn
        where the template has no tools); the operator may switch it off (property function_calling)."""
        return (self.task == Task.TEXT_GENERATION and self.has_chat_template
                and bool(dict(self.properties).get("function_calling", True)))

    @property
    def deprecated(self) -> bool:
        return self.deprecated_on is not None and self.deprecated_on <= timezone.now().date()

    def price_at(self, when: float) -> PriceSnapshot | None:
        for price in self.prices:
            if price.effective_at <= when:
                return price
        return None

    @property
    def speculation(self) -> dict[str, Any]:
        """The model's default speculation (what a request without `speculation` gets)."""
        settings = {**ENGINE_SPECULATION_DEFAULTS, **dict(self.engine_settings)}
        return {"mode": settings["speculation"], "k": settings["num_speculative_tokens"],
                "draft_model": settings["draft_model"]}

    @property
    def kv_compression(self) -> dict[str, Any] | None:
        """The model's default KV compression ({"rate": R} or {"max_cache_tokens": N}), None when it has none."""
        settings = dict(self.engine_settings)
        if settings.get("kv_compression_rate") is not None:
            return {"rate": settings["kv_compression_rate"]}
        if settings.get("kv_compression_max_tokens") is not None:
            return {"max_cache_tokens": settings["kv_compression_max_tokens"]}
        return None

    def listing(self, now: float) -> dict[str, Any]:
        """The OpenAI-style model object with Hearth's catalog facts and current price attached."""
        price = self.price_at(now)
        return {
            "id": self.name,
            "object": "model",
            "created": self.created,
            "owned_by": "hearth",
            "task": self.task,
            "description": self.description,
            "context_window": self.context_window,
            "supports_lora": self.supports_lora,
            "supports_batch": self.supports_batch,
            "supports_tools": self.supports_tools,
            "supports_json_mode": self.supports_json_mode,
            "deprecated_on": self.deprecated_on.isoformat() if self.deprecated_on else None,
            "properties": dict(self.properties),
            "speculation": self.speculation if self.task == Task.TEXT_GENERATION else None,
            "pricing": price.as_json() if price else None,
        }


_memo_lock = threading.Lock()
_memo: tuple[str, dict[str, ModelEntry]] | None = None


def _version() -> str:
    token = cache.get(_VERSION_KEY)
    if token is None:
        cache.add(_VERSION_KEY, uuid.uuid4().hex, None)
        token = cache.get(_VERSION_KEY) or "unversioned"
    return token


def invalidate() -> None:
    """Called on every catalog or price change; other processes see the new version token on their next read."""
    global _memo
    cache.set(_VERSION_KEY, uuid.uuid4().hex, None)
    with _memo_lock:
        _memo = None


def _load() -> dict[str, ModelEntry]:
    prices: dict[int, list[PriceSnapshot]] = {}
    for p in Price.objects.order_by("-effective_at"):
        prices.setdefault(p.model_id, []).append(PriceSnapshot(
            price_id=p.pk, effective_at=p.effective_at.timestamp(),
            neurons_per_m_input=p.neurons_per_m_input, neurons_per_m_cached_input=p.neurons_per_m_cached_input,
            neurons_per_m_output=p.neurons_per_m_output, usd_per_1k_neurons=p.usd_per_1k_neurons,
            batch_discount_percent=p.batch_discount_percent, lora_surcharge_percent=p.lora_surcharge_percent))
    entries = {}
    for m in AiModel.objects.filter(is_active=True):
        entries[m.name] = ModelEntry(
            pk=m.pk, name=m.name, task=m.task, description=m.description, architecture=m.architecture,
            context_window=m.context_window, has_chat_template=m.has_chat_template,
            supports_lora=m.supports_lora, supports_batch=m.supports_batch,
            engine_settings=tuple(sorted((m.engine_settings or {}).items())),
            properties=tuple(sorted((m.properties or {}).items())), installed=m.installed,
            deprecated_on=m.deprecated_on, created=int(m.created_at.timestamp()),
            prices=tuple(prices.get(m.pk, ())))
    return entries


def catalog() -> dict[str, ModelEntry]:
    """Active models by name. Rebuilt only when the version token changed; one cache read otherwise."""
    global _memo
    version = _version()
    memo = _memo
    if memo is not None and memo[0] == version:
        return memo[1]
    entries = _load()
    with _memo_lock:
        _memo = (version, entries)
    return entries


def catalog_cached() -> dict[str, ModelEntry] | None:
    """The snapshot if this process holds the current one, else None (rebuilding it needs the database)."""
    memo = _memo
    return memo[1] if memo is not None and memo[0] == _version() else None


def get_model(name: str) -> ModelEntry | None:
    return catalog().get(name)


def served_models(now: float | None = None, entries: dict[str, ModelEntry] | None = None) -> list[dict[str, Any]]:
    now = time.time() if now is None else now
    return [m.listing(now) for m in (entries if entries is not None else catalog()).values() if m.installed]


def set_price(model: AiModel, *, input_neurons: Decimal | float, cached_input_neurons: Decimal | float,
              output_neurons: Decimal | float, effective_at=None, usd_per_1k_neurons: Decimal | None = None,
              batch_discount_percent: Decimal | float | None = None, note: str = "",
              lora_surcharge_percent: Decimal | float | None = None) -> Price:
    """A new price row, effective from `effective_at` (default now); earlier usage keeps its own price."""
    price = Price(model=model, effective_at=effective_at or timezone.now(),
                  neurons_per_m_input=Decimal(str(input_neurons)),
                  neurons_per_m_cached_input=Decimal(str(cached_input_neurons)),
                  neurons_per_m_output=Decimal(str(output_neurons)), note=note)
    if usd_per_1k_neurons is not None:
        price.usd_per_1k_neurons = Decimal(str(usd_per_1k_neurons))
    if batch_discount_percent is not None:
        price.batch_discount_percent = Decimal(str(batch_discount_percent))
    if lora_surcharge_percent is not None:
        price.lora_surcharge_percent = Decimal(str(lora_surcharge_percent))
    price.full_clean()
    price.save()
    return price


# A price effective "now" is stamped when the form is processed; one given a moment earlier (the operator's clock,
# the form's minute resolution) is still now, but anything further back would reprice usage already charged.
PAST_PRICE_GRACE = timedelta(minutes=1)


def change_price(model: AiModel, *, input_neurons: Decimal, cached_input_neurons: Decimal, output_neurons: Decimal,
                 usd_per_1k_neurons: Decimal | None = None, batch_discount_percent: Decimal | None = None,
                 effective_at: datetime | None = None, note: str = "") -> Price:
    """An operator's price change: a new row effective now or later, never earlier (usage already charged keeps
    its price). ValidationError for a time in the past, a negative rate, a discount over 100 or a clash with
    another price of the model at the same instant; nothing is written then."""
    now = timezone.now()
    if effective_at is not None and effective_at < now - PAST_PRICE_GRACE:
        raise ValidationError({"effective_at": "must be now or in the future: usage already charged keeps "
                                               "the price it was charged at"})
    return set_price(model, input_neurons=input_neurons, cached_input_neurons=cached_input_neurons,
                     output_neurons=output_neurons, usd_per_1k_neurons=usd_per_1k_neurons,
                     batch_discount_percent=batch_discount_percent,
                     effective_at=max(effective_at, now) if effective_at else now, note=note.strip()[:200])


_KV_DEFAULT_KEYS = ("kv_compression_rate", "kv_compression_max_tokens")


def set_engine_defaults(model: AiModel, *, speculation: str, k: int,
                        kv_compression: dict[str, Any] | None) -> AiModel:
    """Set what a request that does not ask gets: speculation (mode and k) and KV compression ({"rate": R},
    {"max_cache_tokens": N}, or None for none). Requests pass these to the engine explicitly (see
    serving.pipeline), so the next request uses them without an engine restart. Other engine settings are kept.
    ValidationError (nothing written) for an unknown mode, k outside [1, 16], draft without a draft model, or a
    bad compression value."""
    problems: dict[str, str] = {}
    if speculation not in [m.value for m in SpecMode]:
        problems["speculation"] = f"must be one of {', '.join(m.value for m in SpecMode)}"
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        problems["k"] = f"must be a whole number from 1 to {MAX_SPECULATIVE_TOKENS}"
    kv: KVCompressionSettings | None = None
    if kv_compression is not None:
        try:
            kv = KVCompressionSettings.parse(kv_compression)
        except InvalidRequestError as exc:
            problems["kv_compression"] = str(exc)
    if problems:
        raise ValidationError(problems)
    with transaction.atomic():
        # Re-read under a row lock: an edit of other settings (admin, another operator) must not be lost.
        row = AiModel.objects.select_for_update().get(pk=model.pk)
        chosen = {key: value for key, value in (row.engine_settings or {}).items() if key not in _KV_DEFAULT_KEYS}
        if speculation == SpecMode.DRAFT and not chosen.get("draft_model"):
            raise ValidationError({"speculation": f"draft needs a draft model, and {row.name} has none; "
                                                  "choose ngram or off"})
        chosen.update(speculation=speculation, num_speculative_tokens=k)
        if kv is not None and kv.rate is not None:
            chosen["kv_compression_rate"] = kv.rate
        elif kv is not None:
            chosen["kv_compression_max_tokens"] = kv.max_cache_tokens
        known = {f.name for f in fields(EngineConfig)}
        try:
            EngineConfig(**{key: value for key, value in chosen.items() if key in known})
        except (InvalidRequestError, TypeError) as exc:
            raise ValidationError(f"these engine settings would not load: {exc}") from None
        row.engine_settings = chosen
        row.save(update_fields=["engine_settings", "updated_at"])
    model.engine_settings = chosen
    return row


def seed(models: Iterable[Any], *, log: Callable[[str], None] = print) -> list[AiModel]:
    """Create or refresh catalog rows from bundled-model specs (inference.models.catalog.BundledModel).

    Only facts that come from the model itself are refreshed; what operators edit (active, deprecation, engine
    settings, prices) is left alone. Each model gets default engine settings and a default price the first time
    it is seeded.
    """
    seeded: list[AiModel] = []
    specs = list(models)
    installed = {spec.name for spec in specs if spec.installed}
    with transaction.atomic():
        for spec in specs:
            facts = {
                "task": spec.task, "description": spec.description, "architecture": spec.architecture,
                "context_window": spec.context_window, "has_chat_template": spec.has_chat_template,
                "supports_lora": spec.supports_lora, "properties": dict(spec.properties),
                "installed": bool(spec.installed),
            }
            row, created = AiModel.objects.update_or_create(
                name=spec.name, defaults=facts,
                create_defaults={**facts, "engine_settings": default_engine_settings(spec.name, installed)})
            if not row.prices.exists():
                n_in, n_cached, n_out = DEFAULT_PRICES.get(spec.name, DEFAULT_PRICE_BY_TASK[spec.task])
                # Effective from the model's creation, so usage at any time since has a price.
                set_price(row, input_neurons=n_in, cached_input_neurons=n_cached, output_neurons=n_out,
                          effective_at=row.created_at, note="default price from seed_catalog")
            log(f"{'added' if created else 'updated'} {spec.name} ({spec.task}, "
                f"{'installed' if spec.installed else 'not installed'})")
            seeded.append(row)
        names = {spec.name for spec in specs}
        gone = AiModel.objects.filter(installed=True).exclude(name__in=names)
        for row in gone:
            log(f"marked {row.name} as not installed")
        gone.update(installed=False)
    invalidate()
    return seeded
