"""Request bodies of the inference APIs, as strict pydantic models: they check types and shapes (and feed the
OpenAPI document); value ranges are checked once, by the engine's SamplingParams."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
)
from pydantic_core import PydanticCustomError

from controlplane.api.body import Integer, StrictBody


class TextPart(StrictBody):
    type: Literal["text"]
    text: str


class CalledFunction(StrictBody):
    name: str
    arguments: str = Field(description="The arguments as JSON text, as the model produced them.")


class ToolCall(StrictBody):
    """A tool call an assistant message made earlier in the conversation (OpenAI's shape)."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="An assistant's earlier tool calls.")
    tool_call_id: str | None = Field(None, description="On a tool message: the call it answers.")


class FunctionDefinition(StrictBody):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="The arguments' JSON schema (an object schema).")
    strict: bool | None = None


class FunctionTool(StrictBody):
    type: Literal["function"]
    function: FunctionDefinition


class FlatTool(StrictBody):
    """Workers AI's own tool shape: the function's fields at the top level."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class NamedFunction(StrictBody):
    name: str


class NamedToolChoice(StrictBody):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["auto", "none", "required"] | NamedToolChoice


class JsonSchemaFormat(StrictBody):
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormatText(StrictBody):
    type: Literal["text"]


class ResponseFormatJsonObject(StrictBody):
    type: Literal["json_object"]


class ResponseFormatJsonSchema(StrictBody):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema,
                           Field(discriminator="type")]


class NativeResponseFormat(StrictBody):
    """Workers AI's JSON mode: `json_schema` is the schema itself."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class Speculation(StrictBody):
    mode: str = Field(description="off, ngram (prompt lookup) or draft (the model's draft model).")
    k: Integer | None = Field(None, description="Most draft tokens per step, 1 to 16; the model's default if absent.")


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
    max_cache_tokens: Integer | None = Field(None, description="Or: keep at most this many entries per attention head.")


class _Sampling(StrictBody):
    max_tokens: Integer | None = Field(None, description="Tokens to generate at most (>= 1).")
    temperature: float | None = Field(None, description="0 (greedy) to 5.")
    top_p: float | None = Field(None, description="Nucleus sampling, in (0, 1].")
    top_k: Integer | None = Field(None, description="Sample from the k most likely tokens; 0 disables.")
    seed: Integer | None = Field(None, description="Makes sampling reproducible, in [0, 2^63).")
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


class NativeOptions(StrictBody):
    rejectIfBusy: bool = Field(False, description="Answer 429 (3040) at once when the model has no free "
                               "capacity, instead of queueing.")
    queueRequest: bool = Field(False, description="Run as an async batch (see the queueRequest API).")


class NativeTextGeneration(_Sampling):
    """Workers AI text generation: a prompt (raw, or wrapped as one user message on chat models) or messages."""

    prompt: str | None = None
    messages: list[Message] | None = None
    raw: bool = False
    response_format: NativeResponseFormat | None = Field(
        None, description="JSON mode: {\"type\": \"json_object\"} or {\"type\": \"json_schema\", \"json_schema\": "
        "<schema>}; result.response is then the JSON value itself.")
    tools: list[FunctionTool | FlatTool] | None = Field(
        None, description="Functions the model may call ({name, description, parameters}, or OpenAI's "
        "{type: function, function: {...}}); calls come back in result.tool_calls.")
    options: NativeOptions | None = None


class NativeEmbeddings(StrictBody):
    """Workers AI text embeddings: one text or a list of them."""

    text: str | list[str]
    lora: str | None = None


class StreamOptions(StrictBody):
    include_usage: bool = False


class _OpenAISampling(_Sampling):
    model: str
    n: Integer | None = Field(None, description="Choices to generate, 1 to 8; the prompt is computed once.")
    stream_options: StreamOptions | None = None
    user: str | None = None


class ChatCompletionRequest(_OpenAISampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Integer | None = None
    logprobs: bool | None = None
    top_logprobs: Integer | None = Field(None, description="0 to 20; needs logprobs: true.")
    response_format: ResponseFormat | None = Field(
        None, description="text, json_object, or json_schema {name, schema, strict}: the output is constrained "
        "to the schema by the grammar.")
    tools: list[FunctionTool] | None = Field(None, description="Functions the model may call.")
    tool_choice: ToolChoice | None = Field(
        None, description="auto (the default with tools), none, required, or {type: function, function: {name}}.")
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call per answer.")
    rejectIfBusy: bool = Field(False, description="Answer 429 (engine_overloaded) at once when the model has no "
                               "free capacity, instead of queueing.")


class CompletionRequest(_OpenAISampling):
    prompt: str | list[str] = Field(description="One prompt, or a list of up to 16 (a choice each).")
    logprobs: Integer | None = Field(None, description="0 to 20 alternatives per token.")
    echo: bool = Field(False, description="Put the prompt before each choice's text.")
    response_format: ResponseFormat | None = Field(None, description="As on chat completions.")
    best_of: Integer | None = None
    suffix: str | None = None


class EmbeddingRequest(StrictBody):
    model: str
    input: str | list[str]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Integer | None = None
    user: str | None = None


# ------------------------------------------------------------------------------------------ Anthropic Messages
class CacheControl(StrictBody):
    type: Literal["ephemeral"]
    ttl: str | None = None


class AnthropicText(StrictBody):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = Field(None, description="Accepted; every prefix is cached anyway.")


class AnthropicToolUse(StrictBody):
    """A call the assistant made earlier in the conversation."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class AnthropicToolResult(StrictBody):
    """The client's answer to a tool_use block."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[AnthropicText] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


AnthropicBlock = Annotated[AnthropicText | AnthropicToolUse | AnthropicToolResult, Field(discriminator="type")]


class AnthropicMessage(StrictBody):
    role: Literal["user", "assistant"]
    content: str | list[AnthropicBlock]


class AnthropicTool(StrictBody):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] = Field(description="The input's JSON schema (an object schema).")
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None


class AnthropicToolChoice(StrictBody):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, description="With type tool: the tool to call.")
    disable_parallel_tool_use: bool | None = None


class AnthropicMetadata(StrictBody):
    user_id: str | None = None


class AnthropicCountTokensRequest(StrictBody):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[AnthropicText] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None


class AnthropicJsonFormat(StrictBody):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class AnthropicOutputConfig(StrictBody):
    format: AnthropicJsonFormat | None = Field(None, description="Structured output: the answer is held to the "
                                               "JSON schema by the grammar.")
    effort: str | None = Field(None, description="Accepted and ignored.")


class AnthropicThinking(StrictBody):
    model_config = ConfigDict(strict=True, extra="allow")

    type: Literal["enabled", "disabled", "adaptive"]


class AnthropicMessagesRequest(AnthropicCountTokensRequest):
    """Anthropic's Messages API (the `anthropic` SDK's `messages.create` / `messages.stream`). Fields that
    steer Anthropic's own service (tiers, regions, containers, diagnostics) are accepted and ignored."""

    max_tokens: Integer = Field(description="Tokens to generate at most (required, >= 1).")
    temperature: float | None = Field(None, description="0 to 1 (Anthropic's range; 1 by default).")
    top_p: float | None = None
    top_k: Integer | None = None
    stop_sequences: list[str] | None = Field(None, description="Up to 16 stop strings.")
    stream: bool = False
    metadata: AnthropicMetadata | None = None
    output_config: AnthropicOutputConfig | None = None
    thinking: AnthropicThinking | None = Field(None, description="disabled or adaptive; no model here thinks.")
    cache_control: CacheControl | None = Field(None, description="Accepted; every prefix is cached anyway.")
    service_tier: str | None = None
    inference_geo: str | None = None
    speed: str | None = None
    container: Any = None
    diagnostics: Any = None
    user_profile_id: str | None = None
    workspace_id: str | None = None


# ------------------------------------------------------------------------------------------- OpenAI Responses
class InputText(StrictBody):
    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(StrictBody):
    """A conversation turn (the `type` may be left out, as the SDK allows)."""

    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(StrictBody):
    """A call the model made earlier (sent back with its output)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(StrictBody):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None


InputItem = InputMessage | FunctionCallItem | FunctionCallOutputItem


class ResponsesFunctionTool(StrictBody):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesNamedFunction(StrictBody):
    type: Literal["function"]
    name: str


class ResponsesTextFormat(StrictBody):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponsesText(StrictBody):
    format: ResponsesTextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(StrictBody):
    """OpenAI's Responses API (the openai SDK's `responses.create` / `responses.stream`)."""

    model: str
    input: str | list[InputItem] = Field(description="A user message, or a list of input items.")
    instructions: str | None = Field(None, description="A system turn put first (not carried to continuations).")
    previous_response_id: str | None = Field(None, description="Continue a stored response of this account.")
    max_output_tokens: Integer | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[ResponsesFunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | ResponsesNamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: ResponsesText | None = Field(None, description="text.format: text, json_object or json_schema.")
    stream: bool = False
    store: bool = Field(True, description="Keep the response (GET, DELETE, previous_response_id).")
    background: bool = Field(False, description="Run at batch priority; poll GET /v1/responses/{id}.")
    metadata: dict[str, str] | None = None
    user: str | None = None
