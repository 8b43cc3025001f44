"""Usage reports from the rollups (never the raw events): filters, grouping, totals, CSV."""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from typing import Any

from django.db.models import Sum
from django.utils.dateparse import parse_date, parse_datetime

from controlplane.api import errors
from controlplane.usage.models import UsageDay, UsageMinute

GROUPS = ("model", "key", "day", "minute")
_SUMS = ("requests", "errors", "input_tokens", "cached_input_tokens", "output_tokens", "spec_proposed",
         "spec_accepted", "neurons", "cost_usd", "latency_ms_sum", "ttft_ms_sum", "ttft_count")
CSV_COLUMNS = ("time", "model", "key_id", "requests", "errors", "input_tokens", "cached_input_tokens",
               "output_tokens", "spec_proposed", "spec_accepted", "spec_acceptance_rate", "neurons", "cost_usd",
               "avg_latency_ms", "avg_ttft_ms")


@dataclass(frozen=True, slots=True)
class UsageQuery:
    since: datetime
    until: datetime  # exclusive
    granularity: str  # day | minute
    models: tuple[str, ...]
    key_id: str | None
    group_by: tuple[str, ...]


def _parse_time(value: str, name: str, *, end: bool) -> datetime:
    try:
        day = parse_date(value) if len(value) == 10 else None
        moment = None if day else parse_datetime(value)
    except ValueError:
        day = moment = None
    if day is not None:
        # A bare end date includes that whole day.
        return datetime.combine(day + timedelta(days=1) if end else day, time.min, tzinfo=UTC)
    if moment is None:
        raise errors.invalid(f"{name} must be an ISO 8601 date or time", name)
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def parse_query(params: Any, now: datetime) -> UsageQuery:
    granularity = params.get("granularity", "day")
    if granularity not in ("day", "minute"):
        raise errors.invalid("granularity must be day or minute", "granularity")
    until = _parse_time(params["until"], "until", end=True) if params.get("until") else now
    default_span = timedelta(days=30) if granularity == "day" else timedelta(hours=1)
    since = _parse_time(params["since"], "since", end=False) if params.get("since") else until - default_span
    if since >= until:
        raise errors.invalid("since must be before until", "since")
    group_by = tuple(g for g in (p.strip() for p in params.get("group_by", "").split(",")) if g)
    unknown = [g for g in group_by if g not in GROUPS]
    if unknown:
        raise errors.invalid(f"group_by: unknown {unknown}; use {', '.join(GROUPS)}", "group_by")
    if "minute" in group_by and granularity != "minute":
        raise errors.invalid("group_by=minute needs granularity=minute", "group_by")
    models = tuple(m for m in params.getlist("model") if m) if hasattr(params, "getlist") else ()
    return UsageQuery(since=since, until=until, granularity=granularity, models=models,
                      key_id=params.get("key") or None, group_by=group_by)


def _number(value: Any) -> Any:
    if isinstance(value, Decimal):
        return float(value)
    return value if value is not None else 0


def report(account_id: str, query: UsageQuery) -> dict[str, Any]:
    if query.granularity == "day":
        rows = UsageDay.objects.filter(account_id=account_id, day__gte=query.since.astimezone(UTC).date(),
                                       day__lt=_ceil_day(query.until))
        time_field = "day"
    else:
        rows = UsageMinute.objects.filter(account_id=account_id, minute__gte=query.since, minute__lt=query.until)
        time_field = "minute"
    if query.models:
        rows = rows.filter(model__in=query.models)
    if query.key_id:
        rows = rows.filter(key_id=query.key_id)
    fields = [{"model": "model", "key": "key_id", "day": time_field, "minute": time_field}[g] for g in query.group_by]
    fields = list(dict.fromkeys(fields))
    sums = {name: Sum(name) for name in _SUMS}
    grouped = rows.values(*fields).annotate(**sums).order_by(*fields) if fields else [rows.aggregate(**sums)]
    out_rows = [_row(r, time_field) for r in grouped if r.get("requests")]
    totals = _row(rows.aggregate(**sums), time_field)
    return {
        "since": query.since.isoformat(), "until": query.until.isoformat(), "granularity": query.granularity,
        "group_by": list(query.group_by), "rows": out_rows, "totals": totals,
    }


def _ceil_day(moment: datetime) -> date:
    utc = moment.astimezone(UTC)
    return utc.date() + timedelta(days=1) if utc.time() != time.min else utc.date()


def _row(values: dict[str, Any], time_field: str) -> dict[str, Any]:
    row: dict[str, Any] = {}
    if time_field in values:
        moment = values[time_field]
        row["time"] = moment.isoformat() if moment is not None else None
    if "model" in values:
        row["model"] = values["model"]
    if "key_id" in values:
        row["key_id"] = values["key_id"] or None
    for name in _SUMS:
        row[name] = _number(values.get(name))
    requests = row["requests"] or 0
    row["avg_latency_ms"] = row["latency_ms_sum"] / requests if requests else None
    row["avg_ttft_ms"] = row["ttft_ms_sum"] / row["ttft_count"] if row["ttft_count"] else None
    row["spec_acceptance_rate"] = row["spec_accepted"] / row["spec_proposed"] if row["spec_proposed"] else None
    for name in ("latency_ms_sum", "ttft_ms_sum", "ttft_count"):
        row.pop(name)
    return row


def to_csv(result: dict[str, Any]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in result["rows"]:
        writer.writerow({c: ("" if row.get(c) is None else row.get(c)) for c in CSV_COLUMNS})
    return buffer.getvalue()
