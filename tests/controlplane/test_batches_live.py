"""OpenAI Batches with the official `openai` client, unchanged, against uvicorn on loopback with the real
engine and a real Celery worker over Redis."""

from __future__ import annotations

import io
import json
import time

import openai
import pytest
from cp_support import CHAT_MODEL, make_tenant

from controlplane.catalog.services import seed
from inference.models.catalog import BUNDLED_MODELS

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.real_model, pytest.mark.redis]


@pytest.fixture
def live(live_server_url, transactional_db, batch_worker):
    seed(BUNDLED_MODELS.values(), log=lambda line: None)
    tenant = make_tenant("live-batches")
    return openai.OpenAI(base_url=f"{live_server_url}/v1", api_key=tenant.secret, max_retries=0, timeout=60), tenant


def line(custom_id: str, content: str, max_tokens: int = 48) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": CHAT_MODEL, "messages": [{"role": "user", "content": content}],
                     "max_tokens": max_tokens, "temperature": 0}}


def upload(client: openai.OpenAI, rows: list) -> str:
    data = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows).encode()
    created = client.files.create(file=("requests.jsonl", io.BytesIO(data)), purpose="batch")
    assert created.purpose == "batch" and created.bytes == len(data) and created.filename == "requests.jsonl"
    return created.id


def wait(client: openai.OpenAI, batch_id: str, statuses: tuple[str, ...], timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.1)


def test_official_client_files_batches_and_content(live):
    client, _ = live
    file_id = upload(client, [line("a", "Name a colour.", 3), "not json", line("b", "Name an animal.", 3)])
    assert client.files.retrieve(file_id).id == file_id
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"run": "1"})
    assert batch.status == "validating" and batch.metadata == {"run": "1"}
    done = wait(client, batch.id, ("completed", "failed"))
    assert done.status == "completed"
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (3, 2, 1)
    output = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    assert [o["custom_id"] for o in output] == ["a", "b"]
    assert all(o["response"]["body"]["choices"][0]["message"]["content"] for o in output)
    errors = [json.loads(x) for x in client.files.content(done.error_file_id).read().splitlines()]
    assert len(errors) == 1 and errors[0]["error"]["code"] == "invalid_json"
    assert batch.id in [b.id for b in client.batches.list(limit=5)]
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_does_not_exist")
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=file_id, endpoint="/v1/moderations", completion_window="24h")


def test_official_client_cancel(live, settings):
    settings.HEARTH_BATCH_RUN_ITEMS = 2  # the worker's 4 threads hold 8 items, so most are still unstarted
    client, _ = live
    file_id = upload(client, [line(f"r{i}", "Write a long story about the sea.") for i in range(24)])
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    wait(client, batch.id, ("in_progress",))
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = wait(client, batch.id, ("cancelled",))
    assert done.cancelled_at is not None and done.request_counts.completed < 24
    # Another account's key cannot see or cancel it.
    other = openai.OpenAI(base_url=str(client.base_url), api_key=make_tenant("live-other").secret, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        other.batches.cancel(batch.id)
