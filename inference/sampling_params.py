"""Per-request sampling settings, validated at construction so a bad value never reaches the batch."""

from __future__ import annotations

from dataclasses import dataclass, field

from inference.errors import InvalidRequestError

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 1024
MAX_TOKENS = 1_000_000  # far beyond any context window; the engine clamps to the real limit


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(slots=True)
class SamplingParams:
    """How one request samples. Every combination may share a batch with every other.

    temperature 0 means greedy; top_k 0 (or -1) and top_p 1 and min_p 0 switch those filters off.
    repetition_penalty follows the CTRL/transformers rule over prompt and output tokens;
    frequency_penalty and presence_penalty follow OpenAI's rule over output tokens only.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; N: the chosen token's logprob plus the top N alternatives
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(self.stop is None or isinstance(self.stop, list | tuple), "stop must be a string or a list of strings")
        _check(self.stop_token_ids is None or isinstance(self.stop_token_ids, list | tuple),
               "stop_token_ids must be a list of integers")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        for flag in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            _check(isinstance(getattr(self, flag), bool), f"{flag} must be true or false")
        _check(isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool),
               "max_tokens must be an integer")
        _check(1 <= self.max_tokens <= MAX_TOKENS, f"max_tokens must be in [1, {MAX_TOKENS}], got {self.max_tokens}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "frequency_penalty", "presence_penalty"):
            _check(_is_number(getattr(self, name)), f"{name} must be a number")
        _check(0.0 <= self.temperature <= 5.0, f"temperature must be in [0, 5], got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(isinstance(self.top_k, int) and not isinstance(self.top_k, bool), "top_k must be an integer")
        _check(self.top_k >= -1, f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        if self.top_k == -1:
            self.top_k = 0
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _check(0.0 < self.repetition_penalty <= 2.0,
               f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0,
               f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        _check(-2.0 <= self.presence_penalty <= 2.0,
               f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if self.seed is not None:
            _check(isinstance(self.seed, int) and not isinstance(self.seed, bool), "seed must be an integer")
            _check(0 <= self.seed < 2**63, f"seed must be in [0, 2^63), got {self.seed}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings")
        _check(all(len(s) <= MAX_STOP_LENGTH for s in self.stop),
               f"each stop string must be at most {MAX_STOP_LENGTH} characters")
        _check(len(self.stop) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings")
        _check(all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids must be non-negative integers")
        if self.logprobs is not None:
            _check(isinstance(self.logprobs, int) and not isinstance(self.logprobs, bool),
                   "logprobs must be an integer")
            _check(0 <= self.logprobs <= MAX_LOGPROBS, f"logprobs must be in [0, {MAX_LOGPROBS}]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)
