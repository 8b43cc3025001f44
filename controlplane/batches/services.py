"""Every write to batches and their items (files: controlplane.batches.file_services; an item's claim, lease and
result on the worker: controlplane.batches.item_services). Views and tasks call these; nothing else writes these
tables.

Item rows are the source of truth; broker messages only say "look at items N, M...". A message may be lost (the
sweep sends it again) or delivered twice (the claim turns the second one away), so neither changes what ends
up stored: exactly one result per item.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from controlplane.accounts.services import KeyContext
from controlplane.api import errors
from controlplane.api.errors import ApiError
from controlplane.api.http import ascii_int
from controlplane.batches import events
from controlplane.batches.file_services import page, result_file
from controlplane.batches.models import Batch, File, Item
from controlplane.batches.validation import ItemError, check_line
from controlplane.serving.protocol import OPENAI_BATCH_PATHS

log = logging.getLogger("controlplane.batches")
Status = Batch.Status
ItemStatus = Item.Status


def _now() -> datetime:
    return timezone.now()


# ------------------------------------------------------------------------------------------------ batches
def _window_hours(completion_window: str) -> int:
    value = completion_window.strip().lower()
    hours = ascii_int(value[:-1]) if value.endswith("h") else None
    if hours is None or not 1 <= hours <= 168:
        raise errors.invalid("completion_window: give hours such as '24h' (1h to 168h)", "completion_window")
    return hours


def _check_metadata(metadata: Any) -> dict[str, str] | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > 16 or any(
            not isinstance(k, str) or not isinstance(v, str) or len(k) > 64 or len(v) > 512
            for k, v in metadata.items()):
        raise errors.invalid("metadata: up to 16 string pairs, keys up to 64 and values up to 512 characters",
                             "metadata")
    return metadata


def create_openai_batch(ctx: KeyContext, *, input_file_id: str, endpoint: str, completion_window: str,
                        metadata: Any = None) -> Batch:
    """A batch in `validating`; the prepare task reads the file into items."""
    if endpoint not in OPENAI_BATCH_PATHS:
        raise errors.invalid(f"endpoint: one of {', '.join(OPENAI_BATCH_PATHS)}", "endpoint")
    hours = _window_hours(completion_window)
    metadata = _check_metadata(metadata)
    source = File.objects.filter(account_id=ctx.account_id, pk=input_file_id).defer("content").first()
    if source is None:
        raise errors.not_found(f"No such file: {input_file_id}")
    if source.purpose != File.Purpose.BATCH:
        raise errors.invalid(f"input_file_id: {input_file_id} was not uploaded with purpose 'batch'",
                             "input_file_id")
    now = _now()
    with transaction.atomic():
        batch = Batch.objects.create(
            account_id=ctx.account_id, api_key_id=ctx.key_id, allowed_models=list(ctx.allowed_models),
            api=Batch.Api.OPENAI, endpoint=endpoint, status=Status.VALIDATING, input_file=source,
            completion_window=completion_window, metadata=metadata, created_at=now,
            expires_at=now + timedelta(hours=hours))
        transaction.on_commit(lambda: send_prepare([batch.pk]))
    return batch


def create_native_batch(ctx: KeyContext, model: str, requests: list[tuple[str | None, dict[str, Any]]]) -> Batch:
    """A Workers AI queueRequest: the requests were checked by the view; they are queued at once."""
    now = _now()
    with transaction.atomic():
        batch = Batch.objects.create(
            account_id=ctx.account_id, api_key_id=ctx.key_id, allowed_models=list(ctx.allowed_models),
            api=Batch.Api.NATIVE, model=model, status=Status.IN_PROGRESS, total_count=len(requests),
            completion_window=f"{settings.HEARTH_BATCH_DEFAULT_WINDOW_HOURS}h", created_at=now,
            in_progress_at=now, expires_at=now + timedelta(hours=settings.HEARTH_BATCH_DEFAULT_WINDOW_HOURS))
        Item.objects.bulk_create(
            [Item(batch=batch, index=i, custom_id=ref, model=model, body=body) for i, (ref, body) in
             enumerate(requests)], batch_size=500)
        transaction.on_commit(lambda: dispatch(batch.pk))
    return batch


def get_batch(account_id: str, batch_id: str) -> Batch:
    """The account's batch; another account's id is simply not found."""
    found = Batch.objects.filter(account_id=account_id, pk=batch_id).first()
    if found is None:
        raise errors.not_found(f"No such batch: {batch_id}")
    return found


def list_batches(account_id: str, *, limit: int, after: str | None) -> tuple[list[Batch], bool]:
    query = Batch.objects.filter(account_id=account_id).order_by("-created_at", "-pk")
    return page(query, Batch, account_id, limit, after)


def items_of(batch: Batch) -> list[Item]:
    return list(Item.objects.filter(batch=batch).order_by("index"))


def cancel_batch(account_id: str, batch_id: str) -> Batch:
    """Stop a batch: unstarted items are cancelled now, running ones finish (or stop at their next lease
    renewal), then the batch becomes `cancelled` with what completed in its output file."""
    now = _now()
    with transaction.atomic():
        batch = Batch.objects.select_for_update().filter(account_id=account_id, pk=batch_id).first()
        if batch is None:
            raise errors.not_found(f"No such batch: {batch_id}")
        if batch.status in (Status.CANCELLING, Status.CANCELLED):
            return batch
        if batch.status in Batch.TERMINAL or batch.status == Status.FINALIZING:
            raise ApiError(409, errors.CODE_INVALID_INPUT, f"Cannot cancel a batch that is {batch.status}",
                           openai_code="invalid_state", openai_status=409)
        stop_unstarted(batch, ItemStatus.CANCELLED, "batch_cancelled", "The batch was cancelled before this "
                        "request ran", now)
        Batch.objects.filter(pk=batch.pk).update(status=Status.CANCELLING, cancelling_at=now)
    events.publish(Batch.objects.get(pk=batch.pk))  # while running items finish, watchers see `cancelling`
    finish_if_drained(batch.pk)
    return Batch.objects.get(pk=batch.pk)


def stop_unstarted(batch: Batch, status: str, code: str, message: str, now: datetime) -> int:
    error = {"status": 400, "openai_status": 400, "code": errors.CODE_INVALID_INPUT, "openai_code": code,
             "message": message, "param": None}
    stopped = Item.objects.filter(batch=batch, status=ItemStatus.QUEUED).update(
        status=status, error=error, finished_at=now, lease_until=None)
    if stopped:
        Batch.objects.filter(pk=batch.pk).update(cancelled_count=F("cancelled_count") + stopped)
    return stopped


# ------------------------------------------------------------------------------------------------ worker side
def send_prepare(batch_ids: Iterable[str]) -> None:
    from controlplane.batches.tasks import prepare_batch

    for batch_id in batch_ids:
        try:
            prepare_batch.delay(batch_id)
        except Exception:  # the sweep sends it again; the batch is safe in the database
            log.exception("could not queue batch %s for validation", batch_id)


def send_items(item_ids: list[int]) -> None:
    """Send the items to the workers, a message for each run of up to HEARTH_BATCH_RUN_ITEMS of them (a worker
    claims, runs and stores a run together: item_services)."""
    if not item_ids:
        return
    from controlplane.batches.tasks import run_items
    from controlplane.celery import app

    size = max(1, settings.HEARTH_BATCH_RUN_ITEMS)
    try:
        with app.producer_or_acquire() as producer:
            for start in range(0, len(item_ids), size):
                run_items.apply_async((item_ids[start:start + size],), producer=producer)
    except Exception:  # the sweep sends them again after HEARTH_BATCH_REDISPATCH_SECONDS
        log.exception("could not queue %d batch items", len(item_ids))


def prepare(batch_id: str) -> None:
    """validating -> in_progress: read the input file into one item per line (a bad line becomes a failed item,
    not a failed batch). Runs at most once per batch whatever the number of deliveries."""
    batch = Batch.objects.filter(pk=batch_id).select_related("input_file").first()
    if batch is None or batch.status != Status.VALIDATING:
        if batch is not None and batch.status == Status.IN_PROGRESS:
            dispatch(batch_id)
        return
    if batch.cancelling_at or batch.expired_at:
        finish_if_drained(batch_id)
        return
    content = bytes(batch.input_file.content) if batch.input_file is not None else None
    now = _now()
    problem = None
    rows: list[Item] = []
    if content is None:
        problem = ("file_not_found", "The input file was deleted before the batch started")
    else:
        lines = [(n, line) for n, line in enumerate(content.decode("utf-8", "replace").splitlines(), 1)
                 if line.strip()]
        if not lines:
            problem = ("empty_file", "The input file has no requests")
        elif len(lines) > settings.HEARTH_BATCH_MAX_REQUESTS:
            problem = ("too_many_requests", f"The input file has {len(lines):,} requests; the limit is "
                       f"{settings.HEARTH_BATCH_MAX_REQUESTS:,}")
        else:
            rows = _items_from_lines(batch, lines, now)
    with transaction.atomic():
        locked = Batch.objects.select_for_update().get(pk=batch_id)
        if locked.status != Status.VALIDATING:
            return
        if problem is not None:
            code, message = problem
            Batch.objects.filter(pk=batch_id).update(
                status=Status.FAILED, failed_at=now, finished_at=now,
                errors=[{"code": code, "message": message, "param": None, "line": None}])
        else:
            Item.objects.bulk_create(rows, batch_size=500)
            failed = sum(1 for r in rows if r.status == ItemStatus.FAILED)
            model = next((r.model for r in rows if r.model), "")
            Batch.objects.filter(pk=batch_id).update(
                status=Status.IN_PROGRESS, in_progress_at=now, total_count=len(rows), failed_count=failed,
                model=model)
    events.publish(Batch.objects.get(pk=batch_id))
    if problem is None:
        dispatch(batch_id)
        finish_if_drained(batch_id)


def _items_from_lines(batch: Batch, lines: list[tuple[int, str]], now: datetime) -> list[Item]:
    rows = []
    seen: set[str] = set()
    for index, (number, line) in enumerate(lines):
        try:
            custom_id, model, body = check_line(line, number, batch.endpoint, tuple(batch.allowed_models), seen,
                                                batch.account_id)
            rows.append(Item(batch=batch, index=index, custom_id=custom_id, model=model, body=body))
        except ItemError as exc:
            rows.append(Item(batch=batch, index=index, custom_id=exc.custom_id, status=ItemStatus.FAILED,
                             error=error_json(exc.error), finished_at=now))
    return rows


def error_json(error: ApiError) -> dict[str, Any]:
    return {"status": error.status, "openai_status": error.openai_status or error.status, "code": error.code,
            "openai_code": error.openai_code, "message": error.message, "param": error.param}


def dispatch(batch_id: str) -> list[int]:
    """Send messages for the next queued items, keeping at most HEARTH_BATCH_WINDOW of this batch's items
    dispatched at once: batches share the workers fairly and the broker never holds a whole batch."""
    now = _now()
    with transaction.atomic():
        batch = Batch.objects.select_for_update().filter(pk=batch_id).first()
        if batch is None or batch.status != Status.IN_PROGRESS or batch.cancelling_at or batch.expired_at:
            return []
        outstanding = Item.objects.filter(batch_id=batch_id, dispatched_at__isnull=False,
                                          status__in=(ItemStatus.QUEUED, ItemStatus.RUNNING)).count()
        free = settings.HEARTH_BATCH_WINDOW - outstanding
        if free <= 0:
            return []
        ids = list(Item.objects.filter(batch_id=batch_id, status=ItemStatus.QUEUED, dispatched_at__isnull=True)
                   .order_by("index").values_list("pk", flat=True)[:free])
        if ids:
            Item.objects.filter(pk__in=ids).update(dispatched_at=now)
            Batch.objects.filter(pk=batch_id).update(dispatched_count=F("dispatched_count") + len(ids))
            transaction.on_commit(lambda: send_items(ids))
    return ids


def finish_if_drained(batch_id: str) -> None:
    """Once no item is pending: `finalizing` (files are written), then the terminal status. Idempotent; a
    crash between the two steps is picked up by the sweep."""
    now = _now()
    with transaction.atomic():
        batch = Batch.objects.select_for_update().filter(pk=batch_id).first()
        if batch is None or batch.status in Batch.TERMINAL:
            return
        stopping = batch.cancelling_at is not None or batch.expired_at is not None
        if batch.status == Status.VALIDATING and not stopping:
            return
        if batch.pending_count > 0:
            return
        if batch.status != Status.FINALIZING:
            Batch.objects.filter(pk=batch_id).update(status=Status.FINALIZING, finalizing_at=now)
    events.publish(Batch.objects.get(pk=batch_id))
    finalize(batch_id)


def finalize(batch_id: str) -> None:
    from controlplane.batches.results import error_lines, output_lines

    now = _now()
    with transaction.atomic():
        batch = Batch.objects.select_for_update().filter(pk=batch_id).first()
        if batch is None or batch.status != Status.FINALIZING:
            return
        changes: dict[str, Any] = {"finished_at": now}
        if batch.api == Batch.Api.OPENAI:
            items = items_of(batch)
            out, err = output_lines(items), error_lines(items)
            if out:
                changes["output_file"] = result_file(batch, "output", out, now)
            if err:
                changes["error_file"] = result_file(batch, "errors", err, now)
        if batch.cancelling_at is not None:
            changes.update(status=Status.CANCELLED, cancelled_at=now)
        elif batch.expired_at is not None:
            changes.update(status=Status.EXPIRED)
        else:
            changes.update(status=Status.COMPLETED, completed_at=now)
        for name, value in changes.items():
            setattr(batch, name, value)
        batch.save(update_fields=list(changes))
    events.publish(batch)
