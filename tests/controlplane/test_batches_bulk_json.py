"""A batch item's answer (Item.response) is written and read by orjson (controlplane/batches/fields.py): what is
stored reads back exactly as json's writing would, through the ORM, the worker's own SQL and the output file."""

from __future__ import annotations

import json
import math
import random

import pytest
from cp_support import CHAT_MODEL
from django.db import connection

from controlplane.accounts.services import authenticate_key
from controlplane.batches import item_services, item_sql, services
from controlplane.batches.item_services import Outcome
from controlplane.batches.models import Item
from controlplane.batches.results import output_lines

pytestmark = pytest.mark.django_db


def answer(rng: random.Random, rows: int) -> dict:
    vectors = [[rng.gauss(0.0, 0.05) for _ in range(384)] for _ in range(rows)]
    vectors[0][:5] = [0.0, -0.0, 5e-324, 1.7976931348623157e308, rng.uniform(-1e-300, 1e-300)]
    return {"object": "list", "model": "@hearth/all-minilm-l6-v2", "note": "«modèle» — 移行 \u2603 \"q\" \\ \n",
            "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": rows * 8, "total_tokens": rows * 8, "big": 2**62, "none": None,
                      "flags": [True, False], "nested": {"a": [[], {}]}}}


def items(tenant, count: int) -> list[Item]:
    batch = services.create_native_batch(authenticate_key(tenant.secret), CHAT_MODEL, [
        (f"r{i}", {"prompt": "Say hi.", "max_tokens": 2}) for i in range(count)])
    return list(Item.objects.filter(batch=batch).order_by("index"))


def test_an_answer_reads_back_exactly_through_every_path(tenant):
    rng = random.Random()
    first, second, third = items(tenant, 3)
    big, small = answer(rng, 2048), answer(rng, 3)
    claim = item_services.claim(first.pk).claim
    assert item_services.finish(claim, Outcome(Item.Status.SUCCEEDED, response=big))  # the worker's SQL
    second.response = small
    second.save(update_fields=["response"])  # the ORM's save
    stored = Item.objects.get(pk=first.pk)
    assert stored.response == big and json.loads(json.dumps(big)) == big
    assert Item.objects.get(pk=second.pk).response == small
    assert item_sql.read([first.pk])[0].response == big
    # The output file's line carries the answer as it was, every float bit for bit.
    [line] = output_lines([stored])
    assert json.loads(line)["response"]["body"] == big and line.endswith(b"\n") and b"\n" not in line[:-1]
    # No answer is SQL NULL (not JSON null), as the plain JSONField stores it; lookups inside the JSON still work.
    assert Item.objects.filter(pk=third.pk, response__isnull=True).exists()
    assert Item.objects.filter(pk=second.pk, response__usage__total_tokens=24).exists()


def test_rows_written_by_json_before_read_back_and_non_finite_floats_become_null(tenant):
    old, odd = items(tenant, 2)
    value = {"response": "hi", "scores": [0.1, 1e-7, 12345678.9], "t": "\u00e9\u4e2d"}
    text = json.dumps(value)  # what the plain JSONField wrote: spaces after separators, \\u escapes
    cast = "::jsonb" if connection.vendor == "postgresql" else ""
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {Item._meta.db_table} SET response = %s{cast} WHERE id = %s", [text, old.pk])
    assert Item.objects.get(pk=old.pk).response == value
    # json writes NaN, which neither database takes as JSON (SQLite's JSON_VALID check, PostgreSQL's jsonb): such
    # an answer could not be stored at all. orjson writes null.
    odd.response = {"x": [math.nan, math.inf, 1.5]}
    odd.save(update_fields=["response"])
    assert Item.objects.get(pk=odd.pk).response == {"x": [None, None, 1.5]}


def test_an_integer_past_64_bits_is_stored_through_json(tenant):
    [item] = items(tenant, 1)
    item.response = {"n": 2**70, "v": [1.5, -(2**65)]}
    item.save(update_fields=["response"])
    assert Item.objects.get(pk=item.pk).response == {"n": 2**70, "v": [1.5, -(2**65)]}
