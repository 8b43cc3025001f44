"""What the engine hands back: per-request outputs (streamed as deltas) and usage."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class FinishReason(StrEnum):
    STOP = "stop"  # EOS, a stop token id, a stop string, or the end of the request's grammar
    LENGTH = "length"  # max_tokens reached (or the context window filled)
    ABORT = "abort"  # aborted by the caller
    ERROR = "error"  # this request failed inside the engine; the others go on


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: list[tuple[int, str, float]] = field(default_factory=list)  # (token_id, token, logprob)


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float = 0.0  # time.monotonic() at submission
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    preemptions: int = 0

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def queue_s(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    def time_per_output_token_s(self, completion_tokens: int) -> float | None:
        if self.first_token_time is None or self.finished_time is None or completion_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (completion_tokens - 1)


@dataclass(slots=True)
class RequestOutput:
    """One step's news for one request: the new text (delta) plus the running totals."""

    request_id: str
    delta_text: str
    delta_token_ids: list[int]
    text: str  # everything generated so far (stop strings removed)
    token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    usage: Usage
    metrics: RequestMetrics
    logprobs: list[TokenLogprob] | None = None  # for the delta tokens, when requested
    all_logprobs: list[TokenLogprob] | None = None  # for every output token so far, when requested
    error: str | None = None  # set when finish_reason is ERROR
    speculation: dict | None = None  # proposed / accepted / acceptance_rate / ... when the request speculated
    kv_compression: dict | None = None  # target, compressions, evicted entries, cached vs uncompressed entries
    constrained: dict | None = None  # jump-forward tokens proposed / accepted, when the request has a constraint
    replica: str | None = None  # which engine replica produced it, when a fleet serves the model
    stop_str: str | None = None  # the stop string that ended it (finish_reason STOP), if one did
