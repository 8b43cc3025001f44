"""The bulk JSON writer (embedding answers) writes what the ordinary one does: every number read back exactly."""

from __future__ import annotations

import json
import random

from controlplane.api.http import dumps, dumps_bulk, envelope


def test_bulk_answers_read_back_as_the_ordinary_json_does() -> None:
    rng = random.Random()
    vectors = [[rng.gauss(0.0, 0.05) for _ in range(384)] for _ in range(2048)]
    vectors[0][:4] = [0.0, -0.0, 1e-45, 3.4028234663852886e38]
    openai_answer = {"object": "list", "model": "@hearth/all-minilm-l6-v2",
                     "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)],
                     "usage": {"prompt_tokens": 16384, "total_tokens": 16384}}
    native_answer = envelope({"shape": [len(vectors), 384], "data": vectors, "pooling": "mean"},
                             messages=["«modèle» retiré le 2027-01-01 — 移行してください"])
    for answer in (openai_answer, native_answer):
        bulk = dumps_bulk(answer)
        # Small numbers may be written in positional rather than exponent notation; each reads back bit for bit.
        assert json.loads(bulk) == json.loads(dumps(answer)) == answer


def test_what_orjson_cannot_write_goes_through_json() -> None:
    from decimal import Decimal

    import pytest

    assert json.loads(dumps_bulk({"n": 2**70, "big": [-(2**65)]})) == {"n": 2**70, "big": [-(2**65)]}
    with pytest.raises(TypeError):  # neither writer takes a Decimal: json's own error
        dumps_bulk({"price": Decimal("1.5")})
