"""The completeness guarantee, end to end: a real `celery worker` process on the real Redis broker is killed
with SIGKILL in the middle of a batch; a second worker finishes it; every item has exactly one result and one
usage event, none lost and none written twice."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from cp_support import BATCH_BROKER, CHAT_MODEL
from django.db import connection

from controlplane.accounts.services import authenticate_key
from controlplane.batches import services
from controlplane.batches.models import Batch, Item
from controlplane.usage.models import Source, UsageEvent

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.real_model, pytest.mark.redis]
ROOT = Path(__file__).resolve().parents[2]
ITEMS = 8


def _worker_env(queue: str, *, sweep: bool) -> dict[str, str]:
    env = {**os.environ, "CELERY_BROKER_URL": BATCH_BROKER, "HEARTH_BATCH_QUEUE": queue,
           # Short windows so the dead worker's messages and claims come back within seconds. On a loaded
           # machine a renewal can come late and another worker take an item over (its work is then void, never
           # written); the attempt cap is raised so that cannot fail an item here.
           "HEARTH_BATCH_VISIBILITY_TIMEOUT": "3", "HEARTH_BATCH_LEASE_SECONDS": "4",
           "HEARTH_BATCH_MAX_ATTEMPTS": "50",
           "HEARTH_BATCH_WORKER": "off", "HF_HUB_OFFLINE": "1", "DJANGO_SETTINGS_MODULE": "controlplane.settings"}
    if sweep:
        # The rescuer also runs beat, as a production deployment does: the sweep re-sends an item whose message
        # died with the worker (SIGKILL between the broker's pop and its unacked bookkeeping loses one).
        env |= {"HEARTH_BATCH_SWEEP_SECONDS": "5", "HEARTH_BATCH_REDISPATCH_SECONDS": "20"}
    db = connection.settings_dict
    if connection.vendor == "sqlite":
        env["HEARTH_SQLITE_PATH"] = str(db["NAME"])
        env.pop("DATABASE_URL", None)
    else:
        env["DATABASE_URL"] = (f"postgres://{db['USER']}{':' + db['PASSWORD'] if db['PASSWORD'] else ''}"
                               f"@{db['HOST']}:{db['PORT']}/{db['NAME']}")
    return env


def _start_worker(queue: str, name: str, logs: Path, *, beat: bool = False) -> subprocess.Popen:
    # The log goes to a file: an unread pipe that fills up would block the worker mid-write.
    log = (logs / f"{name}.log").open("wb")
    extra = ["-B", "-s", str(logs / f"{name}-beat-schedule")] if beat else []
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "controlplane", "worker", "-P", "threads", "-c", "4", "-Q", queue,
         "-n", f"{name}@%h", "--without-heartbeat", "--without-mingle", "--without-gossip", "-l", "WARNING",
         *extra],
        cwd=ROOT, env=_worker_env(queue, sweep=beat), stdout=log, stderr=subprocess.STDOUT)
    log.close()
    proc.log_path = logs / f"{name}.log"  # type: ignore[attr-defined]
    return proc


def _report(proc: subprocess.Popen, batch_id: str) -> str:
    rows = Item.objects.filter(batch_id=batch_id).order_by("index").values_list("index", "status", "attempts")
    log = proc.log_path.read_text(errors="replace")[-3000:]  # type: ignore[attr-defined]
    return f"items (index, status, attempts): {list(rows)}\nworker log tail:\n{log}"


def _wait(predicate, what: str, timeout: float, proc: subprocess.Popen, batch_id: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            pytest.fail(f"the worker exited early while waiting for {what}\n{_report(proc, batch_id)}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}\n{_report(proc, batch_id)}")
        time.sleep(0.05)


def test_worker_killed_mid_batch_loses_nothing_and_writes_nothing_twice(tenant, batch_queue, tmp_path):
    redis.Redis.from_url(BATCH_BROKER).delete(batch_queue)
    ctx = authenticate_key(tenant.secret)
    batch = services.create_native_batch(ctx, CHAT_MODEL, [
        # The first item ends long before the others: the kill below then lands while they still run, however
        # late the test's own process gets the core (with every item the same length, all could end in the same
        # few milliseconds and leave nothing held).
        (f"doc-{i}", {"prompt": f"Write a long story about lighthouse number {i}.", "max_tokens": 2 if i == 0 else 24,
                      "temperature": 0}) for i in range(ITEMS)])
    items = Item.objects.filter(batch=batch)
    first = _start_worker(batch_queue, "doomed", tmp_path)
    try:
        # Kill it once it has finished something and is in the middle of more.
        _wait(lambda: items.filter(status="succeeded").exists() and items.filter(status="running").exists(),
              "the first worker to be mid-batch", 120, first, batch.pk)
        first.send_signal(signal.SIGKILL)
        first.wait(10)
    finally:
        if first.poll() is None:
            first.kill()
    held = set(items.filter(status="running").values_list("pk", flat=True))
    done_before = items.filter(status="succeeded").count()
    assert held and done_before < ITEMS  # it really died mid-batch, holding claims

    second = _start_worker(batch_queue, "rescuer", tmp_path, beat=True)
    restarted = time.monotonic()
    try:
        # The dead worker's items resume as soon as their 4 s leases lapse (the next 5 s sweep at the latest),
        # not after the 20 s redispatch delay; a loaded machine gets the worker's own startup on top.
        _wait(lambda: items.filter(pk__in=held, status="succeeded").exists(), "a held item to resume", 120,
              second, batch.pk)
        resumed_s = time.monotonic() - restarted
        _wait(lambda: Batch.objects.get(pk=batch.pk).status == "completed", "the second worker to finish", 240,
              second, batch.pk)
    finally:
        second.send_signal(signal.SIGTERM)
        try:
            second.wait(15)
        except subprocess.TimeoutExpired:
            second.kill()

    assert resumed_s < 40, f"the batch resumed {resumed_s:.1f} s after the restart"
    finished = Batch.objects.get(pk=batch.pk)
    assert (finished.total_count, finished.completed_count, finished.failed_count) == (ITEMS, ITEMS, 0)
    rows = list(items.order_by("index"))
    assert all(row.status == "succeeded" and row.response["response"] for row in rows)
    # The items the dead worker held were run again, by the second worker.
    assert all(row.attempts >= 2 for row in rows if row.pk in held)
    # Exactly one usage event per item: no result (and no charge) was written twice.
    events = UsageEvent.objects.filter(source=Source.BATCH)
    assert events.count() == ITEMS
    assert sorted(e.output_tokens for e in events) == sorted(row.output_tokens for row in rows)
