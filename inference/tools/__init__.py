"""Tool (function) calling in the engine library: the functions a request offers (`ToolSpec`), the Hermes/Qwen
call syntax (`HERMES`: its grammar, its streaming parser, its text), and the prompt side lives in
`inference.prompts` (`encode_prompt(..., tools=...)`)."""

from inference.tools.hermes import HERMES, HermesFormat
from inference.tools.parser import (
    ArgumentsDelta,
    ContentDelta,
    ToolCall,
    ToolCallParser,
    ToolCallStart,
    ToolEvent,
    new_call_id,
    parse,
)
from inference.tools.spec import ToolChoice, ToolSpec, as_tool_specs

__all__ = [
    "HERMES", "HermesFormat", "ToolSpec", "ToolChoice", "as_tool_specs", "ToolCallParser", "ToolCall",
    "ToolEvent", "ContentDelta", "ToolCallStart", "ArgumentsDelta", "new_call_id", "parse",
]
