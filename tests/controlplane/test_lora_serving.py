"""Serving with LoRA adapters through the APIs on the real engine: `lora` on the native route, `model:
"<base>:<adapter>"` and `lora` on /v1, the answer the adapter gives (checked against an engine of our own
serving the same files), isolation between accounts, usage events that record the adapter and pay its surcharge,
and refusals."""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path

import pytest
from cp_support import CHAT_MODEL, EMBED_MODEL
from django.core.files.uploadedfile import SimpleUploadedFile

from controlplane.adapters import services as adapters
from controlplane.api import errors
from controlplane.catalog.models import AiModel
from controlplane.catalog.services import invalidate, set_price
from controlplane.usage.models import UsageEvent
from inference import LLM, EngineConfig, LoRARequest, SamplingParams
from inference.models.catalog import model_path
from tests.lora_support import make_peft_adapter

pytestmark = pytest.mark.django_db
PROMPT = "Write one sentence about the sea:"
GREEDY = {"prompt": PROMPT, "raw": True, "max_tokens": 10, "temperature": 0}


@pytest.fixture(scope="module")
def adapter_files(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("serving-adapters")
    base = model_path(CHAT_MODEL)
    return [make_peft_adapter(base, root / f"a{i}", rank=8, seed=seed, targets=targets)
            for i, (seed, targets) in enumerate([(11, ("q_proj", "v_proj")), (12, ("o_proj", "down_proj"))])]


def _upload(account, name: str, folder: Path):
    files = {n: SimpleUploadedFile(n, (folder / n).read_bytes())
             for n in ("adapter_config.json", "adapter_model.safetensors")}
    return adapters.upload_adapter(account, name=name, base_model=CHAT_MODEL, description="", files=files)


def _run(client, tenant, body, model=CHAT_MODEL):
    return client.post(f"{tenant.run_url}{model}", data=json.dumps(body), content_type="application/json",
                       **tenant.auth)


def _completion(client, tenant, model, **extra):
    body = {"model": model, "prompt": PROMPT, "max_tokens": 10, "temperature": 0, **extra}
    return client.post("/v1/completions", data=json.dumps(body), content_type="application/json", **tenant.auth)


@pytest.fixture(autouse=True)
def _media(settings, tmp_path) -> None:
    settings.MEDIA_ROOT = str(tmp_path / "media")  # uploaded adapters stay in the test's own folder


@pytest.fixture(scope="module")
def reference_llm() -> LLM:
    return LLM(CHAT_MODEL, EngineConfig(dtype="float32", kv_cache_memory="128MiB"))


@pytest.mark.once  # engine and protocol behaviour: the PostgreSQL pass adds nothing but a minute of CPU
def test_lora_on_both_apis_gives_the_adapters_answer(client, tenant, backend, adapter_files, reference_llm):
    first, second = (_upload(tenant.account, f"style-{i}", folder) for i, folder in enumerate(adapter_files))
    expected = []
    for adapter in (first, second):
        lora = LoRARequest(adapters.adapter_key(adapter), adapters.adapter_dir(adapter))
        expected.append(reference_llm.generate(PROMPT, SamplingParams(max_tokens=10, temperature=0), lora)[0].text)
    base_text = reference_llm.generate(PROMPT, SamplingParams(max_tokens=10, temperature=0))[0].text
    assert len({base_text, *expected}) == 3  # each adapter changes the answer its own way

    for adapter, text in zip((first, second), expected, strict=True):
        for ref in (adapter.name, adapter.id):  # by name or by id
            response = _run(client, tenant, {**GREEDY, "lora": ref})
            assert response.status_code == 200, response.content
            assert response.json()["result"]["response"] == text
        by_model = _completion(client, tenant, f"{CHAT_MODEL}:{adapter.name}")
        assert by_model.status_code == 200, by_model.content
        assert by_model.json()["choices"][0]["text"] == text
        assert _completion(client, tenant, CHAT_MODEL, lora=adapter.name).json()["choices"][0]["text"] == text
    assert _run(client, tenant, GREEDY).json()["result"]["response"] == base_text

    events = UsageEvent.objects.filter(account=tenant.account).order_by("created_at")
    assert [e.adapter for e in events] == ["style-0"] * 4 + ["style-1"] * 4 + [""]


def test_adapter_use_pays_the_surcharge(client, tenant, backend, adapter_files):
    adapter = _upload(tenant.account, "priced", adapter_files[0])
    model = AiModel.objects.get(name=CHAT_MODEL)
    set_price(model, input_neurons=1000, cached_input_neurons=100, output_neurons=3000,
              lora_surcharge_percent=Decimal(50))
    invalidate()
    assert _run(client, tenant, {**GREEDY, "lora": adapter.name}).status_code == 200
    assert _run(client, tenant, GREEDY).status_code == 200
    with_adapter, plain = UsageEvent.objects.filter(account=tenant.account).order_by("created_at")
    for event, factor in ((with_adapter, Decimal("1.5")), (plain, Decimal(1))):
        fresh = event.input_tokens - event.cached_input_tokens
        expected = (fresh * 1000 + event.cached_input_tokens * 100 + event.output_tokens * 3000) / Decimal(10**6)
        assert event.neurons == (expected * factor).quantize(Decimal("0.000001"))
    assert with_adapter.adapter == "priced" and plain.adapter == ""


def test_accounts_use_only_their_own_and_public_adapters(client, tenant, other_tenant, backend, adapter_files):
    mine = _upload(tenant.account, "private-one", adapter_files[0])
    for ref in (mine.name, mine.id):
        response = _run(client, other_tenant, {**GREEDY, "lora": ref})
        assert response.status_code == 400
        assert "No LoRA adapter" in response.json()["errors"][0]["message"]
    adapters.set_public(mine.id, True)
    assert _run(client, other_tenant, {**GREEDY, "lora": mine.id}).status_code == 200
    assert UsageEvent.objects.get(account=other_tenant.account).adapter == "private-one"


def test_lora_refusals_are_clear_4xx(client, tenant, backend, adapter_files):
    adapter = _upload(tenant.account, "ok", adapter_files[0])
    embed = client.post(f"{tenant.run_url}{EMBED_MODEL}", data=json.dumps({"text": "hi", "lora": adapter.name}),
                        content_type="application/json", **tenant.auth)
    assert embed.status_code == 400 and embed.json()["errors"][0]["code"] == errors.CODE_LORA_UNSUPPORTED
    unknown = _run(client, tenant, {**GREEDY, "lora": "nope"})
    assert unknown.status_code == 400 and "No LoRA adapter 'nope'" in unknown.json()["errors"][0]["message"]
    by_model = _completion(client, tenant, f"{CHAT_MODEL}:nope")
    assert by_model.status_code == 400 and by_model.json()["error"]["param"] == "lora"
    clash = _completion(client, tenant, f"{CHAT_MODEL}:{adapter.name}", lora="other")
    assert clash.status_code == 400 and "lora names 'other'" in clash.json()["error"]["message"]
    pending = adapters.create_adapter(tenant.account, name="half", base_model=CHAT_MODEL)
    missing = _run(client, tenant, {**GREEDY, "lora": pending.name})
    assert missing.status_code == 400 and missing.json()["errors"][0]["code"] == 3039
    assert not UsageEvent.objects.filter(account=tenant.account).exists()  # refused at admission: nothing billed


@pytest.mark.django_db(transaction=True)
@pytest.mark.redis
def test_batches_serve_each_item_with_its_adapter(client, tenant, batch_worker, adapter_files):
    """A Workers AI queueRequest mixing two adapters and the base model, and an OpenAI batch line naming
    `<base>:<adapter>`: each item gets what the same request gets interactively, and its usage names the adapter."""
    from test_batches_native import poll_until_done, post

    first, second = (_upload(tenant.account, f"batch-{i}", folder) for i, folder in enumerate(adapter_files))
    choice = [first.name, None, second.id, first.id]
    requests = [{**GREEDY, **({"lora": ref} if ref else {})} for ref in choice]
    queued = post(client, tenant, CHAT_MODEL, {"requests": requests})
    assert queued.status_code == 200, queued.content
    result = poll_until_done(client, tenant, CHAT_MODEL, queued.json()["result"]["request_id"])
    answers = [r["result"]["response"] for r in result["responses"]]
    interactive = [_run(client, tenant, body).json()["result"]["response"] for body in requests]
    assert answers == interactive and answers[0] == answers[3] and len(set(answers[:3])) == 3
    batch_events = UsageEvent.objects.filter(account=tenant.account, source="batch").order_by("request_id")
    assert sorted(e.adapter for e in batch_events) == sorted(["batch-0", "", "batch-1", "batch-0"])

    from controlplane.batches.validation import check_openai_body

    line = {"model": f"{CHAT_MODEL}:{second.name}", "prompt": PROMPT, "max_tokens": 4}
    checked = check_openai_body("/v1/completions", line, (), tenant.account.pk)
    assert checked.entry.name == CHAT_MODEL and checked.adapter == second.name
    assert checked.lora is not None and checked.lora.name == adapters.adapter_key(second)

    bad = post(client, tenant, CHAT_MODEL, {"requests": [{**GREEDY, "lora": "nope"}]})
    assert bad.status_code == 400 and "No LoRA adapter 'nope'" in bad.json()["errors"][0]["message"]
