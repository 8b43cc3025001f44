"""A JSON column for answers of thousands of numbers (a batch item's embedding vectors), written and read by orjson.

json's C encoder and decoder hold the interpreter lock for the whole of one call: a 2,048-vector answer took
0.4 s to write on a Zen 4 core, and for that long every other thread of the process stood still, the engine's
step loop and the event loop among them, although a worker thread did the writing (the same stall
`controlplane.api.http.dumps_bulk` removes from interactive answers). orjson writes and reads the same JSON about
ten times faster, and values read back exactly as json's would (every float bit for bit). Unlike json it writes a
non-finite float (NaN, an infinity) as null, which is valid JSON: json's NaN is refused by both databases (SQLite's
JSON_VALID check, PostgreSQL's jsonb), so such an answer could not be stored at all. A value orjson cannot write (an
integer past 64 bits) goes through json (`controlplane.api.http.dumps_bulk`, which writes both).
"""

from __future__ import annotations

import json
from typing import Any

import orjson
from django.db import models
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models.fields.json import KeyTransform

from controlplane.api.http import dumps_bulk


class BulkJSONField(models.JSONField):
    def get_db_prep_value(self, value: Any, connection: BaseDatabaseWrapper, prepared: bool = False) -> Any:
        if not prepared:
            value = self.get_prep_value(value)
        if self.encoder is not None:
            return super().get_db_prep_value(value, connection, prepared=True)
        text = dumps_bulk(value)
        if connection.vendor == "postgresql":
            from psycopg.types.json import Jsonb

            return Jsonb(value, dumps=lambda _: text)  # already written: psycopg takes the bytes
        return text.decode()

    def from_db_value(self, value: Any, expression: Any, connection: BaseDatabaseWrapper) -> Any:
        if value is None or self.decoder is not None or (
                isinstance(expression, KeyTransform) and not isinstance(value, str)):
            return super().from_db_value(value, expression, connection)
        try:
            return orjson.loads(value)
        except orjson.JSONDecodeError:  # what json wrote and orjson does not read (NaN, Infinity), or not JSON
            try:
                return json.loads(value)
            except json.JSONDecodeError:
                return value
