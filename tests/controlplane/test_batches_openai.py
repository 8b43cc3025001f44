"""OpenAI /v1/files and /v1/batches through the API, on the real engine and a real Celery worker over Redis."""

from __future__ import annotations

import json
import time

import pytest
from cp_support import CHAT_MODEL, EMBED_MODEL
from django.core.files.uploadedfile import SimpleUploadedFile

from controlplane.batches.models import Batch, File, Item
from controlplane.usage.models import Source, UsageEvent

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.real_model, pytest.mark.redis]
CHAT = "/v1/chat/completions"


def jsonl(*rows) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows)


def chat_line(custom_id: str, content: str = "Say hi.", max_tokens: int = 3, model: str = CHAT_MODEL, **extra):
    return {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": {
        "model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
        "temperature": 0, **extra}}


def upload(client, tenant, content: bytes, purpose: str = "batch", name: str = "in.jsonl", prefix: str = "/v1"):
    return client.post(f"{prefix}/files", {"purpose": purpose, "file": SimpleUploadedFile(name, content)},
                       **tenant.auth)


def create(client, tenant, file_id: str, endpoint: str = CHAT, window: str = "24h", **extra):
    return client.post("/v1/batches", data=json.dumps({"input_file_id": file_id, "endpoint": endpoint,
                                                       "completion_window": window, **extra}),
                       content_type="application/json", **tenant.auth)


def wait_for(client, tenant, batch_id: str, statuses=("completed", "failed", "expired", "cancelled"),
             timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        batch = client.get(f"/v1/batches/{batch_id}", **tenant.auth).json()
        if batch["status"] in statuses:
            return batch
        assert time.monotonic() < deadline, f"batch still {batch['status']}"
        time.sleep(0.1)


def content_lines(client, tenant, file_id: str) -> list[dict]:
    response = client.get(f"/v1/files/{file_id}/content", **tenant.auth)
    assert response.status_code == 200 and response["Content-Type"] == "application/jsonl"
    return [json.loads(line) for line in response.content.decode().splitlines()]


def openai_error(response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.content
    error = response.json()["error"]
    assert error["message"] and error["type"]
    if code is not None:
        assert error["code"] == code
    return error


def test_files_upload_retrieve_content_list_delete(client, tenant, other_tenant):
    content = jsonl(chat_line("a"))
    created = upload(client, tenant, content, name="mine.jsonl")
    assert created.status_code == 200, created.content
    f = created.json()
    assert f["object"] == "file" and f["id"].startswith("file-") and f["purpose"] == "batch"
    assert (f["bytes"], f["filename"], f["status"]) == (len(content), "mine.jsonl", "processed")
    assert client.get(f"/v1/files/{f['id']}", **tenant.auth).json() == f
    assert client.get(f"/v1/files/{f['id']}/content", **tenant.auth).content == content
    second = upload(client, tenant, content).json()
    page = client.get("/v1/files?limit=1", **tenant.auth).json()
    assert page["object"] == "list" and [x["id"] for x in page["data"]] == [second["id"]] and page["has_more"]
    rest = client.get(f"/v1/files?limit=1&after={second['id']}", **tenant.auth).json()
    assert [x["id"] for x in rest["data"]] == [f["id"]] and rest["has_more"] is False
    # Another account sees none of it.
    for path in (f"/v1/files/{f['id']}", f"/v1/files/{f['id']}/content"):
        openai_error(client.get(path, **other_tenant.auth), 404, "not_found")
    assert client.get("/v1/files", **other_tenant.auth).json()["data"] == []
    openai_error(client.delete(f"/v1/files/{f['id']}", **other_tenant.auth), 404)
    deleted = client.delete(f"/v1/files/{f['id']}", **tenant.auth).json()
    assert deleted == {"id": f["id"], "object": "file", "deleted": True}
    openai_error(client.get(f"/v1/files/{f['id']}", **tenant.auth), 404)


def test_bad_uploads(client, tenant, settings):
    openai_error(upload(client, tenant, b"{}", purpose="fine-tune"), 400, "invalid_value")
    openai_error(upload(client, tenant, b"   \n"), 400, "invalid_value")
    openai_error(upload(client, tenant, b"\xff\xfe\x00"), 400, "invalid_value")
    openai_error(client.post("/v1/files", {"purpose": "batch"}, **tenant.auth), 400, "invalid_value")
    openai_error(client.post("/v1/files", data="{}", content_type="application/json", **tenant.auth), 400)
    settings.HEARTH_BATCH_MAX_FILE_BYTES = 10
    openai_error(upload(client, tenant, jsonl(chat_line("a"))), 413, "request_too_large")
    openai_error(client.post("/v1/files", {"purpose": "batch"}), 401, "invalid_api_key")
    assert not File.objects.exists()


def test_bad_batch_creation(client, tenant, other_tenant):
    mine = upload(client, tenant, jsonl(chat_line("a"))).json()["id"]
    theirs = upload(client, other_tenant, jsonl(chat_line("a"))).json()["id"]
    openai_error(create(client, tenant, "file-nope"), 404, "not_found")
    openai_error(create(client, tenant, theirs), 404, "not_found")
    openai_error(create(client, tenant, mine, endpoint="/v1/images"), 400, "invalid_value")
    openai_error(create(client, tenant, mine, window="soon"), 400, "invalid_value")
    openai_error(create(client, tenant, mine, metadata={"k": 5}), 400, "invalid_value")
    error = openai_error(client.post("/v1/batches", data=json.dumps({"endpoint": CHAT}),
                                     content_type="application/json", **tenant.auth), 400, "invalid_value")
    assert "input_file_id" in error["message"]
    openai_error(client.post("/v1/batches", data=b"{oops", content_type="application/json", **tenant.auth), 400,
                 "invalid_json")
    assert not Batch.objects.exists()


def test_chat_batch_with_bad_lines_failing_alone(client, tenant, other_tenant, batch_worker):
    content = jsonl(
        chat_line("good-1", "Name a colour."),
        b"{this is not json",
        {"custom_id": "wrong-url", "method": "POST", "url": "/v1/embeddings", "body": {"model": CHAT_MODEL}},
        chat_line("no-model", model="@hearth/nope"),
        chat_line("good-1"),  # a repeated custom_id
        chat_line("bad-value", temperature=9),
        chat_line("good-2", "Name an animal.", logprobs=True, top_logprobs=2),
        chat_line("embedder", model=EMBED_MODEL),
    )
    file_id = upload(client, tenant, content).json()["id"]
    created = create(client, tenant, file_id, metadata={"job": "nightly"})
    assert created.status_code == 200, created.content
    batch = created.json()
    assert batch["object"] == "batch" and batch["status"] == "validating" and batch["endpoint"] == CHAT
    assert batch["input_file_id"] == file_id and batch["metadata"] == {"job": "nightly"}
    assert batch["expires_at"] - batch["created_at"] == 24 * 3600 and batch["completion_window"] == "24h"

    done = wait_for(client, tenant, batch["id"])
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": 8, "completed": 2, "failed": 6}
    for stamp in ("in_progress_at", "finalizing_at", "completed_at"):
        assert done[stamp] is not None
    output = content_lines(client, tenant, done["output_file_id"])
    assert [line["custom_id"] for line in output] == ["good-1", "good-2"]
    for line in output:
        assert line["error"] is None and line["response"]["status_code"] == 200
        body = line["response"]["body"]
        assert body["object"] == "chat.completion" and body["model"] == CHAT_MODEL
        assert body["choices"][0]["message"]["content"] and body["usage"]["completion_tokens"] <= 3
    assert len(output[1]["response"]["body"]["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2
    errors = {line["custom_id"]: line for line in content_lines(client, tenant, done["error_file_id"])}
    assert set(errors) == {None, "wrong-url", "no-model", "good-1", "bad-value", "embedder"}
    assert errors[None]["error"]["code"] == "invalid_json" and "Line 2" in errors[None]["error"]["message"]
    assert errors["no-model"]["response"]["status_code"] == 404
    assert errors["no-model"]["response"]["body"]["error"]["code"] == "model_not_found"
    assert "temperature" in errors["bad-value"]["error"]["message"]
    assert "repeats" in errors["good-1"]["error"]["message"]
    assert errors["embedder"]["response"]["status_code"] == 400
    # The output file is the account's, listed and fetched like an upload; another account gets 404.
    out = client.get(f"/v1/files/{done['output_file_id']}", **tenant.auth).json()
    assert out["purpose"] == "batch_output"
    openai_error(client.get(f"/v1/files/{done['output_file_id']}/content", **other_tenant.auth), 404)
    openai_error(client.get(f"/v1/batches/{batch['id']}", **other_tenant.auth), 404, "not_found")
    openai_error(client.post(f"/v1/batches/{batch['id']}/cancel", **other_tenant.auth), 404)
    assert client.get("/v1/batches", **other_tenant.auth).json()["data"] == []
    # Metering: one batch-sourced event per request that ran.
    events = UsageEvent.objects.filter(source=Source.BATCH)
    assert events.count() == 2 and {e.route for e in events} == {"openai.chat"}
    assert sum(e.output_tokens for e in events) == sum(
        line["response"]["body"]["usage"]["completion_tokens"] for line in output)
    # A finished batch cannot be cancelled.
    openai_error(client.post(f"/v1/batches/{batch['id']}/cancel", **tenant.auth), 409, "invalid_state")


def test_embeddings_and_completions_batches_and_listing(client, tenant, batch_worker):
    emb = upload(client, tenant, jsonl(*[{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
                                          "body": {"model": EMBED_MODEL, "input": [f"text {i}", "more"]}}
                                         for i in range(3)])).json()["id"]
    cmp_ = upload(client, tenant, jsonl({"custom_id": "c", "method": "POST", "url": "/v1/completions",
                                         "body": {"model": CHAT_MODEL, "prompt": "The sky is", "max_tokens": 2,
                                                  "temperature": 0}})).json()["id"]
    first = create(client, tenant, emb, endpoint="/v1/embeddings").json()
    second = create(client, tenant, cmp_, endpoint="/v1/completions", window="2h").json()
    assert second["expires_at"] - second["created_at"] == 7200
    done = wait_for(client, tenant, first["id"])
    assert done["request_counts"] == {"total": 3, "completed": 3, "failed": 0} and done["error_file_id"] is None
    lines = content_lines(client, tenant, done["output_file_id"])
    assert [line["custom_id"] for line in lines] == ["e0", "e1", "e2"]
    assert all(len(line["response"]["body"]["data"]) == 2 and len(line["response"]["body"]["data"][0]["embedding"])
               == 384 for line in lines)
    done = wait_for(client, tenant, second["id"])
    [line] = content_lines(client, tenant, done["output_file_id"])
    assert line["response"]["body"]["object"] == "text_completion"
    listed = client.get("/v1/batches?limit=1", **tenant.auth).json()
    assert [b["id"] for b in listed["data"]] == [second["id"]] and listed["has_more"] is True
    after = client.get(f"/v1/batches?after={second['id']}", **tenant.auth).json()
    assert [b["id"] for b in after["data"]] == [first["id"]] and after["has_more"] is False
    openai_error(client.get("/v1/batches?limit=0", **tenant.auth), 400)
    # The account-mounted routes reach the same objects.
    mounted = client.get(f"/client/v4/accounts/{tenant.account.pk}/ai/v1/batches/{first['id']}", **tenant.auth)
    assert mounted.status_code == 200 and mounted.json()["id"] == first["id"]


def test_cancel_stops_unstarted_items_and_keeps_finished_results(client, tenant, settings, batch_worker):
    settings.HEARTH_BATCH_RUN_ITEMS = 2  # the worker's 4 threads hold 8 items, so most are still unstarted
    rows = [chat_line(f"r{i}", "Write a long story about the sea.", max_tokens=48) for i in range(24)]
    batch = create(client, tenant, upload(client, tenant, jsonl(*rows)).json()["id"]).json()
    wait_for(client, tenant, batch["id"], statuses=("in_progress",))
    cancelled = client.post(f"/v1/batches/{batch['id']}/cancel", **tenant.auth)
    assert cancelled.status_code == 200 and cancelled.json()["status"] in ("cancelling", "cancelled")
    assert cancelled.json()["cancelling_at"] is not None
    done = wait_for(client, tenant, batch["id"])
    assert done["status"] == "cancelled" and done["cancelled_at"] is not None
    stored = Batch.objects.get(pk=batch["id"])
    assert stored.cancelled_count > 0 and stored.pending_count == 0
    assert stored.completed_count == done["request_counts"]["completed"]
    statuses = set(Item.objects.filter(batch=stored).values_list("status", flat=True))
    assert statuses <= {"succeeded", "cancelled"} and "cancelled" in statuses
    errors = content_lines(client, tenant, done["error_file_id"])
    assert len(errors) == stored.cancelled_count
    assert {line["error"]["code"] for line in errors} == {"batch_cancelled"}
    if stored.completed_count:
        assert len(content_lines(client, tenant, done["output_file_id"])) == stored.completed_count
    # Only what ran was metered.
    assert UsageEvent.objects.filter(source=Source.BATCH).count() == stored.completed_count
    # Cancelling again is harmless.
    assert client.post(f"/v1/batches/{batch['id']}/cancel", **tenant.auth).json()["status"] == "cancelled"


def test_read_only_key_reads_but_cannot_create(client, tenant, catalog):
    from cp_support import make_tenant

    from controlplane.accounts.models import ApiKey

    reader = make_tenant("reader-b", permission=ApiKey.Permission.READ)
    openai_error(upload(client, reader, jsonl(chat_line("a"))), 403, "permission_denied")
    assert client.get("/v1/batches", **reader.auth).status_code == 200


def test_account_past_its_free_allocation_cannot_start_batches(client, tenant):
    file_id = upload(client, tenant, jsonl(chat_line("a"))).json()["id"]
    tenant.account.daily_free_neurons = 0
    tenant.account.save()
    openai_error(create(client, tenant, file_id), 429, "insufficient_quota")
    native = client.post(f"{tenant.run_url}{CHAT_MODEL}?queueRequest=true", content_type="application/json",
                         data=json.dumps({"requests": [{"prompt": "hi"}]}), **tenant.auth)
    assert native.status_code == 429 and native.json()["errors"][0]["code"] == 3036
    assert not Batch.objects.exists()


def test_batch_lines_take_response_format_tools_and_n(client, tenant, batch_worker):
    schema = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]}},
              "required": ["colour"]}
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}
    content = jsonl(
        chat_line("json", "Pick a colour.", 30, n=2,
                  response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}}),
        chat_line("tool", "What is the weather in Oslo?", 60, tools=[weather], tool_choice="required",
                  parallel_tool_calls=False),
        chat_line("bad", "Hi", 5, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"type": "string", "pattern": "(unclosed"}}}}}))
    batch = create(client, tenant, upload(client, tenant, content).json()["id"]).json()
    done = wait_for(client, tenant, batch["id"])
    assert done["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    lines = {line["custom_id"]: line for line in content_lines(client, tenant, done["output_file_id"])}
    picked = lines["json"]["response"]["body"]
    assert len(picked["choices"]) == 2
    assert all(json.loads(c["message"]["content"])["colour"] in ("red", "green", "blue") for c in picked["choices"])
    message = lines["tool"]["response"]["body"]["choices"][0]
    assert message["finish_reason"] == "tool_calls"
    call = message["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather" and "city" in json.loads(call["function"]["arguments"])
    [error] = content_lines(client, tenant, done["error_file_id"])
    assert error["custom_id"] == "bad" and "schema" in json.dumps(error["response"]["body"]).lower()
