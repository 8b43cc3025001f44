"""One job type for every inference API and every path: built once from a parsed body by the API's protocol
module, run at interactive priority (a view, the playground) or batch priority (a batch item), and turned into
a usage record in one place.

A job is what the engine needs to know about a request, in the engine's own terms: prompts (a text or chat
messages, one per prompt of a list), `SamplingParams`, the output budget, `n` choices per prompt, a grammar
constraint, tools, and what the catalog and the account resolved (LoRA adapter, speculation, KV compression).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from controlplane.api import errors
from controlplane.catalog.services import ModelEntry
from inference import LoRARequest, SamplingParams
from inference.compression import KVCompressionSettings
from inference.constrained import Constraint
from inference.errors import InvalidRequestError
from inference.spec.settings import SpeculationSettings
from inference.tools import ToolChoice, ToolSpec

MAX_CHOICES = 8  # n per prompt
MAX_PROMPTS = 16  # prompts in one completions request
MAX_SEQUENCES = 64  # prompts × n: one request never takes more than an engine's sequence slots
MAX_EMBEDDING_INPUTS = 2048  # texts in one embeddings request (OpenAI's limit)


class Work(StrEnum):
    GENERATE = "generate"
    EMBED = "embed"


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt: raw text, text wrapped as a user turn on chat models, or chat messages."""

    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    raw: bool = False


@dataclass(frozen=True, slots=True)
class Tools:
    """The functions a request offers and how the model may use them."""

    specs: tuple[ToolSpec, ...]
    choice: ToolChoice  # auto, required, or one named function ("none" offers no tools at all)
    parallel: bool = True


@dataclass(slots=True)
class Job:
    entry: ModelEntry
    route: str  # the usage route ("openai.chat", "native", "playground", ...)
    body: Any  # the parsed body: the protocol module's renderers read their own fields from it
    work: Work = Work.GENERATE
    prompts: tuple[Prompt, ...] = ()
    params: SamplingParams | None = None  # max_tokens is set per prompt once its length is known
    max_tokens: int | None = None  # asked for; None: default_max_tokens, or all the context leaves
    default_max_tokens: int | None = None
    n: int = 1
    echo: bool = False
    stream: bool = False
    constraint: Constraint | None = None  # what the output must match (JSON schema, tool calls, ...)
    tools: Tools | None = None
    texts: tuple[str, ...] = ()  # embeddings
    reject_if_busy: bool = False  # refuse at once rather than wait for an engine slot (interactive only)
    # Resolved against the catalog and the account at admission (or when a batch item is checked).
    adapter: str = ""  # the LoRA adapter's name, recorded with the usage; "" for the base model
    lora: LoRARequest | None = None
    speculation: SpeculationSettings | None = None
    kv_compression: KVCompressionSettings | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # protocol-specific facts for rendering

    @property
    def model(self) -> str:
        return self.entry.name

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n


def sampling_params(body: Any, *, temperature: float | None = None, logprobs: int | None = None,
                    max_tokens: int | None = None, stop: list[str] | None = None) -> SamplingParams:
    """The engine's SamplingParams from a parsed body; its range checks become 400s. max_tokens is set later,
    once the prompt length is known."""
    kwargs: dict[str, Any] = {}
    for name in ("temperature", "top_p", "top_k", "seed", "repetition_penalty", "frequency_penalty",
                 "presence_penalty"):
        value = getattr(body, name, None)
        if value is not None:
            kwargs[name] = value
    if "temperature" not in kwargs and temperature is not None:
        kwargs["temperature"] = temperature
    stop = stop if stop is not None else getattr(body, "stop", None)
    if stop:
        kwargs["stop"] = [stop] if isinstance(stop, str) else list(stop)
    if logprobs is not None:
        kwargs["logprobs"] = logprobs
    if max_tokens is None:
        max_tokens = getattr(body, "max_tokens", None)
    try:
        return SamplingParams(max_tokens=max_tokens if max_tokens is not None else 1, **kwargs)
    except InvalidRequestError as exc:
        raise errors.invalid(str(exc)) from None


def check_n(n: int | None, prompts: int = 1) -> int:
    """n choices per prompt: 1 to 8, and at most 64 sequences in all."""
    n = 1 if n is None else n
    if not 1 <= n <= MAX_CHOICES:
        raise errors.invalid(f"n: 1 to {MAX_CHOICES} choices per request", "n")
    if n * prompts > MAX_SEQUENCES:
        raise errors.invalid(f"n × prompts is {n * prompts}; at most {MAX_SEQUENCES} sequences per request", "n")
    return n


def schema_constraint(schema: Any, param: str) -> Constraint:
    """A JSON schema from a request as a constraint; a schema that is not even an object is a 400 here, one the
    grammar compiler refuses is a 400 when the job is prepared."""
    if not isinstance(schema, dict):
        raise errors.invalid(f"{param}: a JSON schema object is required", param)
    try:
        return Constraint.json_schema(schema)
    except InvalidRequestError as exc:
        raise errors.invalid(f"{param}: {exc}", param) from None


def check_texts(texts: list[str], param: str) -> tuple[str, ...]:
    """Texts to embed: 1 to MAX_EMBEDDING_INPUTS non-empty strings."""
    if not texts or any(not t.strip() for t in texts):
        raise errors.invalid(f"{param} must be a non-empty string or a non-empty list of them", param)
    if len(texts) > MAX_EMBEDDING_INPUTS:
        raise errors.invalid(f"{param}: {len(texts):,} texts; at most {MAX_EMBEDDING_INPUTS:,} per request", param)
    return tuple(texts)


def output_budget(entry: ModelEntry, prompt_tokens: int, max_tokens: int | None,
                  default_max_tokens: int | None) -> int:
    """max_tokens for a prompt of this length: an explicit value is clamped to what the context leaves; a
    prompt that leaves no room is refused (413 / 3006 natively, context_length_exceeded on /v1)."""
    window = entry.context_window
    room = window - prompt_tokens
    if room < 1:
        raise errors.prompt_too_long(
            f"The prompt is {prompt_tokens:,} tokens; {entry.name} has a context window of {window:,} tokens "
            "(prompt and output together)")
    wanted = max_tokens if max_tokens is not None else default_max_tokens
    return min(wanted, room) if wanted is not None else room
