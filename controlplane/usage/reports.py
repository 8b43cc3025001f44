"""Usage reports from the rollups (never the raw events): filters, grouping, totals, CSV."""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from typing import Any

from django.utils.dateparse import parse_date, parse_datetime

from controlplane.api import errors
from controlplane.usage import histogram
from controlplane.usage.models import ROLLUP_SUMS, UsageDay, UsageMinute
from controlplane.usage.rollup_sql import sum_rollups

GROUPS = ("model", "key", "day", "minute")
FOLD_MAX_ROWS = 500  # totals of up to this many grouped rows are added up here rather than queried again
_HISTOGRAMS = (*histogram.LATENCY_FIELDS, *histogram.TTFT_FIELDS)
CSV_COLUMNS = ("time", "model", "key_id", "requests", "errors", "input_tokens", "cached_input_tokens",
               "output_tokens", "spec_proposed", "spec_accepted", "spec_acceptance_rate", "neurons", "cost_usd",
               "avg_latency_ms", "p50_latency_ms", "p95_latency_ms", "avg_ttft_ms", "p50_ttft_ms", "p95_ttft_ms")


@dataclass(frozen=True, slots=True)
class UsageQuery:
    since: datetime
    until: datetime  # exclusive
    granularity: str  # day | minute
    models: tuple[str, ...]
    key_id: str | None
    group_by: tuple[str, ...]


# Dates far outside any usage are refused rather than computed with: an end date of 9999-12-31 becomes the next
# midnight and a start of 0001-01-01 minus a default span, and both overflow datetime.
YEARS = range(1900, 9999)


def _parse_time(value: str, name: str, *, end: bool) -> datetime:
    try:
        day = parse_date(value) if len(value) == 10 else None
        moment = None if day else parse_datetime(value)
    except ValueError:
        day = moment = None
    if (day or moment) is not None and (day or moment).year not in YEARS:  # type: ignore[union-attr]
        raise errors.invalid(f"{name} must be a date between {YEARS.start} and {YEARS.stop - 1}", name)
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


def _source(query: UsageQuery) -> tuple[type[UsageDay] | type[UsageMinute], str, Any, Any]:
    if query.granularity == "day":
        return UsageDay, "day", query.since.astimezone(UTC).date(), _ceil_day(query.until)
    return UsageMinute, "minute", query.since, query.until


def _fields(group_by: Sequence[str], time_field: str) -> list[str]:
    names = {"model": "model", "key": "key_id", "day": time_field, "minute": time_field}
    return list(dict.fromkeys(names[g] for g in group_by))


def _summed(account_id: str, query: UsageQuery, fields: list[str]) -> list[dict[str, Any]]:
    model, time_field, start, end = _source(query)
    return sum_rollups(model, time_field, account_id, start, end, sums=ROLLUP_SUMS, group=fields,
                       models=query.models, key_id=query.key_id or None)


def _fold(rows: list[dict[str, Any]], fields: list[str]) -> list[dict[str, Any]]:
    """Raw summed rows regrouped by fewer fields, in Python: cheaper than another pass over the rollups when
    the rows are few."""
    out: dict[tuple, dict[str, Any]] = {}
    for row in rows:
        group = tuple(row[f] for f in fields)
        into = out.get(group)
        if into is None:
            out[group] = {**{f: row[f] for f in fields}, **{name: row[name] or 0 for name in ROLLUP_SUMS}}
            continue
        for name in ROLLUP_SUMS:
            into[name] += row[name] or 0
    return [out[group] for group in sorted(out, key=lambda g: tuple("" if v is None else v for v in g))]


def _envelope(query: UsageQuery, group_by: Sequence[str], rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {"since": query.since.isoformat(), "until": query.until.isoformat(), "granularity": query.granularity,
            "group_by": list(group_by), "rows": rows}


def report(account_id: str, query: UsageQuery, *, totals: bool = True) -> dict[str, Any]:
    """The query's rows (one per group) and, unless totals=False, their totals; every figure from rollups."""
    time_field = _source(query)[1]
    fields = _fields(query.group_by, time_field)
    grouped = _summed(account_id, query, fields)
    result = _envelope(query, query.group_by, [_row(r, time_field) for r in grouped if r.get("requests")])
    if totals:
        if not fields:
            total = grouped[0]
        elif len(grouped) <= FOLD_MAX_ROWS:
            total = (_fold(grouped, []) or [{}])[0]
        else:
            total = _summed(account_id, query, [])[0]
        result["totals"] = _row(total, time_field)
    return result


def breakdowns(account_id: str, query: UsageQuery, groupings: Sequence[tuple[str, ...]]) -> dict[str, Any]:
    """Several groupings of the same rows (e.g. by model and by key) and their totals from one pass over the
    rollups: grouped once by every field named, then folded per grouping. `query.group_by` is ignored."""
    time_field = _source(query)[1]
    union = _fields([g for grouping in groupings for g in grouping], time_field)
    rows = _summed(account_id, query, union)
    out: dict[str, Any] = {}
    for grouping in groupings:
        folded = _fold(rows, _fields(grouping, time_field))
        out[",".join(grouping)] = _envelope(query, grouping, [_row(r, time_field) for r in folded if r["requests"]])
    out["totals"] = _row((_fold(rows, []) or [{}])[0], time_field)
    return out


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
    for name in ROLLUP_SUMS:
        if name not in _HISTOGRAMS:
            row[name] = _number(values.get(name))
    requests = row["requests"] or 0
    row["avg_latency_ms"] = row["latency_ms_sum"] / requests if requests else None
    row["p50_latency_ms"], row["p95_latency_ms"] = histogram.quantiles(values, histogram.LATENCY_FIELDS)
    row["avg_ttft_ms"] = row["ttft_ms_sum"] / row["ttft_count"] if row["ttft_count"] else None
    row["p50_ttft_ms"], row["p95_ttft_ms"] = histogram.quantiles(values, histogram.TTFT_FIELDS)
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
