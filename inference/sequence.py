"""A request's state inside the engine."""

from __future__ import annotations

import itertools
import time
import uuid
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from typing import TYPE_CHECKING

import torch

from inference.block_manager import SeqBlocks
from inference.compression.compressor import CompressionState
from inference.compression.settings import KVCompressionSettings
from inference.constrained.constraint import Constraint
from inference.errors import InvalidRequestError
from inference.lora.slots import HostAdapter, LoRARequest
from inference.outputs import FinishReason, RequestMetrics
from inference.sampling_params import SamplingParams
from inference.spec.settings import SpecStats, SpeculationSettings

if TYPE_CHECKING:
    from inference.constrained.state import GrammarState


class Priority(IntEnum):
    """Lower value is served first. Interactive traffic always goes before batch work."""

    INTERACTIVE = 0
    BATCH = 1


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class GenerationRequest:
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str | None = None
    priority: Priority = Priority.INTERACTIVE
    extra_keys: tuple = ()  # mixed into prefix-cache keys (adapter id, cache salt, ...)
    speculation: SpeculationSettings | None = None  # None: the engine's default
    kv_compression: KVCompressionSettings | None = None  # None: the model's default
    lora: LoRARequest | None = None  # None: the base model
    # The first output tokens, given instead of sampled (with params.logprobs, each position still reports the
    # model's own top choices): scores a known continuation, e.g. against a full-cache reference. Sampling
    # resumes after them.
    forced_output: list[int] | None = None
    # The grammar the output must match (JSON schema, regex, tool calls, ...); None: free text.
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        if self.request_id is None:
            self.request_id = uuid.uuid4().hex
        if not isinstance(self.params, SamplingParams):
            raise InvalidRequestError("params must be a SamplingParams")
        ids = self.prompt_token_ids
        if not isinstance(ids, list | tuple) or not ids:
            raise InvalidRequestError("the prompt is empty")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidRequestError("prompt_token_ids must be integers")
        self.prompt_token_ids = list(ids)
        if self.forced_output is not None:
            forced = self.forced_output
            if not isinstance(forced, list | tuple) or not all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in forced):
                raise InvalidRequestError("forced_output must be a list of token ids")
            self.forced_output = list(forced) or None
        self.priority = Priority(self.priority)
        if self.speculation is not None and not isinstance(self.speculation, SpeculationSettings):
            raise InvalidRequestError("speculation must be a SpeculationSettings")
        if self.kv_compression is not None:
            self.kv_compression = KVCompressionSettings.parse(self.kv_compression)
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise InvalidRequestError("constraint must be a Constraint")
        if self.lora is not None:
            if not isinstance(self.lora, LoRARequest):
                raise InvalidRequestError("lora must be a LoRARequest")
            # KV computed under an adapter is that adapter's: it must never be shared with other requests.
            self.extra_keys = (*self.extra_keys, ("lora", self.lora.name))


_arrival_counter = itertools.count()


@dataclass(slots=True, eq=False)
class Sequence:
    request: GenerationRequest
    blocks: SeqBlocks
    generator: torch.Generator | None
    detokenizer: object  # IncrementalDetokenizer
    stop_matcher: object  # StopStringMatcher
    output_token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V is in the cache
    cached_prompt_tokens: int | None = None  # prefix-cache hit at first scheduling (usage)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    text: str = ""  # emitted text so far
    emitted_tokens: int = 0  # output tokens already reported
    logprobs: list = field(default_factory=list)  # TokenLogprob per output token, when requested
    draft: list[int] = field(default_factory=list)  # proposed tokens to verify this step
    draft_probs: torch.Tensor | None = None  # the drafter's distribution per draft token (None: deterministic)
    # The draft is the grammar's only continuation (jump-forward), not a drafter's guess: verified like any
    # draft, counted apart from speculation (it neither feeds nor pauses the drafter's adaptive control).
    draft_forced: bool = False
    spec_stats: SpecStats = field(default_factory=SpecStats)
    compression: CompressionState | None = None  # KV compression target and scores, when on
    lora: HostAdapter | None = None  # the adapter's checked weights, when the request names one
    lora_slot: int | None = None  # the adapter slot pinned while the sequence runs
    grammar: GrammarState | None = None  # the constraint's matcher over the accepted output, when constrained
    order: int = field(default_factory=lambda: next(_arrival_counter))
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=time.monotonic()))

    @property
    def request_id(self) -> str:
        return self.request.request_id  # type: ignore[return-value]

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def priority(self) -> Priority:
        return self.request.priority

    @property
    def sort_key(self) -> tuple[int, int]:
        return (int(self.request.priority), self.order)

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + len(self.output_token_ids)

    def token_ids(self) -> list[int]:
        return self.request.prompt_token_ids + self.output_token_ids

    def token_at(self, index: int) -> int:
        """token_ids()[index], without building the list."""
        prompt = self.request.prompt_token_ids
        return prompt[index] if index < len(prompt) else self.output_token_ids[index - len(prompt)]

    @property
    def next_forced(self) -> int | None:
        """The token the next output position must take, when the request gives it."""
        forced = self.request.forced_output
        done = len(self.output_token_ids)
        return forced[done] if forced is not None and done < len(forced) else None

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def final_chunk_min(self) -> int:
        """The fewest tokens the prompt's last chunk may have: the compression observation window, or 1."""
        return self.compression.observe_window if self.compression is not None else 1

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
