"""Prompt rendering: chat messages through the model's template, or raw text as is, and the tools a request
offers.

Messages are OpenAI's: `system`/`developer`, `user`, `assistant` (content may be null or empty when it has
`tool_calls`: `[{"id", "type": "function", "function": {"name", "arguments": "<JSON object text>"}}]`; the
flat `{"name", "arguments"}` form and arguments given as an object are accepted too) and `tool` (content, and
optionally the `tool_call_id` it answers).

Tools (`tools=`: `ToolSpec`s or OpenAI/Workers AI function dicts) reach the model in the Hermes/Qwen syntax of
`inference.tools`, so one grammar and one parser serve every model:

* A template that renders tools itself in that syntax (its text mentions `tools`, `tool_calls` and
  `<tool_call>`, as Qwen2.5's does) gets them as it expects: `tools` as OpenAI function objects, past calls as
  `tool_calls` with their arguments as objects, results as `tool` messages.
* Any other chat template (SmolLM2's) gets plain turns that Hearth writes in the same syntax:
  - the tools prompt (`inference.tools.syntax.tools_prompt`: "# Tools", one function signature per line
    inside `<tools></tools>`, and how to call) ends the first system turn, after a blank line, or is a new
    system turn at the start;
  - an assistant turn's calls become its text, after its content and a newline, one block per call joined
    by newlines: `<tool_call>\\n{"name": "NAME", "arguments": {...}}\\n</tool_call>`;
  - each run of consecutive tool messages becomes one user turn holding every result, in order, as
    `<tool_response>\\n...\\n</tool_response>` joined by newlines. tool_call_id is not shown: as in Qwen's
    template, results follow the order of the calls.
* A prompt that skips the template (raw, or a model without one) gets the tools prompt and a blank line before
  its text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from inference.errors import InvalidRequestError
from inference.tools.spec import NAME_PATTERN, ToolSpec, as_tool_specs
from inference.tools.syntax import OPEN, render_call, render_response, tools_prompt

ROLES = {"system", "user", "assistant", "tool", "developer"}


def _text(content: Any, where: str, *, optional: bool = False) -> str:
    if content is None and optional:
        return ""
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
            raise InvalidRequestError(f"{where}: only text parts are supported")
        content = "".join(texts)
    if not isinstance(content, str):
        raise InvalidRequestError(f"{where} must be a string")
    return content


def _check_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """Past calls as {"id", "name", "arguments": dict}; a name or arguments the syntax cannot carry is refused."""
    if not isinstance(calls, list | tuple):
        raise InvalidRequestError(f"{where} must be a list")
    checked = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        if not isinstance(call, dict):
            raise InvalidRequestError(f"{at} must be an object")
        if call.get("type", "function") != "function":
            raise InvalidRequestError(f"{at}.type must be \"function\"")
        function = call.get("function", call)  # OpenAI nests the function; Workers AI may not
        if not isinstance(function, dict):
            raise InvalidRequestError(f"{at}.function must be an object")
        name = function.get("name")
        if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
            raise InvalidRequestError(f"{at}: invalid function name {name!r}")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                raise InvalidRequestError(f"{at}.function.arguments is not valid JSON") from None
        if not isinstance(arguments, dict):
            raise InvalidRequestError(f"{at}.function.arguments must be a JSON object")
        call_id = call.get("id", "")
        if not isinstance(call_id, str):
            raise InvalidRequestError(f"{at}.id must be a string")
        checked.append({"id": call_id, "name": name, "arguments": arguments})
    return checked


def _check_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Messages as {"role", "content"}, plus "tool_calls" on assistant turns that made calls and
    "tool_call_id" on tool results that name one."""
    if not isinstance(messages, list | tuple) or not messages:
        raise InvalidRequestError("messages must be a non-empty list")
    checked: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequestError(f"messages[{i}] must be an object with role and content")
        role = message.get("role")
        if role not in ROLES:
            raise InvalidRequestError(f"messages[{i}].role must be one of {sorted(ROLES)}")
        calls = message.get("tool_calls") if role == "assistant" else None
        calls = _check_tool_calls(calls, f"messages[{i}].tool_calls") if calls else None
        entry: dict[str, Any] = {"role": "system" if role == "developer" else role,
                                 "content": _text(message.get("content"), f"messages[{i}].content",
                                                  optional=calls is not None)}
        if calls:
            entry["tool_calls"] = calls
        if role == "tool" and message.get("tool_call_id") is not None:
            if not isinstance(message["tool_call_id"], str):
                raise InvalidRequestError(f"messages[{i}].tool_call_id must be a string")
            entry["tool_call_id"] = message["tool_call_id"]
        checked.append(entry)
    return checked


def native_tool_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the model's own chat template renders tools, past calls and results in the Hermes syntax.
    Every model takes tools either way; without this, Hearth writes them into plain turns."""
    template = getattr(tokenizer, "chat_template", None)
    return (isinstance(template, str) and re.search(r"\btools\b", template) is not None
            and "tool_calls" in template and OPEN in template)


def encode_prompt(tokenizer: PreTrainedTokenizerBase, *, prompt: str | None = None,
                  messages: Sequence[Any] | None = None, raw: bool = False,
                  tools: Sequence[ToolSpec | Mapping[str, Any]] | None = None) -> list[int]:
    """Token ids for a request.

    messages go through the chat template with the generation prompt appended. A prompt on a chat model is
    wrapped as one user message unless raw is set (Workers AI's rule); a model without a template takes
    prompts as they are and refuses messages. tools are rendered as the module docstring describes.
    """
    if (prompt is None) == (messages is None):
        raise InvalidRequestError("give exactly one of prompt or messages")
    specs = as_tool_specs(tools) if tools else ()
    template = getattr(tokenizer, "chat_template", None)
    if messages is not None:
        if not template:
            raise InvalidRequestError("this model has no chat template: send a raw prompt instead of messages")
        return _apply_template(tokenizer, _check_messages(messages), specs)
    if not isinstance(prompt, str):
        raise InvalidRequestError("prompt must be a string")
    if not prompt:
        raise InvalidRequestError("the prompt is empty")
    if template and not raw:
        return _apply_template(tokenizer, [{"role": "user", "content": prompt}], specs)
    if specs:
        prompt = f"{tools_prompt(specs)}\n\n{prompt}"
    return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])


def _apply_template(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]],
                    specs: Sequence[ToolSpec]) -> list[int]:
    kwargs: dict[str, Any] = {}
    if specs or any("tool_calls" in m or m["role"] == "tool" for m in messages):
        if native_tool_template(tokenizer):
            messages = [_native(m) for m in messages]
            if specs:
                kwargs["tools"] = [s.as_openai() for s in specs]
        else:
            messages = _written_out(messages, specs)
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    except Exception as exc:  # templates raise their own errors (e.g. roles must alternate)
        raise InvalidRequestError(f"the chat template rejected these messages: {exc}") from exc
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _native(message: dict[str, Any]) -> dict[str, Any]:
    """A message as HF tool-aware templates take it: calls in OpenAI's shape with arguments as objects."""
    if "tool_calls" not in message:
        return message
    calls = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
             for c in message["tool_calls"]]
    return {"role": message["role"], "content": message["content"], "tool_calls": calls}


def _written_out(messages: list[dict[str, Any]], specs: Sequence[ToolSpec]) -> list[dict[str, Any]]:
    """Plain role/content turns carrying tools, calls and results in the Hermes syntax (module docstring)."""
    out: list[dict[str, Any]] = []
    results_open = False  # whether out[-1] is the user turn collecting a run of tool results
    for message in messages:
        role, content = message["role"], message["content"]
        if role == "tool":
            if results_open:
                out[-1]["content"] += "\n" + render_response(content)
            else:
                out.append({"role": "user", "content": render_response(content)})
            results_open = True
            continue
        results_open = False
        if "tool_calls" in message:
            blocks = "\n".join(render_call(c["name"], c["arguments"]) for c in message["tool_calls"])
            content = f"{content}\n{blocks}" if content else blocks
        out.append({"role": role, "content": content})
    if specs:
        instructions = tools_prompt(specs)
        if out[0]["role"] == "system":
            system = out[0]["content"]
            out[0] = {"role": "system", "content": f"{system}\n\n{instructions}" if system else instructions}
        else:
            out.insert(0, {"role": "system", "content": instructions})
    return out


def prompt_char_limit(tokenizer: PreTrainedTokenizerBase, max_model_len: int) -> int:
    """Characters past which no prompt fits the context: the context length times the longest token's text
    (every token stands for at least one character of the prompt, and at most this many). Lets a server
    refuse a huge prompt before spending seconds tokenising it."""
    longest = max((len(tokenizer.convert_tokens_to_string([t])) for t in tokenizer.get_vocab()), default=1)
    return max_model_len * max(longest, 1)
