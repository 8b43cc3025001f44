"""The statements every batch item runs, its claim, the read of what it took, and its result (with its batch's
count), as SQL built once per process.

The embedded worker shares its process, and so the interpreter lock and the cores, with the engine whose steps
it feeds: each millisecond an item's bookkeeping spends in Python is taken from the engine's steps (measured: a
batch's throughput against the engine alone fell with it). Through the ORM, compiling the claim's conditional
UPDATE alone took ~1.5 ms of CPU on an AVX2 EPYC core, running it 0.03 ms; the result's UPDATE and the batch
counter's (with the read of the counts after it) cost about as much again. These are the same statements the
ORM wrote, with the same conditions on the row itself (PostgreSQL re-checks those after waiting for a row lock,
not conditions inside a subquery), for SQLite and PostgreSQL alike; values go through each field's own
conversion, so both backends store what the ORM would.
"""

from __future__ import annotations

import functools
from datetime import datetime
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connection, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import Field, Model
from django.db.models.expressions import Col

from controlplane.batches.models import Batch, Item

# The counts a finished item changes, and what the worker reads back after changing one of them.
COUNTERS = ("completed_count", "failed_count", "cancelled_count")
_READ_BACK = ("status", "total_count", "dispatched_count", *COUNTERS)


def _column(model: type[Model], name: str) -> str:
    return connection.ops.quote_name(model._meta.get_field(name).column)


def _table(model: type[Model]) -> str:
    return connection.ops.quote_name(model._meta.db_table)


def _prep(model: type[Model], name: str, value: Any) -> Any:
    field: Field = model._meta.get_field(name)  # type: ignore[assignment]
    return field.get_db_prep_save(value, connection)


@functools.cache
def _claim_sql() -> str:
    c = functools.partial(_column, Item)
    b = functools.partial(_column, Batch)
    terminal = ", ".join(["%s"] * len(Batch.TERMINAL))
    return (f"UPDATE {_table(Item)} SET {c('status')} = %s, {c('claim_token')} = %s, {c('lease_until')} = %s, "
            f"{c('attempts')} = {c('attempts')} + 1, {c('started_at')} = COALESCE({c('started_at')}, %s) "
            f"WHERE {c('id')} = %s AND {c('attempts')} < %s "
            f"AND ({c('status')} = %s OR ({c('status')} = %s AND {c('lease_until')} <= %s)) "
            f"AND {c('batch')} IN (SELECT {b('id')} FROM {_table(Batch)} WHERE {b('cancelling_at')} IS NULL "
            f"AND {b('expired_at')} IS NULL AND NOT ({b('status')} IN ({terminal})))")


def take(item_id: int, token: str, now: datetime, lease_until: datetime, max_attempts: int) -> bool:
    """Mark the item running under this claim: a queued item, or a running one whose lease ran out, with
    attempts left, of a batch still running. False when it took nothing."""
    running, queued = Item.Status.RUNNING, Item.Status.QUEUED
    at, until = _prep(Item, "started_at", now), _prep(Item, "lease_until", lease_until)
    params = [running, token, until, at, item_id, max_attempts, queued, running, at, *sorted(Batch.TERMINAL)]
    with connection.cursor() as cursor:
        cursor.execute(_claim_sql(), params)
        return cursor.rowcount > 0


@functools.cache
def _columns(model: type[Model]) -> tuple[Col, ...]:
    """Every stored field of the model, in the order Model.from_db takes them."""
    table = model._meta.db_table
    return tuple(field.get_col(table) for field in model._meta.concrete_fields)


@functools.cache
def _read_sql() -> str:
    def names(model: type[Model]) -> str:
        return ", ".join(f"{_table(model)}.{connection.ops.quote_name(col.target.column)}"
                         for col in _columns(model))

    return (f"SELECT {names(Item)}, {names(Batch)} FROM {_table(Item)} INNER JOIN {_table(Batch)} "
            f"ON {_table(Item)}.{_column(Item, 'batch')} = {_table(Batch)}.{_column(Batch, 'id')} "
            f"WHERE {_table(Item)}.{_column(Item, 'id')} = %s")


def _instance(db: BaseDatabaseWrapper, model: type[Model], values: tuple[Any, ...]) -> Model:
    """A model instance from its columns as the database returned them, through the converters the ORM applies
    (the backend's, e.g. SQLite's text datetimes, then the field's own, e.g. JSON). db: this thread's connection
    itself, not the `connection` proxy, which looks the thread's up again at every attribute."""
    converted = []
    for col, value in zip(_columns(model), values, strict=True):
        for convert in (*db.ops.get_db_converters(col), *col.get_db_converters(db)):
            value = convert(value, col, db)
        converted.append(value)
    return model.from_db(db.alias, [f.attname for f in model._meta.concrete_fields], converted)


def read(item_id: int) -> Item | None:
    """The item with its batch, what `Item.objects.select_related("batch").get(pk=item_id)` returns (None where
    it does not exist): the read right after a claim, whose query the ORM compiled anew each time (about as
    much CPU as the claim's UPDATE did)."""
    db = connections[DEFAULT_DB_ALIAS]
    with db.cursor() as cursor:
        cursor.execute(_read_sql(), [item_id])
        row = cursor.fetchone()
    if row is None:
        return None
    split = len(Item._meta.concrete_fields)
    item = _instance(db, Item, row[:split])
    item.batch = _instance(db, Batch, row[split:])  # type: ignore[attr-defined]
    return item  # type: ignore[return-value]


_RESULT_FIELDS = ("status", "response", "error", "finished_at", "lease_until", "input_tokens",
                  "cached_input_tokens", "output_tokens")


@functools.cache
def _result_sql() -> str:
    c = functools.partial(_column, Item)
    sets = ", ".join(f"{c(name)} = %s" for name in _RESULT_FIELDS)
    return (f"UPDATE {_table(Item)} SET {sets} "
            f"WHERE {c('id')} = %s AND {c('status')} = %s AND {c('claim_token')} = %s")


def store_result(item_id: int, token: str, values: dict[str, Any]) -> bool:
    """Write an item's outcome (values: every name of _RESULT_FIELDS) while this claim still holds it."""
    params = [_prep(Item, name, values[name]) for name in _RESULT_FIELDS]
    with connection.cursor() as cursor:
        cursor.execute(_result_sql(), [*params, item_id, Item.Status.RUNNING, token])
        return cursor.rowcount > 0


@functools.cache
def _count_sql(counter: str) -> str:
    c = functools.partial(_column, Batch)
    return (f"UPDATE {_table(Batch)} SET {c(counter)} = {c(counter)} + 1 WHERE {c('id')} = %s "
            f"RETURNING {', '.join(map(c, _READ_BACK))}")


def count_finished(batch: Batch, counter: str) -> None:
    """Add one to the batch's counter and refresh `batch`'s status and counts from the row as written (under
    the row lock the update took, so the last of several finishers sees every count)."""
    if counter not in COUNTERS:
        raise ValueError(f"not a batch item counter: {counter}")
    with connection.cursor() as cursor:
        cursor.execute(_count_sql(counter), [batch.pk])
        row = cursor.fetchone()
    if row is None:
        raise Batch.DoesNotExist(batch.pk)
    for name, value in zip(_READ_BACK, row, strict=True):
        setattr(batch, name, value)
