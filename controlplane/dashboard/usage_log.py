"""The dashboard's request log: an account's newest usage events, filtered, 50 at a time.

Pages are keyset pages on (created_at, id), newest first: an "older" link carries the last row's position as a
cursor, and the next page starts strictly after it. The query walks the (account, -created_at) index from that
point and stops after PAGE_SIZE + 1 rows (the extra one only tells whether an older page exists), so page 1,000 costs
what page 1 does. There is no total count and no OFFSET: both would read every event the account ever made.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.db.models import Q, QuerySet
from django.utils.dateparse import parse_datetime

from controlplane.api import errors
from controlplane.usage.models import Source, Status, UsageEvent

PAGE_SIZE = 50
NO_KEY = "none"  # the key filter's value for playground (keyless) requests
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_CURSOR = re.compile(r"^(-?\d{1,20})_(\d{1,20})$")
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
_MINUTE = re.compile(r"^\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}$")
# Columns the log shows: the rest of an event (prices, affinity, request ids) stays on disk.
_COLUMNS = ("id", "created_at", "api_key_id", "model", "adapter", "route", "source", "status", "http_status",
            "error_code", "stream", "input_tokens", "cached_input_tokens", "output_tokens", "latency_ms", "ttft_ms",
            "neurons", "cost_usd")


@dataclass(frozen=True, slots=True)
class Cursor:
    """A position in the log: the last row shown. Its created_at travels as integer microseconds so that the
    next query compares against exactly the stored value."""

    created_at: datetime
    id: int

    def encode(self) -> str:
        delta = self.created_at.astimezone(UTC) - _EPOCH
        micros = (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds
        return f"{micros}_{self.id}"

    @classmethod
    def decode(cls, value: str) -> Cursor:
        match = _CURSOR.match(value)
        try:
            if match is None:
                raise ValueError(value)
            return cls(_EPOCH + timedelta(microseconds=int(match[1])), int(match[2]))
        except (ValueError, OverflowError):
            raise errors.invalid("before must be a cursor taken from an “older” link", "before") from None


@dataclass(frozen=True, slots=True)
class LogFilters:
    model: str = ""
    key: str = ""  # '' every key, NO_KEY keyless requests, else a key id
    status: str = ""
    source: str = ""
    since: datetime | None = None
    until: datetime | None = None  # exclusive
    before: Cursor | None = None

    def params(self, *, before: Cursor | None = None) -> dict[str, str]:
        """The filters as query parameters (what links to other pages of the same log carry)."""
        out = {"model": self.model, "key": self.key, "status": self.status, "source": self.source,
               "since": _show(self.since), "until": _show(self.until, end=True)}
        if before is not None:
            out["before"] = before.encode()
        return {name: value for name, value in out.items() if value}


@dataclass(frozen=True, slots=True)
class LogPage:
    events: list[UsageEvent]
    older: Cursor | None  # where the next (older) page starts; None on the last page


def _show(moment: datetime | None, *, end: bool = False) -> str:
    """A bound as the form's datetime-local input shows it (UTC, to the minute, seconds when they matter)."""
    if moment is None:
        return ""
    utc = moment.astimezone(UTC)
    if end and utc.second == 0 and utc.microsecond == 0:
        utc -= timedelta(minutes=1)  # the form's "until" names the last minute it includes
    return utc.strftime("%Y-%m-%dT%H:%M" if utc.second == 0 and utc.microsecond == 0 else "%Y-%m-%dT%H:%M:%S")


def _moment(value: str, name: str, *, end: bool) -> datetime | None:
    """A bound from the form: a date (a whole UTC day) or a datetime-local value (UTC); an end bound given to
    the minute includes that minute."""
    value = value.strip()
    if not value:
        return None
    try:
        moment = parse_datetime(value) if not _DATE.match(value) else parse_datetime(value + "T00:00")
        if moment is None:
            raise ValueError(value)
        moment = moment if moment.tzinfo else moment.replace(tzinfo=UTC)
        if end and _DATE.match(value):
            moment += timedelta(days=1)
        elif end and _MINUTE.match(value):
            moment += timedelta(minutes=1)
    except (ValueError, OverflowError):
        raise errors.invalid(f"{name} must be a date (YYYY-MM-DD) or a time (YYYY-MM-DDTHH:MM), in UTC",
                             name) from None
    return moment


def parse_filters(params: object) -> LogFilters:
    """Filters from a query string; a value that names nothing this log knows is a 400 (ApiError)."""
    get = params.get  # type: ignore[attr-defined]
    model = get("model", "").strip()
    if len(model) > 200:
        raise errors.invalid("model must be at most 200 characters", "model")
    key = get("key", "").strip()
    if key and key != NO_KEY:
        try:
            key = str(uuid.UUID(key))
        except ValueError:
            raise errors.invalid("key must be one of the account's keys", "key") from None
    status = get("status", "").strip()
    if status and status not in Status.values:
        raise errors.invalid(f"status must be one of {', '.join(Status.values)}", "status")
    source = get("source", "").strip()
    if source and source not in Source.values:
        raise errors.invalid(f"source must be one of {', '.join(Source.values)}", "source")
    since = _moment(get("since", ""), "since", end=False)
    until = _moment(get("until", ""), "until", end=True)
    if since is not None and until is not None and since >= until:
        raise errors.invalid("since must be before until", "since")
    before = get("before", "").strip()
    return LogFilters(model=model, key=key, status=status, source=source, since=since, until=until,
                      before=Cursor.decode(before) if before else None)


def query(account_id: str, filters: LogFilters, limit: int | None = None) -> QuerySet[UsageEvent]:
    """The page's query: at most limit + 1 events, newest first, from the account's time index."""
    limit = limit or PAGE_SIZE
    rows = UsageEvent.objects.filter(account_id=account_id)
    if filters.model:
        rows = rows.filter(model=filters.model)
    if filters.key == NO_KEY:
        rows = rows.filter(api_key__isnull=True)
    elif filters.key:
        rows = rows.filter(api_key_id=filters.key)
    if filters.status:
        rows = rows.filter(status=filters.status)
    if filters.source:
        rows = rows.filter(source=filters.source)
    if filters.since is not None:
        rows = rows.filter(created_at__gte=filters.since)
    if filters.until is not None:
        rows = rows.filter(created_at__lt=filters.until)
    if filters.before is not None:
        # The plain bound is what the index range starts from; the OR only breaks ties within one timestamp.
        at, last_id = filters.before.created_at, filters.before.id
        rows = rows.filter(created_at__lte=at).filter(Q(created_at__lt=at) | Q(id__lt=last_id))
    return rows.only(*_COLUMNS).order_by("-created_at", "-id")[:limit + 1]


def page(account_id: str, filters: LogFilters, limit: int | None = None) -> LogPage:
    limit = limit or PAGE_SIZE
    events = list(query(account_id, filters, limit))
    if len(events) <= limit:
        return LogPage(events, None)
    events = events[:limit]
    return LogPage(events, Cursor(events[-1].created_at, events[-1].id))
