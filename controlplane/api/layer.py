"""Sending to the channel layer from whichever thread has news: a request's thread, a batch worker's, the engine's.

`async_to_sync(layer.group_send)` from a thread the server's event loop did not start (a Celery worker thread)
runs the send on a new loop of its own. The in-memory layer's queues belong to the server's loop, and waking a
consumer from another loop is not thread-safe: the consumer only saw the message when something else woke its
loop. So the server's loop is recorded when a WebSocket consumer connects, and any other thread hands its send
to that loop with run_coroutine_threadsafe and waits for it, so that one thread's sends arrive in order. Before
any socket connects there is nobody to tell on this process, and async_to_sync does (channels_redis still needs
it: another process may be listening). A send never raises: a lost notice only costs a chart a moment.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Future
from typing import Any

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

log = logging.getLogger("controlplane.api")
_server_loop: asyncio.AbstractEventLoop | None = None
SEND_TIMEOUT_S = 2.0


def remember_server_loop() -> None:
    """Called from a consumer's connect (so, on the server's loop)."""
    global _server_loop
    _server_loop = asyncio.get_running_loop()


def _log_failure(future: Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("a channel-layer send failed", exc_info=future.exception())


def group_send(group: str, message: dict[str, Any]) -> None:
    try:
        layer = get_channel_layer()
        if layer is None:
            return
        loop = _server_loop
        if loop is not None and loop.is_running() and not loop.is_closed():
            try:
                on_that_loop = asyncio.get_running_loop() is loop
            except RuntimeError:
                on_that_loop = False
            if not on_that_loop:
                # Wait for it: sends left to run side by side on the loop can overtake each other (on Redis a
                # send is several awaits), and a dashboard must not see "cancelled" before "cancelling".
                future = asyncio.run_coroutine_threadsafe(layer.group_send(group, message), loop)
                try:
                    future.result(timeout=SEND_TIMEOUT_S)
                except TimeoutError:
                    future.add_done_callback(_log_failure)
                    log.warning("a channel-layer send to %s is still pending after %.0f s", group, SEND_TIMEOUT_S)
                return
        async_to_sync(layer.group_send)(group, message)
    except Exception:
        log.warning("could not send %s to %s", message.get("type"), group, exc_info=True)
