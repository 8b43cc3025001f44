"""Every bad request is a clear 4xx in its route's envelope, never a 500, and nothing billable is recorded."""

from __future__ import annotations

import json

import pytest
from cp_support import CHAT_MODEL, EMBED_MODEL
from django.db.models import Sum
from django.test import override_settings

from controlplane.usage.models import UsageDay, UsageEvent

pytestmark = pytest.mark.django_db


def assert_nothing_billable() -> None:
    assert not UsageEvent.objects.filter(neurons__gt=0).exists()
    assert (UsageDay.objects.aggregate(n=Sum("neurons"))["n"] or 0) == 0


def native(client, tenant, body, model=CHAT_MODEL, raw: bytes | None = None):
    data = raw if raw is not None else json.dumps(body)
    return client.post(f"{tenant.run_url}{model}", data=data, content_type="application/json", **tenant.auth)


def openai(client, tenant, path, body, raw: bytes | None = None):
    data = raw if raw is not None else json.dumps(body)
    return client.post(f"/v1/{path}", data=data, content_type="application/json", **tenant.auth)


def native_error(response, status: int, code: int) -> str:
    assert response.status_code == status, response.content
    body = response.json()
    assert body["success"] is False and body["result"] is None and body["messages"] == []
    assert body["errors"][0]["code"] == code
    return body["errors"][0]["message"]


def openai_error(response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.content
    error = response.json()["error"]
    assert error["message"] and error["type"]
    if code:
        assert error["code"] == code
    return error


@pytest.mark.parametrize("raw, fragment", [
    (b"{not json", "Malformed JSON"),
    (b"", "missing a body"),
    (b"[1, 2]", "must be a JSON object"),
    (b"\xff\xfe", "Malformed JSON"),
    (b'{"prompt": "\\ud800 hi"}', "lone UTF-16 surrogate"),
    (b'{"messages": [{"role": "user", "content": "a\\udfff"}], "prompt": "x"}', "lone UTF-16 surrogate"),
    (b'{"prompt": "hi", "x": ' + b"[" * 10_000 + b"]" * 10_000 + b"}", "nested deeper"),
    (b'{"prompt": "hi", "x": ' + b"[" * 65 + b"]" * 65 + b"}", "nested deeper"),
])
def test_malformed_bodies(client, tenant, raw, fragment):
    assert fragment in native_error(native(client, tenant, None, raw=raw), 400, 3003)
    openai_error(openai(client, tenant, "chat/completions", None, raw=raw), 400, "invalid_json")
    assert_nothing_billable()


@pytest.mark.parametrize("body, fragment", [
    ({"prompt": 5}, "prompt"),
    ({"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": "hi", "stream": 1}, "stream"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "role"),
    ({"prompt": "hi", "messages": [{"role": "user", "content": "x"}]}, "exactly one"),
    ({}, "exactly one"),
    ({"prompt": ""}, "must not be empty"),
])
def test_wrong_types_and_shapes_native(client, tenant, body, fragment):
    assert fragment in native_error(native(client, tenant, body), 400, 5006)
    assert_nothing_billable()


@pytest.mark.parametrize("body, fragment", [
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "temperature": 9}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "top_k": -5}, "top_k"),
    ({"prompt": "hi", "seed": -1}, "seed"),
    ({"prompt": "hi", "repetition_penalty": 3}, "repetition_penalty"),
    ({"prompt": "hi", "frequency_penalty": 2.5}, "frequency_penalty"),
    ({"prompt": "hi", "presence_penalty": -3}, "presence_penalty"),
])
def test_out_of_range_values(client, tenant, body, fragment):
    assert fragment in native_error(native(client, tenant, body), 400, 5006)
    chat = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "hi"}],
            **{k: v for k, v in body.items() if k != "prompt"}}
    assert fragment in openai_error(openai(client, tenant, "chat/completions", chat), 400)["message"]
    assert_nothing_billable()


@pytest.mark.parametrize("body, param", [
    ({"model": CHAT_MODEL}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "model"),
    ({"model": CHAT_MODEL, "messages": []}, "messages"),
    ({"model": CHAT_MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 9}, "n"),
    ({"model": CHAT_MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
     "tools"),
    ({"model": CHAT_MODEL, "messages": [{"role": "user", "content": "hi"}],
      "response_format": {"type": "json_schema"}}, "response_format"),
    ({"model": CHAT_MODEL, "messages": [{"role": "user", "content": "hi"}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"model": CHAT_MODEL, "messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"},
     "tool_choice"),
    ({"model": CHAT_MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"model": CHAT_MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
])
def test_openai_chat_validation(client, tenant, body, param):
    error = openai_error(openai(client, tenant, "chat/completions", body), 400)
    assert error["param"] and error["param"].startswith(param)
    assert_nothing_billable()


def test_openai_completions_and_embeddings_validation(client, tenant):
    for body in ({"model": CHAT_MODEL, "prompt": []}, {"model": CHAT_MODEL, "prompt": ["a"] * 17},
                 {"model": CHAT_MODEL, "prompt": "a", "echo": True, "logprobs": 1},
                 {"model": CHAT_MODEL, "prompt": ["a", "b"], "n": 40},
                 {"model": CHAT_MODEL, "prompt": "a", "best_of": 3}, {"model": CHAT_MODEL, "prompt": 7}):
        openai_error(openai(client, tenant, "completions", body), 400)
    for body in ({"model": EMBED_MODEL, "input": []}, {"model": EMBED_MODEL, "input": [[1, 2, 3]]},
                 {"model": EMBED_MODEL, "input": ["ok", ""]}, {"model": EMBED_MODEL, "input": "x", "dimensions": 7},
                 {"model": EMBED_MODEL, "input": "x", "encoding_format": "hex"}):
        openai_error(openai(client, tenant, "embeddings", body), 400)
    # A generation model on the embeddings route, and the other way round.
    assert "cannot serve" in openai_error(
        openai(client, tenant, "embeddings", {"model": CHAT_MODEL, "input": "x"}), 400)["message"]
    openai_error(openai(client, tenant, "chat/completions",
                        {"model": EMBED_MODEL, "messages": [{"role": "user", "content": "x"}]}), 400)
    native_error(native(client, tenant, {"text": []}, model=EMBED_MODEL), 400, 5006)
    native_error(native(client, tenant, {"prompt": "x"}, model=EMBED_MODEL), 400, 5006)
    assert_nothing_billable()


def test_an_empty_model_name_is_a_400_on_every_openai_route(client, tenant):
    for path, body in (("chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("completions", {"prompt": "hi"}), ("embeddings", {"input": "hi"})):
        error = openai_error(openai(client, tenant, path, {"model": "", **body}), 400)
        assert error["param"] == "model"
    assert_nothing_billable()


def test_unknown_model(client, tenant):
    assert "@hearth/nope" in native_error(native(client, tenant, {"prompt": "hi"}, model="@hearth/nope"), 400, 5007)
    # Percent-encoded, as some clients send it.
    native_error(native(client, tenant, {"prompt": "hi"}, model="%40hearth%2Fnope"), 400, 5007)
    openai_error(openai(client, tenant, "chat/completions",
                        {"model": "@hearth/nope", "messages": [{"role": "user", "content": "hi"}]}), 404,
                 "model_not_found")
    openai_error(client.get("/v1/models/@hearth/nope", **tenant.auth), 404, "model_not_found")
    assert_nothing_billable()


def test_lora_on_a_model_without_lora_support_is_5005(client, tenant):
    native_error(native(client, tenant, {"text": "x", "lora": "my-adapter"}, model=EMBED_MODEL), 400, 5005)


def test_an_unknown_lora_adapter_is_400_5007(client, tenant):
    message = native_error(native(client, tenant, {"prompt": "x", "lora": "nope"}), 400, 5007)
    assert "LoRA adapter" in message


@override_settings(HEARTH_MAX_REQUEST_BYTES=1000, DATA_UPLOAD_MAX_MEMORY_SIZE=1000)
def test_request_too_large_is_413_3006(client, tenant):
    body = {"prompt": "x" * 2000}
    assert "too large" in native_error(native(client, tenant, body), 413, 3006)
    openai_error(openai(client, tenant, "chat/completions",
                        {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "x" * 2000}]}), 413)
    assert_nothing_billable()


def test_wrong_method_is_405_in_envelope(client, tenant):
    response = client.get(f"{tenant.run_url}{CHAT_MODEL}", **tenant.auth)
    assert native_error(response, 405, 7001) and response["Allow"] == "POST"
    openai_error(client.get("/v1/chat/completions", **tenant.auth), 405)


def test_unauthenticated_request_learns_nothing_about_body_errors(client, tenant):
    response = client.post(f"{tenant.run_url}{CHAT_MODEL}", data=b"{bad", content_type="application/json")
    native_error(response, 401, 10000)


def test_unknown_routes_answer_json_in_the_route_style(client, tenant):
    assert native_error(client.get("/client/v4/accounts/x/ai/nothing", **tenant.auth), 404, 7003)
    openai_error(client.get("/v1/nothing", **tenant.auth), 404, "not_found")
