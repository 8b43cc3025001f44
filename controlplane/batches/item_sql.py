"""The statements every batch item runs, its claim, the read of what it took, and its result (with its batch's
counts), as SQL built once per process (once per run length for the statements that take a run of items).

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

# The counts a finished item changes, and what the worker reads back after changing them (whether the batch is
# being stopped too: the rest of a run stops then, not at its next lease renewal).
COUNTERS = ("completed_count", "failed_count", "cancelled_count")
_READ_BACK = ("status", "total_count", "dispatched_count", *COUNTERS, "cancelling_at", "expired_at")


def _column(model: type[Model], name: str) -> str:
    return connection.ops.quote_name(model._meta.get_field(name).column)


def _table(model: type[Model]) -> str:
    return connection.ops.quote_name(model._meta.db_table)


def _prep(model: type[Model], name: str, value: Any) -> Any:
    field: Field = model._meta.get_field(name)  # type: ignore[assignment]
    return field.get_db_prep_save(value, connection)


@functools.lru_cache(maxsize=64)  # one per run length
def _claim_sql(count: int) -> str:
    c = functools.partial(_column, Item)
    b = functools.partial(_column, Batch)
    terminal = ", ".join(["%s"] * len(Batch.TERMINAL))
    ids = ", ".join(["%s"] * count)
    return (f"UPDATE {_table(Item)} SET {c('status')} = %s, {c('claim_token')} = %s, {c('lease_until')} = %s, "
            f"{c('attempts')} = {c('attempts')} + 1, {c('started_at')} = COALESCE({c('started_at')}, %s) "
            f"WHERE {c('id')} IN ({ids}) AND {c('attempts')} < %s "
            f"AND ({c('status')} = %s OR ({c('status')} = %s AND {c('lease_until')} <= %s)) "
            f"AND {c('batch')} IN (SELECT {b('id')} FROM {_table(Batch)} WHERE {b('cancelling_at')} IS NULL "
            f"AND {b('expired_at')} IS NULL AND NOT ({b('status')} IN ({terminal}))) "
            f"RETURNING {c('id')}")


def take(item_ids: list[int], token: str, now: datetime, lease_until: datetime, max_attempts: int) -> list[int]:
    """Mark the items running under this claim, each that is queued, or running with its lease run out, with
    attempts left, of a batch still running: one statement for a run of items. Returns the ids it took. Every
    condition is on the item's own row, so PostgreSQL re-checks each after waiting for that row's lock."""
    if not item_ids:
        return []
    running, queued = Item.Status.RUNNING, Item.Status.QUEUED
    at, until = _prep(Item, "started_at", now), _prep(Item, "lease_until", lease_until)
    params = [running, token, until, at, *item_ids, max_attempts, queued, running, at, *sorted(Batch.TERMINAL)]
    with connection.cursor() as cursor:
        cursor.execute(_claim_sql(len(item_ids)), params)
        return sorted(row[0] for row in cursor.fetchall())


@functools.cache
def _columns(model: type[Model]) -> tuple[Col, ...]:
    """Every stored field of the model, in the order Model.from_db takes them."""
    table = model._meta.db_table
    return tuple(field.get_col(table) for field in model._meta.concrete_fields)


@functools.cache
def _named_columns(model: type[Model]) -> dict[str, Col]:
    return {col.target.name: col for col in _columns(model)}


@functools.lru_cache(maxsize=64)
def _read_sql(count: int) -> str:
    def names(model: type[Model]) -> str:
        return ", ".join(f"{_table(model)}.{connection.ops.quote_name(col.target.column)}"
                         for col in _columns(model))

    return (f"SELECT {names(Item)}, {names(Batch)} FROM {_table(Item)} INNER JOIN {_table(Batch)} "
            f"ON {_table(Item)}.{_column(Item, 'batch')} = {_table(Batch)}.{_column(Batch, 'id')} "
            f"WHERE {_table(Item)}.{_column(Item, 'id')} IN ({', '.join(['%s'] * count)}) "
            f"ORDER BY {_table(Item)}.{_column(Item, 'id')}")


def _instance(db: BaseDatabaseWrapper, model: type[Model], values: tuple[Any, ...]) -> Model:
    """A model instance from its columns as the database returned them, through the converters the ORM applies
    (the backend's, e.g. SQLite's text datetimes, then the field's own, e.g. JSON). db: this thread's connection
    itself, not the `connection` proxy, which looks the thread's up again at every attribute."""
    converted = [_convert(db, col, value) for col, value in zip(_columns(model), values, strict=True)]
    return model.from_db(db.alias, [f.attname for f in model._meta.concrete_fields], converted)


def _convert(db: BaseDatabaseWrapper, col: Col, value: Any) -> Any:
    for convert in (*db.ops.get_db_converters(col), *col.get_db_converters(db)):
        value = convert(value, col, db)
    return value


def read(item_ids: list[int]) -> list[Item]:
    """The items that exist, by id, each with its batch joined, as `Item.objects.select_related("batch")`
    returns them (the read right after a claim, whose query the ORM compiled anew each time: about as much CPU
    as the claim's UPDATE). Items of one batch share one Batch instance, so counting one item's result
    refreshes the counts every item of the run sees."""
    if not item_ids:
        return []
    db = connections[DEFAULT_DB_ALIAS]
    with db.cursor() as cursor:
        cursor.execute(_read_sql(len(item_ids)), list(item_ids))
        rows = cursor.fetchall()
    split = len(Item._meta.concrete_fields)
    batches: dict[Any, Batch] = {}
    items = []
    for row in rows:
        item = _instance(db, Item, row[:split])
        batch = batches.get(item.batch_id)  # type: ignore[attr-defined]
        if batch is None:
            batch = batches[item.batch_id] = _instance(db, Batch, row[split:])  # type: ignore[attr-defined, assignment]
        item.batch = batch  # type: ignore[attr-defined]
        items.append(item)
    return items  # type: ignore[return-value]


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
def _count_sql() -> str:
    c = functools.partial(_column, Batch)
    adds = ", ".join(f"{c(name)} = {c(name)} + %s" for name in COUNTERS)
    return f"UPDATE {_table(Batch)} SET {adds} WHERE {c('id')} = %s RETURNING {', '.join(map(c, _READ_BACK))}"


def count_finished(batch: Batch, added: dict[str, int]) -> None:
    """Add to the batch's counters (added: counter name -> items finished) and refresh `batch`'s status and
    counts from the row as written (under the row lock the update took, so the last of several finishers sees
    every count)."""
    unknown = set(added) - set(COUNTERS)
    if unknown:
        raise ValueError(f"not a batch item counter: {', '.join(sorted(unknown))}")
    db = connections[DEFAULT_DB_ALIAS]
    with db.cursor() as cursor:
        cursor.execute(_count_sql(), [*(added.get(name, 0) for name in COUNTERS), batch.pk])
        row = cursor.fetchone()
    if row is None:
        raise Batch.DoesNotExist(batch.pk)
    columns = _named_columns(Batch)
    for name, value in zip(_READ_BACK, row, strict=True):
        setattr(batch, name, _convert(db, columns[name], value))
