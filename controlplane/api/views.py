"""Operational endpoints: liveness and Prometheus metrics."""

from __future__ import annotations

import hmac

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from controlplane.api import errors
from controlplane.api.metrics import REGISTRY


def healthz(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok", content_type="text/plain")


def metrics(request: HttpRequest) -> HttpResponse:
    token = settings.HEARTH_METRICS_TOKEN
    if token:
        given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given, token):
            return HttpResponse("metrics need the scrape token", status=401, content_type="text/plain")
    return HttpResponse(generate_latest(REGISTRY), content_type=CONTENT_TYPE_LATEST)


def _style(request: HttpRequest) -> str:
    path = request.path
    return "openai" if path.startswith("/v1/") or "/ai/v1/" in path else "native"


def not_found(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    """Unknown routes answer in the API's envelope (an HTML page would break every client's error handling)."""
    return errors.not_found(f"No route for {request.method} {request.path}").response(_style(request))


def server_error(request: HttpRequest) -> HttpResponse:
    return errors.internal().response(_style(request))
