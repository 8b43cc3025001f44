"""The Hermes/Qwen tool-call format as one object: its grammar, its parser and its text.

    fmt = HERMES
    constraint = fmt.constraint(tools, "auto", parallel=True)   # GenerationRequest(constraint=...)
    parser = fmt.parser(tools)                                   # parser.feed(delta) ... parser.finish()
    content, calls = fmt.parse(output_text, tools)

The grammar is an xgrammar structural tag. Each function is a tag whose fixed opening carries its name,
`<tool_call>\\n{"name": "NAME", "arguments": `, followed by its parameters schema and `}\\n</tool_call>`,
so the name can only be one of the tools' and the arguments must match that function's schema. Whitespace
inside the arguments is JSON's, which the parser accepts too.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from inference.constrained import Constraint, ConstraintKind
from inference.errors import InvalidRequestError
from inference.tools import syntax
from inference.tools.parser import ToolCall, ToolCallParser, new_call_id, parse
from inference.tools.spec import ToolChoice, ToolSpec, as_tool_specs


def _names(tools: Iterable[ToolSpec | Mapping[str, Any]] | None) -> list[str] | None:
    return None if tools is None else [t.name for t in as_tool_specs(tools)]


class HermesFormat:
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, as Qwen2.5 and Hermes models write it;
    Hearth renders the same syntax into the prompt of models whose templates have no tools."""

    open = syntax.OPEN
    close = syntax.CLOSE

    def constraint(self, tools: Sequence[ToolSpec | Mapping[str, Any]],
                   choice: str | Mapping[str, Any] | ToolChoice = "auto", parallel: bool = True) -> Constraint:
        """The grammar a generation must follow.

        choice "auto": free text, and whatever follows `<tool_call>` is a call of one of the tools matching its
        schema; "required": one call or more and nothing else; a function's name (or ToolChoice): exactly one
        call of that function; "none": text that never opens `<tool_call>`. parallel=False allows at most one
        call (for "auto", nothing may follow it).
        """
        # Imported here: xgrammar is needed only where grammars are built, not by everything that parses tools.
        from xgrammar import StructuralTag
        from xgrammar import structural_tag as st

        specs = as_tool_specs(tools)
        if not specs:
            raise InvalidRequestError("tool calling needs at least one tool")
        if not isinstance(parallel, bool):
            raise InvalidRequestError("parallel_tool_calls must be true or false")
        chosen = ToolChoice.parse(choice, specs)

        def tag(spec: ToolSpec) -> st.TagFormat:
            return st.TagFormat(begin=f"{syntax.CALL_PREFIX}{spec.name}{syntax.ARGUMENTS_PREFIX}",
                                content=st.JSONSchemaFormat(json_schema=spec.parameters), end=syntax.CALL_SUFFIX)

        fmt: Any
        if chosen.mode == "none":
            fmt = st.AnyTextFormat(excludes=[syntax.OPEN])
        elif chosen.mode == "auto":
            fmt = st.TriggeredTagsFormat(triggers=[syntax.OPEN], tags=[tag(s) for s in specs],
                                         stop_after_first=not parallel)
        elif chosen.mode == "required":
            fmt = st.TagsWithSeparatorFormat(tags=[tag(s) for s in specs], separator=syntax.CALL_SEPARATOR,
                                             at_least_one=True, stop_after_first=not parallel)
        else:
            fmt = tag(next(s for s in specs if s.name == chosen.function))
        # Not Constraint.structural_tag: it sorts keys, and a schema's property order is the order the grammar
        # makes the model write them in (the order the prompt shows).
        spec = json.dumps(StructuralTag(format=fmt).model_dump(mode="json"), separators=(",", ":"))
        return Constraint(ConstraintKind.STRUCTURAL_TAG, spec)

    def parser(self, tools: Iterable[ToolSpec | Mapping[str, Any]] | None = None, *,
               make_id: Callable[[], str] = new_call_id) -> ToolCallParser:
        """A streaming parser; with tools, a call naming any other function stays content."""
        return ToolCallParser(_names(tools), make_id=make_id)

    def parse(self, text: str, tools: Iterable[ToolSpec | Mapping[str, Any]] | None = None
              ) -> tuple[str, list[ToolCall]]:
        """A whole output's content and calls (the same result as streaming it through `parser`)."""
        return parse(text, _names(tools))

    def render_call(self, name: str, arguments: Mapping[str, Any]) -> str:
        return syntax.render_call(name, arguments)

    def render_response(self, content: str) -> str:
        return syntax.render_response(content)

    def tools_prompt(self, tools: Sequence[ToolSpec]) -> str:
        return syntax.tools_prompt(tools)


HERMES = HermesFormat()
