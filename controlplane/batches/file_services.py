"""Every write to the files of the Files API: batch input uploads, and the output and error files a finished batch
leaves (controlplane.batches.services.finalize). An account sees only its own."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import Q
from django.utils import timezone

from controlplane.accounts.services import KeyContext
from controlplane.api import errors
from controlplane.batches.models import Batch, File


def create_file(ctx: KeyContext, *, purpose: str, filename: str, content: bytes,
                expires_after_seconds: int | None = None) -> File:
    if purpose != File.Purpose.BATCH:
        raise errors.invalid(f"purpose: only 'batch' files can be uploaded here, not {purpose!r}", "purpose")
    limit = settings.HEARTH_BATCH_MAX_FILE_BYTES
    if len(content) > limit:
        raise errors.request_too_large(f"The file is {len(content):,} bytes; the limit is {limit:,}")
    if not content.strip():
        raise errors.invalid("file: the file is empty", "file")
    try:
        content.decode("utf-8")
    except UnicodeDecodeError:
        raise errors.invalid("file: a batch input file must be UTF-8 JSONL", "file") from None
    now = timezone.now()
    expires = now + timedelta(seconds=expires_after_seconds) if expires_after_seconds else None
    return File.objects.create(account_id=ctx.account_id, purpose=purpose, filename=filename[:255] or "input.jsonl",
                               bytes=len(content), content=content, created_at=now, expires_at=expires)


def get_file(account_id: str, file_id: str) -> File:
    """The account's file; another account's id is simply not found."""
    found = File.objects.filter(account_id=account_id, pk=file_id).defer("content").first()
    if found is None:
        raise errors.not_found(f"No such file: {file_id}")
    return found


def file_content(account_id: str, file_id: str) -> tuple[File, bytes]:
    found = File.objects.filter(account_id=account_id, pk=file_id).first()
    if found is None:
        raise errors.not_found(f"No such file: {file_id}")
    return found, bytes(found.content)


def list_files(account_id: str, *, purpose: str | None, limit: int, after: str | None) -> tuple[list[File], bool]:
    query = File.objects.filter(account_id=account_id).defer("content").order_by("-created_at", "-pk")
    if purpose:
        query = query.filter(purpose=purpose)
    return page(query, File, account_id, limit, after)


def delete_file(account_id: str, file_id: str) -> None:
    deleted, _ = File.objects.filter(account_id=account_id, pk=file_id).delete()
    if not deleted:
        raise errors.not_found(f"No such file: {file_id}")


def page(query: Any, model: Any, account_id: str, limit: int, after: str | None) -> tuple[list, bool]:
    """One page of an account's files or batches, newest first, after the object `after` (its id)."""
    if after:
        anchor = model.objects.filter(account_id=account_id, pk=after).only("created_at").first()
        if anchor is None:
            raise errors.invalid(f"after: no such object {after!r}", "after")
        query = query.filter(Q(created_at__lt=anchor.created_at) | Q(created_at=anchor.created_at, pk__lt=anchor.pk))
    rows = list(query[: limit + 1])
    return rows[:limit], len(rows) > limit


def result_file(batch: Batch, kind: str, lines: list[bytes], now: datetime) -> File:
    content = b"".join(lines)
    return File.objects.create(account_id=batch.account_id, purpose=File.Purpose.BATCH_OUTPUT,
                               filename=f"{batch.pk}_{kind}.jsonl", bytes=len(content), content=content,
                               created_at=now)
