"""Stored Responses (store: true): kept per account until they expire; continued by previous_response_id;
background ones queued for a Celery worker, claimed once, finished once."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from controlplane.api import errors
from controlplane.serving.job import Job
from controlplane.serving.models import StoredResponse
from controlplane.serving.protocol.responses import base_response, output_messages

Status = StoredResponse.Status
FINISHED = (Status.COMPLETED, Status.INCOMPLETE)
STALE_CLAIM = timedelta(minutes=10)  # a background run claimed this long ago lost its worker: run it again


def _expiry(now: datetime) -> datetime:
    return now + timedelta(hours=settings.HEARTH_RESPONSES_RETENTION_HOURS)


def _live(account_id: str, response_id: str) -> StoredResponse:
    row = StoredResponse.objects.filter(pk=response_id, account_id=account_id, expires_at__gt=timezone.now()).first()
    if row is None:  # another account's id, an expired one and a made-up one all look the same
        raise errors.not_found(f"No response {response_id!r}")
    return row


def prior_conversation(account_id: str, response_id: str) -> list[dict[str, Any]]:
    """What a continuation starts from: the stored conversation and the stored answer."""
    try:
        row = _live(account_id, response_id)
    except errors.ApiError as exc:
        exc.param = "previous_response_id"
        raise
    if row.status not in FINISHED:
        raise errors.invalid(f"previous_response_id: {response_id} is {row.status}; only a finished response can "
                             "be continued", "previous_response_id")
    return [*row.conversation, *output_messages(row.response)]


def save(account_id: str, key_id: str | None, job: Job, raw: dict[str, Any], response: dict[str, Any]) -> None:
    now = timezone.now()
    StoredResponse.objects.create(
        id=response["id"], account_id=account_id, api_key_id=key_id or "", model=job.model,
        status=response["status"], background=False, created_at=now, expires_at=_expiry(now),
        previous_response_id=job.body.previous_response_id or "", body=raw,
        conversation=job.extra["conversation"], response=response)


def queue(account_id: str, key_id: str | None, job: Job, raw: dict[str, Any]) -> dict[str, Any]:
    """A background response, stored as queued; the caller sends its task."""
    now = timezone.now()
    response = base_response(job, Status.QUEUED, int(now.timestamp()))
    StoredResponse.objects.create(
        id=response["id"], account_id=account_id, api_key_id=key_id or "", model=job.model, status=Status.QUEUED,
        background=True, created_at=now, expires_at=_expiry(now),
        previous_response_id=job.body.previous_response_id or "", body=raw,
        conversation=job.extra["conversation"], response=response)
    return response


def get(account_id: str, response_id: str) -> dict[str, Any]:
    return _live(account_id, response_id).response


def delete(account_id: str, response_id: str) -> None:
    _live(account_id, response_id).delete()


def cancel(account_id: str, response_id: str) -> dict[str, Any]:
    """Only a background response that has not finished can be cancelled; a running one's result is dropped."""
    with transaction.atomic():
        row = StoredResponse.objects.select_for_update().filter(pk=_live(account_id, response_id).pk).first()
        assert row is not None
        if not row.background:
            raise errors.invalid("Only background responses can be cancelled")
        if row.status in (Status.QUEUED, Status.IN_PROGRESS):
            row.status = Status.CANCELLED
            row.response = {**row.response, "status": Status.CANCELLED}
            row.save(update_fields=["status", "response"])
        return row.response


def claim(response_id: str) -> StoredResponse | None:
    """Take a queued background response (or one whose worker died) for this worker; None if another has it or
    it is done: a message delivered twice runs once."""
    now = timezone.now()
    taken = StoredResponse.objects.filter(pk=response_id, status=Status.QUEUED).update(
        status=Status.IN_PROGRESS, claimed_at=now)
    if not taken:
        taken = StoredResponse.objects.filter(pk=response_id, status=Status.IN_PROGRESS,
                                              claimed_at__lt=now - STALE_CLAIM).update(claimed_at=now)
    return StoredResponse.objects.filter(pk=response_id).first() if taken else None


def finish(response_id: str, response: dict[str, Any]) -> bool:
    """Store a background run's answer, unless it was cancelled (or finished elsewhere) meanwhile."""
    return bool(StoredResponse.objects.filter(pk=response_id, status=Status.IN_PROGRESS).update(
        status=response["status"], response=response))


def fail(response_id: str, error: errors.ApiError) -> None:
    row = StoredResponse.objects.filter(pk=response_id, status=Status.IN_PROGRESS).first()
    if row is not None:
        row.status = Status.FAILED
        row.response = {**row.response, "status": Status.FAILED,
                        "error": {"code": error.openai_code or "server_error", "message": error.message}}
        row.save(update_fields=["status", "response"])


def cleanup(now: datetime | None = None) -> int:
    """Remove expired responses (the periodic cleanup)."""
    deleted, _ = StoredResponse.objects.filter(expires_at__lte=now or timezone.now()).delete()
    return deleted


def unfinished(now: datetime | None = None) -> list[str]:
    """Background responses whose message may be lost: queued a while ago, or claimed by a worker that died."""
    now = now or timezone.now()
    queued = StoredResponse.objects.filter(status=Status.QUEUED, created_at__lt=now - timedelta(minutes=1))
    stale = StoredResponse.objects.filter(status=Status.IN_PROGRESS, claimed_at__lt=now - STALE_CLAIM)
    return [*queued.values_list("pk", flat=True), *stale.values_list("pk", flat=True)]
