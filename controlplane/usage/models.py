"""Usage events (one per request) and the per-minute / per-day rollups that charts and reports read."""

from __future__ import annotations

from django.db import models
from django.utils import timezone

from controlplane.accounts.models import Account, ApiKey
from controlplane.catalog.models import Price
from controlplane.usage import histogram


class Source(models.TextChoices):
    INTERACTIVE = "interactive", "Interactive"
    BATCH = "batch", "Batch"


class Status(models.TextChoices):
    OK = "ok", "OK"
    ERROR = "error", "Error"
    ABORTED = "aborted", "Aborted by the client"


class UsageEvent(models.Model):
    created_at = models.DateTimeField(default=timezone.now)
    account = models.ForeignKey(Account, on_delete=models.CASCADE, related_name="usage_events")
    api_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    model = models.CharField(max_length=200)
    adapter = models.CharField(max_length=200, blank=True)
    request_id = models.CharField(max_length=64, blank=True)
    route = models.CharField(max_length=32)
    source = models.CharField(max_length=16, choices=Source.choices, default=Source.INTERACTIVE)
    status = models.CharField(max_length=8, choices=Status.choices)
    http_status = models.PositiveSmallIntegerField(default=200)
    error_code = models.CharField(max_length=32, blank=True)
    stream = models.BooleanField(default=False)
    input_tokens = models.PositiveIntegerField(default=0)
    cached_input_tokens = models.PositiveIntegerField(default=0)
    output_tokens = models.PositiveIntegerField(default=0)
    # Speculative decoding: draft tokens proposed and accepted (not billed: output_tokens counts what was kept).
    spec_proposed = models.PositiveIntegerField(default=0)
    spec_accepted = models.PositiveIntegerField(default=0)
    neurons = models.DecimalField(max_digits=20, decimal_places=6, default=0)
    cost_usd = models.DecimalField(max_digits=20, decimal_places=10, default=0)
    # The price row in effect when the request ran: prices are immutable once effective, so this pins the
    # rates this event was charged at even after later price changes.
    price = models.ForeignKey(Price, null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    latency_ms = models.FloatField(default=0.0)
    ttft_ms = models.FloatField(null=True, blank=True)
    session_affinity = models.CharField(max_length=200, blank=True)
    replica = models.CharField(max_length=64, blank=True)  # the fleet replica that served it ("" in-process)

    class Meta:
        ordering = ["-created_at"]
        indexes = [
            models.Index(fields=["account", "-created_at"]),
            models.Index(fields=["account", "model", "-created_at"]),
            # The request log filtered by status: errors and aborts are rare, and a walk of the time index
            # looking for them would pass a great many rows.
            models.Index(fields=["account", "status", "-created_at"]),
        ]

    def __str__(self) -> str:
        return f"{self.account_id} {self.model} {self.status} {self.created_at:%Y-%m-%d %H:%M:%S}"


class Rollup(models.Model):
    account = models.ForeignKey(Account, on_delete=models.CASCADE, related_name="+")
    model = models.CharField(max_length=200)
    # The key's id as text ('' for none) rather than a foreign key: NULLs would defeat the unique constraint
    # the upsert relies on, and rollups outlive deleted keys.
    key_id = models.CharField(max_length=36, blank=True, default="")
    requests = models.PositiveIntegerField(default=0)
    errors = models.PositiveIntegerField(default=0)
    input_tokens = models.BigIntegerField(default=0)
    cached_input_tokens = models.BigIntegerField(default=0)
    output_tokens = models.BigIntegerField(default=0)
    spec_proposed = models.BigIntegerField(default=0)
    spec_accepted = models.BigIntegerField(default=0)
    neurons = models.DecimalField(max_digits=24, decimal_places=6, default=0)
    cost_usd = models.DecimalField(max_digits=24, decimal_places=10, default=0)
    latency_ms_sum = models.FloatField(default=0.0)
    ttft_ms_sum = models.FloatField(default=0.0)
    ttft_count = models.PositiveIntegerField(default=0)

    class Meta:
        abstract = True


# One count per latency / TTFT bucket (histogram.py): p50 and p95 come from summing rollups, never from events.
# A database default because the upsert names only the columns a request adds to.
for _name in (*histogram.LATENCY_FIELDS, *histogram.TTFT_FIELDS):
    Rollup.add_to_class(_name, models.IntegerField(default=0, db_default=0))

# Every additive column of a rollup row: what a report or chart sums over a set of rows.
ROLLUP_SUMS = ("requests", "errors", "input_tokens", "cached_input_tokens", "output_tokens", "spec_proposed",
               "spec_accepted", "neurons", "cost_usd", "latency_ms_sum", "ttft_ms_sum", "ttft_count",
               *histogram.LATENCY_FIELDS, *histogram.TTFT_FIELDS)


class UsageMinute(Rollup):
    minute = models.DateTimeField()

    class Meta:
        ordering = ["-minute"]
        constraints = [models.UniqueConstraint(fields=["account", "minute", "model", "key_id"],
                                               name="unique_usage_minute")]


class UsageDay(Rollup):
    day = models.DateField()

    class Meta:
        ordering = ["-day"]
        constraints = [models.UniqueConstraint(fields=["account", "day", "model", "key_id"],
                                               name="unique_usage_day")]
