"""The periodic safety net (Celery beat): expiry windows, re-sending lost work, and results retention."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from controlplane.batches.models import Batch, File, Item
from controlplane.batches.services import (
    dispatch,
    finalize,
    finish_if_drained,
    send_items,
    send_prepare,
    stop_unstarted,
)

Status = Batch.Status
ItemStatus = Item.Status


def _now() -> datetime:
    return timezone.now()


def expire_due(now: datetime | None = None) -> list[str]:
    """Batches past their completion window: unstarted items expire, running ones finish, then `expired`."""
    now = now or _now()
    expired = []
    for batch_id in Batch.objects.filter(status__in=(Status.VALIDATING, Status.IN_PROGRESS), expires_at__lte=now,
                                         expired_at__isnull=True).values_list("pk", flat=True):
        with transaction.atomic():
            batch = Batch.objects.select_for_update().get(pk=batch_id)
            if batch.expired_at is not None or batch.status not in (Status.VALIDATING, Status.IN_PROGRESS):
                continue
            stop_unstarted(batch, ItemStatus.EXPIRED, "batch_expired",
                            "The batch's completion window ended before this request ran", now)
            Batch.objects.filter(pk=batch_id).update(expired_at=now)
        expired.append(batch_id)
        finish_if_drained(batch_id)
    return expired


def sweep(now: datetime | None = None, *, startup: bool = False) -> dict[str, int]:
    """The safety net under the broker: expire what is due, re-send messages that were lost (or whose worker
    died), fill dispatch windows and finish batches left half-finalised. At startup of the embedded worker
    (whose queue was just rebuilt) every unfinished dispatched item is re-sent at once.

    A running item whose lease lapsed lost its worker (a live worker renews every third of the lease): it is
    re-sent at the next sweep, not after the redispatch delay meant for queued messages that may still be on
    their way. At the embedded worker's startup the leases still live belong to the process that died (the
    embedded queue has no other consumer), so they are ended at once and their items resume now."""
    now = now or _now()
    stale = now if startup else now - timedelta(seconds=settings.HEARTH_BATCH_REDISPATCH_SECONDS)
    if startup:
        Item.objects.filter(status=ItemStatus.RUNNING, lease_until__gt=now).update(lease_until=now)
    counts = {"expired": len(expire_due(now)), "prepared": 0, "resent": 0, "finalized": 0}
    validating = list(Batch.objects.filter(status=Status.VALIDATING, created_at__lte=stale)
                      .values_list("pk", flat=True))
    send_prepare(validating)
    counts["prepared"] = len(validating)
    for batch_id in Batch.objects.filter(status__in=(Status.IN_PROGRESS, Status.CANCELLING)).values_list(
            "pk", flat=True):
        lost = Item.objects.filter(batch_id=batch_id).filter(
            Q(status=ItemStatus.QUEUED, dispatched_at__lte=stale)
            | Q(status=ItemStatus.RUNNING, lease_until__lte=now))
        ids = list(lost.values_list("pk", flat=True))
        if ids:
            Item.objects.filter(pk__in=ids).update(dispatched_at=now)
            send_items(ids)
            counts["resent"] += len(ids)
        dispatch(batch_id)
        finish_if_drained(batch_id)
    grace = now if startup else now - timedelta(minutes=1)
    for batch_id in Batch.objects.filter(status=Status.FINALIZING, finalizing_at__lte=grace).values_list(
            "pk", flat=True):
        finalize(batch_id)
        counts["finalized"] += 1
    from controlplane.serving import response_store, tasks  # background Responses share the safety net

    lost_responses = response_store.unfinished(now)
    for response_id in lost_responses:
        tasks.send(response_id)
    counts["responses_resent"] = len(lost_responses)
    return counts


def cleanup(now: datetime | None = None) -> dict[str, int]:
    """Remove results kept past HEARTH_BATCH_RETENTION_HOURS (items and output/error files; the batch row
    stays, marked purged) and files past their own expiry."""
    now = now or _now()
    cutoff = now - timedelta(hours=settings.HEARTH_BATCH_RETENTION_HOURS)
    purged = items = 0
    for batch in Batch.objects.filter(finished_at__lte=cutoff, results_purged_at__isnull=True):
        with transaction.atomic():
            items += Item.objects.filter(batch=batch).delete()[0]
            File.objects.filter(pk__in=[f for f in (batch.output_file_id, batch.error_file_id) if f]).delete()
            Batch.objects.filter(pk=batch.pk).update(results_purged_at=now, output_file=None, error_file=None)
        purged += 1
    files = File.objects.filter(expires_at__lte=now).delete()[0]
    from controlplane.serving import response_store

    return {"batches": purged, "items": items, "files": files, "responses": response_store.cleanup(now)}
