"""What the engine hands back: per-request outputs (streamed as deltas) and usage, and its own gauges (EngineMetrics)."""

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


@dataclass(slots=True)
class EngineMetrics:
    queue_depth: int
    running: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_usage: float
    prefix_cache_hit_rate: float
    prefix_cache_hit_tokens: int
    prompt_tokens_total: int
    generation_tokens_total: int
    requests_finished_total: int
    preemptions_total: int
    ttft_s_avg: float | None
    tpot_s_avg: float | None
    tokens_per_s: float  # generated tokens per second over the last ~10 s
    spec_proposed: int = 0
    spec_accepted: int = 0
    spec_acceptance_rate: float = 0.0
    spec_mean_accepted_length: float = 0.0
    spec_per_position_acceptance: list[float] | None = None
    kv_compressions_total: int = 0
    kv_evicted_entries_total: int = 0
    kv_freed_blocks_total: int = 0
    mid_step_admissions_total: int = 0  # interactive prompts started between the layers of a step in flight
    lora_slots: int = 0  # adapter slots (0: LoRA off)
    lora_resident: list[str] | None = None  # adapters in slots now
    lora_disk_loads_total: int = 0
    lora_slot_loads_total: int = 0
    lora_disk_load_ms_avg: float = 0.0
    grammar_compiles_total: int = 0  # constraints compiled (cache misses), and served from the cache
    grammar_cache_hits_total: int = 0
    grammar_compile_ms_avg: float = 0.0
    jump_forward_proposed: int = 0  # grammar-forced draft tokens, and how many verification kept
    jump_forward_accepted: int = 0
    interactive_waiting: int = 0  # of queue_depth, those of INTERACTIVE priority (BATCH ones queue behind them)
    # Prompt tokens of interactive requests still to compute (their uncached rest): the work a new prompt
    # queues behind, which fleet routers weigh when placing one.
    interactive_prefill_tokens: int = 0
