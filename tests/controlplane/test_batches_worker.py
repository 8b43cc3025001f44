"""Execution guarantees on the real database, broker and engine: claims are exclusive, results are written once,
lost messages come back, a busy engine means waiting (never failing), expiry, retention and pricing."""

from __future__ import annotations

import copy
import json
import random
import threading
import time
from dataclasses import replace
from datetime import timedelta
from decimal import Decimal

import pytest
from asgiref.sync import async_to_sync
from cp_support import CHAT_MODEL, redis_url
from django.test import override_settings
from django.utils import timezone

from controlplane.accounts.services import authenticate_key
from controlplane.batches import events, item_services, item_sql, maintenance, services, tasks
from controlplane.batches.models import Batch, File, Item
from controlplane.catalog.models import AiModel
from controlplane.catalog.services import get_model, set_price
from controlplane.celery import app
from controlplane.usage.models import Source, UsageEvent
from controlplane.usage.services import UsageRecord, record

ALL = ("completed", "failed", "expired", "cancelled")


def native_batch(tenant, count: int, *, max_tokens: int = 2, prompt: str = "Say hi.") -> Batch:
    ctx = authenticate_key(tenant.secret)
    return services.create_native_batch(ctx, CHAT_MODEL, [
        (f"r{i}", {"prompt": f"{prompt} ({i})", "max_tokens": max_tokens, "temperature": 0}) for i in range(count)])


def drain(layer, channel: str, quiet_s: float) -> list[dict]:
    """Every message the channel receives until it stays quiet for quiet_s."""
    import asyncio

    async def receive_all() -> list[dict]:
        received = []
        while True:
            try:
                received.append(await asyncio.wait_for(layer.receive(channel), timeout=quiet_s))
            except TimeoutError:
                return received

    return async_to_sync(receive_all)()


def wait_batch(batch_id: str, statuses=ALL, timeout: float = 120.0) -> Batch:
    deadline = time.monotonic() + timeout
    while True:
        batch = Batch.objects.get(pk=batch_id)
        if batch.status in statuses:
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.05)


# ------------------------------------------------------------------------------------- no engine needed
@pytest.mark.django_db
def test_claims_are_exclusive_and_a_result_is_written_once(tenant):
    batch = native_batch(tenant, 2)
    first, second = Item.objects.filter(batch=batch).order_by("index")
    a = item_services.claim(first.pk)
    assert a.claim is not None and a.wait_s is None and (a.item.pk, a.item.batch.pk) == (first.pk, batch.pk)
    # A second delivery while the lease is live waits instead of running it again (or dropping it).
    again = item_services.claim(first.pk)
    assert again.claim is None and 0 < again.wait_s <= 60
    # The holder dies: its lease runs out and another worker takes the item over.
    Item.objects.filter(pk=first.pk).update(lease_until=timezone.now() - timedelta(seconds=1))
    b = item_services.claim(first.pk)
    assert b.claim is not None and b.claim.token != a.claim.token
    usage = UsageRecord(account_id=tenant.account.pk, key_id=str(tenant.key.pk), model=CHAT_MODEL,
                        route="native", source=Source.BATCH, input_tokens=5, output_tokens=2)
    # The old holder comes back with its answer: refused, nothing counted or metered.
    stale = item_services.Outcome(Item.Status.SUCCEEDED, response={"response": "old"}, usage=usage)
    assert item_services.finish(a.claim, stale) is False
    fresh = item_services.Outcome(Item.Status.SUCCEEDED, response={"response": "new"}, usage=usage)
    assert item_services.finish(b.claim, fresh) is True
    assert item_services.finish(b.claim, fresh) is False  # and a replay of the winner's write too
    item = Item.objects.get(pk=first.pk)
    assert (item.status, item.response, item.attempts, item.output_tokens) == ("succeeded", {"response": "new"},
                                                                              2, 2)
    assert UsageEvent.objects.filter(source=Source.BATCH).count() == 1
    assert item_services.claim(first.pk) == item_services.ClaimResult()  # done: nothing to run, nothing to wait for
    batch.refresh_from_db()
    assert (batch.completed_count, batch.pending_count, batch.status) == (1, 1, "in_progress")
    # A busy engine gives the item back without counting an attempt.
    c = item_services.claim(second.pk).claim
    item_services.release([c])
    assert Item.objects.get(pk=second.pk).attempts == 0 and item_services.claim(second.pk).claim is not None


def stored(instance) -> dict:
    return {f.attname: getattr(instance, f.attname) for f in type(instance)._meta.concrete_fields}


@pytest.mark.django_db
def test_a_claim_reads_its_item_and_batch_as_the_orm_does(tenant):
    batch = native_batch(tenant, 2, prompt="Quote «this» and \u2603")
    Batch.objects.filter(pk=batch.pk).update(metadata={"team": "ops", "n": [1, 2.5, None]},
                                             errors=[{"code": "x"}], in_progress_at=timezone.now())
    first = Item.objects.filter(batch=batch).order_by("index").first()
    Item.objects.filter(pk=first.pk).update(custom_id=None, error={"message": "earlier"})
    taken = item_services.claim(first.pk)
    orm = Item.objects.select_related("batch").get(pk=first.pk)
    # Every stored field of both rows, with the types the ORM gives (aware datetimes, decoded JSON, ints).
    assert stored(taken.item) == stored(orm) and stored(taken.item.batch) == stored(orm.batch)
    assert {k: type(v) for k, v in stored(taken.item).items()} == {k: type(v) for k, v in stored(orm).items()}
    assert timezone.is_aware(taken.item.lease_until) and taken.item.body["prompt"].startswith("Quote «this»")
    assert taken.item.batch.metadata == {"team": "ops", "n": [1, 2.5, None]} and taken.claim.batch is taken.item.batch
    assert not taken.item._state.adding and taken.item._state.db == orm._state.db
    assert item_sql.read([10**9]) == []  # an item deleted between the claim's UPDATE and its read


@pytest.mark.django_db
def test_a_finish_reads_back_every_count_and_a_stopping_batch_lends_no_item(tenant):
    batch = native_batch(tenant, 3)
    first, second, third = Item.objects.filter(batch=batch).order_by("index")
    a, b = item_services.claim(first.pk).claim, item_services.claim(second.pk).claim
    # Another worker's count lands between this claim and its finish: the finish sees it.
    assert item_services.finish(b, item_services.Outcome(Item.Status.FAILED, error={"message": "no"}))
    assert item_services.finish(a, item_services.Outcome(Item.Status.SUCCEEDED, response={"response": "ok"}))
    assert (a.batch.completed_count, a.batch.failed_count, a.batch.pending_count) == (1, 1, 1)
    item = Item.objects.get(pk=first.pk)
    assert (item.status, item.response, item.error, item.lease_until) == ("succeeded", {"response": "ok"}, None,
                                                                           None)
    assert item.finished_at is not None and item.started_at <= item.finished_at
    assert Item.objects.get(pk=second.pk).error == {"message": "no"}
    # A batch being cancelled lends no more items (the claim's condition on the batch row): the item ends.
    Batch.objects.filter(pk=batch.pk).update(cancelling_at=timezone.now())
    assert item_services.claim(third.pk) == item_services.ClaimResult()
    assert Item.objects.get(pk=third.pk).status == "cancelled"


@pytest.mark.django_db
def test_the_dispatch_window_refills_in_chunks_and_every_item_is_sent_once(tenant, settings):
    settings.HEARTH_BATCH_WINDOW = 16  # refills once two slots are free
    batch = native_batch(tenant, 40)
    services.prepare(batch.pk)  # what the prepare task does once the creating transaction commits

    def dispatched() -> list[int]:
        return list(Item.objects.filter(batch=batch, dispatched_at__isnull=False).order_by("index")
                    .values_list("index", flat=True))

    assert dispatched() == list(range(16)) and Batch.objects.get(pk=batch.pk).dispatched_count == 16
    done, outstanding = 0, []
    while (pending := Item.objects.filter(batch=batch, dispatched_at__isnull=False, status="queued")
           .order_by("index").first()) is not None:
        claim = item_services.claim(pending.pk).claim
        assert item_services.finish(claim, item_services.Outcome(Item.Status.SUCCEEDED, response={"response": "ok"}))
        done += 1
        sent = len(dispatched())
        if sent < 40:
            outstanding.append(sent - done)
    # Refilled every second finish: the window never fell below all but one chunk, nor went over.
    assert set(outstanding) == {15, 16}
    assert dispatched() == list(range(40)) and done == 40
    batch.refresh_from_db()
    assert (batch.status, batch.completed_count, batch.dispatched_count) == ("completed", 40, 40)


@pytest.mark.django_db
def test_an_item_that_keeps_dying_fails_after_max_attempts(tenant, settings):
    settings.HEARTH_BATCH_MAX_ATTEMPTS = 2
    batch = native_batch(tenant, 1)
    item = Item.objects.get(batch=batch)
    for _ in range(2):
        assert item_services.claim(item.pk).claim is not None
        Item.objects.filter(pk=item.pk).update(lease_until=timezone.now() - timedelta(seconds=1))
    assert item_services.claim(item.pk) == item_services.ClaimResult()
    item.refresh_from_db()
    assert item.status == "failed" and "2 times" in item.error["message"]
    assert Batch.objects.get(pk=batch.pk).status == "completed"


@pytest.mark.django_db
def test_expiry_window_ends_unstarted_requests(client, tenant):
    from controlplane.batches.models import File as BatchFile

    lines = b"".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                                 "body": {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "x"}]}})
                     .encode() + b"\n" for i in range(3))
    source = BatchFile.objects.create(account=tenant.account, purpose="batch", filename="in.jsonl",
                                      bytes=len(lines), content=lines)
    ctx = authenticate_key(tenant.secret)
    batch = services.create_openai_batch(ctx, input_file_id=source.pk, endpoint="/v1/chat/completions",
                                         completion_window="1h")
    services.prepare(batch.pk)
    assert Batch.objects.get(pk=batch.pk).status == "in_progress"
    assert maintenance.sweep()["expired"] == 0  # not due yet
    later = timezone.now() + timedelta(hours=1, seconds=1)
    assert maintenance.sweep(later)["expired"] == 1
    done = client.get(f"/v1/batches/{batch.pk}", **tenant.auth).json()
    assert done["status"] == "expired" and done["expired_at"] is not None and done["output_file_id"] is None
    errors = [json.loads(x) for x in bytes(File.objects.get(pk=done["error_file_id"]).content).splitlines()]
    assert [e["custom_id"] for e in errors] == ["c0", "c1", "c2"]
    assert {e["error"]["code"] for e in errors} == {"batch_expired"} and all(e["response"] is None for e in errors)


@pytest.mark.django_db
def test_cleanup_task_removes_results_after_retention(client, tenant, settings):
    settings.HEARTH_BATCH_RETENTION_HOURS = 24
    now = timezone.now()
    old, recent = native_batch(tenant, 2), native_batch(tenant, 1)
    kept_input = File.objects.create(account=tenant.account, purpose="batch", filename="a.jsonl", content=b"x")
    gone_input = File.objects.create(account=tenant.account, purpose="batch", filename="b.jsonl", content=b"x",
                                     expires_at=now - timedelta(seconds=1))
    out = File.objects.create(account=tenant.account, purpose="batch_output", filename="o.jsonl", content=b"{}")
    Batch.objects.filter(pk=old.pk).update(status="completed", finished_at=now - timedelta(hours=25), output_file=out)
    Batch.objects.filter(pk=recent.pk).update(status="completed", finished_at=now - timedelta(hours=23))
    assert "batches.cleanup" in {entry["task"] for entry in app.conf.beat_schedule.values()}

    assert tasks.cleanup() == {"batches": 1, "items": 2, "files": 1, "responses": 0}
    assert not Item.objects.filter(batch=old).exists() and Item.objects.filter(batch=recent).count() == 1
    assert not File.objects.filter(pk__in=[out.pk, gone_input.pk]).exists()
    assert File.objects.filter(pk=kept_input.pk).exists()
    old.refresh_from_db()
    assert old.results_purged_at is not None and old.output_file_id is None
    poll = client.post(f"{tenant.run_url}{CHAT_MODEL}", data=json.dumps({"request_id": old.pk}),
                       content_type="application/json", **tenant.auth)
    assert poll.status_code == 404 and "retention" in poll.json()["errors"][0]["message"]
    assert tasks.cleanup() == {"batches": 0, "items": 0, "files": 0, "responses": 0}  # idempotent


@pytest.mark.django_db
def test_batch_discount_from_price_row_or_setting(tenant, settings):
    model = AiModel.objects.get(name=CHAT_MODEL)
    usage = UsageRecord(account_id=tenant.account.pk, key_id=None, model=CHAT_MODEL, route="native",
                        input_tokens=1000, output_tokens=500)
    full = record(usage).neurons
    settings.HEARTH_BATCH_DISCOUNT_PERCENT = Decimal("25")
    batch_usage = replace(usage, source=Source.BATCH)
    assert record(batch_usage).neurons == (full * Decimal("0.75")).quantize(Decimal("0.000001"))
    set_price(model, input_neurons=1500, cached_input_neurons=375, output_neurons=6000,
              batch_discount_percent=50)
    price = get_model(CHAT_MODEL).price_at(time.time() + 1)
    assert price.batch_discount() == 50 and price.as_json()["batch_discount_percent"] == 50.0
    event = record(replace(batch_usage, created_at=timezone.now() + timedelta(seconds=1)))
    assert event.neurons == (full / 2).quantize(Decimal("0.000001"))
    assert event.cost_usd == (event.neurons * Decimal("0.011") / 1000).quantize(Decimal("0.0000000001"))
    # Interactive usage is unaffected.
    assert record(replace(usage, created_at=timezone.now() + timedelta(seconds=1))).neurons == full


def test_publishing_progress_never_fails_the_work(db, tenant):
    batch = native_batch(tenant, 1)
    broken = {"default": {"BACKEND": "channels_redis.core.RedisChannelLayer",
                          "CONFIG": {"hosts": ["redis://127.0.0.1:1/0"]}}}
    with override_settings(CHANNEL_LAYERS=broken):
        events.publish(batch)  # logs, does not raise


@pytest.mark.redis
def test_count_updates_are_throttled_but_status_changes_always_go_out(db, tenant):
    from channels.layers import get_channel_layer

    layer_settings = {"default": {"BACKEND": "channels_redis.core.RedisChannelLayer",
                                  "CONFIG": {"hosts": [redis_url(1)]}}}
    batch = native_batch(tenant, 3)
    with override_settings(CHANNEL_LAYERS=layer_settings):
        layer = get_channel_layer()
        channel = async_to_sync(layer.new_channel)()
        async_to_sync(layer.group_add)(events.group_name(tenant.account.pk), channel)
        for completed in (1, 2):  # two count updates in quick succession: the second is skipped
            batch.completed_count = completed
            events.publish(batch, throttle=True)
        batch.status, batch.completed_count = Batch.Status.COMPLETED, 3
        events.publish(batch)  # a status change is never skipped, however soon
        late = copy.copy(batch)  # a worker thread that read its counts before the batch finished publishes last
        late.status, late.completed_count = Batch.Status.IN_PROGRESS, 2
        events.publish(late)  # older than what was sent: dropped, though not throttled
        received = [e for e in drain(layer, channel, 0.5) if e["batch_id"] == batch.pk]
    assert [(e["status"], e["completed"]) for e in received] == [
        (batch.Status.IN_PROGRESS, 1), ("completed", 3)]


@pytest.mark.redis
def test_events_of_threads_that_publish_out_of_order_reach_a_subscriber_in_order(db, tenant):
    from channels.layers import get_channel_layer

    layer_settings = {"default": {"BACKEND": "channels_redis.core.RedisChannelLayer",
                                  "CONFIG": {"hosts": [redis_url(1)]}}}
    batch = native_batch(tenant, 40)
    counts = list(range(1, 41))
    random.Random(7).shuffle(counts)  # the order in which the finishers' threads reach publish
    start = threading.Barrier(8)

    def finisher(mine: list[int]) -> None:
        start.wait()
        for completed in mine:
            state = copy.copy(batch)
            state.completed_count = completed
            events.publish(state)

    with override_settings(CHANNEL_LAYERS=layer_settings):
        layer = get_channel_layer()
        channel = async_to_sync(layer.new_channel)()
        async_to_sync(layer.group_add)(events.group_name(tenant.account.pk), channel)
        threads = [threading.Thread(target=finisher, args=(counts[i::8],)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        received = [e["completed"] for e in drain(layer, channel, 0.5) if e["batch_id"] == batch.pk]
    assert received and received == sorted(received) and len(set(received)) == len(received)
    assert received[-1] == 40  # the newest state always goes out


def test_a_hanging_send_holds_up_no_other_publisher_and_the_newest_state_follows_it(db, tenant, monkeypatch):
    from controlplane.api import layer as api_layer

    batch = native_batch(tenant, 5)
    sent: list[int] = []
    started, release = threading.Event(), threading.Event()

    def send(group: str, message: dict) -> None:  # the first send hangs until released, as on a stuck layer
        if not started.is_set():
            started.set()
            release.wait(10)
        sent.append(message["completed"])

    monkeypatch.setattr(api_layer, "group_send", send)

    def state(completed: int) -> Batch:
        copied = copy.copy(batch)
        copied.completed_count = completed
        return copied

    first = threading.Thread(target=events.publish, args=(state(1),))
    first.start()
    assert started.wait(5)
    began = time.monotonic()
    for completed in (2, 4, 3):  # each returns at once; 3 is older than 4, which was decided: dropped
        events.publish(state(completed))
    assert time.monotonic() - began < 1
    release.set()
    first.join(5)
    assert sent == [1, 4]  # the newest waiting state went out after the hung one, from the thread that sent it


# ------------------------------------------------------------------------------------- with the worker
@pytest.mark.django_db(transaction=True)
@pytest.mark.real_model
@pytest.mark.redis
def test_sweep_resends_work_a_dead_worker_held(tenant, settings, batch_worker):
    settings.HEARTH_BATCH_WINDOW = 0  # nothing is sent at creation: the rows look like a crash left them
    batch = native_batch(tenant, 3)
    past = timezone.now() - timedelta(minutes=10)
    ids = list(Item.objects.filter(batch=batch).values_list("pk", flat=True))
    Item.objects.filter(pk=ids[0]).update(status="running", claim_token="dead", lease_until=past, attempts=1,
                                          dispatched_at=past)
    Item.objects.filter(pk=ids[1]).update(dispatched_at=past)  # its message was lost
    settings.HEARTH_BATCH_WINDOW = 40
    counts = tasks.sweep()
    assert counts["resent"] == 2
    done = wait_batch(batch.pk)
    assert (done.status, done.completed_count, done.failed_count) == ("completed", 3, 0)
    assert Item.objects.get(pk=ids[0]).attempts == 2
    assert UsageEvent.objects.filter(source=Source.BATCH).count() == 3


@pytest.mark.django_db(transaction=True)
@pytest.mark.real_model
@pytest.mark.redis
def test_a_lapsed_lease_is_resent_at_once_and_a_restart_ends_the_dead_process_leases(tenant, settings,
                                                                                   batch_worker):
    settings.HEARTH_BATCH_WINDOW = 0
    batch = native_batch(tenant, 2)
    now = timezone.now()
    ids = list(Item.objects.filter(batch=batch).values_list("pk", flat=True))
    # Dispatched moments ago, its worker gone: the lease lapsed, so waiting out the redispatch delay is no use.
    Item.objects.filter(pk=ids[0]).update(status="running", claim_token="dead", lease_until=now - timedelta(seconds=1),
                                          attempts=1, dispatched_at=now)
    # Still leased, by the process that just died: only a restart of the embedded worker may end that lease.
    Item.objects.filter(pk=ids[1]).update(status="running", claim_token="dead", lease_until=now + timedelta(
        minutes=1), attempts=1, dispatched_at=now)
    settings.HEARTH_BATCH_WINDOW = 40
    assert maintenance.sweep()["resent"] == 1
    assert maintenance.sweep(startup=True)["resent"] >= 1
    started = time.monotonic()
    done = wait_batch(batch.pk)
    assert (done.status, done.completed_count, done.failed_count) == ("completed", 2, 0)
    assert time.monotonic() - started < 30  # not the minute the dead lease had left


@pytest.mark.once  # the engine's refusal and Celery's retry: the PostgreSQL pass would add 14 s and nothing else
@pytest.mark.django_db(transaction=True)
@pytest.mark.real_model
@pytest.mark.redis
def test_busy_engine_means_retry_with_backoff_never_failure(tenant, batch_worker):
    from celery.signals import task_retry

    from controlplane.serving.dispatch import InProcessBackend, set_backend
    from inference import GenerationRequest, SamplingParams

    busy = InProcessBackend(settings_for=lambda model: {"kv_cache_memory": "64MiB", "max_num_seqs": 1,
                                                        "max_queue": 1, "dtype": "float32"})
    engine = busy.engine_sync(CHAT_MODEL)
    retries: list[str] = []

    def on_retry(sender=None, **kwargs):
        if sender is not None and sender.name == "batches.run_items":
            retries.append(str(kwargs.get("reason")))

    task_retry.connect(on_retry, weak=False)
    previous = set_backend(busy)
    try:
        # Fill the engine: one request running, one waiting (max_queue=1), for a couple of seconds.
        ids = engine.encode(prompt="Count slowly.")
        occupiers = [threading.Thread(target=engine.generate_blocking, args=(GenerationRequest(
            ids, SamplingParams(max_tokens=60, ignore_eos=True, temperature=0)),), daemon=True) for _ in range(2)]
        occupiers[0].start()
        deadline = time.monotonic() + 30
        while engine.metrics().running < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        occupiers[1].start()
        while engine.metrics().queue_depth < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        batch = native_batch(tenant, 2)
        done = wait_batch(batch.pk)
    finally:
        set_backend(previous)
        task_retry.disconnect(on_retry)
        busy.shutdown()
    assert (done.status, done.completed_count, done.failed_count) == ("completed", 2, 0)
    assert retries  # the engine refused at least once, and the items waited instead of failing
    assert list(Item.objects.filter(batch=batch).values_list("attempts", flat=True)) == [1, 1]


@pytest.mark.django_db(transaction=True)
@pytest.mark.real_model
@pytest.mark.redis
def test_progress_events_reach_a_subscriber_on_the_redis_channel_layer(tenant, batch_worker):
    from channels.layers import get_channel_layer

    layer_settings = {"default": {"BACKEND": "channels_redis.core.RedisChannelLayer",
                                  "CONFIG": {"hosts": [redis_url(1)]}}}
    with override_settings(CHANNEL_LAYERS=layer_settings):
        layer = get_channel_layer()
        channel = async_to_sync(layer.new_channel)()
        async_to_sync(layer.group_add)(events.group_name(tenant.account.pk), channel)
        batch = native_batch(tenant, 3)
        wait_batch(batch.pk)
        received = drain(layer, channel, 2)
    mine = [e for e in received if e["batch_id"] == batch.pk]
    assert mine and all(e["type"] == "batch.progress" for e in mine)
    assert [e["completed"] for e in mine] == sorted(e["completed"] for e in mine)
    assert mine[-1]["status"] == "completed" and mine[-1]["completed"] == 3 and mine[-1]["total"] == 3


@pytest.mark.django_db
def test_a_connection_kept_by_a_worker_thread_that_ended_is_closed():
    from celery.signals import task_postrun, task_prerun
    from django.db import connections

    kept = []

    def pool_thread():
        # What a pool thread does: a task starts, opens a connection, ends; the connection stays open.
        task_prerun.send(sender=tasks.sweep, task_id="t", task=tasks.sweep, args=(), kwargs={})
        with connections["default"].cursor() as cursor:
            cursor.execute("SELECT 1")
        task_postrun.send(sender=tasks.sweep, task_id="t", task=tasks.sweep, args=(), kwargs={}, retval=None,
                          state="SUCCESS")
        kept.append(connections["default"])

    thread = threading.Thread(target=pool_thread)
    thread.start()
    thread.join()
    if getattr(kept[0], "pool", None) is not None:  # PostgreSQL's pool: given back at the task's end, none kept
        assert kept[0].connection is None and tasks.close_connections_of_ended_threads() == 0
        return
    assert kept and kept[0].connection is not None  # kept beyond its task, and its thread is gone
    assert tasks.close_connections_of_ended_threads() >= 1
    assert kept[0].connection is None
    assert tasks.close_connections_of_ended_threads() == 0


@pytest.mark.django_db(transaction=True)
@pytest.mark.real_model
@pytest.mark.redis
def test_worker_tasks_reuse_database_connections_and_replace_one_the_server_ended(tenant, settings, batch_worker):
    from collections import Counter

    from django.db import connection
    from django.db.backends.signals import connection_created

    opened: Counter[int] = Counter()  # connections taken, by thread (none by this test's own thread counted)
    pool = getattr(connection, "pool", None)  # PostgreSQL's sessions are pooled (settings: DB_POOL)
    sessions_before = pool.get_stats().get("connections_num", 0) if pool is not None else 0

    def count(sender, connection, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            opened[threading.get_ident()] += 1

    connection_created.connect(count, weak=False)
    try:
        # 12 items (and the batch's preparation) on 4 threads: with a connection per task some thread opens several.
        settings.HEARTH_BATCH_RUN_ITEMS = 1  # a task an item
        done = wait_batch(native_batch(tenant, 12).pk)
        assert (done.status, done.completed_count, done.failed_count) == ("completed", 12, 0)
        if pool is None:  # each thread keeps the one it opened
            assert all(n == 1 for n in opened.values()), dict(opened)
            return
        # Each task takes a session from the pool and gives it back: the server started at most one for each
        # worker thread, far fewer than the tasks took.
        started = pool.get_stats().get("connections_num", 0) - sessions_before
        assert started <= len(opened) < sum(opened.values()), (started, dict(opened))
        # And a task gives its session back while the engine works on its item: it takes one for the claim
        # and another for the result, so the threads waiting on the engine hold none.
        assert sum(opened.values()) >= 2 * 12, dict(opened)
        # The server ends every other session on this database (a restart, an idle timeout): the pool finds
        # them dead before lending them, and no item is lost or waits for the sweep.
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                           "WHERE datname = current_database() AND pid <> pg_backend_pid()")
            assert cursor.fetchone()[0] >= 1
        batch = native_batch(tenant, 4)
        done = wait_batch(batch.pk, timeout=30)
        assert (done.status, done.completed_count, done.failed_count) == ("completed", 4, 0)
        assert list(Item.objects.filter(batch=batch).values_list("attempts", flat=True)) == [1, 1, 1, 1]
    finally:
        connection_created.disconnect(count)
