"""Writing usage events with their rollups, and the account-level checks (free allocation, hard budget)."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any

from django.db import connection, transaction
from django.db.models import Model, Sum, UniqueConstraint
from django.dispatch import Signal
from django.utils import timezone

from controlplane.accounts.services import KeyContext
from controlplane.api import errors
from controlplane.catalog.services import PriceSnapshot, get_model
from controlplane.usage import histogram
from controlplane.usage.models import Source, Status, UsageDay, UsageEvent, UsageMinute

log = logging.getLogger("controlplane.usage")
_ZERO = Decimal(0)
# Sent once an event and its rollups are committed (kwargs: account_id). The dashboard pushes live charts from it.
usage_recorded = Signal()


@dataclass(slots=True)
class UsageRecord:
    """Everything a request contributes to metering; built by the serving layer, written by record()."""

    account_id: str
    key_id: str | None
    model: str
    route: str
    status: str = Status.OK
    http_status: int = 200
    error_code: str = ""
    adapter: str = ""
    request_id: str = ""
    source: str = Source.INTERACTIVE
    stream: bool = False
    input_tokens: int = 0
    cached_input_tokens: int = 0
    output_tokens: int = 0
    spec_proposed: int = 0  # draft tokens speculative decoding proposed for this request
    spec_accepted: int = 0  # of which the target model accepted
    latency_ms: float = 0.0
    ttft_ms: float | None = None
    session_affinity: str = ""
    replica: str = ""
    created_at: datetime | None = None


# A statement per rollup and set of delta columns: one request adds to one bucket of each histogram, a run of
# them to several, so the sets are many but each recurs; the least used are dropped.
@functools.lru_cache(maxsize=512)
def _upsert_sql(model: type[Model], keys: tuple[str, ...], deltas: tuple[str, ...]) -> str:
    """INSERT ... ON CONFLICT DO UPDATE adding the deltas, built once per rollup model and field set."""
    meta = model._meta
    quote = connection.ops.quote_name
    table = quote(meta.db_table)
    unique = next(c for c in meta.constraints if isinstance(c, UniqueConstraint))
    conflict = [meta.get_field(name).column for name in unique.fields]
    if set(conflict) != {meta.get_field(name).column for name in keys}:
        raise ValueError(f"{meta.label}: the lookup must name exactly the unique constraint's fields")
    columns = [meta.get_field(name).column for name in (*keys, *deltas)]
    updates = ", ".join(f"{quote(c)} = {table}.{quote(c)} + excluded.{quote(c)}" for c in columns[len(keys):])
    return (f"INSERT INTO {table} ({', '.join(map(quote, columns))}) VALUES ({', '.join(['%s'] * len(columns))}) "
            f"ON CONFLICT ({', '.join(map(quote, conflict))}) DO UPDATE SET {updates}")


@functools.cache
def _insert_sql(model: type[Model]) -> str:
    """INSERT of every column but the key, returning the key: built once per model."""
    meta = model._meta
    quote = connection.ops.quote_name
    columns = [quote(f.column) for f in meta.concrete_fields if not f.primary_key]
    return (f"INSERT INTO {quote(meta.db_table)} ({', '.join(columns)}) VALUES ({', '.join(['%s'] * len(columns))}) "
            f"RETURNING {quote(meta.pk.column)}")


def _insert(obj: Model) -> None:
    """Save a new row with one statement built once (as _bump, for the CPU the ORM spends compiling an INSERT
    of two dozen columns on every request: a batch worker shares the engine's interpreter and cores). Values go
    through each field's own conversion, as the ORM's INSERT does."""
    fields = [f for f in obj._meta.concrete_fields if not f.primary_key]
    values = [f.get_db_prep_save(f.pre_save(obj, True), connection) for f in fields]
    with connection.cursor() as cursor:
        cursor.execute(_insert_sql(type(obj)), values)
        obj.pk = cursor.fetchone()[0]
    obj._state.adding = False
    obj._state.db = connection.alias


def _bump(model: type[Model], lookup: dict[str, Any], deltas: dict[str, Any]) -> None:
    """Add deltas to the rollup row for lookup, creating it on first use: one INSERT ... ON CONFLICT DO UPDATE,
    race-free on SQLite and PostgreSQL alike. Raw SQL because the ORM has no additive upsert, and building a
    dozen F() expressions per request costs more CPU than the query itself."""
    meta = model._meta
    deltas = dict(sorted(deltas.items()))  # one statement per set of columns, whatever order they were added in
    names = (*lookup, *deltas)
    values = [meta.get_field(name).get_db_prep_save(value, connection)
              for name, value in zip(names, (*lookup.values(), *deltas.values()), strict=True)]
    with connection.cursor() as cursor:
        cursor.execute(_upsert_sql(model, tuple(lookup), tuple(deltas)), values)


def charge(price: PriceSnapshot | None, input_tokens: int, cached_input_tokens: int, output_tokens: int, *,
           batch: bool = False, adapter: bool = False) -> tuple[Decimal, Decimal]:
    """Neurons and dollars for these tokens at this price, rounded as events store them (no price: nothing).
    A request served with a LoRA adapter pays the price's adapter surcharge on top."""
    if price is None:
        return _ZERO, _ZERO
    neurons = price.neurons(input_tokens, min(cached_input_tokens, input_tokens), output_tokens)
    if adapter:
        neurons = neurons * (100 + price.lora_surcharge_percent) / 100
    if batch:
        neurons = neurons * (100 - price.batch_discount()) / 100
    cost = price.cost_usd(neurons)
    return neurons.quantize(Decimal("0.000001")), cost.quantize(Decimal("0.0000000001"))


def record(rec: UsageRecord, price: PriceSnapshot | None = None) -> UsageEvent:
    """Write one usage event and fold it into the minute and day rollups, in one transaction.

    The price is the one in effect when the request arrived (looked up from the catalog when not given); a
    failed request is never billable whatever tokens it reports.
    """
    return record_many([(rec, price)])[0]


def record_many(entries: list[tuple[UsageRecord, PriceSnapshot | None]]) -> list[UsageEvent]:
    """record() for several requests at once (a run of batch items finishing together): one event each, and
    each rollup row they share bumped once with their summed deltas, in one transaction. The sums are what the
    requests one by one would have added."""
    events: list[UsageEvent] = []
    minutes: dict[tuple[str, str, str, datetime], dict[str, Any]] = {}
    days: dict[tuple[str, str, str, date], dict[str, Any]] = {}
    for rec, price in entries:
        event, deltas = _event(rec, price)
        events.append(event)
        utc = event.created_at.astimezone(UTC)
        group = (rec.account_id, rec.model, rec.key_id or "")
        _add(minutes, (*group, utc.replace(second=0, microsecond=0)), deltas)
        _add(days, (*group, utc.date()), deltas)
    # Inside a caller's transaction (a batch item's result) no savepoint of its own: a failure here fails both.
    with transaction.atomic(savepoint=False):
        for event in events:
            _insert(event)
        # Rows in one order in every transaction, so two writers never wait on each other's rows in a cycle.
        for (account_id, model, key_id, minute), deltas in sorted(minutes.items()):
            _bump(UsageMinute, {"account_id": account_id, "model": model, "key_id": key_id, "minute": minute},
                  deltas)
        for (account_id, model, key_id, day), deltas in sorted(days.items()):
            _bump(UsageDay, {"account_id": account_id, "model": model, "key_id": key_id, "day": day}, deltas)
        for account_id in sorted({event.account_id for event in events}):
            transaction.on_commit(functools.partial(usage_recorded.send, sender=UsageEvent,
                                                    account_id=account_id))
    return events


def _event(rec: UsageRecord, price: PriceSnapshot | None) -> tuple[UsageEvent, dict[str, Any]]:
    """The event one request writes (unsaved) and what it adds to its rollup rows."""
    created = rec.created_at or timezone.now()
    if price is None:
        entry = get_model(rec.model)
        price = entry.price_at(created.timestamp()) if entry else None
    billable = rec.status != Status.ERROR
    tokens_in = rec.input_tokens if billable else 0
    tokens_cached = min(rec.cached_input_tokens, tokens_in) if billable else 0
    tokens_out = rec.output_tokens if billable else 0
    neurons, cost = charge(price if billable else None, tokens_in, tokens_cached, tokens_out,
                           batch=rec.source == Source.BATCH, adapter=bool(rec.adapter))
    event = UsageEvent(
        created_at=created, account_id=rec.account_id, api_key_id=rec.key_id, model=rec.model,
        adapter=rec.adapter, request_id=rec.request_id[:64], route=rec.route, source=rec.source,
        status=rec.status, http_status=rec.http_status, error_code=rec.error_code, stream=rec.stream,
        input_tokens=tokens_in, cached_input_tokens=tokens_cached, output_tokens=tokens_out,
        spec_proposed=rec.spec_proposed, spec_accepted=rec.spec_accepted,
        neurons=neurons, cost_usd=cost, price_id=price.price_id if price and billable else None,
        latency_ms=rec.latency_ms, ttft_ms=rec.ttft_ms, session_affinity=rec.session_affinity[:200],
        replica=rec.replica[:64])
    deltas = {
        "requests": 1, "errors": 0 if rec.status != Status.ERROR else 1,
        "input_tokens": tokens_in, "cached_input_tokens": tokens_cached, "output_tokens": tokens_out,
        "spec_proposed": rec.spec_proposed, "spec_accepted": rec.spec_accepted,
        "neurons": neurons, "cost_usd": cost, "latency_ms_sum": rec.latency_ms,
        "ttft_ms_sum": rec.ttft_ms or 0.0, "ttft_count": 1 if rec.ttft_ms is not None else 0,
        **histogram.deltas(rec.latency_ms, rec.ttft_ms),
    }
    return event, deltas


def _add(into: dict[Any, dict[str, Any]], key: Any, deltas: dict[str, Any]) -> None:
    summed = into.get(key)
    if summed is None:
        into[key] = dict(deltas)
        return
    for name, value in deltas.items():
        summed[name] = summed.get(name, 0) + value


def neurons_used_on(account_id: str, day) -> Decimal:
    total = UsageDay.objects.filter(account_id=account_id, day=day).aggregate(n=Sum("neurons"))["n"]
    return Decimal(total or 0)


def cost_in_month(account_id: str, now: datetime) -> Decimal:
    utc = now.astimezone(UTC)
    first = utc.date().replace(day=1)
    total = UsageDay.objects.filter(account_id=account_id, day__gte=first).aggregate(c=Sum("cost_usd"))["c"]
    return Decimal(total or 0)


def seconds_to_utc_midnight(now: datetime) -> float:
    utc = now.astimezone(UTC)
    midnight = datetime.combine(utc.date() + timedelta(days=1), datetime.min.time(), tzinfo=UTC)
    return (midnight - utc).total_seconds()


def check_account_limits(ctx: KeyContext, now: datetime | None = None) -> None:
    """Refuse (429 / 3036) once a free account used its daily allocation or any account hit its hard budget."""
    now = now or timezone.now()
    if not ctx.paid_plan:
        used = neurons_used_on(ctx.account_id, now.astimezone(UTC).date())
        if used >= ctx.free_neurons_per_day:
            raise errors.account_limited(
                f"You have used up your daily free allocation of {ctx.free_neurons_per_day:,} neurons; it resets "
                "at 00:00 UTC. Upgrade the account to a paid plan to continue.",
                seconds_to_utc_midnight(now))
    if ctx.monthly_budget_usd is not None:
        spent = cost_in_month(ctx.account_id, now)
        if spent >= ctx.monthly_budget_usd:
            utc = now.astimezone(UTC)
            next_month = (utc.replace(day=28) + timedelta(days=4)).replace(
                day=1, hour=0, minute=0, second=0, microsecond=0)
            raise errors.account_limited(
                f"The account's hard budget of ${ctx.monthly_budget_usd} for this month is used up "
                f"(${spent:.4f} spent).", (next_month - utc).total_seconds())
