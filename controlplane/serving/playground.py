"""The dashboard's playground: one chat reply streamed from the engine to a signed-in user.

It is the API's path with a session for a principal: the session and CSRF token authenticate it (no API key is
pasted into a page), `pipeline.admit_for_account` applies the account's free allocation and budget and per-user
rate limits, and the request is metered like any other, billed to the account with no key and route
"playground". The reply is server-sent events over a fetch() POST:

    data: {"type": "start", "model", "request_id"}
    data: {"type": "token", "text"}                        one per engine output with text
    data: {"type": "done", "usage", "latency_ms", "ttft_ms", "neurons", "cost_usd", "finish_reason", "speculation",
           "parsed"}                                       parsed: the JSON value (json_schema), or the text
                                                           and tool calls apart (tools); null otherwise
    data: {"type": "error", "message"}                     the engine failed mid-stream

Anything refused before the stream starts is a 4xx JSON `{"error": {"message", "param", "code"}}`. A client
that leaves (the page's Stop button aborts the fetch) cancels the engine request; its event is `aborted`.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from decimal import Decimal
from typing import Any

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse, JsonResponse
from pydantic import Field

from controlplane.accounts.services import user_can_access
from controlplane.api import errors
from controlplane.api.body import Integer, StrictBody, parse
from controlplane.api.errors import ApiError
from controlplane.api.http import read_json, sse
from controlplane.catalog.services import ModelEntry, PriceSnapshot
from controlplane.serving import pipeline
from controlplane.serving.job import Job, Prompt, sampling_params
from controlplane.serving.protocol import tools as tool_glue
from controlplane.serving.protocol.base import event_stream
from controlplane.serving.protocol.common import check_tools, format_constraint, is_json_job, json_value
from controlplane.serving.protocol.native import DEFAULT_TEMPERATURE, native_calls
from controlplane.usage.services import charge
from inference import FinishReason, RequestOutput

ROUTE = "playground"
DEFAULT_MAX_TOKENS = 256
MAX_TEXT_CHARS = 32_000  # a playground message, not a document; the context window bounds it anyway


class PlaygroundRequest(StrictBody):
    model: str = Field(min_length=1)
    message: str = Field(max_length=MAX_TEXT_CHARS)
    system: str = Field("", max_length=MAX_TEXT_CHARS)
    max_tokens: Integer | None = None
    temperature: float | None = None
    json_schema: str = Field("", max_length=MAX_TEXT_CHARS, description="A JSON schema the reply must match.")
    tools: str = Field("", max_length=MAX_TEXT_CHARS, description="A JSON list of functions the model may call.")


def _parse(raw: dict[str, Any]) -> PlaygroundRequest:
    body = parse(PlaygroundRequest, raw)
    if not body.message.strip():
        raise errors.invalid("Write a message to send", "message")
    if body.json_schema.strip() and body.tools.strip():
        raise errors.invalid("Give a JSON schema or tools, not both", "tools")
    return body


def _json_field(text: str, param: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise errors.invalid(f"{param} is not valid JSON: {exc}", param) from None


def error_response(exc: ApiError) -> HttpResponse:
    response = JsonResponse({"error": {"message": exc.message, "param": exc.param, "code": exc.code}},
                            status=exc.status)
    for name, value in exc.headers.items():
        response[name] = value
    return response


def _prompt(entry: ModelEntry, body: PlaygroundRequest) -> Prompt:
    """Chat-template models get chat messages; a plain model gets one prompt, the system text first."""
    system = body.system.strip()
    if entry.has_chat_template:
        messages = [{"role": "system", "content": system}] if system else []
        return Prompt(messages=[*messages, {"role": "user", "content": body.message}])
    return Prompt(text=f"{system}\n\n{body.message}" if system else body.message, raw=True)


def _job(entry: ModelEntry, body: PlaygroundRequest) -> Job:
    constraint, tools = None, None
    if body.json_schema.strip():
        constraint = format_constraint("json_schema", _json_field(body.json_schema, "json_schema"), entry,
                                       "json_schema")
    if body.tools.strip():
        listed = _json_field(body.tools, "tools")
        if not isinstance(listed, list) or not listed:
            raise errors.invalid("tools: a JSON list of functions ({name, description, parameters})", "tools")
        tools = check_tools(listed, None, None, entry, None)
        constraint = tool_glue.constraint(tools) if tools is not None else None
    return Job(entry=entry, route=ROUTE, body=body, prompts=(_prompt(entry, body),),
               params=sampling_params(body, temperature=DEFAULT_TEMPERATURE), max_tokens=body.max_tokens,
               default_max_tokens=DEFAULT_MAX_TOKENS, stream=True, constraint=constraint, tools=tools)


def _parsed(job: Job, out: RequestOutput) -> dict[str, Any] | None:
    """What the page shows under "Parsed": the JSON value, or the text and tool calls apart."""
    if job.tools is not None:
        content, calls = tool_glue.split(out.text, job.tools)
        return {"content": content, "tool_calls": native_calls(calls)}
    if is_json_job(job):
        return {"json": json_value(out.text, out)}
    return None


def _charge(price: PriceSnapshot | None, out: RequestOutput) -> tuple[Decimal, Decimal]:
    """Neurons and dollars as metering records them, so the figures the page shows are the ones billed."""
    usage = out.usage
    return charge(price, usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens)


def _summary(gen: pipeline.Generation, out: RequestOutput) -> dict[str, Any]:
    neurons, cost = _charge(gen.adm.price, out)
    now = time.monotonic()
    spec = out.speculation or {}
    return {
        "type": "done", "finish_reason": "length" if out.finish_reason == FinishReason.LENGTH else "stop",
        "usage": {"input_tokens": out.usage.prompt_tokens, "cached_input_tokens": out.usage.cached_tokens,
                  "output_tokens": out.usage.completion_tokens},
        "latency_ms": round((now - gen.started) * 1000, 1),
        "ttft_ms": round((gen.first_token_at - gen.started) * 1000, 1) if gen.first_token_at else None,
        "neurons": str(neurons), "cost_usd": str(cost),
        "speculation": {"proposed": spec.get("proposed", 0), "accepted": spec.get("accepted", 0)},
        "parsed": _parsed(gen.job, out),
    }


async def _stream(adm: pipeline.Admission, started: float) -> HttpResponse:
    gen = pipeline.Generation(adm=adm, stream=True, session_affinity="", started=started)
    await gen.prepare()
    await gen.open_stream()
    request_id = gen.request_id

    async def events() -> AsyncIterator[bytes]:
        yield sse({"type": "start", "model": adm.entry.name, "request_id": request_id})
        async with aclosing(gen.outputs()) as outputs:
            async for _choice, out in outputs:
                if out.delta_text:
                    yield sse({"type": "token", "text": out.delta_text})
                if out.finished:
                    if out.finish_reason == FinishReason.ERROR:
                        yield sse({"type": "error", "message": f"The engine failed this request: "
                                                               f"{out.error or 'unknown error'}"})
                    else:
                        yield sse(_summary(gen, out))

    return event_stream(events())


async def run(request: HttpRequest, account_id: str) -> HttpResponse:
    """POST /dashboard/<account>/models/playground/ (JSON: model, message, system, max_tokens, temperature,
    json_schema, tools; the last two as JSON text).

    Session-authenticated and CSRF-checked by the dashboard's middleware; owners of the account and operators
    only, since it spends the account's money."""
    started = time.monotonic()
    if request.method != "POST":
        return error_response(errors.method_not_allowed(["POST"]))
    user = await request.auser()
    if not user.is_authenticated:
        return error_response(errors.unauthorized("Your session has ended: sign in again"))
    if not await sync_to_async(user_can_access)(user, account_id, manage=True):
        if await sync_to_async(user_can_access)(user, account_id):
            return error_response(errors.forbidden("Only the account's owners can run the playground"))
        return error_response(errors.not_found("No such account"))
    try:
        raw = read_json(request)
        model = raw.get("model")
        if not isinstance(model, str) or not model:
            raise errors.invalid("Choose a model", "model")
        adm = await sync_to_async(pipeline.admit_for_account)(account_id, user.pk, model=model,
                                                              body=lambda entry: _job(entry, _parse(raw)))
        return await _stream(adm, started)
    except ApiError as exc:
        return error_response(exc)
