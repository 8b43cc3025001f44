"""Request bodies of the inference APIs, as strict pydantic models: they check types and shapes (and feed the
OpenAPI document); value ranges are checked once, by the engine's SamplingParams."""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
)
from pydantic_core import PydanticCustomError

from controlplane.api import errors


class StrictBody(BaseModel):
    # Strict: "5" is not an integer and 1 is not a boolean. Unknown fields are ignored so newer clients work.
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(StrictBody):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart]


class Speculation(StrictBody):
    mode: str = Field(description="off, ngram (prompt lookup) or draft (the model's draft model).")
    k: int | None = Field(None, description="Most draft tokens per step, 1 to 16; the model's default if absent.")


def _one_speculation_error(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    # A str-or-object union reports a failure once per branch; say once what is wrong and what is accepted.
    try:
        return handler(value)
    except ValidationError as exc:
        accepted = 'give "off", "ngram" or "draft", or {"mode": ..., "k": 1 to 16}'
        details = [f"{'.'.join(str(p) for p in e['loc'][1:])}: {e['msg']}" for e in exc.errors()
                   if isinstance(value, dict) and e["loc"][:1] == ("Speculation",)]
        raise PydanticCustomError("speculation", "{detail}{accepted}",
                                  {"detail": f"{'; '.join(details)}; " if details else "",
                                   "accepted": accepted}) from None


SpeculationField = Annotated[str | Speculation | None, WrapValidator(_one_speculation_error)]


class KVCompression(StrictBody):
    rate: float | None = Field(None, description="Keep 1/rate of the KV cache entries (>= 1; 1 turns it off).")
    max_cache_tokens: int | None = Field(None, description="Or: keep at most this many entries per attention head.")


class _Sampling(StrictBody):
    max_tokens: int | None = Field(None, description="Tokens to generate at most (>= 1).")
    temperature: float | None = Field(None, description="0 (greedy) to 5.")
    top_p: float | None = Field(None, description="Nucleus sampling, in (0, 1].")
    top_k: int | None = Field(None, description="Sample from the k most likely tokens; 0 disables.")
    seed: int | None = Field(None, description="Makes sampling reproducible, in [0, 2^63).")
    repetition_penalty: float | None = Field(None, description="In (0, 2]; 1 disables.")
    frequency_penalty: float | None = Field(None, description="In [-2, 2].")
    presence_penalty: float | None = Field(None, description="In [-2, 2].")
    stop: str | list[str] | None = Field(None, description="Up to 16 stop strings.")
    stream: bool = False
    lora: str | None = Field(None, description="A LoRA adapter id or name, for models that support LoRA.")
    speculation: SpeculationField = Field(
        None, description="Speculative decoding for this request: off, ngram or draft, or {mode, k}; the "
        "model's default when absent. Greedy output is unchanged by it; sampling keeps its distribution.")
    kv_compression: KVCompression | None = Field(
        None, description="KV-cache compression for this request: {\"rate\": R} or {\"max_cache_tokens\": N}; "
        "the model's default when absent. Long prompts only; evicts the entries attention used least.")


class NativeTextGeneration(_Sampling):
    """Workers AI text generation: a prompt (raw, or wrapped as one user message on chat models) or messages."""

    prompt: str | None = None
    messages: list[Message] | None = None
    raw: bool = False


class NativeEmbeddings(StrictBody):
    """Workers AI text embeddings: one text or a list of them."""

    text: str | list[str]
    lora: str | None = None


class StreamOptions(StrictBody):
    include_usage: bool = False


class _OpenAISampling(_Sampling):
    model: str
    n: int | None = Field(None, description="Only 1 is supported.")
    stream_options: StreamOptions | None = None
    user: str | None = None


class ChatCompletionRequest(_OpenAISampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, description="0 to 20; needs logprobs: true.")
    response_format: dict[str, Any] | None = Field(None, description="Only {\"type\": \"text\"} is supported.")
    tools: list[dict[str, Any]] | None = Field(None, description="Tool calling is not supported; send none.")


class CompletionRequest(_OpenAISampling):
    prompt: str | list[str]
    logprobs: int | None = Field(None, description="0 to 20 alternatives per token.")
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class EmbeddingRequest(StrictBody):
    model: str
    input: str | list[str]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


def _describe(exc: ValidationError) -> tuple[str, str | None]:
    parts = []
    first_param = None
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith(("function-", "tagged-union")))
        # Unions report one error per branch; the location names the branch type, which only confuses.
        loc = ".".join(p for p in loc.split(".") if p not in {"str", "list[str]", "list[TextPart]", "int"})
        first_param = first_param or loc or None
        parts.append(f"{loc}: {err['msg']}" if loc else err["msg"])
    return "; ".join(dict.fromkeys(parts)), first_param


T = TypeVar("T", bound=BaseModel)


def parse(schema: type[T], body: dict[str, Any]) -> T:
    try:
        return schema.model_validate(body)
    except ValidationError as exc:
        message, param = _describe(exc)
        raise errors.invalid(f"Invalid request body: {message}", param) from None
