"""SamplingParams: every bad value is refused up front with an InvalidRequestError that names its field."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest

from inference.errors import InvalidRequestError
from inference.sampling_params import MAX_LOGPROBS, MAX_STOP_STRINGS, SamplingParams

NAN = math.nan
INF = math.inf

INVALID: list[tuple[str, Any]] = [
    *[("max_tokens", v) for v in (0, -1, 1.5, True, "10", None)],
    *[("temperature", v) for v in (-0.1, 5.01, NAN, INF, -INF, "1", None, True)],
    *[("top_p", v) for v in (0, 0.0, -0.1, 1.01, NAN, INF, "0.5", None, False)],
    *[("top_k", v) for v in (-2, -100, 1.5, 2.0, True, "5", None)],
    *[("min_p", v) for v in (-0.01, 1.01, NAN, INF, "0.1", None)],
    *[("seed", v) for v in (-1, 2**63, 1.5, True, "1")],
    *[("repetition_penalty", v) for v in (0, 0.0, -1.0, 2.01, NAN, INF, "1.1", None)],
    *[("frequency_penalty", v) for v in (-2.01, 2.01, NAN, -INF, "0", None)],
    *[("presence_penalty", v) for v in (-2.01, 2.01, NAN, INF, "0", None)],
    *[("stop", v) for v in ([""], "", [1], [None], ["ok", b"bytes"], ["s"] * (MAX_STOP_STRINGS + 1))],
    *[("stop_token_ids", v) for v in ([-1], [1.5], [True], ["1"], [None])],
    *[("logprobs", v) for v in (-1, MAX_LOGPROBS + 1, 1.5, True, "3")],
]


@pytest.mark.parametrize(("field", "value"), INVALID, ids=[f"{f}={v!r}"[:40] for f, v in INVALID])
def test_invalid_value_is_refused_naming_its_field(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value})
    # \b: "stop" must not be satisfied by a message about "stop_token_ids".
    assert re.search(rf"\b{field}\b", str(info.value)), str(info.value)


def test_invalid_request_error_is_a_value_error() -> None:
    # Callers that only know ValueError (argument parsing, pydantic-ish glue) still catch it.
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)


VALID_EDGES: list[tuple[str, Any]] = [
    ("max_tokens", 1), ("temperature", 0), ("temperature", 5), ("temperature", 0.0), ("top_p", 1e-9),
    ("top_p", 1), ("top_k", 0), ("top_k", 1), ("min_p", 0), ("min_p", 1), ("seed", 0), ("seed", 2**63 - 1),
    ("repetition_penalty", 2), ("repetition_penalty", 1e-6), ("frequency_penalty", -2), ("frequency_penalty", 2),
    ("presence_penalty", -2), ("presence_penalty", 2), ("logprobs", 0), ("logprobs", MAX_LOGPROBS),
    ("stop", ["s"] * MAX_STOP_STRINGS), ("stop_token_ids", [0, 5]),
]


@pytest.mark.parametrize(("field", "value"), VALID_EDGES, ids=[f"{f}={v!r}"[:40] for f, v in VALID_EDGES])
def test_boundary_values_are_accepted(field: str, value: Any) -> None:
    assert getattr(SamplingParams(**{field: value}), field) == value


def test_normalisation() -> None:
    assert SamplingParams(top_k=-1).top_k == 0  # -1 is the other common spelling of "off"
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop=None).stop == []  # type: ignore[arg-type]
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []  # type: ignore[arg-type]
    assert SamplingParams(stop_token_ids=(7, 8)).stop_token_ids == [7, 8]


def test_defaults_sample_plainly() -> None:
    params = SamplingParams()
    assert not params.greedy and not params.needs_penalties
    assert params.top_k == 0 and params.top_p == 1.0 and params.min_p == 0.0 and params.logprobs is None


@pytest.mark.parametrize(("kwargs", "greedy", "penalties"), [
    ({"temperature": 0.0}, True, False),
    ({"temperature": 1e-3}, False, False),
    ({"repetition_penalty": 1.1}, False, True),
    ({"frequency_penalty": -0.1}, False, True),
    ({"presence_penalty": 0.1, "temperature": 0}, True, True),
])
def test_greedy_and_needs_penalties(kwargs: dict[str, Any], greedy: bool, penalties: bool) -> None:
    params = SamplingParams(**kwargs)
    assert params.greedy is greedy
    assert params.needs_penalties is penalties


# Gaps in SamplingParams' validation found while writing these tests; strict, so fixing one flags the
# marker for removal.
@pytest.mark.parametrize(("field", "value"), [
    ("stop", 123), ("stop_token_ids", 5), ("ignore_eos", "yes"), ("skip_special_tokens", None),
    ("include_stop_str_in_output", 1),
])
def test_wrong_types_are_rejected_by_name(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequestError, match=rf"\b{field}\b"):
        SamplingParams(**{field: value})
