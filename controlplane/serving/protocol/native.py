"""Workers AI's native run API: POST /client/v4/accounts/{account_id}/ai/run/{model}, answered in the Cloudflare
envelope. Text generation takes a prompt or messages, JSON mode (`response_format`: `result.response` is then
the JSON value itself) and tools (`result.tool_calls`: `[{"name", "arguments"}]`, arguments an object);
embedding models take text."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from controlplane.api import errors
from controlplane.api.body import parse
from controlplane.api.http import SSE_DONE, envelope, sse
from controlplane.catalog.services import ModelEntry
from controlplane.serving import pipeline
from controlplane.serving.dispatch import EmbeddingResult
from controlplane.serving.generation import Run
from controlplane.serving.job import Job, Prompt, Work, check_texts, sampling_params
from controlplane.serving.protocol import tools as tool_glue
from controlplane.serving.protocol.base import Endpoint, choice_outputs
from controlplane.serving.protocol.common import (
    check_tools,
    format_constraint,
    is_json_job,
    json_value,
    message_dicts,
    usage_json,
)
from controlplane.serving.schemas import NativeEmbeddings, NativeTextGeneration
from inference import FinishReason, RequestOutput

DEFAULT_MAX_TOKENS = 256  # Workers AI's default for text generation
DEFAULT_TEMPERATURE = 0.6  # Workers AI's default for its chat models


def deprecation_messages(entry: ModelEntry) -> list[str]:
    if entry.deprecated:
        return [f"{entry.name} is deprecated since {entry.deprecated_on.isoformat()}"]  # type: ignore[union-attr]
    return []


def native_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI-shaped calls as Workers AI answers them: name and the arguments as an object."""
    out = []
    for call in calls:
        try:
            arguments = json.loads(call["function"]["arguments"])
        except ValueError:
            arguments = call["function"]["arguments"]
        out.append({"name": call["function"]["name"], "arguments": arguments})
    return out


class NativeRun(Endpoint):
    path = "native"
    route = "native"
    style = "native"
    task = None

    schema = None  # it depends on the model's task

    def job(self, raw: dict[str, Any], entry: ModelEntry, *, batch: bool = False) -> Job:
        if entry.is_embedding:
            emb = parse(NativeEmbeddings, raw)
            texts = check_texts([emb.text] if isinstance(emb.text, str) else emb.text, "text")
            return Job(entry=entry, route=self.route, body=emb, work=Work.EMBED, texts=texts)
        body = parse(NativeTextGeneration, raw)
        if batch and body.stream:
            raise errors.invalid("stream: batch requests cannot stream; their results are stored", "stream")
        if (body.prompt is None) == (body.messages is None):
            raise errors.invalid("Give exactly one of prompt or messages", "prompt")
        if body.prompt is not None and not body.prompt:
            raise errors.invalid("prompt must not be empty", "prompt")
        if body.messages is not None and not body.messages:
            raise errors.invalid("messages must not be empty", "messages")
        fmt = body.response_format
        constraint = None
        if fmt is not None:
            if fmt.type == "json_schema" and fmt.json_schema is None:
                raise errors.invalid("response_format.json_schema: give the JSON schema", "response_format")
            constraint = format_constraint(fmt.type, fmt.json_schema, entry, "response_format")
        tools = check_tools(body.tools, None, None, entry, constraint)
        if tools is not None:
            if body.raw:
                raise errors.invalid("tools need a chat prompt: raw prompts carry no tool definitions", "raw")
            constraint = tool_glue.constraint(tools)
        prompt = (Prompt(text=body.prompt, raw=body.raw) if body.prompt is not None
                  else Prompt(messages=message_dicts(body.messages or [])))
        return Job(entry=entry, route=self.route, body=body, prompts=(prompt,),
                   params=sampling_params(body, temperature=DEFAULT_TEMPERATURE), max_tokens=body.max_tokens,
                   default_max_tokens=DEFAULT_MAX_TOKENS, stream=body.stream, constraint=constraint, tools=tools,
                   reject_if_busy=bool(body.options and body.options.rejectIfBusy))

    def result(self, job: Job, run: Run, finals: list[RequestOutput]) -> dict[str, Any]:
        """`result` of a finished generation job (the envelope's, and a queued request's)."""
        final = finals[0]
        result: dict[str, Any] = {"response": final.text}
        if is_json_job(job):
            result["response"] = json_value(final.text, final)
        elif job.tools is not None:
            content, calls = tool_glue.split(final.text, job.tools)
            result = {"response": content, "tool_calls": native_calls(calls)}
        result["usage"] = usage_json(run.usage())
        return result

    def render(self, job: Job, run: Run, finals: list[RequestOutput], created: int) -> dict[str, Any]:
        return envelope(self.result(job, run, finals), messages=deprecation_messages(job.entry))

    def embedding_result(self, result: EmbeddingResult) -> dict[str, Any]:
        return {"shape": [len(result.vectors), result.dim], "data": result.vectors, "pooling": "mean"}

    def render_embeddings(self, job: Job, result: EmbeddingResult) -> dict[str, Any]:
        return envelope(self.embedding_result(result), messages=deprecation_messages(job.entry))

    async def events(self, gen: pipeline.Generation, created: int) -> AsyncIterator[bytes]:
        parser = tool_glue.StreamParser(gen.job.tools) if gen.job.tools is not None else None
        async for _choice, out in choice_outputs(gen):
            if parser is None:
                if out.delta_text:
                    yield sse({"response": out.delta_text})
            else:
                text = "".join(d.get("content", "") for d in parser.feed(out.delta_text))
                if text:
                    yield sse({"response": text})
            if out.finished:
                if out.finish_reason == FinishReason.ERROR:
                    yield sse({"error": {"code": errors.CODE_INTERNAL, "message": out.error or "engine error"}})
                else:
                    last: dict[str, Any] = {"response": ""}
                    if parser is not None:
                        text = "".join(d.get("content", "") for d in parser.finish())
                        last = {"response": text, "tool_calls": native_calls(parser.calls)}
                    yield sse({**last, "usage": usage_json(gen.run.usage())})
                yield SSE_DONE


NATIVE = NativeRun()
