"""Tool calls between the APIs' shapes and the engine library's call syntax (`inference.tools.HERMES`): the
offered tools checked into a job, the grammar that holds calls to their schemas, and calls parsed out of
generated text, whole or streamed, in OpenAI's shape (Workers AI's is derived from it)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from controlplane.api import errors
from controlplane.serving.job import Tools
from inference.constrained import Constraint
from inference.errors import InvalidRequestError
from inference.tools import (
    HERMES,
    ArgumentsDelta,
    ContentDelta,
    ToolCall,
    ToolCallStart,
    ToolChoice,
    as_tool_specs,
)


def tools(raw_tools: list[Any], choice: Any, parallel: bool) -> Tools:
    """The tools of a request (pydantic bodies or plain dicts, OpenAI's or Workers AI's flat shape) and its
    tool_choice; 400 for a bad definition, duplicate names or a choice naming no offered tool."""
    dicts = [t.model_dump(exclude_none=True) if isinstance(t, BaseModel) else t for t in raw_tools]
    if isinstance(choice, BaseModel):
        choice = choice.model_dump()
    try:
        specs = as_tool_specs(dicts)
    except InvalidRequestError as exc:
        raise errors.invalid(f"tools: {exc}", "tools") from None
    try:
        chosen = ToolChoice.parse("auto" if choice is None else choice, specs)
    except InvalidRequestError as exc:
        raise errors.invalid(str(exc), "tool_choice") from None
    return Tools(specs=specs, choice=chosen, parallel=parallel)


def constraint(offered: Tools) -> Constraint:
    """The grammar: with "auto" free text in which any call follows its function's schema; with "required"
    or a named function nothing but calls."""
    try:
        return HERMES.constraint(offered.specs, offered.choice, offered.parallel)
    except InvalidRequestError as exc:
        raise errors.invalid(f"tools: {exc}", "tools") from None


def openai_call(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def split(text: str, offered: Tools | None = None) -> tuple[str, list[dict[str, Any]]]:
    """A whole output as its text and its calls (OpenAI's shape)."""
    content, calls = HERMES.parse(text, offered.specs if offered is not None else None)
    return content, [openai_call(c) for c in calls]


class StreamParser:
    """Streamed output as OpenAI chat deltas: `{"content": ...}` for text, `{"tool_calls": [...]}` with each
    call's index, id and name first and then its argument fragments, exactly as the SDKs assemble them."""

    def __init__(self, offered: Tools | None = None) -> None:
        self._parser = HERMES.parser(offered.specs if offered is not None else None)

    @property
    def calls(self) -> list[dict[str, Any]]:
        return [openai_call(c) for c in self._parser.calls]

    def feed(self, text: str) -> list[dict[str, Any]]:
        return self._deltas(self._parser.feed(text)) if text else []

    def finish(self) -> list[dict[str, Any]]:
        return self._deltas(self._parser.finish())

    @staticmethod
    def _deltas(events: list[Any]) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for event in events:
            if isinstance(event, ContentDelta):
                if deltas and "content" in deltas[-1]:
                    deltas[-1]["content"] += event.text
                else:
                    deltas.append({"content": event.text})
            elif isinstance(event, ToolCallStart):
                deltas.append({"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                               "function": {"name": event.name, "arguments": ""}}]})
            elif isinstance(event, ArgumentsDelta):
                deltas.append({"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]})
        return deltas
