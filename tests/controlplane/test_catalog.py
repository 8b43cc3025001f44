"""Catalog seeding, listings with prices, and price rows that never rewrite the past."""

from __future__ import annotations

import io
from datetime import timedelta

import pytest
from cp_support import CHAT_MODEL, EMBED_MODEL
from django.core.exceptions import ValidationError
from django.core.management import call_command
from django.utils import timezone

from controlplane.catalog.models import AiModel, Price
from controlplane.catalog.services import catalog, set_price
from inference.models.catalog import BUNDLED_MODELS, installed_models

pytestmark = pytest.mark.django_db


def test_seed_catalog_command_is_idempotent_and_keeps_operator_edits(db):
    installed = [m.name for m in installed_models()]
    if not installed:
        pytest.skip("no bundled model is installed: run `make models`")
    call_command("seed_catalog", stdout=io.StringIO())
    assert sorted(AiModel.objects.values_list("name", flat=True)) == sorted(installed)
    row = AiModel.objects.get(name=installed[0])
    spec = BUNDLED_MODELS[row.name]
    assert (row.task, row.context_window, row.supports_lora) == (spec.task, spec.context_window, spec.supports_lora)
    row.is_active = False
    row.engine_settings = {"max_num_seqs": 8}
    row.save()
    prices = Price.objects.count()
    call_command("seed_catalog", stdout=io.StringIO())
    row.refresh_from_db()
    assert (row.is_active, row.engine_settings) == (False, {"max_num_seqs": 8})
    assert AiModel.objects.count() == len(installed) and Price.objects.count() == prices == len(installed)


def test_v1_models_lists_installed_models_with_prices(client, tenant, catalog):
    body = client.get("/v1/models", **tenant.auth).json()
    assert body["object"] == "list"
    ids = [m["id"] for m in body["data"]]
    assert ids == sorted(m.name for m in installed_models())
    chat = next(m for m in body["data"] if m["id"] == CHAT_MODEL)
    assert chat["object"] == "model" and chat["task"] == "text-generation" and chat["context_window"] == 8192
    pricing = chat["pricing"]
    assert pricing["neurons_per_m_cached_input_tokens"] < pricing["neurons_per_m_input_tokens"]
    assert pricing["usd_per_m_output_tokens"] == pytest.approx(pricing["neurons_per_m_output_tokens"] * 0.011 / 1000)
    one = client.get(f"/v1/models/{CHAT_MODEL}", **tenant.auth).json()
    assert one["id"] == CHAT_MODEL and one["pricing"] == pricing
    mounted = client.get(f"/client/v4/accounts/{tenant.account.pk}/ai/v1/models", **tenant.auth).json()
    assert [m["id"] for m in mounted["data"]] == ids


def test_models_search_filters_and_pages(client, tenant, catalog):
    url = f"/client/v4/accounts/{tenant.account.pk}/ai/models/search"
    body = client.get(url, {"task": "text-embeddings"}, **tenant.auth).json()
    assert body["success"] and [m["name"] for m in body["result"]] == (
        [EMBED_MODEL] if BUNDLED_MODELS[EMBED_MODEL].installed else [])
    if body["result"]:
        props = {p["property_id"]: p["value"] for p in body["result"][0]["properties"]}
        assert props["context_window"] == "256" and props["price"][0]["currency"] == "USD"
    page = client.get(url, {"per_page": 1, "page": 2}, **tenant.auth).json()
    assert page["result_info"]["per_page"] == 1 and page["result_info"]["total_count"] == len(installed_models())
    found = client.get(url, {"search": "smollm"}, **tenant.auth).json()["result"]
    assert [m["name"] for m in found] == ([CHAT_MODEL] if BUNDLED_MODELS[CHAT_MODEL].installed else [])


def test_models_say_whether_they_take_tools_and_json_mode(client, tenant, catalog):
    listed = {m["id"]: m for m in client.get("/v1/models", **tenant.auth).json()["data"]}
    assert (listed[CHAT_MODEL]["supports_tools"], listed[CHAT_MODEL]["supports_json_mode"]) == (True, True)
    if EMBED_MODEL in listed:
        assert (listed[EMBED_MODEL]["supports_tools"], listed[EMBED_MODEL]["supports_json_mode"]) == (False, False)
    model = AiModel.objects.get(name=CHAT_MODEL)
    model.properties = {**model.properties, "function_calling": False}
    model.save()  # an operator's edit: the catalog cache follows at once
    found = client.get(f"/client/v4/accounts/{tenant.account.pk}/ai/models/search", {"search": "smollm"},
                       **tenant.auth).json()["result"]
    props = [(p["property_id"], p["value"]) for p in found[0]["properties"]]
    assert ("function_calling", "false") in props and ("json_mode", "true") in props
    assert [k for k, _ in props].count("function_calling") == 1


def test_listing_follows_catalog_edits_at_once(client, tenant, catalog):
    model = AiModel.objects.get(name=CHAT_MODEL)
    new = set_price(model, input_neurons=4242, cached_input_neurons=1000, output_neurons=9999)
    listed = client.get(f"/v1/models/{CHAT_MODEL}", **tenant.auth).json()
    assert listed["pricing"]["neurons_per_m_input_tokens"] == 4242
    assert catalog_price_id(CHAT_MODEL) == new.pk
    model.deprecated_on = timezone.now().date()
    model.save()
    assert client.get(f"/v1/models/{CHAT_MODEL}", **tenant.auth).json()["deprecated_on"] is not None
    model.is_active = False
    model.save()
    assert CHAT_MODEL not in [m["id"] for m in client.get("/v1/models", **tenant.auth).json()["data"]]


def catalog_price_id(name: str) -> int:
    import time

    return catalog()[name].price_at(time.time()).price_id


def test_a_price_that_took_effect_cannot_be_edited_but_a_future_one_can(catalog):
    model = AiModel.objects.get(name=CHAT_MODEL)
    current = model.prices.first()
    current.neurons_per_m_input = 1
    with pytest.raises(ValidationError):
        current.full_clean()
    future = set_price(model, input_neurons=10, cached_input_neurons=5, output_neurons=20,
                       effective_at=timezone.now() + timedelta(days=2))
    future.neurons_per_m_input = 11
    future.full_clean()
    with pytest.raises(ValidationError):
        set_price(model, input_neurons=-1, cached_input_neurons=0, output_neurons=0,
                  effective_at=timezone.now() + timedelta(days=3))
