"""The text of the Hermes/Qwen tool-call syntax: how a call, a tool result and the tool instructions read.

A call is exactly what the grammar lets a model write and what the parser reads:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Several calls are separated by one newline. A result goes back to the model in a user turn:

    <tool_response>
    {"temperature": 21}
    </tool_response>
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from inference.tools.spec import ToolSpec

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
# The grammar's fixed text around a call's name and arguments (what Qwen's own template writes for past calls).
CALL_PREFIX = OPEN + '\n{"name": "'
ARGUMENTS_PREFIX = '", "arguments": '
CALL_SUFFIX = "}\n" + CLOSE
CALL_SEPARATOR = "\n"
RESPONSE_OPEN = "<tool_response>"
RESPONSE_CLOSE = "</tool_response>"


def dump_arguments(arguments: Mapping[str, Any]) -> str:
    """Arguments as JSON text the way chat templates write them (`tojson`: ", " and ": ", non-ASCII kept)."""
    return json.dumps(arguments, ensure_ascii=False)


def render_call(name: str, arguments: Mapping[str, Any]) -> str:
    return f"{CALL_PREFIX}{name}{ARGUMENTS_PREFIX}{dump_arguments(arguments)}{CALL_SUFFIX}"


def render_response(content: str) -> str:
    return f"{RESPONSE_OPEN}\n{content}\n{RESPONSE_CLOSE}"


def tools_prompt(tools: Sequence[ToolSpec]) -> str:
    """The instructions that offer tools to a model whose chat template cannot: the same syntax as Qwen's, so
    one parser and one grammar serve every model."""
    signatures = "\n".join(json.dumps(t.as_openai(), ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\n"
        "You may call functions to help with the user's request. Their signatures are listed inside "
        "<tools></tools>, one JSON object per line:\n"
        f"<tools>\n{signatures}\n</tools>\n\n"
        "To call a function, write a JSON object with its name and its arguments inside "
        f"{OPEN}{CLOSE} tags, one block per call:\n"
        f"{OPEN}\n"
        '{"name": "<function name>", "arguments": <the arguments as a JSON object>}\n'
        f"{CLOSE}\n"
        f"Each result comes back inside {RESPONSE_OPEN}{RESPONSE_CLOSE} tags."
    )
