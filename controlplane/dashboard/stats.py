"""What the overview shows, read from the usage rollups (never a scan of events): the last hour minute by
minute, and today so far; plus the engines' own gauges (KV-cache use, queue) from the in-process backend.
Shapes are plain JSON so the page and the WebSocket send the same thing."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from django.db.models import Sum

from controlplane.accounts.models import Account
from controlplane.serving.dispatch import current_backend
from controlplane.usage import histogram
from controlplane.usage.models import ROLLUP_SUMS, UsageDay, UsageMinute

WINDOW_MINUTES = 60
_MINUTE_SUMS = ("requests", "errors", "input_tokens", "output_tokens", *histogram.LATENCY_FIELDS,
                *histogram.TTFT_FIELDS)


def _ratio(part: float, whole: float) -> float | None:
    return part / whole if whole else None


def _series(account: Account, start: datetime, end: datetime) -> tuple[dict[str, list], dict | None]:
    rows = (UsageMinute.objects.filter(account_id=account.pk, minute__gte=start, minute__lte=end)
            .values("minute").annotate(**{name: Sum(name) for name in _MINUTE_SUMS}))
    by_minute = {row["minute"].astimezone(UTC): row for row in rows}
    series: dict[str, list] = {key: [] for key in ("labels", "requests", "tokens", "errors", "p50_latency_ms",
                                                    "p95_latency_ms", "p95_ttft_ms")}
    for m in range(WINDOW_MINUTES):
        minute = start + timedelta(minutes=m)
        row = by_minute.get(minute) or {}
        series["labels"].append(minute.strftime("%H:%M"))
        series["requests"].append(row.get("requests") or 0)
        series["tokens"].append((row.get("input_tokens") or 0) + (row.get("output_tokens") or 0))
        series["errors"].append(row.get("errors") or 0)
        p50, p95 = histogram.quantiles(row, histogram.LATENCY_FIELDS)
        series["p50_latency_ms"].append(p50)
        series["p95_latency_ms"].append(p95)
        series["p95_ttft_ms"].append(histogram.quantiles(row, histogram.TTFT_FIELDS)[1])
    return series, by_minute.get(end)


def engines() -> list[dict[str, Any]]:
    """One entry per running text-generation engine replica (one per model in process); none before the first
    request loads one (the dashboard must never load a model by looking)."""
    backend = current_backend()
    if backend is None:
        return []
    out = []
    for model, replica, m in backend.replica_metrics():
        out.append({"model": model, "replica": replica, "kv_usage": m.kv_usage, "kv_blocks_total": m.kv_blocks_total,
                    "kv_blocks_free": m.kv_blocks_free, "running": m.running, "queue_depth": m.queue_depth,
                    "tokens_per_s": m.tokens_per_s, "prefix_cache_hit_rate": m.prefix_cache_hit_rate})
    return out


def overview(account: Account, now: datetime) -> dict[str, Any]:
    utc = now.astimezone(UTC)
    end = utc.replace(second=0, microsecond=0)
    series, last = _series(account, end - timedelta(minutes=WINDOW_MINUTES - 1), end)
    sums = UsageDay.objects.filter(account_id=account.pk, day=utc.date()).aggregate(
        **{name: Sum(name) for name in ROLLUP_SUMS})
    today = {name: sums[name] or 0 for name in ROLLUP_SUMS}
    requests = today["requests"]
    p50_latency, p95_latency = histogram.quantiles(today, histogram.LATENCY_FIELDS)
    p50_ttft, p95_ttft = histogram.quantiles(today, histogram.TTFT_FIELDS)
    return {
        "account": {"id": account.pk, "name": account.name},
        "generated_at": utc.isoformat(),
        "series": series,
        "now": {"requests_per_min": last["requests"] if last else 0,
                "tokens_per_min": (last["input_tokens"] + last["output_tokens"]) if last else 0},
        "today": {
            "requests": requests, "errors": today["errors"],
            "input_tokens": today["input_tokens"], "output_tokens": today["output_tokens"],
            "neurons": float(Decimal(today["neurons"])), "free_neurons": account.free_neurons_per_day,
            "paid_plan": account.paid_plan,
            "cost_usd": float(Decimal(today["cost_usd"])),
            "error_rate": _ratio(today["errors"], requests),
            "mean_latency_ms": _ratio(today["latency_ms_sum"], requests),
            "p50_latency_ms": p50_latency, "p95_latency_ms": p95_latency,
            "mean_ttft_ms": _ratio(today["ttft_ms_sum"], today["ttft_count"]),
            "p50_ttft_ms": p50_ttft, "p95_ttft_ms": p95_ttft,
            "prefix_cache_hit_rate": _ratio(today["cached_input_tokens"], today["input_tokens"]),
            "spec_acceptance": _ratio(today["spec_accepted"], today["spec_proposed"]),
        },
        "engines": engines(),
    }
