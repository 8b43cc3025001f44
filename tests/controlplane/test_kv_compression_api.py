"""KV compression through the control plane: the per-request override on both APIs, catalog defaults, the
server-wide switch, and clear 400s for bad values."""

from __future__ import annotations

import json

import pytest
from cp_support import CHAT_MODEL
from django.test import override_settings

from controlplane.catalog.models import AiModel
from controlplane.serving.dispatch import catalog_settings
from controlplane.usage.models import UsageEvent
from inference import EngineConfig
from inference.models.catalog import BUNDLED_MODELS

pytestmark = pytest.mark.django_db

# A long, input-grounded prompt: compression only applies past the engine's minimum prompt length.
LONG = " ".join(f"Item {n}: the {['red', 'blue', 'green'][n % 3]} box holds {n * 7} marbles." for n in range(60))


def run(client, tenant, body, model=CHAT_MODEL):
    return client.post(f"{tenant.run_url}{model}", data=json.dumps(body), content_type="application/json",
                       **tenant.auth)


def chat(client, tenant, body, model=CHAT_MODEL):
    return client.post("/v1/chat/completions", content_type="application/json", **tenant.auth,
                       data=json.dumps({"model": model, "messages": [{"role": "user", "content": "Hi"}], **body}))


@pytest.mark.parametrize("value", [{}, {"rate": 0.5}, {"rate": "8"}, {"rate": 2, "max_cache_tokens": 10},
                                   {"max_cache_tokens": 0}, {"max_cache_tokens": 1.5}, {"ratio": 8}, 8, "8x"])
def test_invalid_kv_compression_is_400_on_both_apis_and_not_metered(client, tenant, catalog, value):
    if not BUNDLED_MODELS[CHAT_MODEL].installed:
        pytest.skip("SmolLM2 is not installed: run `make models`")
    native = run(client, tenant, {"prompt": "Hi", "max_tokens": 2, "kv_compression": value})
    assert native.status_code == 400, native.content
    error = native.json()["errors"][0]
    assert error["code"] == 5006 and "kv_compression" in error["message"]
    openai = chat(client, tenant, {"max_tokens": 2, "kv_compression": value})
    assert openai.status_code == 400, openai.content
    body = openai.json()["error"]
    assert body["type"] == "invalid_request_error" and body["param"].startswith("kv_compression")
    assert not UsageEvent.objects.exists()


def test_catalog_defaults_and_the_server_switch_reach_the_engine_config(catalog):
    AiModel.objects.filter(name=CHAT_MODEL).update(engine_settings={"kv_compression_rate": 8})
    from controlplane.catalog.services import invalidate

    invalidate()
    config = EngineConfig.from_settings(catalog_settings(CHAT_MODEL))
    assert config.kv_compression and config.default_kv_compression().rate == 8.0
    with override_settings(HEARTH_KV_COMPRESSION=False):
        assert EngineConfig.from_settings(catalog_settings(CHAT_MODEL)).kv_compression is False


@pytest.mark.real_model
def test_a_request_can_compress_its_cache_on_both_apis(client, tenant, backend):
    native = run(client, tenant, {"prompt": LONG, "max_tokens": 8, "temperature": 0,
                                  "kv_compression": {"rate": 4}})
    assert native.status_code == 200, native.content
    assert native.json()["result"]["response"]
    openai = client.post("/v1/chat/completions", content_type="application/json", **tenant.auth, data=json.dumps({
        "model": CHAT_MODEL, "messages": [{"role": "user", "content": LONG}], "max_tokens": 8, "temperature": 0,
        "kv_compression": {"max_cache_tokens": 64}}))
    assert openai.status_code == 200, openai.content
    metrics = backend._engines[CHAT_MODEL].metrics()  # the in-process engine really compressed both
    assert metrics.kv_compressions_total >= 2 and metrics.kv_evicted_entries_total > 0
    assert metrics.kv_blocks_free == metrics.kv_blocks_total
