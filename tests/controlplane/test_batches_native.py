"""Workers AI async batches (queueRequest) on the real engine and a real Celery worker over Redis."""

from __future__ import annotations

import json
import time

import pytest
from cp_support import CHAT_MODEL, EMBED_MODEL, make_tenant

from controlplane.batches.models import Batch
from controlplane.usage.models import Source, UsageEvent

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.real_model, pytest.mark.redis]


def post(client, tenant, model, body, query="?queueRequest=true", raw=None):
    data = raw if raw is not None else json.dumps(body)
    return client.post(f"{tenant.run_url}{model}{query}", data=data, content_type="application/json",
                       **tenant.auth)


def poll_until_done(client, tenant, model, request_id, timeout=120.0) -> dict:
    deadline = time.monotonic() + timeout
    seen = set()
    while True:
        response = post(client, tenant, model, {"request_id": request_id}, query="")
        assert response.status_code == 200, response.content
        result = response.json()["result"]
        if "responses" in result:
            result["seen_statuses"] = seen
            return result
        assert result["status"] in ("queued", "running") and result["request_id"] == request_id
        seen.add(result["status"])
        assert time.monotonic() < deadline, f"batch still {result['status']}"
        time.sleep(0.1)


def test_queue_request_text_generation_round_trip(client, tenant, batch_worker):
    requests = [{"prompt": f"Name a colour number {i}.", "max_tokens": 3, "temperature": 0,
                 "external_reference": f"ref-{i}"} for i in range(3)]
    requests.append({"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2})
    queued = post(client, tenant, CHAT_MODEL, {"requests": requests})
    assert queued.status_code == 200, queued.content
    body = queued.json()
    assert body["success"] is True and body["errors"] == []
    assert body["result"]["status"] == "queued" and body["result"]["model"] == CHAT_MODEL
    result = poll_until_done(client, tenant, CHAT_MODEL, body["result"]["request_id"])
    responses = result["responses"]
    assert [r["id"] for r in responses] == [0, 1, 2, 3]
    assert [r["external_reference"] for r in responses] == ["ref-0", "ref-1", "ref-2", None]
    assert all(r["success"] and r["result"]["response"] for r in responses)
    assert all(1 <= r["result"]["usage"]["completion_tokens"] <= 3 for r in responses)
    usage = result["usage"]
    assert usage["prompt_tokens"] == sum(r["result"]["usage"]["prompt_tokens"] for r in responses)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    # Greedy: the batch answer equals the interactive one for the same body.
    direct = client.post(f"{tenant.run_url}{CHAT_MODEL}", content_type="application/json", **tenant.auth,
                         data=json.dumps({"prompt": "Name a colour number 0.", "max_tokens": 3, "temperature": 0}))
    assert direct.json()["result"]["response"] == responses[0]["result"]["response"]

    events = UsageEvent.objects.filter(source=Source.BATCH).order_by("created_at")
    assert events.count() == 4 and {e.route for e in events} == {"native"}
    assert sum(e.output_tokens for e in events) == usage["completion_tokens"]
    assert all(e.api_key_id == tenant.key.pk and e.neurons > 0 for e in events)
    assert UsageEvent.objects.filter(source=Source.INTERACTIVE).count() == 1


def test_queue_request_embeddings_and_options_in_body(client, tenant, batch_worker):
    queued = post(client, tenant, EMBED_MODEL, query="", body={
        "requests": [{"text": ["a cat", "a dog"], "external_reference": "pets"}, {"text": "a lighthouse"}],
        "options": {"queueRequest": True}})
    assert queued.status_code == 200, queued.content
    result = poll_until_done(client, tenant, EMBED_MODEL, queued.json()["result"]["request_id"])
    first, second = result["responses"]
    assert first["external_reference"] == "pets" and first["result"]["shape"] == [2, 384]
    assert second["result"]["shape"] == [1, 384] and len(second["result"]["data"][0]) == 384
    assert result["usage"]["prompt_tokens"] > 0 and result["usage"]["completion_tokens"] == 0


def test_prompt_beyond_the_context_fails_alone(client, tenant, batch_worker):
    huge = "word " * 9000
    queued = post(client, tenant, CHAT_MODEL, {"requests": [
        {"prompt": huge, "max_tokens": 2}, {"prompt": "Hello", "max_tokens": 2, "external_reference": "ok"}]})
    result = poll_until_done(client, tenant, CHAT_MODEL, queued.json()["result"]["request_id"])
    bad, good = result["responses"]
    assert bad["success"] is False and bad["result"] is None and bad["errors"][0]["code"] == 3006
    assert good["success"] is True and good["external_reference"] == "ok"
    batch = Batch.objects.get()
    assert (batch.status, batch.completed_count, batch.failed_count) == ("completed", 1, 1)


@pytest.mark.parametrize("body, fragment", [
    ({"requests": []}, "non-empty list"),
    ({"requests": "x"}, "non-empty list"),
    ({"requests": [{"prompt": 5}]}, "requests[0]"),
    ({"requests": [{"prompt": "hi"}, {"prompt": "hi", "stream": True}]}, "requests[1]: stream"),
    ({"requests": [{"prompt": "hi", "temperature": 9}]}, "requests[0]"),
    ({"requests": [{"prompt": "hi", "external_reference": 7}]}, "external_reference"),
    ({"requests": ["hi"]}, "must be an object"),
])
def test_bad_submissions_are_400_in_the_envelope(client, tenant, body, fragment):
    response = post(client, tenant, CHAT_MODEL, body)
    assert response.status_code == 400, response.content
    error = response.json()
    assert error["success"] is False and error["errors"][0]["code"] == 5006
    assert fragment in error["errors"][0]["message"]
    assert not Batch.objects.exists()


def test_requests_without_queue_request_and_malformed_json(client, tenant):
    response = post(client, tenant, CHAT_MODEL, {"requests": [{"prompt": "hi"}]}, query="")
    assert response.status_code == 400 and "queueRequest" in response.json()["errors"][0]["message"]
    response = post(client, tenant, CHAT_MODEL, None, raw=b"{nope")
    assert response.status_code == 400 and response.json()["errors"][0]["code"] == 3003


def test_payload_over_10_mb_is_413_3006(client, tenant, settings):
    settings.HEARTH_MAX_REQUEST_BYTES = 1000
    response = post(client, tenant, CHAT_MODEL, {"requests": [{"prompt": "x" * 2000}]})
    assert response.status_code == 413 and response.json()["errors"][0]["code"] == 3006
    assert not Batch.objects.exists()


def test_poll_scoping_and_errors(client, tenant, other_tenant, batch_worker):
    queued = post(client, tenant, CHAT_MODEL, {"requests": [{"prompt": "hi", "max_tokens": 1}]})
    request_id = queued.json()["result"]["request_id"]
    # Another account's key on its own account: not found, never the batch.
    stranger = post(client, other_tenant, CHAT_MODEL, {"request_id": request_id}, query="")
    assert stranger.status_code == 404 and stranger.json()["errors"][0]["code"] == 7003
    # Another account's key on this account's URL: refused before anything is looked up.
    response = client.post(f"{tenant.run_url}{CHAT_MODEL}", data=json.dumps({"request_id": request_id}),
                           content_type="application/json", **other_tenant.auth)
    assert response.status_code == 403
    for bad in ({"request_id": 5}, {"request_id": ""}):
        response = post(client, tenant, CHAT_MODEL, bad, query="")
        assert response.status_code == 400 and response.json()["errors"][0]["code"] == 5006
    response = post(client, tenant, CHAT_MODEL, {"request_id": "batch_nope"}, query="")
    assert response.status_code == 404
    anonymous = client.post(f"{tenant.run_url}{CHAT_MODEL}", data=json.dumps({"request_id": request_id}),
                            content_type="application/json")
    assert anonymous.status_code == 401
    # The owner still gets it.
    assert len(poll_until_done(client, tenant, CHAT_MODEL, request_id)["responses"]) == 1


def test_read_only_key_cannot_submit_but_can_poll(client, catalog):
    from controlplane.accounts.models import ApiKey

    reader = make_tenant("reader", permission=ApiKey.Permission.READ)
    response = post(client, reader, CHAT_MODEL, {"requests": [{"prompt": "hi"}]})
    assert response.status_code == 403
    assert post(client, reader, CHAT_MODEL, {"request_id": "batch_x"}, query="").status_code == 404


def test_queue_request_items_take_json_mode_and_tools(client, tenant, batch_worker):
    schema = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]}},
              "required": ["colour"]}
    tools = [{"name": "get_weather", "description": "Weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}]
    queued = post(client, tenant, CHAT_MODEL, {"requests": [
        {"messages": [{"role": "user", "content": "Pick a colour."}], "max_tokens": 30, "temperature": 0,
         "response_format": {"type": "json_schema", "json_schema": schema}},
        {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "max_tokens": 60, "temperature": 0,
         "tools": tools}]})
    assert queued.status_code == 200, queued.content
    responses = poll_until_done(client, tenant, CHAT_MODEL, queued.json()["result"]["request_id"])["responses"]
    assert responses[0]["success"] and responses[0]["result"]["response"]["colour"] in ("red", "green", "blue")
    assert responses[1]["success"] and isinstance(responses[1]["result"]["tool_calls"], list)
    for call in responses[1]["result"]["tool_calls"]:
        assert call["name"] == "get_weather" and isinstance(call["arguments"], dict)
