"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens (also under the account prefix).

Content blocks map onto the chat messages every API shares: text blocks join into a turn's text, an assistant's
`tool_use` blocks become its tool calls and a user's `tool_result` blocks become tool turns, so the chat
template sees the same conversation an OpenAI client would send. Prefix-cache hits are reported as
`cache_read_input_tokens`; `input_tokens` counts the rest, as Anthropic's usage does.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from controlplane.api import errors
from controlplane.api.http import dumps
from controlplane.catalog.models import Task
from controlplane.catalog.services import ModelEntry
from controlplane.serving import pipeline
from controlplane.serving.generation import Run
from controlplane.serving.job import Job, Prompt, sampling_params
from controlplane.serving.protocol import tools as tool_glue
from controlplane.serving.protocol.base import Endpoint, choice_outputs
from controlplane.serving.protocol.common import check_tools, format_constraint
from controlplane.serving.schemas import (
    AnthropicCountTokensRequest,
    AnthropicMessagesRequest,
    AnthropicText,
    AnthropicToolResult,
    AnthropicToolUse,
)
from inference import FinishReason, RequestOutput, Usage

MAX_STOP_SEQUENCES = 16


def event(kind: str, data: dict[str, Any]) -> bytes:
    """One server-sent event as Anthropic streams them: a named event whose data repeats its type."""
    return f"event: {kind}\ndata: {dumps({'type': kind, **data})}\n\n".encode()


def _text(content: str | list[AnthropicText] | None) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(block.text for block in content)


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def chat_messages(body: AnthropicCountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as the chat messages the prompt renderer takes."""
    out: list[dict[str, Any]] = []
    system = _text(body.system)
    if system:
        out.append({"role": "system", "content": system})
    for i, message in enumerate(body.messages):
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        text: list[str] = []
        calls: list[dict[str, Any]] = []
        for block in message.content:
            if isinstance(block, AnthropicToolUse):
                if message.role != "assistant":
                    raise errors.invalid(f"messages[{i}]: tool_use blocks belong to assistant turns",
                                         f"messages.{i}.content")
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": json.dumps(block.input)}})
            elif isinstance(block, AnthropicToolResult):
                if message.role != "user":
                    raise errors.invalid(f"messages[{i}]: tool_result blocks belong to user turns",
                                         f"messages.{i}.content")
                result = _text(block.content)
                out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": f"Error: {result}" if block.is_error else result})
            else:
                text.append(block.text)
        if text or calls:
            turn: dict[str, Any] = {"role": message.role, "content": "".join(text)}
            if calls:
                turn["tool_calls"] = calls
            out.append(turn)
    if not any(m["role"] in ("user", "tool") for m in out):
        raise errors.invalid("messages: the conversation needs a user turn", "messages")
    return out


def _tools(body: AnthropicCountTokensRequest, entry: ModelEntry) -> Any:
    """Anthropic's tools and tool_choice in the shared shape: auto, any (= required), tool (a named one), none."""
    if not body.tools:
        if body.tool_choice is not None and body.tool_choice.type not in ("auto", "none"):
            raise errors.invalid("tool_choice needs tools", "tool_choice")
        return None
    offered = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                 "parameters": t.input_schema}} for t in body.tools]
    choice = body.tool_choice
    if choice is None or choice.type == "auto":
        wanted: Any = "auto"
    elif choice.type == "none":
        wanted = "none"
    elif choice.type == "any":
        wanted = "required"
    else:
        if not choice.name:
            raise errors.invalid("tool_choice: type tool needs the tool's name", "tool_choice.name")
        wanted = {"type": "function", "function": {"name": choice.name}}
    parallel = not (choice is not None and choice.disable_parallel_tool_use)
    return check_tools(offered, wanted, parallel, entry, None)


def anthropic_usage(usage: Usage) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens, "output_tokens": usage.completion_tokens,
            "cache_read_input_tokens": usage.cached_tokens, "cache_creation_input_tokens": 0}


def stop_reason(final: RequestOutput, calls: bool) -> tuple[str, str | None]:
    if final.finish_reason == FinishReason.LENGTH:  # a call cut off by max_tokens is not a finished call
        return "max_tokens", None
    if calls:
        return "tool_use", None
    if final.stop_str is not None:
        return "stop_sequence", final.stop_str
    return "end_turn", None


class Messages(Endpoint):
    path = "/v1/messages"
    route = "anthropic.messages"
    style = "anthropic"
    task = Task.TEXT_GENERATION

    schema = AnthropicMessagesRequest

    def job(self, raw: dict[str, Any], entry: ModelEntry, *, batch: bool = False) -> Job:
        body = self.shape(raw)
        if batch and body.stream:
            raise errors.invalid("stream: batch requests cannot stream; their results are stored", "stream")
        if body.max_tokens < 1:
            raise errors.invalid("max_tokens: must be at least 1", "max_tokens")
        stops = body.stop_sequences or []
        if len(stops) > MAX_STOP_SEQUENCES:
            raise errors.invalid(f"stop_sequences: at most {MAX_STOP_SEQUENCES}", "stop_sequences")
        params = sampling_params(body, max_tokens=body.max_tokens, stop=list(stops))
        if body.thinking is not None and body.thinking.type == "enabled":
            raise errors.invalid(f"thinking: {entry.name} has no extended thinking; use disabled or adaptive",
                                 "thinking")
        fmt = body.output_config.format if body.output_config is not None else None
        constraint = format_constraint("json_schema", fmt.schema_, entry, "output_config.format") if fmt else None
        tools = _tools(body, entry)
        if tools is not None:
            if constraint is not None:
                raise errors.invalid("give tools or an output format, not both", "output_config.format")
            constraint = tool_glue.constraint(tools)
        return Job(entry=entry, route=self.route, body=body, prompts=(Prompt(messages=chat_messages(body)),),
                   params=params, max_tokens=body.max_tokens, stream=body.stream, constraint=constraint, tools=tools)

    def render(self, job: Job, run: Run, finals: list[RequestOutput], created: int) -> dict[str, Any]:
        final = finals[0]
        content, calls = tool_glue.split(final.text, job.tools) if job.tools is not None else (final.text, [])
        blocks: list[dict[str, Any]] = [{"type": "text", "text": content}] if content or not calls else []
        for call in calls:
            try:
                arguments = json.loads(call["function"]["arguments"] or "{}")
            except ValueError:  # cut off by max_tokens mid-arguments (stop_reason says so)
                arguments = {}
            blocks.append({"type": "tool_use", "id": tool_use_id(call["id"]), "name": call["function"]["name"],
                           "input": arguments})
        reason, sequence = stop_reason(final, bool(calls))
        return {"id": f"msg_{run.request_id.removeprefix('req-')}", "type": "message", "role": "assistant",
                "model": job.model, "content": blocks, "stop_reason": reason, "stop_sequence": sequence,
                "usage": anthropic_usage(run.usage())}

    def stream_error(self, error: errors.ApiError) -> bytes:
        return event("error", {"error": error.anthropic_body()["error"]})

    async def events(self, gen: pipeline.Generation, created: int) -> AsyncIterator[bytes]:
        job = gen.job
        message_id = f"msg_{gen.request_id.removeprefix('req-')}"
        start_usage = {**anthropic_usage(gen.run.usage()), "output_tokens": 0}
        yield event("message_start", {"message": {
            "id": message_id, "type": "message", "role": "assistant", "model": job.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": start_usage}})
        parser = tool_glue.StreamParser(job.tools) if job.tools is not None else None
        index = -1
        open_kind: str | None = None  # "text" or "tool_use": the block being streamed

        def close() -> bytes:
            nonlocal open_kind
            open_kind = None
            return event("content_block_stop", {"index": index})

        final: RequestOutput | None = None
        async for _choice, out in choice_outputs(gen):
            final = out
            deltas = ([{"content": out.delta_text}] if out.delta_text else []) if parser is None else (
                parser.feed(out.delta_text) + (parser.finish() if out.finished else []))
            for delta in deltas:
                if delta.get("content"):
                    if open_kind != "text":
                        if open_kind is not None:
                            yield close()
                        index += 1
                        open_kind = "text"
                        yield event("content_block_start", {"index": index,
                                                            "content_block": {"type": "text", "text": ""}})
                    yield event("content_block_delta", {"index": index,
                                                        "delta": {"type": "text_delta", "text": delta["content"]}})
                for call in delta.get("tool_calls", ()):
                    if "id" in call:  # a new call: its own block
                        if open_kind is not None:
                            yield close()
                        index += 1
                        open_kind = "tool_use"
                        yield event("content_block_start", {"index": index, "content_block": {
                            "type": "tool_use", "id": tool_use_id(call["id"]), "name": call["function"]["name"],
                            "input": {}}})
                    elif call["function"].get("arguments"):
                        yield event("content_block_delta", {"index": index, "delta": {
                            "type": "input_json_delta", "partial_json": call["function"]["arguments"]}})
        if index < 0:  # nothing was said: an empty text block, as Anthropic sends
            index = 0
            open_kind = "text"
            yield event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
        if open_kind is not None:
            yield close()
        assert final is not None
        reason, sequence = stop_reason(final, bool(parser is not None and parser.calls))
        usage = gen.run.usage()
        yield event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                      "usage": {"output_tokens": usage.completion_tokens}})
        yield event("message_stop", {})


MESSAGES = Messages()


def count_tokens_job(raw: dict[str, Any], entry: ModelEntry | None) -> tuple[AnthropicCountTokensRequest, Any]:
    """The count_tokens body checked (the model known or not): its conversation and tools, ready to encode."""
    from controlplane.api.body import parse

    body = parse(AnthropicCountTokensRequest, raw)
    if entry is None:
        return body, None
    return body, _tools(body, entry)

