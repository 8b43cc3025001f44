"""OpenAI's Responses API with the official `openai` SDK, unchanged, against a live server on the real engine:
text, instructions, streaming, tools and the tool loop, JSON schemas, stored chains, background runs."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pytest
from cp_support import CHAT_MODEL, make_tenant
from pydantic import BaseModel
from test_live_server import client_for, live, wait_for_events  # noqa: F401  (live is a fixture)

from controlplane.serving import response_store
from controlplane.serving.models import StoredResponse

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.real_model, pytest.mark.once]

INSTRUCTIONS = "You answer as a Responses test: briefly, in one plain sentence. " * 6  # cached by no other test
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                           "unit": {"type": "string", "enum": ["C", "F"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}


class Colour(BaseModel):
    name: str
    hex: str


def test_text_instructions_streaming_and_usage(live):  # noqa: F811
    url, tenant = live
    client = client_for(url, tenant)
    first = client.responses.create(model=CHAT_MODEL, input="Name a colour.", instructions=INSTRUCTIONS,
                                    max_output_tokens=12, temperature=0)
    assert first.object == "response" and first.id.startswith("resp_") and first.status in ("completed", "incomplete")
    assert first.output[0].type == "message" and first.output_text
    assert first.usage.input_tokens > 0 and first.usage.output_tokens <= 12
    assert first.usage.input_tokens_details.cached_tokens == 0
    with client.responses.stream(model=CHAT_MODEL, input="Name a colour.", instructions=INSTRUCTIONS,
                                 max_output_tokens=12, temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        streamed = stream.get_final_response()
    assert "".join(deltas) == streamed.output_text == first.output_text
    assert streamed.usage.input_tokens_details.cached_tokens > 0  # the same instructions, from the prefix cache
    assert client.responses.retrieve(streamed.id).output_text == first.output_text  # streamed ones are stored too
    events = [e for e in wait_for_events(2) if e.route == "openai.responses"]
    assert len(events) == 2


def test_previous_response_id_chains_land_on_the_cache(live):  # noqa: F811
    url, tenant = live
    client = client_for(url, tenant)
    first = client.responses.create(model=CHAT_MODEL, input=[{"role": "user", "content": "My name is Ada. " * 8}],
                                    max_output_tokens=10, temperature=0)
    second = client.responses.create(model=CHAT_MODEL, previous_response_id=first.id, input="What is my name?",
                                     max_output_tokens=10, temperature=0)
    # The continuation is the stored conversation plus its answer: its prompt starts with what was cached.
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 16 * (first.usage.input_tokens // 16) - 16
    third = client.responses.create(model=CHAT_MODEL, previous_response_id=second.id, input="Thanks.",
                                    max_output_tokens=4, temperature=0)
    assert third.usage.input_tokens_details.cached_tokens >= second.usage.input_tokens_details.cached_tokens
    # Another account cannot see, continue, cancel or delete it.
    other = client_for(url, make_tenant("other-responses"))
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.create(model=CHAT_MODEL, previous_response_id=first.id, input="hi", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(first.id)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    # store: false keeps nothing.
    unstored = client.responses.create(model=CHAT_MODEL, input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    # Expired responses are gone, and the periodic cleanup removes them.
    StoredResponse.objects.filter(pk=second.id).update(expires_at="2000-01-01T00:00:00Z")
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    assert response_store.cleanup() >= 1 and not StoredResponse.objects.filter(pk=second.id).exists()


def test_tools_whole_streamed_and_the_tool_loop(live):  # noqa: F811
    url, tenant = live
    client = client_for(url, tenant)
    ask = "What is the weather in Paris?"
    body = {"model": CHAT_MODEL, "input": ask, "tools": [WEATHER], "max_output_tokens": 160, "temperature": 0,
            "tool_choice": {"type": "function", "name": "get_weather"}}
    reply = client.responses.create(**body)
    calls = [o for o in reply.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    with client.responses.stream(**body) as stream:
        argument_deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        streamed = stream.get_final_response()
    streamed_calls = [o for o in streamed.output if o.type == "function_call"]
    assert "".join(argument_deltas) == streamed_calls[0].arguments == calls[0].arguments
    # The loop, by continuation: the function's output goes back as an input item.
    answer = client.responses.create(model=CHAT_MODEL, previous_response_id=reply.id, tools=[WEATHER],
                                     max_output_tokens=24, temperature=0, input=[
                                         {"type": "function_call_output", "call_id": calls[0].call_id,
                                          "output": "18 degrees and sunny"}])
    assert answer.status in ("completed", "incomplete") and answer.output
    # ... and by resending the items.
    resent = client.responses.create(model=CHAT_MODEL, tools=[WEATHER], max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": ask},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
         "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 degrees and sunny"}])
    assert resent.output


def test_json_schema_output(live):  # noqa: F811
    url, tenant = live
    client = client_for(url, tenant)
    parsed = client.responses.parse(model=CHAT_MODEL, input="Give a colour and its hex code.", text_format=Colour,
                                    max_output_tokens=60, temperature=0)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Colour)


def test_background_responses_run_at_batch_priority_and_are_polled(live, batch_worker):  # noqa: F811
    url, tenant = live
    client = client_for(url, tenant)
    queued = client.responses.create(model=CHAT_MODEL, input="Describe the sea.", max_output_tokens=8,
                                     temperature=0, background=True)
    assert queued.status in ("queued", "in_progress") and queued.background
    deadline = time.monotonic() + 60
    while (polled := client.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert polled.status in ("completed", "incomplete") and polled.output_text
    assert polled.usage.output_tokens <= 8
    events = [e for e in wait_for_events(1) if e.route == "openai.responses"]
    assert [e.source for e in events] == ["batch"]  # billed once, as batch work
    foreground = client.responses.create(model=CHAT_MODEL, input="hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(foreground.id)  # only background responses can be cancelled
    late = client.responses.cancel(queued.id)  # finished already: cancelling changes nothing
    assert late.status == polled.status


def test_bad_requests_get_openais_envelope(live):  # noqa: F811
    url, tenant = live
    headers = {"Authorization": f"Bearer {tenant.secret}", "content-type": "application/json"}
    ok = {"model": CHAT_MODEL, "input": "hi", "max_output_tokens": 2}
    bad = [b"not json", b"[]", json.dumps({**ok, "input": []}).encode(), json.dumps({**ok, "input": 5}).encode(),
           json.dumps({**ok, "input": [{"role": "robot", "content": "x"}]}).encode(),
           json.dumps({**ok, "input": [{"type": "function_call_output"}]}).encode(),
           json.dumps({**ok, "max_output_tokens": "many"}).encode(), json.dumps({**ok, "temperature": 9}).encode(),
           json.dumps({**ok, "background": True, "stream": True}).encode(),
           json.dumps({**ok, "background": True, "store": False}).encode(),
           json.dumps({**ok, "text": {"format": {"type": "json_schema", "name": "x"}}}).encode(),
           json.dumps({**ok, "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}).encode(),
           json.dumps({**ok, "tool_choice": "required"}).encode()]
    for raw in bad:
        response = httpx.post(f"{url}/v1/responses", content=raw, headers=headers, timeout=30)
        assert response.status_code == 400, (raw, response.text)
        assert response.json()["error"]["message"], raw
    missing = httpx.post(f"{url}/v1/responses", json={**ok, "previous_response_id": "resp_nope"}, headers=headers)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "previous_response_id"
    assert httpx.get(f"{url}/v1/responses/resp_nope", headers=headers).status_code == 404
    assert httpx.post(f"{url}/v1/responses", json=ok).status_code == 401
