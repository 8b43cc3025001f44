"""The model catalog and its prices. Prices are rows with an effective time: a change is a new row, so usage
already recorded keeps the price it was charged at."""

from __future__ import annotations

from decimal import Decimal

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import models
from django.utils import timezone


class Task(models.TextChoices):
    TEXT_GENERATION = "text-generation", "Text generation"
    TEXT_EMBEDDINGS = "text-embeddings", "Text embeddings"


class AiModel(models.Model):
    name = models.CharField(max_length=200, unique=True)
    task = models.CharField(max_length=32, choices=Task.choices)
    description = models.TextField(blank=True)
    architecture = models.CharField(max_length=32, blank=True)
    context_window = models.PositiveIntegerField()
    has_chat_template = models.BooleanField(default=False)
    supports_lora = models.BooleanField(default=False)
    supports_batch = models.BooleanField(default=True)
    engine_settings = models.JSONField(
        default=dict, blank=True, help_text="EngineConfig fields for this model's engine (e.g. kv_cache_memory).")
    properties = models.JSONField(default=dict, blank=True)
    installed = models.BooleanField(default=True, help_text="Weights were present at the last seed_catalog.")
    is_active = models.BooleanField(default=True, help_text="Inactive models are listed nowhere and not served.")
    deprecated_on = models.DateField(
        null=True, blank=True, help_text="Deprecated from this date: still served, flagged in listings.")
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        verbose_name = "model"

    def __str__(self) -> str:
        return self.name


def _default_usd_per_1k() -> Decimal:
    return Decimal(settings.HEARTH_USD_PER_1K_NEURONS)


class Price(models.Model):
    model = models.ForeignKey(AiModel, on_delete=models.CASCADE, related_name="prices")
    effective_at = models.DateTimeField(default=timezone.now)
    neurons_per_m_input = models.DecimalField(max_digits=14, decimal_places=4)
    neurons_per_m_cached_input = models.DecimalField(max_digits=14, decimal_places=4)
    neurons_per_m_output = models.DecimalField(max_digits=14, decimal_places=4, default=Decimal(0))
    usd_per_1k_neurons = models.DecimalField(max_digits=12, decimal_places=6, default=_default_usd_per_1k)
    batch_discount_percent = models.DecimalField(
        max_digits=5, decimal_places=2, null=True, blank=True,
        help_text="Percent off neurons for batch requests; empty: HEARTH_BATCH_DISCOUNT_PERCENT.")
    lora_surcharge_percent = models.DecimalField(
        max_digits=7, decimal_places=2, default=Decimal(0),
        help_text="Percent added to the neurons of requests served with a LoRA adapter.")
    note = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        ordering = ["model", "-effective_at"]
        constraints = [models.UniqueConstraint(fields=["model", "effective_at"], name="unique_price_time")]
        indexes = [models.Index(fields=["model", "-effective_at"])]

    def __str__(self) -> str:
        return f"{self.model} from {self.effective_at:%Y-%m-%d %H:%M}"

    def clean(self) -> None:
        if self.pk is not None:
            stored = Price.objects.filter(pk=self.pk).first()
            if stored is not None and stored.effective_at <= timezone.now():
                raise ValidationError(
                    "A price that has taken effect cannot be edited (usage was charged at it); "
                    "add a new price with a later effective time instead.")
        for field in ("neurons_per_m_input", "neurons_per_m_cached_input", "neurons_per_m_output",
                      "usd_per_1k_neurons", "batch_discount_percent", "lora_surcharge_percent"):
            value = getattr(self, field)
            if value is not None and value < 0:
                raise ValidationError({field: "must not be negative"})
        if self.batch_discount_percent is not None and self.batch_discount_percent > 100:
            raise ValidationError({"batch_discount_percent": "must be at most 100"})
