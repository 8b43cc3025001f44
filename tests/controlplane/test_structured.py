"""Structured outputs and tool calls through the official openai and cloudflare clients against a live server,
on the real engine: JSON schemas (`parse` with a pydantic model), JSON mode, tools (named, required, streamed),
Workers AI's JSON mode and tools, and the 400s for what cannot be served."""

from __future__ import annotations

import json
from typing import Literal

import cloudflare
import jsonschema
import openai
import pytest
from cp_support import CHAT_MODEL
from pydantic import BaseModel, Field
from test_live_server import client_for, live  # noqa: F401  (live is a fixture)

from controlplane.catalog.models import AiModel

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.real_model, pytest.mark.once]

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 24},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"],
    "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The local time in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "maxLength": 24}},
                                               "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris right now? Use celsius."}]


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    continent: Literal["Europe", "Asia", "Africa", "America", "Oceania"]
    population_millions: int = Field(ge=0, le=100)


def test_parse_returns_a_pydantic_object_and_json_mode_gives_json(live):  # noqa: F811
    url, tenant = live
    client = client_for(url, tenant)
    messages = [{"role": "user", "content": "Describe the city of Paris as JSON."}]
    parsed = client.chat.completions.parse(model=CHAT_MODEL, messages=messages, response_format=City,
                                           max_tokens=120, temperature=0)
    choice = parsed.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, City)
    assert City.model_validate_json(choice.message.content) == choice.message.parsed

    anything = client.chat.completions.create(model=CHAT_MODEL, messages=messages, max_tokens=120, temperature=0,
                                              response_format={"type": "json_object"})
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].message.content), dict)
    completion = client.completions.create(
        model=CHAT_MODEL, prompt="Paris facts in JSON:", max_tokens=80, temperature=0,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {
            "name": "city", "schema": City.model_json_schema()}}})
    assert completion.choices[0].finish_reason == "stop"
    City.model_validate_json(completion.choices[0].text)


def test_tools_named_required_and_streamed(live):  # noqa: F811
    url, tenant = live
    client = client_for(url, tenant)
    named = client.chat.completions.create(model=CHAT_MODEL, messages=ASK, tools=TOOLS, max_tokens=80,
                                           temperature=0, tool_choice={"type": "function",
                                                                       "function": {"name": "get_weather"}})
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)

    required = client.chat.completions.create(model=CHAT_MODEL, messages=ASK, tools=TOOLS, max_tokens=120,
                                              temperature=0, tool_choice="required", parallel_tool_calls=False)
    calls = required.choices[0].message.tool_calls
    assert required.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert calls[0].function.name in ("get_weather", "get_time")
    schema = WEATHER if calls[0].function.name == "get_weather" else TOOLS[1]["function"]["parameters"]
    jsonschema.validate(json.loads(calls[0].function.arguments), schema)

    # Streamed: the SDK assembles delta.tool_calls into exactly the non-streamed answer; no call text leaks.
    with client.chat.completions.stream(model=CHAT_MODEL, messages=ASK, tools=TOOLS, max_tokens=80,
                                        temperature=0, tool_choice={"type": "function",
                                                                    "function": {"name": "get_weather"}}) as stream:
        streamed = stream.get_final_completion()
    got = streamed.choices[0].message
    assert not got.content
    assert [(c.id.startswith("call_"), c.function.name, c.function.arguments) for c in got.tool_calls] == [
        (True, call.function.name, call.function.arguments)]
    assert streamed.choices[0].finish_reason == "tool_calls"

    # The conversation goes on: the call and its result go back through the chat template.
    follow = client.chat.completions.create(model=CHAT_MODEL, max_tokens=20, temperature=0, tools=TOOLS,
                                            tool_choice="none", messages=[
        *ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "sky": "clear"}'}])
    assert follow.choices[0].message.content and not follow.choices[0].message.tool_calls


def test_what_cannot_be_served_is_a_400(live):  # noqa: F811
    url, tenant = live
    client = client_for(url, tenant)
    with pytest.raises(openai.BadRequestError) as bad_schema:
        client.chat.completions.create(model=CHAT_MODEL, messages=ASK, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
                "a": {"type": "string", "pattern": "(unclosed"}}}}})
    assert bad_schema.value.status_code == 400 and "schema" in bad_schema.value.message.lower()
    with pytest.raises(openai.BadRequestError) as unknown:
        client.chat.completions.create(model=CHAT_MODEL, messages=ASK, tools=TOOLS, max_tokens=5,
                                       tool_choice={"type": "function", "function": {"name": "get_stock"}})
    assert "get_stock" in unknown.value.message
    model = AiModel.objects.get(name=CHAT_MODEL)
    model.properties = {**model.properties, "function_calling": False}
    model.save()
    with pytest.raises(openai.BadRequestError) as no_tools:
        client.chat.completions.create(model=CHAT_MODEL, messages=ASK, tools=TOOLS, max_tokens=5)
    assert "tool" in no_tools.value.message


def test_cloudflare_client_json_mode_and_tools(live):  # noqa: F811
    url, tenant = live
    cf = cloudflare.Cloudflare(api_token=tenant.secret, base_url=f"{url}/client/v4", max_retries=0)
    schema = City.model_json_schema()
    result = cf.ai.run(CHAT_MODEL, account_id=tenant.account.pk, max_tokens=120, temperature=0,
                       messages=[{"role": "user", "content": "Describe Paris as JSON."}],
                       response_format={"type": "json_schema", "json_schema": schema})
    assert isinstance(result["response"], dict)
    City.model_validate(result["response"])

    flat = [{"name": "get_weather", "description": "The weather in a city now", "parameters": WEATHER}]
    called = cf.ai.run(CHAT_MODEL, account_id=tenant.account.pk, max_tokens=80, temperature=0, messages=ASK,
                       tools=flat)
    assert isinstance(called.get("tool_calls"), list)
    for call in called["tool_calls"]:  # auto: the model may answer in words, but any call it makes is valid
        assert call["name"] == "get_weather"
        jsonschema.validate(call["arguments"], WEATHER)
