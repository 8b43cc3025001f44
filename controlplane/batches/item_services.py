"""The worker's writes over a batch item's life: its claim, its lease, its release and its result. The batch's
own writes (creation, dispatch, cancel, finalising) are in controlplane.batches.services.

A worker takes items in runs (one broker message names up to HEARTH_BATCH_RUN_ITEMS of them): one statement
claims a run, one reads what it took, and the results that finish together are stored in one transaction,
their counts and usage rollups summed. The embedded worker shares the engine's interpreter and cores, and
per item this bookkeeping was most of its CPU (docs/benchmarks.md, the batch notes); each item still keeps its
own claim token check, lease and exactly one result.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import F, Q
from django.utils import timezone

from controlplane.api import errors
from controlplane.batches import events, item_sql
from controlplane.batches.models import Batch, Item
from controlplane.batches.services import dispatch, error_json, finish_if_drained
from controlplane.catalog.services import get_model
from controlplane.usage.services import UsageRecord, record_many

ItemStatus = Item.Status


def _now() -> datetime:
    return timezone.now()


@dataclass(frozen=True, slots=True)
class Claim:
    item_id: int
    batch_id: str
    token: str
    batch: Batch  # the item's batch as read right after the claim; finishing refreshes its counts


@dataclass(frozen=True, slots=True)
class ClaimResult:
    claim: Claim | None = None
    wait_s: float | None = None  # another worker holds a live lease: look again after this long
    item: Item | None = None  # the claimed item, its batch joined, read after the claim took


@dataclass(slots=True)
class RunClaim:
    """What claiming a run of items gave: the items taken (each with its claim), and the items to look at again
    later because another worker holds a live lease on them (or gave them back a moment ago)."""

    taken: list[tuple[Claim, Item]] = field(default_factory=list)
    later: list[int] = field(default_factory=list)
    wait_s: float = 0.0  # when to look at `later` again: the soonest of their leases to lapse


def _takeable(now: datetime) -> Q:
    """A queued item, or a running one whose holder's lease ran out (the holder died)."""
    return Q(status=ItemStatus.QUEUED) | Q(status=ItemStatus.RUNNING, lease_until__lte=now)


def claim_run(item_ids: list[int]) -> RunClaim:
    """Take items for execution: each queued one, or running one whose holder's lease ran out (the holder
    died). A redelivered message for items another worker is running waits for those leases instead of dropping
    the items, so a holder that dies later still loses nothing.

    The common case is one conditional UPDATE for the run (then one read of what was taken); only an item it
    did not take is read alone to say why: done, leased by a live holder, batch stopped, or out of attempts.
    The run shares one claim token: each item's result is still stored only while its own row holds it."""
    now = _now()
    token = uuid.uuid4().hex
    lease = now + timedelta(seconds=settings.HEARTH_BATCH_LEASE_SECONDS)
    ids = sorted(set(item_ids))
    taken = item_sql.take(ids, token, now, lease, settings.HEARTH_BATCH_MAX_ATTEMPTS)
    result = RunClaim()
    # An item deleted (its batch purged) between the two statements is simply not read back.
    for item in item_sql.read(taken):
        result.taken.append((Claim(item.pk, item.batch_id, token, item.batch), item))  # type: ignore[attr-defined]
    waits = []
    for item_id in sorted(set(ids) - set(taken)):
        wait_s = _not_taken(item_id, now)
        if wait_s is not None:
            result.later.append(item_id)
            waits.append(wait_s)
    result.wait_s = min(waits, default=0.0)
    return result


def claim(item_id: int) -> ClaimResult:
    """claim_run for one item."""
    run = claim_run([item_id])
    if run.taken:
        c, item = run.taken[0]
        return ClaimResult(claim=c, item=item)
    return ClaimResult(wait_s=run.wait_s) if run.later else ClaimResult()


def _not_taken(item_id: int, now: datetime) -> float | None:
    """Why the claim did not take this item, acted on: None when there is nothing to run (done, or closed now
    because its batch stopped or it ran out of attempts), else how long to wait before looking again."""
    item = Item.objects.filter(pk=item_id).select_related("batch").only(
        "status", "lease_until", "attempts", "batch__status", "batch__cancelling_at", "batch__expired_at").first()
    if item is None or item.status in Item.DONE:
        return None
    batch = item.batch
    stopped = batch.cancelling_at is not None or batch.expired_at is not None or batch.status in Batch.TERMINAL
    live_lease = item.status == ItemStatus.RUNNING and item.lease_until is not None and item.lease_until > now
    if live_lease:
        return (item.lease_until - now).total_seconds()  # type: ignore[operator]
    if stopped:
        _close_stopped(item_id, batch, now)
        return None
    if item.attempts >= settings.HEARTH_BATCH_MAX_ATTEMPTS:
        _close_broken(item_id, batch, now)
        return None
    # Takeable now but not a moment ago: its holder gave it back in between. Try again shortly.
    return 0.0


def _close_stopped(item_id: int, batch: Batch, now: datetime) -> None:
    """An item of a cancelled or expired batch that never ran (or whose holder died) ends without running."""
    expired = batch.expired_at is not None and batch.cancelling_at is None
    status = ItemStatus.EXPIRED if expired else ItemStatus.CANCELLED
    code = "batch_expired" if expired else "batch_cancelled"
    message = ("The batch's completion window ended before this request ran" if expired
               else "The batch was cancelled before this request ran")
    error = {"status": 400, "openai_status": 400, "code": errors.CODE_INVALID_INPUT, "openai_code": code,
             "message": message, "param": None}
    with transaction.atomic():
        closed = Item.objects.filter(_takeable(now), pk=item_id).update(
            status=status, error=error, finished_at=now, lease_until=None, claim_token="")
        if closed:
            Batch.objects.filter(pk=batch.pk).update(cancelled_count=F("cancelled_count") + 1)
    if closed:
        finish_if_drained(batch.pk)


def _close_broken(item_id: int, batch: Batch, now: datetime) -> None:
    """An item whose runs kept dying (a worker crash each time, or an unexpected error) fails instead of
    taking workers down forever."""
    error = error_json(errors.internal(f"This request failed {settings.HEARTH_BATCH_MAX_ATTEMPTS} times without "
                                       "an answer; it was given up"))
    with transaction.atomic():
        closed = Item.objects.filter(_takeable(now), pk=item_id).update(
            status=ItemStatus.FAILED, error=error, finished_at=now, lease_until=None, claim_token="")
        if closed:
            Batch.objects.filter(pk=batch.pk).update(failed_count=F("failed_count") + 1)
    if closed:
        events.publish(Batch.objects.get(pk=batch.pk))
        finish_if_drained(batch.pk)
        dispatch(batch.pk)


def renew_run(claims: list[Claim]) -> dict[int, str]:
    """Extend running items' leases, one statement for the run: per item 'ok', 'lost' (another worker took it
    over) or 'stop' (its batch was cancelled or expired: abandon the work)."""
    if not claims:
        return {}
    lease = _now() + timedelta(seconds=settings.HEARTH_BATCH_LEASE_SECONDS)
    ids = [c.item_id for c in claims]
    held = set(ids)
    tokens = {c.token for c in claims}
    renewed = Item.objects.filter(pk__in=ids, status=ItemStatus.RUNNING, claim_token__in=tokens).update(
        lease_until=lease)
    if renewed < len(ids):  # some were taken over: which still hold their claim (their own token)
        rows = Item.objects.filter(pk__in=ids, status=ItemStatus.RUNNING).values_list("pk", "claim_token")
        mine = {c.item_id: c.token for c in claims}
        held = {pk for pk, token in rows if mine.get(pk) == token}
    running = {pk for pk, cancelling, expired in Batch.objects.filter(
        pk__in={c.batch_id for c in claims}).values_list("pk", "cancelling_at", "expired_at")
        if cancelling is None and expired is None}
    return {c.item_id: "lost" if c.item_id not in held else "ok" if c.batch_id in running else "stop"
            for c in claims}


def renew(c: Claim) -> str:
    """renew_run for one item."""
    return renew_run([c])[c.item_id]


def release(claims: list[Claim], *, busy: bool = True) -> None:
    """Give claimed items back: they stay dispatched, their retry message is on its way. A busy platform does
    not count as an attempt (a batch never fails for that); an unexpected error does."""
    changes: dict[str, Any] = {"status": ItemStatus.QUEUED, "claim_token": "", "lease_until": None}
    if busy:
        changes["attempts"] = F("attempts") - 1
    for c in claims:
        Item.objects.filter(pk=c.item_id, status=ItemStatus.RUNNING, claim_token=c.token).update(**changes)


@dataclass(slots=True)
class Outcome:
    """What running an item produced. usage is None when nothing reached the engine (nothing to meter)."""

    status: str  # an Item.Status: succeeded, failed, or cancelled (stopped mid-run)
    response: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    usage: UsageRecord | None = None


_COUNTER = {ItemStatus.SUCCEEDED: "completed_count", ItemStatus.FAILED: "failed_count"}


def finish_run(results: list[tuple[Claim, Outcome]]) -> list[bool]:
    """Store items' results, count them and meter them, in one transaction, each only while its claim is
    current: a second delivery of the same item can never write a second result or a second usage event.
    Returns, per result in order, whether it was stored."""
    now = _now()
    stored = [False] * len(results)
    added: dict[str, dict[str, int]] = {}
    batches: dict[str, Batch] = {}
    usage = []
    with transaction.atomic():
        # Rows in one order in every transaction (items, then batches, then usage rollups): no lock cycles.
        for i in sorted(range(len(results)), key=lambda i: results[i][0].item_id):
            c, outcome = results[i]
            meter = outcome.usage
            stored[i] = item_sql.store_result(c.item_id, c.token, {
                "status": outcome.status, "response": outcome.response, "error": outcome.error,
                "finished_at": now, "lease_until": None, "input_tokens": meter.input_tokens if meter else 0,
                "cached_input_tokens": meter.cached_input_tokens if meter else 0,
                "output_tokens": meter.output_tokens if meter else 0})
            if not stored[i]:
                continue
            counts = added.setdefault(c.batch_id, {})
            counter = _COUNTER.get(outcome.status, "cancelled_count")
            counts[counter] = counts.get(counter, 0) + 1
            batches.setdefault(c.batch_id, c.batch)
            if meter is not None:
                entry = get_model(meter.model)
                # Priced as of the batch's arrival, like an interactive request's; the event lands when it ran.
                usage.append((meter, entry.price_at(c.batch.created_at.timestamp()) if entry else None))
        for batch_id in sorted(added):
            item_sql.count_finished(batches[batch_id], added[batch_id])
        if usage:
            record_many(usage)
    for batch in batches.values():
        events.publish(batch, throttle=True)
        if batch.pending_count <= 0:
            finish_if_drained(batch.pk)
        elif _refill_due(batch):
            dispatch(batch.pk)
    return stored


def finish(c: Claim, outcome: Outcome) -> bool:
    """finish_run for one item."""
    return finish_run([(c, outcome)])[0]


def _refill_due(batch: Batch) -> bool:
    """Whether the dispatch window has room for a chunk (an eighth of it). A dispatch is a locked transaction
    and a count over the batch's items, per item the worker's largest cost, so the window is refilled in chunks
    rather than one item at a time. The estimate never undercounts the room (items that failed before dispatch
    count as done): the last of several finishers sees every count, so a due refill is never missed."""
    if batch.dispatched_count >= batch.total_count:
        return False  # everything has been sent once; lost messages are the sweep's
    outstanding = batch.dispatched_count - (batch.completed_count + batch.failed_count + batch.cancelled_count)
    return settings.HEARTH_BATCH_WINDOW - outstanding >= max(1, settings.HEARTH_BATCH_WINDOW // 8)
