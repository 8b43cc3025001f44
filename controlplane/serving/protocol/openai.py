"""OpenAI's API: /v1/chat/completions, /v1/completions, /v1/embeddings (also under
/client/v4/accounts/{account_id}/ai/v1/). Structured outputs (`response_format`), tools (`tools`,
`tool_choice`, `parallel_tool_calls`), `n` choices, lists of prompts and `echo`."""

from __future__ import annotations

import base64
import struct
from collections.abc import AsyncIterator
from typing import Any

from controlplane.api import errors
from controlplane.api.http import SSE_DONE, sse
from controlplane.catalog.models import Task
from controlplane.catalog.services import ModelEntry
from controlplane.serving import pipeline
from controlplane.serving.dispatch import EmbeddingResult
from controlplane.serving.generation import Run
from controlplane.serving.job import MAX_PROMPTS, Job, Prompt, Work, check_n, check_texts, sampling_params
from controlplane.serving.protocol import tools as tool_glue
from controlplane.serving.protocol.base import Endpoint, choice_outputs
from controlplane.serving.protocol.common import (
    check_tools,
    finish_reason,
    format_constraint,
    message_dicts,
    usage_json,
)
from controlplane.serving.schemas import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from inference import RequestOutput, TokenLogprob

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
FINGERPRINT = "hearth"


def _no_stream_in_batch(body: Any, batch: bool) -> None:
    if batch and getattr(body, "stream", False):
        raise errors.invalid("stream: batch requests cannot stream; their results are stored", "stream")


def _format_of(body: Any, entry: ModelEntry) -> Any:
    fmt = body.response_format
    if fmt is None:
        return None
    schema = fmt.json_schema.schema_ if fmt.type == "json_schema" else None
    if fmt.type == "json_schema" and schema is None:
        raise errors.invalid("response_format.json_schema.schema is required", "response_format")
    return format_constraint(fmt.type, schema, entry, "response_format")


# ------------------------------------------------------------------------------------------------ chat
def _chat_logprobs(items: list[TokenLogprob] | None) -> dict[str, Any] | None:
    if items is None:
        return None

    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {"content": [{**entry(t.token, t.logprob), "top_logprobs": [entry(tok, lp) for _, tok, lp in t.top]}
                        for t in items]}


class ChatCompletions(Endpoint):
    path = "/v1/chat/completions"
    route = "openai.chat"
    style = "openai"
    task = Task.TEXT_GENERATION

    schema = ChatCompletionRequest

    def job(self, raw: dict[str, Any], entry: ModelEntry, *, batch: bool = False) -> Job:
        body = self.shape(raw)
        _no_stream_in_batch(body, batch)
        if body.top_logprobs is not None and not body.logprobs:
            raise errors.invalid("top_logprobs needs logprobs: true", "top_logprobs")
        n = check_n(body.n)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = sampling_params(body, logprobs=logprobs, max_tokens=max_tokens)
        constraint = _format_of(body, entry)
        tools = check_tools(body.tools, body.tool_choice, body.parallel_tool_calls, entry, constraint)
        if tools is not None:
            constraint = tool_glue.constraint(tools)
        return Job(entry=entry, route=self.route, body=body, prompts=(Prompt(messages=message_dicts(body.messages)),),
                   params=params, max_tokens=max_tokens, n=n, stream=body.stream, constraint=constraint,
                   tools=tools, reject_if_busy=body.rejectIfBusy)

    def render(self, job: Job, run: Run, finals: list[RequestOutput], created: int) -> dict[str, Any]:
        choices = []
        for i, final in enumerate(finals):
            message: dict[str, Any] = {"role": "assistant", "content": final.text}
            calls: list[dict[str, Any]] = []
            if job.tools is not None:
                content, calls = tool_glue.split(final.text, job.tools)
                message = {"role": "assistant", "content": content or None}
                if calls:
                    message["tool_calls"] = calls
            choices.append({"index": i, "message": message, "logprobs": _chat_logprobs(final.logprobs),
                            "finish_reason": finish_reason(final, bool(calls))})
        return {"id": f"chatcmpl-{run.request_id}", "object": "chat.completion", "created": created,
                "model": job.model, "system_fingerprint": FINGERPRINT, "choices": choices,
                "usage": usage_json(run.usage())}

    async def events(self, gen: pipeline.Generation, created: int) -> AsyncIterator[bytes]:
        job = gen.job
        completion_id = f"chatcmpl-{gen.request_id}"
        include_usage = bool(job.body.stream_options and job.body.stream_options.include_usage)
        parsers = ({c.index: tool_glue.StreamParser(job.tools) for c in gen.run.choices}
                   if job.tools is not None else {})

        def chunk(index: int, delta: dict[str, Any], reason: str | None = None, logprobs: Any = None) -> bytes:
            data: dict[str, Any] = {
                "id": completion_id, "object": "chat.completion.chunk", "created": created, "model": job.model,
                "system_fingerprint": FINGERPRINT,
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}]}
            if include_usage:
                data["usage"] = None
            return sse(data)

        for choice in gen.run.choices:
            yield chunk(choice.index, {"role": "assistant", "content": ""})
        async for choice, out in choice_outputs(gen):
            parser = parsers.get(choice.index)
            if parser is None:
                if out.delta_text or out.logprobs:
                    yield chunk(choice.index, {"content": out.delta_text}, logprobs=_chat_logprobs(out.logprobs))
            else:
                deltas = parser.feed(out.delta_text) + (parser.finish() if out.finished else [])
                for delta in deltas:
                    yield chunk(choice.index, delta)
            if out.finished:
                yield chunk(choice.index, {}, finish_reason(out, bool(parser and parser.calls)))
        if include_usage:
            yield sse({"id": completion_id, "object": "chat.completion.chunk", "created": created,
                       "model": job.model, "system_fingerprint": FINGERPRINT, "choices": [],
                       "usage": usage_json(gen.run.usage())})
        yield SSE_DONE


# ------------------------------------------------------------------------------------------------ completions
def _completion_logprobs(items: list[TokenLogprob] | None, offset: int) -> dict[str, Any] | None:
    if items is None:
        return None
    offsets, position = [], offset
    for t in items:
        offsets.append(position)
        position += len(t.token)
    return {"tokens": [t.token for t in items], "token_logprobs": [t.logprob for t in items],
            "top_logprobs": [{tok: lp for _, tok, lp in t.top} for t in items], "text_offset": offsets}


class Completions(Endpoint):
    path = "/v1/completions"
    route = "openai.completions"
    style = "openai"
    task = Task.TEXT_GENERATION

    schema = CompletionRequest

    def job(self, raw: dict[str, Any], entry: ModelEntry, *, batch: bool = False) -> Job:
        body = self.shape(raw)
        _no_stream_in_batch(body, batch)
        prompts = [body.prompt] if isinstance(body.prompt, str) else list(body.prompt)
        if not 1 <= len(prompts) <= MAX_PROMPTS:
            raise errors.invalid(f"prompt: one string or a list of 1 to {MAX_PROMPTS}", "prompt")
        if any(not p for p in prompts):
            raise errors.invalid("prompt: every prompt must be a non-empty string", "prompt")
        n = check_n(body.n, len(prompts))
        if body.best_of not in (None, 1, n):
            raise errors.invalid("best_of: only n (or 1) is supported: every choice generated is returned",
                                 "best_of")
        if body.suffix:
            raise errors.invalid("suffix is not supported", "suffix")
        if body.echo and body.logprobs is not None:
            raise errors.invalid("echo with logprobs is not supported: the prompt's logprobs are not computed",
                                 "echo")
        return Job(entry=entry, route=self.route, body=body,
                   prompts=tuple(Prompt(text=p, raw=True) for p in prompts),
                   params=sampling_params(body, logprobs=body.logprobs), max_tokens=body.max_tokens,
                   default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS, n=n, echo=body.echo, stream=body.stream,
                   constraint=_format_of(body, entry))

    def _prefix(self, job: Job, prompt_index: int) -> str:
        return (job.prompts[prompt_index].text or "") if job.echo else ""

    def render(self, job: Job, run: Run, finals: list[RequestOutput], created: int) -> dict[str, Any]:
        choices = []
        for choice, final in zip(run.choices, finals, strict=True):
            prefix = self._prefix(job, choice.prompt_index)
            choices.append({"index": choice.index, "text": prefix + final.text,
                            "logprobs": _completion_logprobs(final.logprobs, len(prefix)),
                            "finish_reason": finish_reason(final)})
        return {"id": f"cmpl-{run.request_id}", "object": "text_completion", "created": created,
                "model": job.model, "system_fingerprint": FINGERPRINT, "choices": choices,
                "usage": usage_json(run.usage())}

    async def events(self, gen: pipeline.Generation, created: int) -> AsyncIterator[bytes]:
        job = gen.job
        completion_id = f"cmpl-{gen.request_id}"
        include_usage = bool(job.body.stream_options and job.body.stream_options.include_usage)
        echoed: set[int] = set()

        def chunk(index: int, text: str, reason: str | None, logprobs: Any) -> bytes:
            data: dict[str, Any] = {
                "id": completion_id, "object": "text_completion", "created": created, "model": job.model,
                "system_fingerprint": FINGERPRINT,
                "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}]}
            if include_usage:
                data["usage"] = None
            return sse(data)

        async for choice, out in choice_outputs(gen):
            prefix = ""
            if choice.index not in echoed:
                echoed.add(choice.index)
                prefix = self._prefix(job, choice.prompt_index)
            offset = len(self._prefix(job, choice.prompt_index)) + len(out.text) - len(out.delta_text)
            logprobs = _completion_logprobs(out.logprobs, offset)
            if out.finished:
                yield chunk(choice.index, prefix + out.delta_text, finish_reason(out), logprobs)
            elif prefix or out.delta_text:
                yield chunk(choice.index, prefix + out.delta_text, None, logprobs)
        if include_usage:
            yield sse({"id": completion_id, "object": "text_completion", "created": created,
                       "model": job.model, "choices": [], "usage": usage_json(gen.run.usage())})
        yield SSE_DONE


# ------------------------------------------------------------------------------------------------ embeddings
def base64_floats(vector: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


class Embeddings(Endpoint):
    path = "/v1/embeddings"
    route = "openai.embeddings"
    style = "openai"
    task = Task.TEXT_EMBEDDINGS

    schema = EmbeddingRequest

    def job(self, raw: dict[str, Any], entry: ModelEntry, *, batch: bool = False) -> Job:
        body = self.shape(raw)
        texts = check_texts([body.input] if isinstance(body.input, str) else body.input, "input")
        dim = dict(entry.properties).get("dimensions")
        if body.dimensions is not None and body.dimensions != dim:
            raise errors.invalid(f"dimensions: this model only produces {dim}-dimensional embeddings",
                                 "dimensions")
        return Job(entry=entry, route=self.route, body=body, work=Work.EMBED, texts=texts)

    def render_embeddings(self, job: Job, result: EmbeddingResult) -> dict[str, Any]:
        encode = base64_floats if job.body.encoding_format == "base64" else (lambda v: v)
        return {
            "object": "list", "model": job.model,
            "data": [{"object": "embedding", "index": i, "embedding": encode(v)}
                     for i, v in enumerate(result.vectors)],
            "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens},
        }

    # This route only embeds: admission's task check keeps generation jobs away, and these answer if it ever
    # lets one through.
    def render(self, job: Job, run: Run, finals: list[RequestOutput], created: int) -> dict[str, Any]:
        raise errors.invalid(f"{job.model} generates text and cannot serve the embeddings route", "model")

    def events(self, gen: pipeline.Generation, created: int) -> AsyncIterator[bytes]:
        raise errors.invalid("The embeddings route does not stream", "stream")


CHAT = ChatCompletions()
COMPLETIONS = Completions()
EMBEDDINGS = Embeddings()
