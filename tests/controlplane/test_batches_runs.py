"""Batch items in runs: one message, one claim and one transaction of results for several items, with each item
keeping its own claim check, lease and exactly one result and usage event."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from celery.signals import before_task_publish, task_prerun
from cp_support import CHAT_MODEL
from django.utils import timezone

from controlplane.accounts.services import authenticate_key
from controlplane.batches import item_services, services
from controlplane.batches.item_services import Outcome
from controlplane.batches.models import Batch, Item
from controlplane.usage.models import Source, UsageDay, UsageEvent
from controlplane.usage.services import UsageRecord

OK, FAILED, CANCELLED = Item.Status.SUCCEEDED, Item.Status.FAILED, Item.Status.CANCELLED


def native_batch(tenant, count: int, *, max_tokens: int = 2) -> Batch:
    return services.create_native_batch(authenticate_key(tenant.secret), CHAT_MODEL, [
        (f"r{i}", {"prompt": f"Say hi. ({i})", "max_tokens": max_tokens, "temperature": 0}) for i in range(count)])


def usage_of(tenant, tokens: int) -> UsageRecord:
    return UsageRecord(account_id=tenant.account.pk, key_id=str(tenant.key.pk), model=CHAT_MODEL, route="native",
                       source=Source.BATCH, input_tokens=tokens, output_tokens=tokens + 1, latency_ms=40.0)


@pytest.mark.django_db
def test_a_run_is_claimed_at_once_and_its_results_stored_together(tenant):
    batch = native_batch(tenant, 6)
    items = list(Item.objects.filter(batch=batch).order_by("index"))
    held = item_services.claim(items[1].pk).claim  # another worker holds a live lease on this one
    done = item_services.claim(items[2].pk).claim
    assert held is not None and item_services.finish(done, Outcome(OK, response={"response": "earlier"}))
    run = item_services.claim_run([i.pk for i in reversed(items)] + [10**9])  # and one that does not exist
    assert [c.item_id for c, _ in run.taken] == [items[k].pk for k in (0, 3, 4, 5)]
    assert [item.pk for _, item in run.taken] == [c.item_id for c, _ in run.taken]
    assert run.later == [items[1].pk] and 0 < run.wait_s <= 60
    # One token and one batch row for the run: counting one result refreshes what every item of it sees.
    assert len({c.token for c, _ in run.taken}) == 1 and len({id(c.batch) for c, _ in run.taken}) == 1
    assert all(item.batch is c.batch and item.status == "running" and item.attempts == 1 for c, item in run.taken)

    (a, _), (b, _), (c, _), (d, _) = run.taken
    Item.objects.filter(pk=c.item_id).update(claim_token="x" * 32)  # taken over meanwhile: its answer is void
    results = [(d, Outcome(CANCELLED, error={"message": "stopped"})),
               (a, Outcome(OK, response={"response": "a"}, usage=usage_of(tenant, 3))),
               (c, Outcome(OK, response={"response": "c"}, usage=usage_of(tenant, 100))),
               (b, Outcome(FAILED, error={"message": "no"}, usage=usage_of(tenant, 5)))]
    assert item_services.finish_run(results) == [True, True, False, True]
    assert (a.batch.completed_count, a.batch.failed_count, a.batch.cancelled_count, a.batch.pending_count) == (
        2, 1, 1, 2)
    stored = {i.pk: i for i in Item.objects.filter(batch=batch)}
    assert (stored[a.item_id].response, stored[a.item_id].output_tokens) == ({"response": "a"}, 4)
    assert stored[b.item_id].error == {"message": "no"} and stored[d.item_id].status == "cancelled"
    assert stored[c.item_id].status == "running" and stored[c.item_id].response is None
    events = UsageEvent.objects.filter(account=tenant.account, source=Source.BATCH)
    assert sorted(events.values_list("input_tokens", flat=True)) == [3, 5]
    day = UsageDay.objects.get(account=tenant.account)
    assert (day.requests, day.input_tokens, day.output_tokens) == (2, 8, 10)
    # A replay of the whole run (a second delivery) stores, counts and meters nothing more.
    assert item_services.finish_run(results) == [False] * 4
    assert Batch.objects.get(pk=batch.pk).completed_count == 2 and events.count() == 2


@pytest.mark.django_db
def test_renewing_a_run_says_which_items_are_still_held_and_which_must_stop(tenant):
    batch, other = native_batch(tenant, 3), native_batch(tenant, 1)
    ids = [*Item.objects.filter(batch=batch).order_by("index").values_list("pk", flat=True),
           Item.objects.get(batch=other).pk]
    run = item_services.claim_run(ids)
    claims = [c for c, _ in run.taken]
    assert len(claims) == 4 and len({id(c.batch) for c in claims}) == 2
    soon = timezone.now() + timedelta(seconds=5)
    Item.objects.filter(pk__in=ids).update(lease_until=soon)
    Item.objects.filter(pk=ids[1]).update(claim_token="y" * 32)
    Batch.objects.filter(pk=other.pk).update(cancelling_at=timezone.now())
    assert item_services.renew_run(claims) == {ids[0]: "ok", ids[1]: "lost", ids[2]: "ok", ids[3]: "stop"}
    leases = dict(Item.objects.filter(pk__in=ids).values_list("pk", "lease_until"))
    assert leases[ids[0]] > soon + timedelta(seconds=30) and leases[ids[1]] == soon
    assert item_services.renew(claims[2]) == "ok"
    # Given back: the busy ones without counting an attempt, the broken ones counted.
    item_services.release(claims[:1])
    item_services.release(claims[2:3], busy=False)
    rows = dict(Item.objects.filter(pk__in=ids).values_list("pk", "attempts"))
    assert (rows[ids[0]], rows[ids[2]]) == (0, 1)
    assert set(Item.objects.filter(pk__in=[ids[0], ids[2]]).values_list("status", flat=True)) == {"queued"}


@pytest.mark.django_db
def test_items_are_sent_in_runs_of_the_configured_size(settings, batch_queue):
    settings.HEARTH_BATCH_RUN_ITEMS = 8
    sent: list[list[int]] = []
    lock = threading.Lock()

    def seen(sender=None, body=None, **kwargs):
        if sender == "batches.run_items":
            with lock:
                sent.append(list(body[0][0]))

    before_task_publish.connect(seen, weak=False)
    try:
        ids = list(range(10**9, 10**9 + 20))  # no such items: a worker that takes these messages finds nothing
        services.send_items(ids)
    finally:
        before_task_publish.disconnect(seen)
    assert sent == [ids[:8], ids[8:16], ids[16:]]


@pytest.mark.django_db(transaction=True)
@pytest.mark.real_model
@pytest.mark.redis
def test_a_batch_runs_in_runs_with_one_result_and_one_usage_event_an_item(tenant, settings, batch_worker):
    settings.HEARTH_BATCH_RUN_ITEMS = 4
    runs: dict[str, int] = {}

    def started(sender=None, args=None, task_id=None, **kwargs):
        if sender is not None and sender.name == "batches.run_items":
            runs[task_id] = len(args[0])

    task_prerun.connect(started, weak=False)
    try:
        batch = native_batch(tenant, 10, max_tokens=3)
        deadline = timezone.now() + timedelta(seconds=120)
        while Batch.objects.get(pk=batch.pk).status != "completed":
            assert timezone.now() < deadline
            threading.Event().wait(0.05)
    finally:
        task_prerun.disconnect(started)
    # Three messages (the test broker's 3 s visibility may hand one out again while it runs: that delivery finds
    # its items held and waits), and every item claimed once.
    assert sorted(runs.values()) == [2, 4, 4]
    items = Item.objects.filter(batch=batch)
    assert set(items.values_list("status", "attempts")) == {("succeeded", 1)}
    assert all(0 < i.output_tokens <= 3 and i.response["response"] for i in items)
    events = UsageEvent.objects.filter(account=tenant.account, source=Source.BATCH)
    assert events.count() == 10 and len(set(events.values_list("request_id", flat=True))) == 10
    assert sum(events.values_list("output_tokens", flat=True)) == sum(i.output_tokens for i in items)


@pytest.mark.django_db(transaction=True)
@pytest.mark.real_model
@pytest.mark.redis
def test_a_cancel_stops_the_rest_of_a_run_when_one_of_its_items_finishes(tenant, settings, batch_worker):
    """Items of a run still on the engine when their batch is cancelled stop as soon as another item of the run
    is stored (its counts say the batch is stopping), not at the next lease renewal, a third of a lease later."""
    settings.HEARTH_BATCH_RUN_ITEMS = 4
    settings.HEARTH_BATCH_LEASE_SECONDS = 600  # no renewal within the test: only the stored result can stop them
    ctx = authenticate_key(tenant.secret)
    story = "Write a very long story about the sea, in many chapters."
    batch = services.create_native_batch(ctx, CHAT_MODEL, [
        ("quick", {"prompt": "Say hi.", "max_tokens": 1, "temperature": 0}),
        ("middle", {"prompt": story, "max_tokens": 60, "temperature": 0}),
        ("long1", {"prompt": story + " Begin.", "max_tokens": 2000, "temperature": 0}),
        ("long2", {"prompt": story + " Go.", "max_tokens": 2000, "temperature": 0})])
    items = {i.custom_id: i for i in Item.objects.filter(batch=batch)}
    deadline = timezone.now() + timedelta(seconds=120)
    while Item.objects.get(pk=items["quick"].pk).status != "succeeded":
        assert timezone.now() < deadline
        threading.Event().wait(0.02)
    assert Item.objects.get(pk=items["middle"].pk).status == "running"
    services.cancel_batch(tenant.account.pk, batch.pk)
    while Batch.objects.get(pk=batch.pk).status != "cancelled":
        assert timezone.now() < deadline
        threading.Event().wait(0.05)
    stored = {i.custom_id: i for i in Item.objects.filter(batch=batch)}
    assert stored["middle"].status == "succeeded" and stored["middle"].output_tokens == 60
    for name in ("long1", "long2"):
        assert (stored[name].status, stored[name].output_tokens, stored[name].error["openai_code"]) == (
            "cancelled", 0, "batch_cancelled")
    finished = Batch.objects.get(pk=batch.pk)
    assert (finished.completed_count, finished.cancelled_count, finished.pending_count) == (2, 2, 0)
