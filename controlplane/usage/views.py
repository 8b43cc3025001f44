"""GET /client/v4/accounts/{account_id}/ai/usage (JSON) and .../ai/usage/export (CSV)."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.utils import timezone

from controlplane.accounts.models import ApiKey
from controlplane.api.auth import principal
from controlplane.api.http import api_view, envelope, json_response
from controlplane.usage import reports


@api_view("native", ("GET",))
def usage(request: HttpRequest, account_id: str) -> HttpResponse:
    principal(request).require(account_id, ApiKey.Permission.READ)
    result = reports.report(account_id, reports.parse_query(request.GET, timezone.now()))
    if request.GET.get("format") == "csv":
        return _csv(result, account_id)
    return json_response(envelope(result))


@api_view("native", ("GET",))
def usage_export(request: HttpRequest, account_id: str) -> HttpResponse:
    principal(request).require(account_id, ApiKey.Permission.READ)
    query = reports.parse_query(request.GET, timezone.now())
    if not query.group_by:
        # An export without grouping would be a single line; default to one row per day, model and key.
        query = reports.UsageQuery(**{**{f: getattr(query, f) for f in query.__slots__},
                                      "group_by": ("day" if query.granularity == "day" else "minute",
                                                   "model", "key")})
    return _csv(reports.report(account_id, query), account_id)


def _csv(result: dict, account_id: str) -> HttpResponse:
    response = HttpResponse(reports.to_csv(result), content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="hearth-usage-{account_id}.csv"'
    return response
