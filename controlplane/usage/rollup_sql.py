"""Summing rollup rows in one SQL statement built once per shape.

A report sums about eighty columns (counts, tokens, money, and the latency and TTFT histograms). Through the ORM
each query spends several times its database time resolving eighty Sum() expressions, so a usage page paid for
Python, not for data. Here the statement is text cached per shape (table, grouping, filters present, columns),
and only the values change between calls. Same SQL on SQLite and PostgreSQL.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from datetime import UTC, date, datetime
from typing import Any

from django.db import connection
from django.db.models import Model
from django.utils.dateparse import parse_date, parse_datetime

_INTEGER_TYPES = {"IntegerField", "BigIntegerField", "PositiveIntegerField", "PositiveBigIntegerField",
                  "SmallIntegerField", "PositiveSmallIntegerField"}


@functools.cache
def _sql(model: type[Model], time_field: str, group: tuple[str, ...], n_models: int, by_key: bool,
         sums: tuple[str, ...]) -> str:
    meta = model._meta
    quote = connection.ops.quote_name

    def col(name: str) -> str:
        return quote(meta.get_field(name).column)

    selected = [f"{col(g)} AS {quote(g)}" for g in group]
    selected += [f"SUM({col(name)}) AS {quote(name)}" for name in sums]
    where = [f"{col('account')} = %s", f"{col(time_field)} >= %s", f"{col(time_field)} < %s"]
    if n_models:
        where.append(f"{col('model')} IN ({', '.join(['%s'] * n_models)})")
    if by_key:
        where.append(f"{col('key_id')} = %s")
    sql = f"SELECT {', '.join(selected)} FROM {quote(meta.db_table)} WHERE {' AND '.join(where)}"
    if group:
        grouped = ", ".join(col(g) for g in group)
        sql += f" GROUP BY {grouped} ORDER BY {grouped}"
    return sql


def _time_value(value: Any) -> Any:
    """SQLite hands dates and times back as text; PostgreSQL as objects. Either way: aware UTC / date."""
    if isinstance(value, str):
        value = parse_datetime(value) if len(value) > 10 else parse_date(value)
    if isinstance(value, datetime) and value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value


def sum_rollups(model: type[Model], time_field: str, account_id: str, start: date | datetime,
                end: date | datetime, *, sums: Sequence[str], group: Sequence[str] = (),
                models: Sequence[str] = (), key_id: str | None = None) -> list[dict[str, Any]]:
    """Rows of `model` for the account with start <= time < end (optionally these models, this key), summed per
    `group` (field names; none: one row of totals). Sums of no rows are None, as SQL has them."""
    field = model._meta.get_field(time_field)
    params: list[Any] = [account_id, field.get_db_prep_value(start, connection),
                         field.get_db_prep_value(end, connection), *models]
    if key_id is not None:
        params.append(key_id)
    sql = _sql(model, time_field, tuple(group), len(models), key_id is not None, tuple(sums))
    names = (*group, *sums)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        rows = [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]
    # PostgreSQL sums a bigint column as numeric: counts come back as Decimal and must be ints again.
    counts = [name for name in sums if model._meta.get_field(name).get_internal_type() in _INTEGER_TYPES]
    for row in rows:
        for name in counts:
            if row[name] is not None:
                row[name] = int(row[name])
    if time_field in group:
        for row in rows:
            row[time_field] = _time_value(row[time_field])
    return rows
