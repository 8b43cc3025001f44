"""The functions a request offers (`ToolSpec`) and how the model may use them (`tool_choice`)."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from inference.errors import InvalidRequestError

# OpenAI's rule for function names. It also keeps names safe to splice into the call syntax and the grammar
# verbatim: no quote, backslash or whitespace can appear in one.
NAME_PATTERN = re.compile(r"[a-zA-Z0-9_-]{1,64}")
MODES = ("auto", "required", "none")


def _empty_parameters() -> dict[str, Any]:
    return {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """One function the model may call: its name, what it does, and a JSON schema for its arguments.

    The arguments of a call are always a JSON object, so `parameters` must be an object schema; a schema that
    names no type gets `"type": "object"` added. `parameters` is copied on construction (plain JSON values only),
    so later changes to the caller's dict never reach a compiled grammar.
    """

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=_empty_parameters)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not NAME_PATTERN.fullmatch(self.name):
            raise InvalidRequestError(f"invalid function name {self.name!r}: use 1 to 64 letters, digits, "
                                      "underscores or dashes")
        if self.description is None:
            object.__setattr__(self, "description", "")
        if not isinstance(self.description, str):
            raise InvalidRequestError(f"function {self.name}: description must be a string")
        parameters = self.parameters
        if parameters is None:
            parameters = _empty_parameters()
        if not isinstance(parameters, Mapping):
            raise InvalidRequestError(f"function {self.name}: parameters must be a JSON schema object")
        try:  # a round trip keeps only JSON values and gives us our own copy
            parameters = json.loads(json.dumps(parameters))
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(f"function {self.name}: parameters are not JSON: {exc}") from None
        kind = parameters.setdefault("type", "object")
        if kind != "object":
            raise InvalidRequestError(f"function {self.name}: parameters must be an object schema "
                                      f"(type \"object\"), not {kind!r}")
        object.__setattr__(self, "parameters", parameters)

    @classmethod
    def from_openai(cls, data: Mapping[str, Any]) -> ToolSpec:
        """OpenAI's `{"type": "function", "function": {...}}`, or the flat `{"name", "description", "parameters"}`
        of Workers AI (and of OpenAI's Responses API, with `"type": "function"`)."""
        if not isinstance(data, Mapping):
            raise InvalidRequestError("a tool must be an object")
        if data.get("type", "function") != "function":
            raise InvalidRequestError(f"unsupported tool type {data.get('type')!r}: only \"function\"")
        if "function" in data or "name" not in data:  # nested (Chat Completions) unless flat with its name
            data = data.get("function")  # type: ignore[assignment]
            if not isinstance(data, Mapping):
                raise InvalidRequestError("a tool needs a \"function\" object (or, flat, a \"name\")")
        if "name" not in data:
            raise InvalidRequestError("a function needs a name")
        return cls(name=data["name"], description=data.get("description") or "",
                   parameters=data.get("parameters"))  # type: ignore[arg-type]  # None means no parameters

    def as_openai(self) -> dict[str, Any]:
        """OpenAI's function-tool shape, as chat templates expect it (a fresh copy each time)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = copy.deepcopy(self.parameters)
        return {"type": "function", "function": function}


def as_tool_specs(tools: Iterable[ToolSpec | Mapping[str, Any]]) -> tuple[ToolSpec, ...]:
    """ToolSpecs from specs or OpenAI/Workers AI dicts, refusing duplicate names (a call names its function)."""
    if isinstance(tools, str | bytes | Mapping):
        raise InvalidRequestError("tools must be a list")
    specs = tuple(t if isinstance(t, ToolSpec) else ToolSpec.from_openai(t) for t in tools)
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise InvalidRequestError(f"two tools are named {spec.name!r}")
        seen.add(spec.name)
    return specs


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """How the model may use the tools: `mode` is "auto" (text, calls or both), "required" (one call or more,
    nothing else), "none" (no call) or "function" (exactly one call of `function`)."""

    mode: str
    function: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in (*MODES, "function"):
            raise InvalidRequestError(f"unknown tool_choice mode {self.mode!r}")
        if (self.mode == "function") != isinstance(self.function, str):
            raise InvalidRequestError("tool_choice names a function exactly when its mode is \"function\"")

    @classmethod
    def parse(cls, choice: str | Mapping[str, Any] | ToolChoice, tools: Iterable[ToolSpec]) -> ToolChoice:
        """A string ("auto", "required", "none", or a function's name), OpenAI's object form
        `{"type": "function", "function": {"name": ...}}` (or `{"name": ...}`), checked against the tools.

        The modes win over a function named like one; the object form is the way to force such a function.
        """
        names = {t.name for t in tools}
        if isinstance(choice, ToolChoice):
            if choice.function is not None and choice.function not in names:
                raise InvalidRequestError(f"tool_choice names {choice.function!r}, which is not among the tools")
            return choice
        if isinstance(choice, Mapping):
            function = choice.get("function", choice)
            name = function.get("name") if isinstance(function, Mapping) else None
            if not isinstance(name, str):
                raise InvalidRequestError("tool_choice must name a function: {\"type\": \"function\", "
                                          "\"function\": {\"name\": ...}}")
        elif isinstance(choice, str):
            if choice in MODES:
                return cls(choice)
            name = choice
        else:
            raise InvalidRequestError("tool_choice must be \"auto\", \"required\", \"none\" or a function")
        if name not in names:
            raise InvalidRequestError(f"tool_choice names {name!r}, which is not among the tools")
        return cls("function", name)
