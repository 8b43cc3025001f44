"""The real path end to end: uvicorn on loopback, the real engine, the official `openai` client unchanged."""

from __future__ import annotations

import base64
import json
import time

import httpx
import openai
import pytest
from cp_support import CHAT_MODEL, EMBED_MODEL, make_tenant

from controlplane.catalog.services import seed
from controlplane.usage.models import Status, UsageEvent
from inference.models.catalog import BUNDLED_MODELS

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.real_model]


@pytest.fixture
def live(live_server_url, transactional_db):
    seed(BUNDLED_MODELS.values(), log=lambda line: None)
    return live_server_url, make_tenant("live")


def wait_for_events(count: int, timeout: float = 10.0) -> list[UsageEvent]:
    """Usage is written after the response is on the wire, so a fast client can look before it lands."""
    deadline = time.monotonic() + timeout
    while True:
        events = list(UsageEvent.objects.order_by("created_at"))
        if len(events) >= count or time.monotonic() > deadline:
            return events
        time.sleep(0.05)


def client_for(url: str, tenant, prefix: str = "/v1") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}{prefix}", api_key=tenant.secret, max_retries=0, timeout=120)


def test_openai_client_chat_stream_usage_and_cached_tokens(live):
    url, tenant = live
    client = client_for(url, tenant)
    assert CHAT_MODEL in [m.id for m in client.models.list()]
    messages = [{"role": "system", "content": "You are terse. " * 10}, {"role": "user", "content": "Say hi."}]
    reply = client.chat.completions.create(model=CHAT_MODEL, messages=messages, max_tokens=5, temperature=0)
    assert reply.object == "chat.completion" and reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content and reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens <= 5

    chunks = list(client.chat.completions.create(model=CHAT_MODEL, messages=messages, max_tokens=5, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply.choices[0].message.content  # greedy: same answer streamed
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    # Same prompt again: the prefix cache serves part of it, and usage says so.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0

    events = wait_for_events(2)
    assert [e.stream for e in events] == [False, True] and all(e.route == "openai.chat" for e in events)
    assert events[1].cached_input_tokens == chunks[-1].usage.prompt_tokens_details.cached_tokens
    assert events[1].ttft_ms is not None and events[1].neurons > 0


def test_openai_client_completions_embeddings_and_account_mount(live):
    url, tenant = live
    mounted = client_for(url, tenant, f"/client/v4/accounts/{tenant.account.pk}/ai/v1")
    completion = mounted.completions.create(model=CHAT_MODEL, prompt="The sky is", max_tokens=3, temperature=0)
    assert completion.object == "text_completion" and completion.choices[0].text
    streamed = "".join(c.choices[0].text for c in mounted.completions.create(
        model=CHAT_MODEL, prompt="The sky is", max_tokens=3, temperature=0, stream=True) if c.choices)
    assert streamed == completion.choices[0].text

    # The client asks for base64 by default and decodes it; ask for floats too and compare.
    b64 = mounted.embeddings.create(model=EMBED_MODEL, input=["a cat", "a dog"])
    floats = mounted.embeddings.create(model=EMBED_MODEL, input=["a cat", "a dog"], encoding_format="float")
    assert len(b64.data) == 2 and len(b64.data[0].embedding) == 384
    assert b64.data[1].embedding == pytest.approx(floats.data[1].embedding, abs=1e-6)
    assert b64.usage.prompt_tokens == floats.usage.prompt_tokens > 0
    events = wait_for_events(4)
    assert [e.route for e in events] == ["openai.completions"] * 2 + ["openai.embeddings"] * 2


def test_openai_client_errors(live):
    url, tenant = live
    client = client_for(url, tenant)
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="@hearth/nope", messages=[{"role": "user", "content": "x"}])
    assert missing.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=CHAT_MODEL, messages=[{"role": "user", "content": "x"}],
                                       temperature=7)
    bad_key = openai.OpenAI(base_url=f"{url}/v1", api_key="hth_" + "x" * 52, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()
    assert not UsageEvent.objects.filter(neurons__gt=0).exists()


def test_native_sse_stream_then_usage_event(live):
    url, tenant = live
    run_url = f"{url}/client/v4/accounts/{tenant.account.pk}/ai/run/%40hearth%2Fsmollm2-135m-instruct"
    with httpx.stream("POST", run_url, headers={**tenant.headers, "x-session-affinity": "chat-7"}, timeout=120,
                      json={"messages": [{"role": "user", "content": "Count to five."}], "max_tokens": 6,
                            "stream": True}) as response:
        assert response.status_code == 200 and response.headers["content-type"] == "text/event-stream"
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert "".join(e["response"] for e in events) and events[-1]["usage"]["completion_tokens"] <= 6
    [event] = wait_for_events(1)
    assert (event.stream, event.status, event.session_affinity) == (True, Status.OK, "chat-7")
    assert event.output_tokens == events[-1]["usage"]["completion_tokens"]


def test_client_leaving_mid_stream_aborts_and_bills_what_was_generated(live):
    url, tenant = live
    run_url = f"{url}/client/v4/accounts/{tenant.account.pk}/ai/run/{CHAT_MODEL}"
    with httpx.stream("POST", run_url, headers=tenant.headers, timeout=120,
                      json={"prompt": "Write a long story about a lighthouse.", "max_tokens": 200,
                            "stream": True, "temperature": 0}) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and "response" in line:
                break  # leave after the first token
    [event] = wait_for_events(1)
    assert event.status == Status.ABORTED and 1 <= event.output_tokens < 200


def test_native_errors_over_http(live):
    url, tenant = live
    other = make_tenant("other-live")
    response = httpx.post(f"{url}/client/v4/accounts/{other.account.pk}/ai/run/{CHAT_MODEL}", headers=tenant.headers,
                          json={"prompt": "x"})
    assert response.status_code == 403 and response.json()["success"] is False
    response = httpx.post(f"{url}/client/v4/accounts/{tenant.account.pk}/ai/run/{CHAT_MODEL}",
                          headers=tenant.headers, content=b"{oops")
    assert response.status_code == 400 and response.json()["errors"][0]["code"] == 3003


def test_lean_api_stack_keeps_security_headers_and_full_stack_serves_the_rest(live):
    url, tenant = live
    api = httpx.get(f"{url}/v1/models", headers=tenant.headers)
    assert api.status_code == 200 and api.headers["x-content-type-options"] == "nosniff"
    assert "set-cookie" not in api.headers
    admin = httpx.get(f"{url}/admin/login/")
    assert admin.status_code == 200 and "csrftoken" in admin.headers.get("set-cookie", "")
    assert admin.headers["x-frame-options"] == "DENY"
    # Embedded mode serves static files (the admin's CSS) from the ASGI app itself.
    assert httpx.get(f"{url}/static/admin/css/base.css").status_code == 200
    # Session-capable routes still answer keys.
    accounts = httpx.get(f"{url}/client/v4/accounts", headers=tenant.headers).json()
    assert [a["id"] for a in accounts["result"]] == [tenant.account.pk]


def test_base64_helper_matches_openai_decoding():
    import numpy as np

    from controlplane.serving.protocol.openai import base64_floats as _base64_floats

    vector = [0.5, -1.25, 3.0]
    decoded = np.frombuffer(base64.b64decode(_base64_floats(vector)), dtype="<f4").tolist()
    assert decoded == vector
