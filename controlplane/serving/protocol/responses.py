"""OpenAI's Responses API: POST /v1/responses (also under the account prefix); stored responses are read,
deleted, cancelled and continued through `serving/response_store.py`.

Input items map onto the chat messages every API shares: messages as turns, `function_call` items as an
assistant's tool calls and `function_call_output` items as tool turns. A continuation (`previous_response_id`)
is the stored conversation, its answer and the new input; `instructions` apply to their own response only.
"""

from __future__ import annotations

import time
import uuid
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
from controlplane.serving.schemas import FunctionCallItem, FunctionCallOutputItem, InputText, ResponsesRequest
from inference import FinishReason, RequestOutput, Usage


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def _text(content: str | list[InputText]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as chat messages; consecutive function_call items join one assistant turn."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    out: list[dict[str, Any]] = []
    for item in body.input:
        if isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            elif out and out[-1]["role"] == "assistant":
                out[-1]["tool_calls"] = [call]
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
        else:
            out.append({"role": item.role, "content": _text(item.content)})
    if not out:
        raise errors.invalid("input: give a message or a list of input items", "input")
    return out


def output_messages(response: dict[str, Any]) -> list[dict[str, Any]]:
    """A stored response's output items as the assistant turn a continuation starts from."""
    turn: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in response.get("output") or ():
        if item.get("type") == "message":
            turn["content"] += "".join(p.get("text", "") for p in item.get("content") or ())
        elif item.get("type") == "function_call":
            turn.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                "name": item["name"], "arguments": item["arguments"]}})
    return [turn] if turn["content"] or turn.get("tool_calls") else []


def use_conversation(job: Job, conversation: list[dict[str, Any]]) -> None:
    """The prompt: this response's instructions (if any), then the conversation (earlier turns of a
    continuation, then the new input)."""
    instructions = job.extra["instructions"]
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
    job.prompts = (Prompt(messages=messages),)
    job.extra["conversation"] = conversation


def responses_usage(usage: Usage) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.total_tokens}


def _tool_dicts(body: ResponsesRequest) -> list[dict[str, Any]]:
    return [t.model_dump(exclude_none=True) for t in body.tools or ()]


def base_response(job: Job, status: str, created: float) -> dict[str, Any]:
    """The response object before (or without) its output: what `response.created` and a queued background
    response show."""
    body: ResponsesRequest = job.body
    fmt = body.text.format if body.text is not None and body.text.format is not None else None
    choice = body.tool_choice
    return {
        "id": job.extra["response_id"], "object": "response", "created_at": created, "status": status,
        "background": body.background, "error": None, "incomplete_details": None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": job.model,
        "output": [], "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id, "store": body.store,
        "temperature": body.temperature, "top_p": body.top_p,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
        "tool_choice": choice.model_dump() if choice is not None and not isinstance(choice, str) else (choice or "auto"),
        "tools": _tool_dicts(body), "metadata": body.metadata or {}, "usage": None, "user": body.user}


class Responses(Endpoint):
    path = "/v1/responses"
    route = "openai.responses"
    style = "openai"
    task = Task.TEXT_GENERATION

    schema = ResponsesRequest

    def job(self, raw: dict[str, Any], entry: ModelEntry, *, batch: bool = False) -> Job:
        body = self.shape(raw)
        if body.background and body.stream:
            raise errors.invalid("background responses do not stream: poll GET /v1/responses/{id}", "stream")
        if body.background and not body.store:
            raise errors.invalid("background responses must be stored (store: true)", "store")
        max_tokens = body.max_output_tokens
        params = sampling_params(body, max_tokens=max_tokens)
        fmt = body.text.format if body.text is not None else None
        constraint = None
        if fmt is not None and fmt.type != "text":
            if fmt.type == "json_schema" and fmt.schema_ is None:
                raise errors.invalid("text.format.schema is required for json_schema", "text.format")
            constraint = format_constraint(fmt.type, fmt.schema_, entry, "text.format")
        choice: Any = body.tool_choice
        if choice is not None and not isinstance(choice, str):
            choice = {"type": "function", "function": {"name": choice.name}}
        tools = check_tools([{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
                             for t in _tool_dicts(body)], choice, body.parallel_tool_calls, entry, constraint)
        if tools is not None:
            constraint = tool_glue.constraint(tools)
        job = Job(entry=entry, route=self.route, body=body, params=params, max_tokens=max_tokens,
                  stream=body.stream, constraint=constraint, tools=tools,
                  extra={"response_id": new_response_id(), "input": input_messages(body),
                         "instructions": body.instructions or ""})
        use_conversation(job, job.extra["input"])
        return job

    def render(self, job: Job, run: Run, finals: list[RequestOutput], created: int) -> dict[str, Any]:
        final = finals[0]
        content, calls = tool_glue.split(final.text, job.tools) if job.tools is not None else (final.text, [])
        items = [_message_item(_new_id("msg"), content, "completed")] if content or not calls else []
        items += [_call_item(_new_id("fc"), call, "completed") for call in calls]
        return finished(job, run, final, created, items)

    def stream_error(self, error: errors.ApiError) -> bytes:

        return _event("error", {"code": error.openai_code, "message": error.message, "param": error.param,
                                "sequence_number": 0})

    async def events(self, gen: pipeline.Generation, created: int) -> AsyncIterator[bytes]:
        job = gen.job
        seq = 0

        def emit(kind: str, data: dict[str, Any]) -> bytes:
            nonlocal seq
            seq += 1
            return _event(kind, {**data, "sequence_number": seq - 1})

        started = base_response(job, "in_progress", created)
        yield emit("response.created", {"response": started})
        yield emit("response.in_progress", {"response": started})
        parser = tool_glue.StreamParser(job.tools) if job.tools is not None else None
        items: list[dict[str, Any]] = []
        current: dict[str, Any] | None = None
        text = ""

        def close() -> list[bytes]:
            nonlocal current
            item, current = current, None
            if item is None:
                return []
            index = len(items) - 1
            if item["type"] == "message":
                part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
                item.update(status="completed", content=[part])
                return [emit("response.output_text.done", {"item_id": item["id"], "output_index": index,
                                                           "content_index": 0, "text": text, "logprobs": []}),
                        emit("response.content_part.done", {"item_id": item["id"], "output_index": index,
                                                            "content_index": 0, "part": part}),
                        emit("response.output_item.done", {"output_index": index, "item": item})]
            item["status"] = "completed"
            return [emit("response.function_call_arguments.done", {"item_id": item["id"], "output_index": index,
                                                                  "arguments": item["arguments"],
                                                                  "name": item["name"]}),
                    emit("response.output_item.done", {"output_index": index, "item": item})]

        final: RequestOutput | None = None
        async for _choice, out in choice_outputs(gen):
            final = out
            deltas = ([{"content": out.delta_text}] if out.delta_text else []) if parser is None else (
                parser.feed(out.delta_text) + (parser.finish() if out.finished else []))
            for delta in deltas:
                if delta.get("content"):
                    if current is None or current["type"] != "message":
                        for chunk in close():
                            yield chunk
                        text = ""
                        current = _message_item(_new_id("msg"), "", "in_progress")
                        current["content"] = []
                        items.append(current)
                        index = len(items) - 1
                        yield emit("response.output_item.added", {"output_index": index, "item": dict(current)})
                        yield emit("response.content_part.added", {
                            "item_id": current["id"], "output_index": index, "content_index": 0,
                            "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}})
                    text += delta["content"]
                    yield emit("response.output_text.delta", {"item_id": current["id"], "output_index": len(items) - 1,
                                                              "content_index": 0, "delta": delta["content"],
                                                              "logprobs": []})
                for call in delta.get("tool_calls", ()):
                    if "id" in call:
                        for chunk in close():
                            yield chunk
                        current = _call_item(_new_id("fc"), call, "in_progress")
                        current["arguments"] = ""
                        items.append(current)
                        yield emit("response.output_item.added", {"output_index": len(items) - 1,
                                                                  "item": dict(current)})
                    elif current is not None and call["function"].get("arguments"):
                        current["arguments"] += call["function"]["arguments"]
                        yield emit("response.function_call_arguments.delta", {
                            "item_id": current["id"], "output_index": len(items) - 1,
                            "delta": call["function"]["arguments"]})
        for chunk in close():
            yield chunk
        assert final is not None
        if not items:  # nothing was said: an empty message, as a whole answer would have
            items.append(_message_item(_new_id("msg"), "", "completed"))
        response = finished(job, gen.run, final, created, items)
        job.extra["final"] = response  # the view stores it once the stream has ended
        yield emit("response.completed", {"response": response})


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def finished(job: Job, run: Run, final: RequestOutput, created: float, items: list[dict[str, Any]]) -> dict[str, Any]:
    """The whole response once generation ended: its output items, status and usage."""
    response = base_response(job, "completed", created)
    response["output"] = items
    if final.finish_reason == FinishReason.LENGTH:
        response["status"] = "incomplete"
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    response["completed_at"] = int(time.time())
    response["usage"] = responses_usage(run.usage())
    return response


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(item_id: str, call: dict[str, Any], status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"].get("arguments", ""), "status": status}


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {dumps({'type': kind, **data})}\n\n".encode()


RESPONSES = Responses()
