"""Backpressure against a live server on the real engine: rejectIfBusy (native `options`, chat's top level) and
the server's bound on the estimated queue wait refuse at once with 429 / 3040 and Retry-After."""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import pytest
from cp_support import CHAT_MODEL
from test_live_server import live, wait_for_events  # noqa: F401  (live is a fixture)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.real_model, pytest.mark.once]

SLOTS = 16  # the test backend's max_num_seqs


# A list of numbers: its continuation runs to max_tokens (16 of 16 draws to 400 tokens at the default temperature
# on the test model), so the streams hold their slots for the whole test. "Count slowly: one, two," stopped early
# in 10 of 16 draws.
FILL = {"prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "stream": True, "max_tokens": 400, "raw": True}


async def _open(client: httpx.AsyncClient, url: str, headers: dict) -> tuple:
    cm = client.stream("POST", url, headers=headers, json=FILL)
    response = await cm.__aenter__()
    assert response.status_code == 200
    lines = response.aiter_lines()
    await anext(lines)
    return cm, lines


async def _queue_depth(client: httpx.AsyncClient, url: str) -> float:
    text = (await client.get(f"{url}/metrics")).text
    line = next(x for x in text.splitlines() if x.startswith(f'hearth_engine_queue_depth{{model="{CHAT_MODEL}"}}'))
    return float(line.rsplit(" ", 1)[1])


async def _fill(client: httpx.AsyncClient, url: str, base: str, headers: dict, extra: int) -> list:
    """Hold every engine slot and queue `extra` more requests behind them.

    The SLOTS streams open together and each one's first event is awaited: they all hold a slot then. Awaiting
    the first events of the extra ones too would wait for slots to free, i.e. for streams to end (the test once
    did that, and depended on some fills stopping early and on the rest not stopping); they are started and the
    engine's queue depth is awaited instead."""
    running = list(await asyncio.gather(*(_open(client, url, headers) for _ in range(SLOTS))))
    queued = [asyncio.ensure_future(_open(client, url, headers)) for _ in range(extra)]
    await _until_queued(client, base, extra)
    return running + queued


async def _until_queued(client: httpx.AsyncClient, base: str, depth: int, *, fewer: bool = False) -> None:
    """Wait until the engine's queue holds at least `depth` requests (or, with `fewer`, at most)."""
    deadline = time.monotonic() + 30
    while (await _queue_depth(client, base) > depth) if fewer else (await _queue_depth(client, base) < depth):
        assert time.monotonic() < deadline, f"the engine's queue never reached {depth}"
        await asyncio.sleep(0.05)


async def _close(streams: list) -> None:
    for stream in streams:
        if isinstance(stream, asyncio.Future):
            if not stream.done():
                stream.cancel()  # still queued: the client goes away before its first event
            with contextlib.suppress(BaseException):
                stream = await stream
        if isinstance(stream, tuple):
            with contextlib.suppress(Exception):
                await stream[0].__aexit__(None, None, None)


def test_reject_if_busy_and_the_queue_wait_bound(live, settings):  # noqa: F811
    url, tenant = live
    run_url = f"{url}{tenant.run_url}{CHAT_MODEL}"
    headers = tenant.headers

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            quiet = await client.post(run_url, headers=headers, json={"prompt": "Hi", "max_tokens": 2, "raw": True,
                                                                      "options": {"rejectIfBusy": True}})
            assert quiet.status_code == 200  # a free engine serves it
            streams = await _fill(client, run_url, url, headers, extra=2)
            try:
                busy = await client.post(run_url, headers=headers, json={
                    "prompt": "Hi", "max_tokens": 2, "raw": True, "options": {"rejectIfBusy": True}})
                assert busy.status_code == 429, busy.text
                assert busy.json()["errors"][0]["code"] == 3040 and int(busy.headers["Retry-After"]) >= 1
                chat = await client.post(f"{url}/v1/chat/completions", headers=headers, json={
                    "model": CHAT_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                    "rejectIfBusy": True})
                assert chat.status_code == 429 and chat.json()["error"]["code"] == "engine_overloaded"
                # Without rejectIfBusy it would wait: the server's bound refuses it when the wait is too long.
                settings.HEARTH_MAX_QUEUE_WAIT_S = 0.001
                bounded = await client.post(run_url, headers=headers, json={"prompt": "Hi", "max_tokens": 2,
                                                                            "raw": True})
                assert bounded.status_code == 429 and "would wait about" in bounded.json()["errors"][0]["message"]
                assert int(bounded.headers["Retry-After"]) >= 1
                settings.HEARTH_MAX_QUEUE_WAIT_S = 0
                waited = client.post(run_url, headers=headers, json={"prompt": "Hi", "max_tokens": 2, "raw": True})
                waiting = asyncio.ensure_future(waited)
                # A non-streaming client that gives up while queued: its request leaves the queue and is metered.
                gone = asyncio.ensure_future(client.post(run_url, headers=headers, json={
                    "prompt": "Hi", "max_tokens": 2, "raw": True}))
                await _until_queued(client, url, 4)
                gone.cancel()
                await _until_queued(client, url, 3, fewer=True)
            finally:
                await _close(streams)
            assert (await waiting).status_code == 200  # queued, then served once slots freed

    asyncio.run(scenario())
    # Every request is metered (the refused ones as errors), the aborted ones (streams, the two queued streams and
    # the non-streaming request that left the queue) once their engine work stops.
    expected = 1 + SLOTS + 2 + 3 + 1 + 1
    events = wait_for_events(expected, timeout=30)
    assert len(events) == expected, [(e.status, e.http_status) for e in events]
    assert sum(e.http_status == 429 for e in events) == 3
    assert sum(e.status == "aborted" for e in events) == SLOTS + 2 + 1
