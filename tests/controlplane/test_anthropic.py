"""Anthropic's Messages API with the official `anthropic` SDK, unchanged, against a live server on the real engine."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest
from cp_support import CHAT_MODEL
from test_live_server import live, wait_for_events  # noqa: F401  (live is a fixture)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.real_model, pytest.mark.once]

SYSTEM = "You are a terse assistant. Answer in one short sentence. " * 6
WEATHER = {"name": "get_weather", "description": "The current weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"},
                                                             "unit": {"type": "string", "enum": ["C", "F"]}},
                            "required": ["city", "unit"]}}


def client_for(url: str, tenant, **kw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=tenant.secret, max_retries=0, timeout=120, **kw)


def test_text_system_multi_turn_and_cache_reads(live):  # noqa: F811
    url, tenant = live
    client = client_for(url, tenant)
    first = client.messages.create(model=CHAT_MODEL, max_tokens=12, extra_body={"temperature": 0}, system=SYSTEM,
                                   messages=[{"role": "user", "content": "Name a colour."}])
    assert first.type == "message" and first.role == "assistant" and first.model == CHAT_MODEL
    assert first.id.startswith("msg_") and first.content[0].type == "text" and first.content[0].text
    assert first.stop_reason in ("end_turn", "max_tokens") and first.usage.output_tokens <= 12
    assert first.usage.input_tokens > 0 and first.usage.cache_read_input_tokens == 0
    second = client.messages.create(
        model=CHAT_MODEL, max_tokens=12, extra_body={"temperature": 0},
        system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": "Name a colour."},
                  {"role": "assistant", "content": first.content[0].text},
                  {"role": "user", "content": [{"type": "text", "text": "And an animal?"}]}])
    # The system prompt and the first turn were served from the prefix cache, and reported as cache reads.
    assert second.usage.cache_read_input_tokens >= 64
    assert second.content[0].text
    # Bearer auth works as well as x-api-key.
    bearer = anthropic.Anthropic(base_url=url, auth_token=tenant.secret, max_retries=0)
    assert bearer.messages.create(model=CHAT_MODEL, max_tokens=2, messages=[
        {"role": "user", "content": "Hi"}]).usage.output_tokens <= 2
    events = [e for e in wait_for_events(3) if e.route == "anthropic.messages"]
    assert len(events) == 3 and events[1].cached_input_tokens == second.usage.cache_read_input_tokens


def test_streaming_matches_the_whole_answer_and_stop_sequences(live):  # noqa: F811
    url, tenant = live
    client = client_for(url, tenant)
    body = {"model": CHAT_MODEL, "max_tokens": 24, "extra_body": {"temperature": 0},
            "messages": [{"role": "user", "content": "Describe the sea in two sentences."}]}
    whole = client.messages.create(**body)
    with client.messages.stream(**body) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    word = whole.content[0].text.split()[2]
    stopped = client.messages.create(**body, stop_sequences=[word])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert whole.content[0].text.startswith(stopped.content[0].text) and word not in stopped.content[0].text


def test_tool_use_whole_and_streamed_then_the_tool_loop(live):  # noqa: F811
    url, tenant = live
    client = client_for(url, tenant)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    body = {"model": CHAT_MODEL, "max_tokens": 160, "extra_body": {"temperature": 0}, "tools": [WEATHER],
            "tool_choice": {"type": "tool", "name": "get_weather"}, "messages": ask}
    reply = client.messages.create(**body)
    calls = [b for b in reply.content if b.type == "tool_use"]
    assert reply.stop_reason == "tool_use" and len(calls) >= 1
    call = calls[0]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER["input_schema"])
    with client.messages.stream(**body) as stream:
        streamed = stream.get_final_message()
    assert [(b.type, getattr(b, "input", None)) for b in streamed.content] == \
        [(b.type, getattr(b, "input", None)) for b in reply.content]
    assert streamed.stop_reason == "tool_use"
    # "any" forces a call too; "none" forbids one.
    forced = client.messages.create(**{**body, "tool_choice": {"type": "any", "disable_parallel_tool_use": True}})
    assert forced.stop_reason == "tool_use" and [b.type for b in forced.content] == ["tool_use"]
    free = client.messages.create(**{**body, "tool_choice": {"type": "none"}, "max_tokens": 8})
    assert all(b.type == "text" for b in free.content)
    # The loop: the call and its result go back through the chat template, and the model answers.
    answer = client.messages.create(model=CHAT_MODEL, max_tokens=24, extra_body={"temperature": 0}, tools=[WEATHER],
                                    messages=[
        *ask, {"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": call.name,
                                                  "input": call.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": "18 degrees and sunny"}]}])
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use") and answer.content
    counted = client.messages.count_tokens(model=CHAT_MODEL, tools=[WEATHER], messages=ask)
    assert counted.input_tokens == reply.usage.input_tokens + reply.usage.cache_read_input_tokens


def test_structured_output_and_service_fields(live):  # noqa: F811
    url, tenant = live
    client = client_for(url, tenant)
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 20},
                                               "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}},
              "required": ["colour", "hex"], "additionalProperties": False}
    reply = client.messages.create(model=CHAT_MODEL, max_tokens=60, messages=[
        {"role": "user", "content": "Give a colour and its hex code as JSON."}],
        output_config={"format": {"type": "json_schema", "schema": schema}}, service_tier="auto",
        thinking={"type": "disabled"}, metadata={"user_id": "u-1"})
    assert reply.stop_reason == "end_turn"
    jsonschema.validate(json.loads(reply.content[0].text), schema)
    with pytest.raises(anthropic.BadRequestError) as thinking:
        client.messages.create(model=CHAT_MODEL, max_tokens=4, messages=[{"role": "user", "content": "Hi"}],
                               thinking={"type": "enabled", "budget_tokens": 1024})
    assert thinking.value.body["error"]["type"] == "invalid_request_error"


def test_bad_requests_get_anthropics_envelope(live):  # noqa: F811
    url, tenant = live
    client = client_for(url, tenant)
    with pytest.raises(anthropic.AuthenticationError) as auth:
        anthropic.Anthropic(base_url=url, api_key="sk-wrong", max_retries=0).messages.create(
            model=CHAT_MODEL, max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert auth.value.body["type"] == "error" and auth.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="@hearth/nope", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert missing.value.body["error"]["type"] == "not_found_error"
    headers = {"x-api-key": tenant.secret, "anthropic-version": "2023-06-01", "content-type": "application/json"}
    ok = {"model": CHAT_MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    bad_bodies = [
        b"not json", b"[1, 2]", json.dumps({**ok, "max_tokens": None}).encode(),
        json.dumps({k: v for k, v in ok.items() if k != "max_tokens"}).encode(),
        json.dumps({**ok, "max_tokens": 0}).encode(), json.dumps({**ok, "messages": []}).encode(),
        json.dumps({**ok, "messages": [{"role": "system", "content": "x"}]}).encode(),
        json.dumps({**ok, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}).encode(),
        json.dumps({**ok, "messages": [{"role": "user", "content": [
            {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}).encode(),
        json.dumps({**ok, "temperature": "hot"}).encode(), json.dumps({**ok, "top_k": -3}).encode(),
        json.dumps({**ok, "tools": [{"name": "f"}]}).encode(),
        json.dumps({**ok, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "other"}}).encode(),
        json.dumps({**ok, "tool_choice": {"type": "any"}}).encode(),
        json.dumps({**ok, "stop_sequences": ["x"] * 17}).encode(),
        json.dumps({**ok, "output_config": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}}).encode()]
    for raw in bad_bodies:
        response = httpx.post(f"{url}/v1/messages", content=raw, headers=headers, timeout=30)
        assert response.status_code == 400, (raw, response.text)
        data = response.json()
        assert data["type"] == "error" and data["error"]["type"] == "invalid_request_error", (raw, data)
        assert data["error"]["message"]
    keyless = httpx.post(f"{url}/v1/messages", json=ok, timeout=30)
    assert keyless.status_code == 401 and keyless.json()["error"]["type"] == "authentication_error"
    refused = httpx.post(f"{url}/v1/messages/count_tokens", json={"model": CHAT_MODEL, "messages": []},
                         headers=headers, timeout=30)
    assert refused.status_code == 400 and refused.json()["type"] == "error"
