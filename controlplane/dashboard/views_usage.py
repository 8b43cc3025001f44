"""The dashboard's Usage pages: totals, a daily chart and tables by model, key and day (from the rollups, through
usage.reports), the same figures as CSV, and the request log (usage_log: keyset pages of the account's events).

Every figure on the summary comes from the day rollups, so the page costs the same with a thousand events or a
million. Filters are dates in UTC, the rollups' days."""

from __future__ import annotations

import dataclasses
import re
import uuid
from datetime import UTC, date, datetime, timedelta
from typing import Any

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse, QueryDict
from django.shortcuts import render
from django.urls import path
from django.utils import timezone
from django.utils.cache import patch_vary_headers
from django.utils.http import urlencode
from django.views.decorators.http import require_GET

from controlplane.accounts.models import Account, ApiKey
from controlplane.api import errors
from controlplane.api.errors import ApiError
from controlplane.catalog import services as catalog_services
from controlplane.dashboard import usage_log
from controlplane.dashboard.access import account_or_404
from controlplane.usage import reports
from controlplane.usage.models import Source, Status

DEFAULT_DAYS = 30
CHART_MAX_DAYS = 366  # longer ranges chart only the days that had requests, not a point per empty day
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


@dataclasses.dataclass(frozen=True, slots=True)
class SummaryFilters:
    since: date
    until: date  # inclusive: the form's last day
    model: str
    key: str

    def params(self) -> dict[str, str]:
        out = {"since": self.since.isoformat(), "until": self.until.isoformat(), "model": self.model,
               "key": self.key}
        return {name: value for name, value in out.items() if value}


# ----------------------------------------------------------------------------------------------- parsing
def _day(value: str, name: str) -> date:
    try:
        if not _DATE.match(value):
            raise ValueError(value)
        day = date.fromisoformat(value)
        if not 1900 <= day.year <= 9998:  # the report turns an end date into the next midnight
            raise ValueError(value)
    except ValueError:
        raise errors.invalid(f"{name} must be a date written YYYY-MM-DD (UTC), got “{value}”", name) from None
    return day


def _form(params: QueryDict, today: date) -> dict[str, str]:
    """What the filter form shows: the request's values as typed, the defaults where none were given."""
    return {"since": params.get("since", "").strip() or (today - timedelta(days=DEFAULT_DAYS - 1)).isoformat(),
            "until": params.get("until", "").strip() or today.isoformat(),
            "model": params.get("model", "").strip(), "key": params.get("key", "").strip()}


def parse_summary(form: dict[str, str]) -> SummaryFilters:
    since, until = _day(form["since"], "since"), _day(form["until"], "until")
    if since > until:
        raise errors.invalid(f"since ({since}) is after until ({until})", "since")
    key = form["key"]
    if key:
        try:
            key = str(uuid.UUID(key))
        except ValueError:
            raise errors.invalid("key must be one of the account's keys", "key") from None
    if len(form["model"]) > 200:
        raise errors.invalid("model must be at most 200 characters", "model")
    return SummaryFilters(since=since, until=until, model=form["model"], key=key)


def _report_query(filters: SummaryFilters, now: datetime, group_by: tuple[str, ...]) -> reports.UsageQuery:
    """The filters as the usage API would read them, so the page, its CSV and /ai/usage agree."""
    params = QueryDict(mutable=True)
    params.update({"since": filters.since.isoformat(), "until": filters.until.isoformat(), "granularity": "day",
                   "group_by": ",".join(group_by)})
    if filters.model:
        params.setlist("model", [filters.model])
    if filters.key:
        params["key"] = filters.key
    return reports.parse_query(params, now)


# ----------------------------------------------------------------------------------------------- figures
def duration(ms: float | None) -> str:
    if ms is None:
        return "–"
    return f"{ms:.0f} ms" if ms < 1000 else f"{ms / 1000:.2f} s"


def latency_pair(p50: float | None, p95: float | None) -> str:
    """p50 / p95 in one unit, as the overview writes them."""
    if p50 is None or p95 is None:
        return "–"
    return f"{p50:.0f} / {p95:.0f} ms" if p95 < 1000 else f"{p50 / 1000:.2f} / {p95 / 1000:.2f} s"


def money(usd: float) -> str:
    """Dollars with the precision the amount needs: tiny models cost fractions of a cent per request."""
    if usd >= 100:
        return f"${usd:,.2f}"
    return f"${usd:.4f}" if usd >= 0.01 or usd == 0 else f"${usd:.6f}"


def _shown(row: dict[str, Any]) -> dict[str, Any]:
    return {**row, "latency_text": latency_pair(row.get("p50_latency_ms"), row.get("p95_latency_ms")),
            "cost_text": money(row["cost_usd"])}


def _key_label(key_id: str | None, keys: dict[str, ApiKey]) -> dict[str, Any]:
    if key_id is None:
        return {"name": "no key", "note": "playground or keyless", "known": False}
    key = keys.get(key_id)
    if key is None:
        return {"name": "deleted key", "note": key_id[:8], "known": False}
    return {"name": key.name, "note": f"{key.prefix}…" + (" (revoked)" if key.revoked_at else ""), "known": True}


def _chart(rows: list[dict[str, Any]], filters: SummaryFilters) -> dict[str, list]:
    by_day = {row["time"]: row for row in rows}
    span = (filters.until - filters.since).days + 1
    days = ([(filters.since + timedelta(days=i)).isoformat() for i in range(span)] if span <= CHART_MAX_DAYS
            else sorted(by_day))
    return {"labels": days,
            "requests": [by_day[d]["requests"] if d in by_day else 0 for d in days],
            "cost_usd": [by_day[d]["cost_usd"] if d in by_day else 0 for d in days]}


def summary(account_id: str, filters: SummaryFilters, keys: dict[str, ApiKey], now: datetime) -> dict[str, Any]:
    """Totals and the tables by model, key and day: two passes over the day rollups."""
    split = reports.breakdowns(account_id, _report_query(filters, now, ()), [("model",), ("key",)])
    by_model, by_key = split["model"], split["key"]
    by_day = reports.report(account_id, _report_query(filters, now, ("day",)), totals=False)
    key_rows = [{**_shown(row), "key": _key_label(row["key_id"], keys)} for row in by_key["rows"]]
    key_rows.sort(key=lambda row: (-row["requests"], row["key"]["name"]))
    return {
        "totals": _shown(split["totals"]),
        "by_model": sorted(map(_shown, by_model["rows"]), key=lambda row: (-row["requests"], row["model"])),
        "by_key": key_rows,
        "by_day": [_shown(row) for row in reversed(by_day["rows"])],  # newest first
        "chart": _chart(by_day["rows"], filters),
    }


def _account_keys(account: Account) -> dict[str, ApiKey]:
    return {str(k.pk): k for k in ApiKey.objects.filter(account=account).order_by("revoked_at", "name")}


def _model_choices(*extra: str) -> list[str]:
    return sorted({*catalog_services.catalog(), *(m for m in extra if m)})


# ------------------------------------------------------------------------------------------------- views
@login_required
@require_GET
def page(request: HttpRequest, account_id: str) -> HttpResponse:
    account, accounts = account_or_404(request, account_id)
    now = timezone.now()
    form = _form(request.GET, now.astimezone(UTC).date())
    keys = _account_keys(account)
    context: dict[str, Any] = {"account": account, "accounts": accounts, "page": "usage", "tab": "summary",
                               "form": form, "keys": list(keys.values())}
    try:
        filters = parse_summary(form)
    except ApiError as exc:
        return render(request, "dashboard/usage.html", {**context, "error": exc.message,
                                                        "models": _model_choices(form["model"])}, status=exc.status)
    figures = summary(account.pk, filters, keys, now)
    return render(request, "dashboard/usage.html", {
        **context, "summary": figures, "filters": filters,
        "models": _model_choices(filters.model, *(row["model"] for row in figures["by_model"])),
        "csv_query": urlencode(filters.params())})


@login_required
@require_GET
def export_csv(request: HttpRequest, account_id: str) -> HttpResponse:
    """The summary's filters as CSV, one row per day, model and key (the usage API's export, on the session)."""
    account, _ = account_or_404(request, account_id)
    now = timezone.now()
    try:
        filters = parse_summary(_form(request.GET, now.astimezone(UTC).date()))
    except ApiError as exc:
        return HttpResponse(exc.message + "\n", status=exc.status, content_type="text/plain; charset=utf-8")
    result = reports.report(account.pk, _report_query(filters, now, ("day", "model", "key")))
    response = HttpResponse(reports.to_csv(result), content_type="text/csv; charset=utf-8")
    name = f"hearth-usage-{account.pk}-{filters.since}-to-{filters.until}.csv"
    response["Content-Disposition"] = f'attachment; filename="{name}"'
    return response


@login_required
@require_GET
def requests_log(request: HttpRequest, account_id: str) -> HttpResponse:
    """The request log. An htmx request (the filter form, the older/newest links) gets only the log's partial;
    a history restore or a plain GET gets the whole page, so it works without JavaScript."""
    account, accounts = account_or_404(request, account_id)
    keys = _account_keys(account)
    partial = bool(request.headers.get("HX-Request")) and not request.headers.get("HX-History-Restore-Request")
    context: dict[str, Any] = {
        "account": account, "accounts": accounts, "page": "usage", "tab": "requests",
        "form": {name: request.GET.get(name, "").strip() for name in ("model", "key", "status", "source",
                                                                      "since", "until")},
        "keys": list(keys.values()), "statuses": Status.choices, "sources": Source.choices,
        "no_key": usage_log.NO_KEY, "page_size": usage_log.PAGE_SIZE}
    template = "dashboard/usage/_log.html" if partial else "dashboard/usage/requests.html"
    status = 200
    try:
        filters = usage_log.parse_filters(request.GET)
    except ApiError as exc:
        context["error"], status = exc.message, exc.status
    else:
        log = usage_log.page(account.pk, filters)
        context.update({
            "rows": [{"event": e, "key": _key_label(str(e.api_key_id) if e.api_key_id else None, keys),
                      "latency": duration(e.latency_ms), "ttft": duration(e.ttft_ms),
                      "cost": money(float(e.cost_usd))} for e in log.events],
            "older_query": urlencode(filters.params(before=log.older)) if log.older else "",
            "newest_query": urlencode(filters.params()) if filters.before else None,
            "filtered": bool(filters.params())})
    if not partial:
        context["models"] = _model_choices(context["form"]["model"])
    response = render(request, template, context, status=status)
    patch_vary_headers(response, ("HX-Request",))  # one URL answers a partial or a page: caches must not mix them
    return response


urlpatterns = [
    path("<str:account_id>/usage/", page, name="dashboard-usage"),
    path("<str:account_id>/usage/export.csv", export_csv, name="dashboard-usage-csv"),
    path("<str:account_id>/usage/requests/", requests_log, name="dashboard-usage-requests"),
]
