"""Checks and shapes several APIs share: messages, output formats and tools, usage objects."""

from __future__ import annotations

import json
from typing import Any

from controlplane.api import errors
from controlplane.catalog.services import ModelEntry
from controlplane.serving.job import Job, Tools, schema_constraint
from controlplane.serving.protocol import tools as tool_glue
from controlplane.serving.schemas import Message
from inference import FinishReason, RequestOutput, Usage
from inference.constrained import Constraint, ConstraintKind


def usage_json(usage: Usage) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens, "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def message_dicts(messages: list[Message]) -> list[dict[str, Any]]:
    """Chat messages as the prompt renderer takes them; an empty turn is a 400 here rather than a template's
    puzzling error later."""
    out = []
    for i, message in enumerate(messages):
        data = message.model_dump(exclude_none=True)
        if message.content is None and not (message.role == "assistant" and message.tool_calls):
            raise errors.invalid(f"messages[{i}].content is required (only an assistant message with tool_calls "
                                 "may omit it)", f"messages.{i}.content")
        if message.tool_calls and message.role != "assistant":
            raise errors.invalid(f"messages[{i}].tool_calls: only assistant messages make tool calls",
                                 f"messages.{i}.tool_calls")
        data.setdefault("content", "")
        out.append(data)
    return out


def format_constraint(kind: str | None, schema: Any, entry: ModelEntry, param: str) -> Constraint | None:
    """A response format ("text", "json_object", "json_schema" with its schema) as a grammar constraint."""
    if kind in (None, "text"):
        return None
    if not entry.supports_json_mode:
        raise errors.invalid(f"{entry.name} does not support JSON mode", param)
    if kind == "json_object":
        return Constraint.json_object()
    return schema_constraint(schema, param)


def is_json_job(job: Job) -> bool:
    """The output is a JSON value by construction (JSON mode), not tool calls."""
    return job.tools is None and job.constraint is not None and job.constraint.kind in (
        ConstraintKind.JSON_OBJECT, ConstraintKind.JSON_SCHEMA)


def json_value(text: str, final: RequestOutput) -> Any:
    """A JSON-mode answer as the value itself (Workers AI's `response`); cut-off text stays text."""
    if final.finish_reason != FinishReason.STOP:
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def check_tools(raw_tools: list[Any] | None, choice: Any, parallel: bool | None, entry: ModelEntry,
                constraint: Constraint | None) -> Tools | None:
    """The tools a request offers, checked against the model and each other: None when it offers none (or
    tool_choice is "none")."""
    if not raw_tools:
        if choice not in (None, "none", "auto"):
            raise errors.invalid("tool_choice needs tools", "tool_choice")
        return None
    if choice == "none":
        return None
    if not entry.supports_tools:
        raise errors.invalid(f"{entry.name} does not support tool calling", "tools")
    if constraint is not None:
        raise errors.invalid("give tools or a JSON response_format, not both", "response_format")
    return tool_glue.tools(raw_tools, choice, True if parallel is None else parallel)


def finish_reason(final: RequestOutput, calls: bool = False) -> str:
    if final.finish_reason == FinishReason.LENGTH:
        return "length"
    return "tool_calls" if calls else "stop"
