"""Metering on the real engine: usage events, neurons and dollars at the price in effect, rollups, limits."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from decimal import Decimal

import pytest
from cp_support import CHAT_MODEL, EMBED_MODEL, make_tenant, seconds_left_in_minute
from django.utils import timezone

from controlplane.accounts.models import Account
from controlplane.catalog.models import AiModel
from controlplane.catalog.services import set_price
from controlplane.usage.models import Status, UsageDay, UsageEvent, UsageMinute

pytestmark = [pytest.mark.django_db, pytest.mark.real_model]


def run(client, tenant, body, model=CHAT_MODEL, **headers):
    return client.post(f"{tenant.run_url}{model}", data=json.dumps(body), content_type="application/json",
                       **tenant.auth, **headers)


def expected_neurons(event: UsageEvent) -> Decimal:
    price = event.price
    fresh = event.input_tokens - event.cached_input_tokens
    total = (fresh * price.neurons_per_m_input + event.cached_input_tokens * price.neurons_per_m_cached_input
             + event.output_tokens * price.neurons_per_m_output) / Decimal(1_000_000)
    return total.quantize(Decimal("0.000001"))


def test_native_run_records_a_priced_event_and_rollups(client, tenant, backend):
    response = run(client, tenant, {"prompt": "Name a colour.", "max_tokens": 4, "temperature": 0},
                   HTTP_X_SESSION_AFFINITY="sess-42")
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["success"] and isinstance(body["result"]["response"], str) and body["result"]["response"]
    usage = body["result"]["usage"]
    event = UsageEvent.objects.get()
    # The reply's usage is exactly what was metered; a 4-token budget yields 1 to 4 tokens (EOS may come first).
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (event.input_tokens, event.output_tokens)
    assert usage["completion_tokens"] in {1, 2, 3, 4}

    assert (event.account_id, event.api_key_id, event.model, event.route) == (
        tenant.account.pk, tenant.key.pk, CHAT_MODEL, "native")
    assert (event.status, event.http_status, event.stream, event.source) == ("ok", 200, False, "interactive")
    assert event.input_tokens == usage["prompt_tokens"] and event.output_tokens == usage["completion_tokens"]
    assert event.session_affinity == "sess-42"
    assert event.neurons == expected_neurons(event) > 0
    assert event.cost_usd == (event.neurons * Decimal("0.011") / 1000).quantize(Decimal("0.0000000001"))
    assert event.latency_ms > 0 and event.ttft_ms is not None and event.ttft_ms <= event.latency_ms

    for rollup in (UsageMinute.objects.get(), UsageDay.objects.get()):
        assert (rollup.requests, rollup.errors, rollup.key_id) == (1, 0, str(tenant.key.pk))
        assert rollup.input_tokens == event.input_tokens and rollup.neurons == event.neurons
    run(client, tenant, {"prompt": "Name a colour.", "max_tokens": 2})
    assert UsageDay.objects.get().requests == 2 and UsageEvent.objects.count() == 2


def test_repeated_prompt_reports_cached_tokens_at_the_discounted_price(client, tenant, backend):
    prompt = "You are a helpful assistant. " * 8 + "Answer briefly: what is two plus two?"
    first = run(client, tenant, {"prompt": prompt, "max_tokens": 2, "temperature": 0}).json()["result"]["usage"]
    second = run(client, tenant, {"prompt": prompt, "max_tokens": 2, "temperature": 0}).json()["result"]["usage"]
    assert second["prompt_tokens"] == first["prompt_tokens"]
    assert second["prompt_tokens_details"]["cached_tokens"] > 0
    events = list(UsageEvent.objects.order_by("created_at"))
    assert events[1].cached_input_tokens == second["prompt_tokens_details"]["cached_tokens"]
    assert events[1].neurons == expected_neurons(events[1])
    if events[0].output_tokens == events[1].output_tokens:
        assert events[1].neurons < events[0].neurons


def test_price_change_applies_from_its_effective_time_only(client, tenant, backend):
    run(client, tenant, {"prompt": "Hello", "max_tokens": 2})
    before = UsageEvent.objects.get()
    old_neurons, old_price = before.neurons, before.price_id
    model = AiModel.objects.get(name=CHAT_MODEL)
    future = set_price(model, input_neurons=1, cached_input_neurons=1, output_neurons=1,
                       effective_at=timezone.now() + timedelta(days=1))
    run(client, tenant, {"prompt": "Hello", "max_tokens": 2})
    assert UsageEvent.objects.order_by("-created_at").first().price_id == old_price  # not effective yet
    new = set_price(model, input_neurons=100_000, cached_input_neurons=50_000, output_neurons=200_000)
    run(client, tenant, {"prompt": "Hello", "max_tokens": 2})
    latest = UsageEvent.objects.order_by("-created_at").first()
    assert latest.price_id == new.pk != future.pk
    assert latest.neurons == expected_neurons(latest) > old_neurons
    before.refresh_from_db()
    assert (before.neurons, before.price_id) == (old_neurons, old_price)  # past usage untouched


def test_prompt_beyond_the_context_window_is_4xx_and_not_billed(client, tenant, backend):
    AiModel.objects.filter(name=CHAT_MODEL).update(context_window=64)
    from controlplane.catalog.services import invalidate

    invalidate()
    long_prompt = "word " * 200
    response = run(client, tenant, {"prompt": long_prompt})
    assert response.status_code == 413 and response.json()["errors"][0]["code"] == 3006
    chat = client.post("/v1/chat/completions", content_type="application/json", **tenant.auth, data=json.dumps(
        {"model": CHAT_MODEL, "messages": [{"role": "user", "content": long_prompt}]}))
    assert chat.status_code == 400 and chat.json()["error"]["code"] == "context_length_exceeded"
    events = list(UsageEvent.objects.all())
    assert len(events) == 2 and all(e.status == Status.ERROR and e.neurons == 0 for e in events)
    assert {e.http_status for e in events} == {413}
    assert UsageDay.objects.get().errors == 2
    # An explicit max_tokens larger than what the context leaves is clamped, not refused.
    ok = run(client, tenant, {"prompt": "Hi", "max_tokens": 5000})
    assert ok.status_code == 200


def test_embeddings_are_metered_on_input_tokens(client, tenant, backend):
    response = run(client, tenant, {"text": ["first text", "a second, longer text"]}, model=EMBED_MODEL)
    assert response.status_code == 200
    result = response.json()["result"]
    assert result["shape"] == [2, 384] and len(result["data"][1]) == 384
    event = UsageEvent.objects.get()
    assert event.model == EMBED_MODEL and event.output_tokens == 0 and event.input_tokens >= 8
    assert event.neurons == expected_neurons(event) > 0


def test_rate_limits_requests_per_minute_with_retry_after(client, catalog, backend):
    limited = make_tenant("limited", requests_per_minute=2)
    for _ in range(2):
        assert run(client, limited, {"prompt": "Hi", "max_tokens": 1}).status_code == 200
    before = time.time()
    refused = run(client, limited, {"prompt": "Hi", "max_tokens": 1})
    after = time.time()
    assert refused.status_code == 429 and refused.json()["errors"][0]["code"] == 971
    assert int(refused["Retry-After"]) in seconds_left_in_minute(before, after)
    openai = client.post("/v1/chat/completions", content_type="application/json", **limited.auth,
                         data=json.dumps({"model": CHAT_MODEL, "messages": [{"role": "user", "content": "x"}]}))
    assert openai.status_code == 429 and openai.json()["error"]["code"] == "rate_limit_exceeded"
    assert UsageEvent.objects.count() == 2  # refusals are not billed


def test_rate_limits_tokens_per_minute(client, catalog, backend):
    limited = make_tenant("tokens", tokens_per_minute=10)
    assert run(client, limited, {"prompt": "Hello there", "max_tokens": 2}).status_code == 200
    refused = run(client, limited, {"prompt": "Hi", "max_tokens": 1})
    assert refused.status_code == 429 and "tokens per minute" in refused.json()["errors"][0]["message"]
    assert int(refused["Retry-After"]) >= 1


def test_daily_free_allocation_then_paid_plan(client, tenant, backend):
    account = Account.objects.get(pk=tenant.account.pk)
    account.daily_free_neurons = 0
    account.save()  # drops the cached key contexts, as an admin edit does
    refused = run(client, tenant, {"prompt": "Hi", "max_tokens": 1})
    assert refused.status_code == 429 and refused.json()["errors"][0]["code"] == 3036
    assert 0 < int(refused["Retry-After"]) <= 86400
    account.paid_plan = True
    account.save()
    assert run(client, tenant, {"prompt": "Hi", "max_tokens": 1}).status_code == 200
