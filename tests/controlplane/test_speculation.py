"""Speculative decoding through the control plane: catalog defaults, the per-request override on both APIs,
speculation stats on usage events and reports, and the Prometheus series."""

from __future__ import annotations

import json

import pytest
from cp_support import CHAT_MODEL, EMBED_MODEL
from django.apps import apps

from controlplane.catalog.models import AiModel
from controlplane.catalog.services import get_model, invalidate, seed
from controlplane.usage.models import Status, UsageEvent
from inference import EngineConfig
from inference.models.catalog import BUNDLED_MODELS

pytestmark = pytest.mark.django_db

QWEN = "@hearth/qwen2.5-coder-0.5b-instruct"
QWEN_15 = "@hearth/qwen2.5-coder-1.5b-instruct"
GEMMA = "@hearth/gemma-3-270m"
GROUNDED = ("Repeat exactly, word for word: The quick brown fox jumps over the lazy dog, then the lazy dog "
            "sleeps under the old oak tree by the river.")


def run(client, tenant, body, model=CHAT_MODEL):
    return client.post(f"{tenant.run_url}{model}", data=json.dumps(body), content_type="application/json",
                       **tenant.auth)


def chat(client, tenant, body, model=CHAT_MODEL):
    return client.post("/v1/chat/completions", content_type="application/json", **tenant.auth,
                       data=json.dumps({"model": model, "messages": [{"role": "user", "content": "Hi"}], **body}))


# ------------------------------------------------------------------------------------------------- catalog
def test_seeded_models_carry_speculation_defaults_into_engine_config(catalog):
    for name in (CHAT_MODEL, QWEN):
        config = EngineConfig.from_settings(dict(catalog[name].engine_settings))
        assert (config.speculation, config.num_speculative_tokens, config.draft_model) == ("ngram", 8, None)
    assert EngineConfig.from_settings(dict(catalog[GEMMA].engine_settings)).speculation == "off"
    # The 1.5B drafts with the 0.5B when that is installed, and falls back to prompt lookup when it is not.
    draft = AiModel.objects.get(name=QWEN_15).engine_settings
    if BUNDLED_MODELS[QWEN].installed:
        assert draft == {"speculation": "draft", "draft_model": QWEN}
        assert EngineConfig.from_settings(draft).draft_model == QWEN
    else:
        assert draft["speculation"] == "ngram"
    AiModel.objects.filter(name=QWEN_15).delete()
    seed([BUNDLED_MODELS[QWEN_15]], log=lambda line: None)  # its draft is not among the seeded models
    assert AiModel.objects.get(name=QWEN_15).engine_settings == {"speculation": "ngram",
                                                                  "num_speculative_tokens": 8}


def test_reseeding_keeps_an_operators_speculation_choice(catalog):
    AiModel.objects.filter(name=CHAT_MODEL).update(engine_settings={"speculation": "off", "max_num_seqs": 8})
    seed(BUNDLED_MODELS.values(), log=lambda line: None)
    assert AiModel.objects.get(name=CHAT_MODEL).engine_settings == {"speculation": "off", "max_num_seqs": 8}
    assert get_model(CHAT_MODEL).speculation == {"mode": "off", "k": 4, "draft_model": None}


def test_upgrade_migration_fills_in_defaults_without_overriding_operators(catalog):
    from importlib import import_module

    migration = import_module("controlplane.catalog.migrations.0002_speculation_defaults")
    AiModel.objects.filter(name=CHAT_MODEL).update(engine_settings={"max_num_seqs": 8})
    AiModel.objects.filter(name=QWEN).update(engine_settings={"speculation": "off"})
    migration.add_defaults(apps, None)
    assert AiModel.objects.get(name=CHAT_MODEL).engine_settings == {
        "max_num_seqs": 8, "speculation": "ngram", "num_speculative_tokens": 8}
    assert AiModel.objects.get(name=QWEN).engine_settings == {"speculation": "off"}


def test_listings_show_each_models_speculation_defaults(client, tenant, catalog):
    models = {m["id"]: m for m in client.get("/v1/models", **tenant.auth).json()["data"]}
    if CHAT_MODEL not in models:
        pytest.skip("SmolLM2 is not installed: run `make models`")
    assert models[CHAT_MODEL]["speculation"] == {"mode": "ngram", "k": 8, "draft_model": None}
    if GEMMA in models:
        assert models[GEMMA]["speculation"] == {"mode": "off", "k": 4, "draft_model": None}
    if EMBED_MODEL in models:
        assert models[EMBED_MODEL]["speculation"] is None
    if QWEN_15 in models:
        assert models[QWEN_15]["speculation"] == {"mode": "draft", "k": 4, "draft_model": QWEN}
    one = client.get(f"/v1/models/{CHAT_MODEL}", **tenant.auth).json()
    assert one["speculation"] == models[CHAT_MODEL]["speculation"]

    url = f"/client/v4/accounts/{tenant.account.pk}/ai/models/search"
    found = client.get(url, {"search": "smollm2"}, **tenant.auth).json()["result"]
    props = {p["property_id"]: p["value"] for p in found[0]["properties"]}
    assert (props["speculation"], props["num_speculative_tokens"]) == ("ngram", "8")
    assert "draft_model" not in props


# ---------------------------------------------------------------------------------------- request checks
@pytest.mark.parametrize("value", ["bogus", "", 5, True, {"mode": "ngram", "k": 0}, {"mode": "ngram", "k": 17},
                                   {"mode": "ngram", "k": "4"}, {"k": 4}, {"mode": "fast"}, ["ngram"]])
def test_invalid_speculation_is_400_on_both_apis_and_not_metered(client, tenant, catalog, value):
    if not BUNDLED_MODELS[CHAT_MODEL].installed:
        pytest.skip("SmolLM2 is not installed: run `make models`")
    native = run(client, tenant, {"prompt": "Hi", "max_tokens": 2, "speculation": value})
    assert native.status_code == 400, native.content
    error = native.json()["errors"][0]
    assert error["code"] == 5006 and "speculation" in error["message"]
    openai = chat(client, tenant, {"max_tokens": 2, "speculation": value})
    assert openai.status_code == 400, openai.content
    body = openai.json()["error"]
    assert body["type"] == "invalid_request_error" and "speculation" in body["message"]
    assert body["param"] is not None and body["param"].startswith("speculation")
    assert not UsageEvent.objects.exists()


def test_draft_on_a_model_without_a_draft_model_is_400(client, tenant, catalog):
    if not BUNDLED_MODELS[CHAT_MODEL].installed:
        pytest.skip("SmolLM2 is not installed: run `make models`")
    for value in ("draft", {"mode": "draft", "k": 2}):
        native = run(client, tenant, {"prompt": "Hi", "max_tokens": 2, "speculation": value})
        assert native.status_code == 400 and native.json()["errors"][0]["code"] == 5006
        assert "draft" in native.json()["errors"][0]["message"]
        openai = chat(client, tenant, {"speculation": value})
        assert openai.status_code == 400 and openai.json()["error"]["param"] == "speculation"
    assert not UsageEvent.objects.exists()


# ------------------------------------------------------------------------------------------ real engine
@pytest.mark.real_model
def test_ngram_gives_the_same_greedy_text_and_meters_its_drafts(client, tenant, backend):
    base = {"prompt": GROUNDED, "max_tokens": 24, "temperature": 0}
    off = run(client, tenant, {**base, "speculation": "off"})
    ngram = run(client, tenant, {**base, "speculation": {"mode": "ngram", "k": 6}})
    assert off.status_code == ngram.status_code == 200, ngram.content
    text = off.json()["result"]["response"]
    assert text and ngram.json()["result"]["response"] == text
    first, second = UsageEvent.objects.order_by("created_at")
    assert (first.spec_proposed, first.spec_accepted) == (0, 0)
    assert second.status == Status.OK and second.spec_proposed > 0
    assert 0 < second.spec_accepted <= second.spec_proposed
    # Drafts are not billed: the event is priced on the tokens kept, as without speculation.
    assert second.output_tokens == first.output_tokens
    price = second.price
    kept = ((second.input_tokens - second.cached_input_tokens) * price.neurons_per_m_input
            + second.cached_input_tokens * price.neurons_per_m_cached_input
            + second.output_tokens * price.neurons_per_m_output) / 1_000_000
    assert second.neurons == kept.quantize(second.neurons)

    # /v1 with the string form: the same words, and the stats land on its event too.
    reply = client.post("/v1/chat/completions", content_type="application/json", **tenant.auth, data=json.dumps({
        "model": CHAT_MODEL, "messages": [{"role": "user", "content": GROUNDED}], "max_tokens": 24,
        "temperature": 0, "speculation": "ngram"}))
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == text
    third = UsageEvent.objects.order_by("created_at").last()
    assert third.route == "openai.chat" and third.spec_proposed > 0

    report = client.get(f"/client/v4/accounts/{tenant.account.pk}/ai/usage", **tenant.auth).json()["result"]
    totals = report["totals"]
    assert totals["spec_proposed"] == second.spec_proposed + third.spec_proposed
    assert totals["spec_accepted"] == second.spec_accepted + third.spec_accepted
    assert totals["spec_acceptance_rate"] == pytest.approx(totals["spec_accepted"] / totals["spec_proposed"])
    csv = client.get(f"/client/v4/accounts/{tenant.account.pk}/ai/usage/export", **tenant.auth).content.decode()
    assert "spec_proposed" in csv.splitlines()[0]

    text = client.get("/metrics").content.decode()
    engine = _sample(text, "hearth_engine_spec_proposed", CHAT_MODEL)
    assert engine is not None and engine >= second.spec_proposed + third.spec_proposed
    assert 0 < _sample(text, "hearth_engine_spec_acceptance_rate", CHAT_MODEL) <= 1
    assert f'hearth_engine_spec_position_acceptance{{model="{CHAT_MODEL}",position="1"}}' in text
    assert f'hearth_speculative_tokens_total{{kind="proposed",model="{CHAT_MODEL}"}}' in text


@pytest.mark.real_model
def test_a_draft_the_engine_cannot_serve_is_400_and_not_billed(client, tenant, backend):
    # The catalog claims a draft model but this engine was loaded without one (settings changed since load):
    # the engine refuses at submission and the API answers 400, never 500.
    AiModel.objects.filter(name=CHAT_MODEL).update(engine_settings={"draft_model": QWEN})
    invalidate()
    native = run(client, tenant, {"prompt": "Hi", "max_tokens": 2, "speculation": "draft"})
    assert native.status_code == 400 and native.json()["errors"][0]["code"] == 5006, native.content
    openai = chat(client, tenant, {"max_tokens": 2, "speculation": "draft"})
    assert openai.status_code == 400 and openai.json()["error"]["type"] == "invalid_request_error"
    events = list(UsageEvent.objects.all())
    assert len(events) == 2 and all(e.status == Status.ERROR and e.neurons == 0 for e in events)


def _sample(text: str, name: str, model: str) -> float | None:
    prefix = f'{name}{{model="{model}"}} '
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix):])
    return None
