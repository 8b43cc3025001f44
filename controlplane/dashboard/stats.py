"""What the overview shows, read from the usage rollups (never a scan of events): the last hour minute by
minute, and today so far. Shapes are plain JSON so the page and the WebSocket send the same thing."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from django.db.models import Sum

from controlplane.accounts.models import Account
from controlplane.usage.models import UsageDay, UsageMinute

WINDOW_MINUTES = 60
_SUMS = ("requests", "errors", "input_tokens", "cached_input_tokens", "output_tokens", "spec_proposed",
         "spec_accepted", "neurons", "cost_usd", "latency_ms_sum", "ttft_ms_sum", "ttft_count")


def _ratio(part: float, whole: float) -> float | None:
    return part / whole if whole else None


def overview(account: Account, now: datetime) -> dict[str, Any]:
    utc = now.astimezone(UTC)
    end = utc.replace(second=0, microsecond=0)
    start = end - timedelta(minutes=WINDOW_MINUTES - 1)
    rows = (UsageMinute.objects.filter(account_id=account.pk, minute__gte=start, minute__lte=end)
            .values("minute").annotate(r=Sum("requests"), e=Sum("errors"), i=Sum("input_tokens"),
                                       o=Sum("output_tokens"), n=Sum("neurons")))
    by_minute = {row["minute"].astimezone(UTC): row for row in rows}
    minutes = [start + timedelta(minutes=m) for m in range(WINDOW_MINUTES)]
    series = {"labels": [m.strftime("%H:%M") for m in minutes], "requests": [], "tokens": [], "errors": []}
    for minute in minutes:
        row = by_minute.get(minute)
        series["requests"].append(row["r"] if row else 0)
        series["tokens"].append((row["i"] + row["o"]) if row else 0)
        series["errors"].append(row["e"] if row else 0)
    today = UsageDay.objects.filter(account_id=account.pk, day=utc.date()).aggregate(
        **{name: Sum(name) for name in _SUMS})
    today = {name: today[name] or 0 for name in _SUMS}
    last = by_minute.get(end)
    requests = today["requests"]
    return {
        "account": {"id": account.pk, "name": account.name},
        "generated_at": utc.isoformat(),
        "series": series,
        "now": {"requests_per_min": last["r"] if last else 0,
                "tokens_per_min": (last["i"] + last["o"]) if last else 0},
        "today": {
            "requests": requests, "errors": today["errors"],
            "input_tokens": today["input_tokens"], "output_tokens": today["output_tokens"],
            "neurons": float(Decimal(today["neurons"])), "free_neurons": account.free_neurons_per_day,
            "cost_usd": float(Decimal(today["cost_usd"])),
            "error_rate": _ratio(today["errors"], requests),
            "mean_latency_ms": _ratio(today["latency_ms_sum"], requests),
            "mean_ttft_ms": _ratio(today["ttft_ms_sum"], today["ttft_count"]),
            "prefix_cache_hit_rate": _ratio(today["cached_input_tokens"], today["input_tokens"]),
            "spec_acceptance": _ratio(today["spec_accepted"], today["spec_proposed"]),
        },
    }
