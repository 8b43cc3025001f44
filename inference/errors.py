"""Errors the engine raises. The control plane maps each to an HTTP status and an API error code."""


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """The request itself is wrong (bad sampling value, empty prompt, ...): a 4xx, never retried."""


class PromptTooLongError(InvalidRequestError):
    """The prompt plus the requested output does not fit the model's context window or the KV cache."""

    def __init__(self, message: str, *, prompt_tokens: int, limit: int) -> None:
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.limit = limit

    def __reduce__(self) -> tuple[object, ...]:
        # Pickled whole, so a fleet replica's refusal reaches the control plane as itself (a 4xx with its
        # figures): by default an exception pickles its message alone and this __init__ then refuses to rebuild.
        return _prompt_too_long, (str(self), self.prompt_tokens, self.limit)


def _prompt_too_long(message: str, prompt_tokens: int, limit: int) -> PromptTooLongError:
    return PromptTooLongError(message, prompt_tokens=prompt_tokens, limit=limit)


class ModelNotFoundError(EngineError, LookupError):
    """No bundled model by that name is installed and no checkpoint directory exists at that path."""


class EngineOverloadedError(EngineError):
    """The engine cannot take more work now (queue full); the caller may retry later."""


class EngineDeadError(EngineError):
    """The engine loop stopped after an internal failure; no further requests are served."""


class EngineLostError(EngineDeadError):
    """The engine serving a request went away mid-request (a fleet replica died and is being replaced): the
    request may be sent again, and lands on a live engine."""


class EngineUnreachableError(EngineLostError):
    """The way to the engine failed, not the engine (a fleet call ended by its transport or by Serve itself): the
    request may or may not have run there, and may be sent again."""


class TokenizerChangedError(EngineLostError):
    """The request's prompt was encoded by a tokenizer that no engine serving its model has any more (a fleet
    redeployed under the same name with another tokenizer while it was on its way): its ids would be read as other
    tokens. Nothing ran; sent again, it is encoded anew."""
