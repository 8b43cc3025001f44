"""Backpressure against a live server on the real engine: rejectIfBusy (native `options`, chat's top level) and
the server's bound on the estimated queue wait refuse at once with 429 / 3040 and Retry-After."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest
from cp_support import CHAT_MODEL
from test_live_server import live, wait_for_events  # noqa: F401  (live is a fixture)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.real_model, pytest.mark.once]

SLOTS = 16  # the test backend's max_num_seqs


async def _fill(client: httpx.AsyncClient, url: str, headers: dict, count: int) -> list:
    """Open `count` long streams and wait for each one's first event: they all hold an engine slot then."""
    streams = []
    for _ in range(count):
        cm = client.stream("POST", url, headers=headers, json={"prompt": "Count slowly: one, two,", "stream": True,
                                                               "max_tokens": 400, "raw": True})
        response = await cm.__aenter__()
        assert response.status_code == 200
        streams.append((cm, response.aiter_lines()))
    for _, lines in streams:
        await anext(lines)
    return streams


async def _close(streams: list) -> None:
    for cm, _ in streams:
        with contextlib.suppress(Exception):
            await cm.__aexit__(None, None, None)


def test_reject_if_busy_and_the_queue_wait_bound(live, settings):  # noqa: F811
    url, tenant = live
    run_url = f"{url}{tenant.run_url}{CHAT_MODEL}"
    headers = tenant.headers

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            quiet = await client.post(run_url, headers=headers, json={"prompt": "Hi", "max_tokens": 2, "raw": True,
                                                                      "options": {"rejectIfBusy": True}})
            assert quiet.status_code == 200  # a free engine serves it
            streams = await _fill(client, run_url, headers, SLOTS + 2)
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
            finally:
                await _close(streams)
            assert (await waiting).status_code == 200  # queued, then served once slots freed

    asyncio.run(scenario())
    # Every request is metered (the refused ones as errors), the aborted streams once their engine work stops.
    events = wait_for_events(1 + SLOTS + 2 + 3 + 1, timeout=30)
    assert len(events) == 1 + SLOTS + 2 + 3 + 1, [(e.status, e.http_status) for e in events]
    assert sum(e.http_status == 429 for e in events) == 3
