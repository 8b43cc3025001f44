"""The engine's errors cross processes as themselves: a fleet replica's refusal is pickled to the control plane,
which answers with the error's own status and figures."""

from __future__ import annotations

import pickle

import pytest

from inference import errors

ALL = [errors.EngineError("x"), errors.InvalidRequestError("bad temperature"),
       errors.PromptTooLongError("the prompt has 9000 tokens but at most 8191 fit", prompt_tokens=9000, limit=8191),
       errors.ModelNotFoundError("no such model"), errors.EngineOverloadedError("queue full"),
       errors.EngineDeadError("stopped"), errors.EngineLostError("the replica died")]


@pytest.mark.parametrize("error", ALL, ids=lambda e: type(e).__name__)
def test_every_engine_error_survives_pickling_with_its_fields(error: errors.EngineError) -> None:
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and str(back) == str(error) and vars(back) == vars(error)
    if isinstance(error, errors.PromptTooLongError):
        assert (back.prompt_tokens, back.limit) == (9000, 8191)
