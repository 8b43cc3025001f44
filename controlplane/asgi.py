"""ASGI entry point (uvicorn controlplane.asgi:application).

Adds what Django's ASGI handler lacks: the lifespan protocol (engines are shut down cleanly, and models named in
HEARTH_PRELOAD_MODELS are loaded at startup instead of on the first request), the in-process batch worker
(HEARTH_BATCH_WORKER=inprocess) and, in embedded mode, static files. Channels' ProtocolTypeRouter is the
place where the dashboard's WebSocket routes plug in.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from typing import Any

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from channels.routing import ProtocolTypeRouter  # noqa: E402
from django.conf import settings  # noqa: E402
from django.core.asgi import get_asgi_application  # noqa: E402
from django.core.handlers.asgi import ASGIHandler  # noqa: E402

django_app = get_asgi_application()

from controlplane.api import errors  # noqa: E402
from controlplane.serving.apps import metrics_token_check  # noqa: E402


class ApiASGIHandler(ASGIHandler):
    """Django's handler with the lean HEARTH_API_MIDDLEWARE stack, for routes that only take API keys."""

    def load_middleware(self, is_async: bool = False) -> None:
        # BaseHandler reads settings.MIDDLEWARE; swap in the API list for the duration of this one call (at
        # startup, before any request).
        full = settings.MIDDLEWARE
        settings.MIDDLEWARE = settings.HEARTH_API_MIDDLEWARE
        try:
            super().load_middleware(is_async)
        finally:
            settings.MIDDLEWARE = full


# Key-only routes: inference, the OpenAI mount, catalog search, metrics and health. Routes that also accept a
# signed-in user (keys, usage, accounts) keep the full stack.
API_PATHS = re.compile(r"^/(v1/|healthz$|metrics$|client/v4/accounts/[^/]+/ai/(run|v1|models)/)")
api_app = ApiASGIHandler()


# Django's handler reads a whole body (spooling a large one to a temporary file) before any view runs, so what
# must not be read is refused here: a body declared larger than its route takes, a chunked body once it passes
# that size, and an API write that carries no key at all (an anonymous caller learns nothing and costs nothing).
UPLOAD_PATHS = re.compile(r"^/(client/v4/accounts/[^/]+/ai/finetunes|dashboard/[^/]+/adapters/)")
FILE_PATHS = re.compile(r"^/(v1/|client/v4/accounts/[^/]+/ai/v1/)files$")
OPENAI_PATHS = re.compile(r"^/(v1/|client/v4/accounts/[^/]+/ai/v1/)")
ANTHROPIC_PATHS = re.compile(r"^/(v1/|client/v4/accounts/[^/]+/ai/v1/)messages(/count_tokens)?$")
UPLOAD_SLACK = 16 * 1024 * 1024  # the multipart framing and the form's other fields


def _body_limit(path: str) -> int:
    if UPLOAD_PATHS.match(path):
        return int(settings.HEARTH_LORA_MAX_BYTES) + UPLOAD_SLACK
    if FILE_PATHS.match(path):
        return int(settings.HEARTH_BATCH_MAX_FILE_BYTES) + UPLOAD_SLACK
    return int(settings.HEARTH_MAX_REQUEST_BYTES)


def _header(scope: dict[str, Any], wanted: bytes) -> bytes | None:
    for name, value in scope.get("headers", ()):
        if name == wanted:
            return value
    return None


def _declared_length(scope: dict[str, Any]) -> int | None:
    value = _header(scope, b"content-length")
    return int(value) if value is not None and value.isdigit() else None


async def _refuse(send: Any, path: str, error: Any) -> None:
    style = ("anthropic" if ANTHROPIC_PATHS.match(path) else "openai" if OPENAI_PATHS.match(path) else "native")
    response = error.response(style)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(response.content)).encode()),
               (b"connection", b"close")]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": response.content})


def _counted(receive: Any, send: Any, path: str, limit: int) -> tuple[Any, Any]:
    """receive and send for a body of unknown length: past `limit` bytes the client gets a 413 and the
    application a disconnect, so nothing more is read or spooled."""
    state = {"read": 0, "refused": False, "started": False}

    async def counted_receive() -> dict[str, Any]:
        if state["refused"]:
            return {"type": "http.disconnect"}
        message = await receive()
        if message["type"] == "http.request":
            state["read"] += len(message.get("body", b""))
            if state["read"] > limit:
                state["refused"] = True
                if not state["started"]:
                    await _refuse(send, path, errors.request_too_large(
                        f"Request is too large: over {limit:,} bytes"))
                return {"type": "http.disconnect"}
        return message

    async def guarded_send(message: dict[str, Any]) -> None:
        if state["refused"]:
            return  # the 413 is the answer
        state["started"] = True
        await send(message)

    return counted_receive, guarded_send


async def http_router(scope: dict[str, Any], receive: Any, send: Any) -> None:
    path = scope.get("path", "")
    app = api_app if API_PATHS.match(path) else django_app
    if scope.get("method") in ("POST", "PUT", "PATCH"):
        # Anthropic's clients send their key as x-api-key.
        keyed = _header(scope, b"authorization") is not None or (
            ANTHROPIC_PATHS.match(path) is not None and _header(scope, b"x-api-key") is not None)
        if app is api_app and not keyed:
            await _refuse(send, path, errors.unauthorized("Missing API key: send `Authorization: Bearer <key>`"))
            return
        limit = _body_limit(path)
        declared = _declared_length(scope)
        if declared is not None and declared > limit:
            limit_text = int(settings.HEARTH_LORA_MAX_BYTES) if UPLOAD_PATHS.match(path) else limit
            what = "an adapter upload" if UPLOAD_PATHS.match(path) else "this route's body"
            await _refuse(send, path, errors.request_too_large(
                f"Request is too large: {what} may be at most {limit_text} bytes"))
            return
        if declared is None:
            receive, send = _counted(receive, send, path, limit)
    await app(scope, receive, send)


if settings.HEARTH_SERVE_STATIC:
    from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler

    django_app = ASGIStaticFilesHandler(django_app)

log = logging.getLogger("controlplane.asgi")
for warning in metrics_token_check():  # uvicorn runs no system checks: say it where operators look
    log.warning("%s (%s)", warning.msg, warning.id)


async def _preload() -> None:
    from asgiref.sync import sync_to_async

    from controlplane.catalog.services import get_model
    from controlplane.serving.dispatch import get_backend

    names = [n.strip() for n in os.environ.get("HEARTH_PRELOAD_MODELS", "").split(",") if n.strip()]
    backend = get_backend()
    for name in names:
        entry = await sync_to_async(get_model)(name)
        if entry is None:
            log.warning("HEARTH_PRELOAD_MODELS names %s, which is not in the catalog", name)
        elif entry.is_embedding:
            await backend.embed(name, ["warm up"])
        else:
            await backend.model_info(name)
        log.info("preloaded %s", name)


async def _start_batch_worker() -> None:
    """The in-process Celery worker for batches (HEARTH_BATCH_WORKER=inprocess); off when workers run apart."""
    from controlplane.batches.runtime import start_embedded

    try:
        await asyncio.to_thread(start_embedded)
    except Exception:  # batches wait in the database; the interactive API must come up regardless
        log.exception("the embedded batch worker did not start; queued batches wait until it does")


async def lifespan(scope: dict[str, Any], receive: Any, send: Any) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            try:
                await _preload()
            except Exception:  # a model that fails to load must not keep the rest of the API down
                log.exception("preloading models failed; they will load on first use")
            await _start_batch_worker()
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            from controlplane.batches.runtime import stop_embedded
            from controlplane.serving.dispatch import current_backend

            await asyncio.to_thread(stop_embedded)
            backend = current_backend()
            if backend is not None:
                backend.shutdown()
            await send({"type": "lifespan.shutdown.complete"})
            return


from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402

from controlplane.dashboard.routing import websocket_urlpatterns  # noqa: E402

# The dashboard's sockets: the session cookie says who it is, and only pages of our own hosts may open one.
application = ProtocolTypeRouter({
    "http": http_router, "lifespan": lifespan,
    "websocket": AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns)))})
