"""Request counting and timing for Prometheus (labelled by route pattern: bounded cardinality), and a
security middleware that costs no thread hop under ASGI."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.http import HttpRequest, HttpResponse
from django.middleware.security import SecurityMiddleware

from controlplane.api.metrics import HTTP_LATENCY, HTTP_REQUESTS


def _observe(request: HttpRequest, response: HttpResponse, started: float) -> None:
    match = getattr(request, "resolver_match", None)
    route = match.route if match is not None else "unmatched"
    HTTP_REQUESTS.labels(route, request.method or "", str(response.status_code)).inc()
    HTTP_LATENCY.labels(route).observe(time.perf_counter() - started)


class MetricsMiddleware:
    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse | Awaitable[HttpResponse]]) -> None:
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest) -> HttpResponse | Awaitable[HttpResponse]:
        if self.is_async:
            return self.__acall__(request)
        started = time.perf_counter()
        response = self.get_response(request)
        _observe(request, response, started)  # type: ignore[arg-type]
        return response

    async def __acall__(self, request: HttpRequest) -> HttpResponse:
        started = time.perf_counter()
        response = await self.get_response(request)  # type: ignore[misc]
        _observe(request, response, started)
        return response


class InlineSecurityMiddleware(SecurityMiddleware):
    """Django's SecurityMiddleware, run inline on the event loop.

    Under ASGI, MiddlewareMixin runs process_request/process_response through sync_to_async, i.e. two thread
    hops per middleware per request. These two methods only read settings and headers, so they are safe to call
    on the loop directly.
    """

    async def __acall__(self, request: HttpRequest) -> HttpResponse:  # type: ignore[override]
        response = self.process_request(request)
        if response is None:
            response = await self.get_response(request)  # type: ignore[misc]
        return self.process_response(request, response)
