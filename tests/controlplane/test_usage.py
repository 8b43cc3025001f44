"""Usage events through the metering service, the rollups they feed, the usage API, CSV, and account limits."""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from cp_support import CHAT_MODEL, EMBED_MODEL, make_tenant

from controlplane.accounts.models import Account
from controlplane.catalog.models import AiModel
from controlplane.catalog.services import get_model, set_price
from controlplane.usage.models import Status, UsageDay, UsageEvent, UsageMinute
from controlplane.usage.services import UsageRecord, check_account_limits, record

pytestmark = pytest.mark.django_db

DAY1 = datetime(2026, 3, 1, 10, 15, 30, tzinfo=UTC)
DAY2 = datetime(2026, 3, 2, 23, 59, 1, tzinfo=UTC)


@pytest.fixture(autouse=True)
def historical_prices(catalog):
    """Prices effective since 2020, so the fixed dates below have a price in effect (as an operator sets)."""
    for name in (CHAT_MODEL, EMBED_MODEL):
        set_price(AiModel.objects.get(name=name), input_neurons=1000, cached_input_neurons=250, output_neurons=4000,
                  effective_at=datetime(2020, 1, 1, tzinfo=UTC))


def rec(tenant, *, model=CHAT_MODEL, at=DAY1, inp=100, cached=0, out=50, status=Status.OK, key=True):
    return record(UsageRecord(account_id=tenant.account.pk, key_id=str(tenant.key.pk) if key else None,
                              model=model, route="native", status=status, input_tokens=inp,
                              cached_input_tokens=cached, output_tokens=out, latency_ms=20.0, ttft_ms=5.0,
                              created_at=at))


def test_rollups_add_up_events_per_minute_and_day(tenant):
    events = [rec(tenant), rec(tenant, at=DAY1 + timedelta(seconds=20)), rec(tenant, at=DAY1 + timedelta(minutes=1)),
              rec(tenant, at=DAY2), rec(tenant, model=EMBED_MODEL, out=0), rec(tenant, status=Status.ERROR)]
    minutes = {(m.minute, m.model): m for m in UsageMinute.objects.all()}
    first_minute = minutes[(DAY1.replace(second=0), CHAT_MODEL)]
    assert (first_minute.requests, first_minute.errors) == (3, 1)
    assert first_minute.neurons == events[0].neurons + events[1].neurons
    days = {(d.day, d.model): d for d in UsageDay.objects.all()}
    day1 = days[(DAY1.date(), CHAT_MODEL)]
    assert day1.requests == 4 and day1.input_tokens == 300 and day1.output_tokens == 150
    assert day1.latency_ms_sum == 80.0 and day1.ttft_count == 4
    assert days[(DAY2.date(), CHAT_MODEL)].requests == 1
    total = sum((e.neurons for e in UsageEvent.objects.all()), Decimal(0))
    assert sum((d.neurons for d in UsageDay.objects.all()), Decimal(0)) == total


def test_failed_requests_are_never_billable(tenant):
    event = rec(tenant, status=Status.ERROR, inp=500, out=500)
    assert (event.neurons, event.cost_usd, event.input_tokens, event.price_id) == (0, 0, 0, None)


def test_event_is_priced_at_the_price_in_effect(tenant):
    event = rec(tenant, inp=1_000_000, cached=400_000, out=1_000_000)
    price = get_model(CHAT_MODEL).price_at(DAY1.timestamp())
    expected = (600_000 * price.neurons_per_m_input + 400_000 * price.neurons_per_m_cached_input
                + 1_000_000 * price.neurons_per_m_output) / 1_000_000
    assert event.neurons == expected
    assert event.cost_usd == expected * Decimal("0.011") / 1000


def test_usage_api_filters_and_groups(client, tenant, other_tenant):
    rec(tenant)
    rec(tenant, at=DAY2)
    rec(tenant, model=EMBED_MODEL, out=0)
    rec(other_tenant)  # another account's usage never shows up
    url = f"/client/v4/accounts/{tenant.account.pk}/ai/usage"
    window = {"since": "2026-03-01", "until": "2026-03-02"}
    body = client.get(url, {**window, "group_by": "model,day"}, **tenant.auth).json()
    assert body["success"]
    rows = {(r["time"], r["model"]): r for r in body["result"]["rows"]}
    assert set(rows) == {("2026-03-01", CHAT_MODEL), ("2026-03-01", EMBED_MODEL), ("2026-03-02", CHAT_MODEL)}
    assert body["result"]["totals"]["requests"] == 3
    only_chat = client.get(url, {**window, "model": CHAT_MODEL}, **tenant.auth).json()["result"]
    assert only_chat["totals"]["requests"] == 2 and only_chat["totals"]["input_tokens"] == 200
    by_key = client.get(url, {**window, "group_by": "key", "key": str(tenant.key.pk)}, **tenant.auth).json()
    assert [r["key_id"] for r in by_key["result"]["rows"]] == [str(tenant.key.pk)]
    minutes = client.get(url, {"since": "2026-03-01T10:00:00Z", "until": "2026-03-01T11:00:00Z",
                               "granularity": "minute", "group_by": "minute"}, **tenant.auth).json()["result"]
    assert [r["time"] for r in minutes["rows"]] == ["2026-03-01T10:15:00+00:00"]
    for bad in ({"group_by": "colour"}, {"since": "yesterday"}, {"granularity": "hour"},
                {"since": "2026-03-05", "until": "2026-03-01"}):
        response = client.get(url, bad, **tenant.auth)
        assert response.status_code == 400 and response.json()["errors"][0]["code"] == 5006


def test_usage_csv_export(client, tenant):
    rec(tenant)
    rec(tenant, at=DAY2)
    response = client.get(f"/client/v4/accounts/{tenant.account.pk}/ai/usage/export",
                          {"since": "2026-03-01", "until": "2026-03-02"}, **tenant.auth)
    assert response.status_code == 200 and response["Content-Type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(response.content.decode())))
    assert [(r["time"], r["model"], r["requests"]) for r in rows] == [
        ("2026-03-01", CHAT_MODEL, "1"), ("2026-03-02", CHAT_MODEL, "1")]
    assert rows[0]["key_id"] == str(tenant.key.pk) and float(rows[0]["neurons"]) > 0
    same = client.get(f"/client/v4/accounts/{tenant.account.pk}/ai/usage",
                      {"since": "2026-03-01", "until": "2026-03-02", "format": "csv", "group_by": "day,model,key"},
                      **tenant.auth)
    assert same.content == response.content


def test_free_allocation_counts_todays_neurons_and_resets_by_day(tenant):
    from controlplane.accounts.services import authenticate_key
    from controlplane.api.errors import ApiError

    now = datetime.now(UTC)
    account = Account.objects.get(pk=tenant.account.pk)
    account.daily_free_neurons = 1
    account.save()
    ctx = authenticate_key(tenant.secret)
    check_account_limits(ctx, now)  # nothing used yet
    rec(tenant, at=now - timedelta(days=1), inp=10_000_000)  # yesterday's usage does not count
    check_account_limits(ctx, now)
    rec(tenant, at=now, inp=1_000_000)
    with pytest.raises(ApiError) as refused:
        check_account_limits(ctx, now)
    assert (refused.value.status, refused.value.code) == (429, 3036)
    assert 0 < int(refused.value.headers["Retry-After"]) <= 86400


def test_hard_budget_applies_to_paid_accounts(tenant):
    from controlplane.accounts.services import authenticate_key
    from controlplane.api.errors import ApiError

    now = datetime.now(UTC)
    account = Account.objects.get(pk=tenant.account.pk)
    account.paid_plan = True
    account.monthly_budget_usd = Decimal("0.0001")
    account.save()
    ctx = authenticate_key(tenant.secret)
    rec(tenant, at=now, inp=10_000_000)  # way over the free allocation: fine for a paid account...
    with pytest.raises(ApiError) as refused:
        check_account_limits(ctx, now)  # ...but not over its budget
    assert refused.value.status == 429 and "budget" in refused.value.message


def test_rollup_upsert_is_safe_for_a_second_key_and_no_key(tenant):
    second = make_tenant("second")
    rec(tenant)
    rec(tenant, key=False)
    record(UsageRecord(account_id=second.account.pk, key_id=str(second.key.pk), model=CHAT_MODEL, route="native",
                       input_tokens=1, created_at=DAY1))
    assert UsageDay.objects.filter(account_id=tenant.account.pk).count() == 2
    assert set(UsageDay.objects.filter(account_id=tenant.account.pk).values_list("key_id", flat=True)) == {
        "", str(tenant.key.pk)}


@pytest.mark.django_db(transaction=True)
def test_concurrent_writers_of_a_new_rollup_row_lose_no_count(tenant):
    """Several threads open the same minute's row at once: the upsert creates it once and adds every delta."""
    from concurrent.futures import ThreadPoolExecutor

    from django.db import connection

    if connection.vendor == "sqlite":
        pytest.skip("SQLite serialises writers on one lock; the race needs a server database (the PostgreSQL pass)")

    def write(_: int) -> None:
        try:
            for _ in range(10):
                rec(tenant, at=DAY2, inp=7, out=3)
        finally:
            connection.close()

    with ThreadPoolExecutor(6) as pool:
        list(pool.map(write, range(6)))
    minute = UsageMinute.objects.get(account_id=tenant.account.pk)
    day = UsageDay.objects.get(account_id=tenant.account.pk)
    assert (minute.requests, minute.input_tokens, minute.output_tokens) == (60, 420, 180)
    assert (day.requests, day.input_tokens, day.output_tokens) == (60, 420, 180)
    assert UsageEvent.objects.filter(account_id=tenant.account.pk).count() == 60


def test_record_many_writes_what_recording_one_by_one_writes(tenant):
    """A run of requests recorded together (a batch's items finishing in one transaction) leaves the same events
    and rollup rows as each recorded alone: random tokens, statuses, latencies, minutes and days, and keys."""
    import random

    from controlplane.usage.services import record_many

    second = make_tenant("second")
    rng = random.Random()
    times = [DAY1, DAY1 + timedelta(seconds=20), DAY1 + timedelta(minutes=3), DAY2]

    models, keyed = [CHAT_MODEL, EMBED_MODEL], [True, False]

    def records(account) -> list[UsageRecord]:
        # Every time, model and key state at least once (so each day and minute has rows of every kind: drawn
        # alone, 24 records once missed the second day and the rows checked below were 4), then 4-24 more drawn.
        groups = [(t, m, k) for t in times for m in models for k in keyed]
        groups += [(rng.choice(times), rng.choice(models), rng.choice(keyed)) for _ in range(rng.randrange(4, 24))]
        rng.shuffle(groups)
        return [UsageRecord(
            account_id=account.account.pk, key_id=str(account.key.pk) if k else None, model=m, route="native",
            source="batch", status=rng.choice([Status.OK, Status.OK, Status.ERROR]),
            input_tokens=rng.randrange(1, 500), cached_input_tokens=rng.randrange(0, 100),
            output_tokens=rng.randrange(0, 300), latency_ms=rng.uniform(0.5, 90_000.0),
            ttft_ms=rng.choice([None, rng.uniform(0.5, 5_000.0)]), created_at=t) for t, m, k in groups]

    alone = records(tenant)
    together = [UsageRecord(**{**{f: getattr(r, f) for f in r.__slots__}, "account_id": second.account.pk,
                               "key_id": str(second.key.pk) if r.key_id else None}) for r in alone]
    for r in alone:
        record(r)
    events = record_many([(r, None) for r in together])
    assert [e.pk for e in events] and all(e.pk for e in events)

    def rows(model, account) -> list[tuple]:
        names = [f.attname for f in model._meta.concrete_fields if f.name not in ("id", "account", "key_id")]
        return sorted((bool(row["key_id"]), *(row[n] for n in names))
                      for row in model.objects.filter(account=account).values("key_id", *names))

    for model in (UsageMinute, UsageDay):
        assert len(rows(model, tenant.account)) > 4 and rows(model, tenant.account) == rows(model, second.account)
    fields = ("model", "status", "input_tokens", "cached_input_tokens", "output_tokens", "neurons", "cost_usd",
              "latency_ms", "ttft_ms", "created_at", "price_id")
    assert (sorted(UsageEvent.objects.filter(account=tenant.account).values_list(*fields))
            == sorted(UsageEvent.objects.filter(account=second.account).values_list(*fields)))
