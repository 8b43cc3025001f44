"""Small HTTP layer shared by every API route: JSON in and out, envelopes, SSE, and one error boundary."""

from __future__ import annotations

import functools
import inspect
import json
import logging
from collections.abc import Callable
from typing import Any

import orjson
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt

from controlplane.api import errors
from controlplane.api.errors import ApiError

log = logging.getLogger("controlplane.api")

AFFINITY_HEADER = "x-session-affinity"  # an opaque session id a client sends: a fleet keeps it on one replica
REPLICA_HEADER = "x-hearth-replica"  # which fleet replica served the answer


def ascii_int(text: str | None) -> int | None:
    """A non-negative integer written in ASCII digits, else None. str.isdigit() also accepts "²" and other
    digits int() refuses, so query, header and form integers are read with this one check."""
    if not text or not text.isascii() or not text.isdigit():
        return None
    return int(text)


def dumps(data: Any) -> str:
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False)


def dumps_bulk(data: Any) -> bytes:
    """`dumps(data)` for answers of thousands of numbers (embedding vectors), as UTF-8 that reads back the same
    (small numbers may be written without an exponent). json's C encoder holds the GIL for the whole of one call:
    2,048 vectors took 0.4 s on a Zen 4 core (about a second on a busy VM), and for that long every other thread
    of the process, the engine's and the event loop's among them, stood still, even with the writing in a worker
    thread. orjson writes them in 0.03 s. What orjson cannot write (an integer past 64 bits) goes through json,
    which also raises the TypeError for what neither writes (a Decimal)."""
    try:
        return orjson.dumps(data)
    except TypeError:
        return dumps(data).encode()


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None, *,
                  bulk: bool = False) -> HttpResponse:
    """bulk: an answer that may hold thousands of numbers (dumps_bulk)."""
    response = HttpResponse(dumps_bulk(data) if bulk else dumps(data), status=status,
                            content_type="application/json")
    for name, value in (headers or {}).items():
        response[name] = value
    return response


def envelope(result: Any, *, messages: list[str] | None = None, result_info: dict | None = None) -> dict:
    body: dict[str, Any] = {"result": result, "success": True, "errors": [], "messages": messages or []}
    if result_info is not None:
        body["result_info"] = result_info
    return body


def sse(data: Any) -> bytes:
    return f"data: {data if isinstance(data, str) else dumps(data)}\n\n".encode()


SSE_DONE = sse("[DONE]")


def read_json(request: HttpRequest) -> dict[str, Any]:
    """The body as a JSON object; 413 when too large, 400 (3003) when empty, not JSON or not an object."""
    length = ascii_int(request.headers.get("Content-Length"))
    if length is not None and length > settings.HEARTH_MAX_REQUEST_BYTES:
        raise errors.request_too_large(
            f"Request is too large: {length:,} bytes, the limit is {settings.HEARTH_MAX_REQUEST_BYTES:,}")
    try:
        raw = request.body
    except RequestDataTooBig:
        raise errors.request_too_large() from None
    if len(raw) > settings.HEARTH_MAX_REQUEST_BYTES:
        raise errors.request_too_large()
    if not raw.strip():
        raise errors.malformed("Request is missing a body: send a JSON object")
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise errors.malformed(f"Malformed JSON body: {exc}") from None
    except RecursionError:
        raise errors.malformed(f"Malformed JSON body: nested deeper than {MAX_JSON_DEPTH} levels") from None
    if not isinstance(data, dict):
        raise errors.malformed(f"The body must be a JSON object, not {type(data).__name__}")
    check_json_text(data)
    return data


MAX_JSON_DEPTH = 64  # no request body of ours nests deeper; deeper ones only exhaust recursion downstream


def check_json_text(data: Any) -> None:
    """400 for what JSON can carry but nothing downstream can use: strings with a lone UTF-16 surrogate
    ("\\ud800" is valid JSON, but no tokenizer or database takes it) and nesting past MAX_JSON_DEPTH. Walked
    without recursion, so the check itself cannot be exhausted."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise errors.malformed(f"Malformed JSON body: nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(value, str):
            _check_string(value)
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_string(key)
                stack.append((item, depth + 1))
        elif isinstance(value, list):
            stack.extend((item, depth + 1) for item in value)


def _check_string(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise errors.malformed("Malformed JSON body: a string holds a lone UTF-16 surrogate (\\ud800-\\udfff "
                               "without its pair), which is not text") from None


class ResponseWithAfterClose(HttpResponse):
    """A response that runs a callback once it has been sent (the ASGI handler closes it after the body).

    Used to write usage after a non-streaming answer is on the wire rather than before it.
    """

    def __init__(self, *args: Any, after_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._after_close: Callable[[], None] | None = after_close

    def close(self) -> None:
        # The body is on the wire already; run before super().close(), whose request_finished signal closes
        # this thread's database connection (so the callback's connection is not left open).
        callback, self._after_close = self._after_close, None
        try:
            if callback is not None:
                callback()
        except Exception:
            log.exception("after-close callback failed")
        finally:
            super().close()


def api_view(style: str, methods: tuple[str, ...]) -> Callable[[Callable], Callable]:
    """CSRF-exempt (bearer auth), method check, and ApiError / unexpected errors rendered in the route's style.

    Works for sync and async views alike.
    """

    def decorate(view: Callable) -> Callable:
        def fail(exc: BaseException) -> HttpResponse:
            if isinstance(exc, ApiError):
                return exc.response(style)
            log.exception("unhandled error in %s", view.__qualname__)
            return errors.internal().response(style)

        if inspect.iscoroutinefunction(view):
            @functools.wraps(view)
            async def async_wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
                if request.method not in methods:
                    return errors.method_not_allowed(list(methods)).response(style)
                try:
                    return await view(request, *args, **kwargs)
                except Exception as exc:
                    return fail(exc)

            return csrf_exempt(async_wrapper)

        @functools.wraps(view)
        def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            if request.method not in methods:
                return errors.method_not_allowed(list(methods)).response(style)
            try:
                return view(request, *args, **kwargs)
            except Exception as exc:
                return fail(exc)

        return csrf_exempt(wrapper)

    return decorate
