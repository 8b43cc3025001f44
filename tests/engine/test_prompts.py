"""Prompt rendering with real tokenizers: plain chats as before, and tools, past calls and results, through the
model's own template (Qwen2.5) or written out in the same syntax (SmolLM2, and Gemma 3's raw prompts)."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from inference.errors import InvalidRequestError
from inference.prompts import encode_prompt, native_tool_template
from inference.tools import HERMES, ToolSpec
from inference.tools.syntax import tools_prompt
from tests.engine.conftest import GEMMA, QWEN, SMOLLM, installed

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"name": "get_time", "description": "Local time", "parameters": {"type": "object", "properties": {}}}

CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
    ]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "25 C"},
    {"role": "assistant", "content": "Paris 21 C, Rome 25 C."},
    {"role": "user", "content": "And Oslo?"},
]
PAST_CALLS = (HERMES.render_call("get_weather", {"city": "Paris"}) + "\n"
              + HERMES.render_call("get_weather", {"city": "Rome"}))
RESULTS = "<tool_response>\n21 C\n</tool_response>\n<tool_response>\n25 C\n</tool_response>"


def load(name: str) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(installed(name))


@pytest.fixture(scope="module")
def qwen() -> PreTrainedTokenizerBase:
    return load(QWEN)


@pytest.fixture(scope="module")
def smollm() -> PreTrainedTokenizerBase:
    return load(SMOLLM)


@pytest.fixture(scope="module")
def gemma() -> PreTrainedTokenizerBase:
    return load(GEMMA)


def render(tokenizer: PreTrainedTokenizerBase, **kwargs: Any) -> str:
    return tokenizer.decode(encode_prompt(tokenizer, **kwargs))


def test_plain_chats_render_as_before(qwen: PreTrainedTokenizerBase, smollm: PreTrainedTokenizerBase) -> None:
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": [
        {"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]
    for tok in (qwen, smollm):
        expected = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "Hi there"}],
                                           tokenize=False, add_generation_prompt=True)
        assert encode_prompt(tok, messages=messages) == tok(expected, add_special_tokens=False)["input_ids"]
        assert encode_prompt(tok, messages=messages, tools=[]) == encode_prompt(tok, messages=messages)


def test_which_templates_render_tools(qwen: PreTrainedTokenizerBase, smollm: PreTrainedTokenizerBase,
                                      gemma: PreTrainedTokenizerBase) -> None:
    assert native_tool_template(qwen)
    assert not native_tool_template(smollm)
    assert not native_tool_template(gemma)


def test_qwen_renders_tools_calls_and_results_through_its_template(qwen: PreTrainedTokenizerBase) -> None:
    text = render(qwen, messages=CONVERSATION, tools=[WEATHER, CLOCK])
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")  # Qwen's own tools section
    assert ToolSpec.from_openai(WEATHER).as_openai() == WEATHER
    for tool in (WEATHER, {"type": "function", "function": CLOCK}):  # each signature, as the template dumps it
        assert qwen.apply_chat_template([{"role": "user", "content": "x"}], tools=[tool], tokenize=False
                                        ).split("<tools>\n")[1].split("\n</tools>")[0] in text
    assert f"<|im_start|>assistant\n{PAST_CALLS}<|im_end|>\n<|im_start|>user\n{RESULTS}<|im_end|>\n" in text
    assert "Hearth" not in text and "You may call functions to help" not in text  # not our fallback
    assert text.endswith("<|im_start|>user\nAnd Oslo?<|im_end|>\n<|im_start|>assistant\n")
    # Arguments as JSON text (OpenAI), or as an object, with the flat call shape: the same prompt.
    flat = [dict(m) for m in CONVERSATION]
    flat[2] = {"role": "assistant", "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}},
                                                   {"name": "get_weather", "arguments": {"city": "Rome"}}]}
    assert render(qwen, messages=flat, tools=[WEATHER, CLOCK]) == text


def test_smollm_gets_the_documented_tools_prompt(smollm: PreTrainedTokenizerBase) -> None:
    specs = [ToolSpec.from_openai(WEATHER), ToolSpec.from_openai(CLOCK)]
    text = render(smollm, messages=CONVERSATION, tools=[WEATHER, CLOCK])
    instructions = tools_prompt(specs)
    assert text.startswith(f"<|im_start|>system\nBe brief.\n\n{instructions}<|im_end|>\n")
    assert '{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", ' in text
    assert f"<|im_start|>assistant\n{PAST_CALLS}<|im_end|>\n<|im_start|>user\n{RESULTS}<|im_end|>\n" in text
    assert text.endswith("<|im_start|>user\nAnd Oslo?<|im_end|>\n<|im_start|>assistant\n")
    assert "<|im_start|>tool" not in text
    # What the prompt shows as a past call is what the parser reads as one.
    shown = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    content, calls = HERMES.parse(shown, specs)
    assert content == "" and [c.arguments_object() for c in calls] == [{"city": "Paris"}, {"city": "Rome"}]
    # Without a system message the tools prompt is one; content before calls stays, one newline apart.
    chat = [{"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
            {"role": "tool", "content": "noon"}]
    text = render(smollm, messages=chat, tools=[CLOCK])
    assert text.startswith(f"<|im_start|>system\n{tools_prompt([ToolSpec.from_openai(CLOCK)])}<|im_end|>\n"
                           "<|im_start|>user\nHi<|im_end|>\n")
    assert (f"<|im_start|>assistant\nChecking.\n{HERMES.render_call('get_time', {})}<|im_end|>\n"
            "<|im_start|>user\n<tool_response>\nnoon\n</tool_response><|im_end|>\n") in text


def test_past_calls_render_without_tools_on_offer(qwen: PreTrainedTokenizerBase,
                                                  smollm: PreTrainedTokenizerBase) -> None:
    for tok in (qwen, smollm):
        text = render(tok, messages=CONVERSATION)
        assert PAST_CALLS in text and RESULTS in text and "# Tools" not in text


def test_raw_prompts_get_the_tools_prompt_in_front(gemma: PreTrainedTokenizerBase) -> None:
    spec = ToolSpec.from_openai(WEATHER)
    ids = encode_prompt(gemma, prompt="What is the weather in Oslo?", tools=[spec])
    assert ids == gemma(f"{tools_prompt([spec])}\n\nWhat is the weather in Oslo?")["input_ids"]
    assert encode_prompt(gemma, prompt="Hi") == gemma("Hi")["input_ids"]


@pytest.mark.parametrize(("messages", "tools", "match"), [
    ([{"role": "assistant", "content": None}], None, "content must be a string"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}], None, "not valid JSON"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}], None, "JSON object"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "bad name", "arguments": "{}"}}]}], None, "name"),
    ([{"role": "assistant", "tool_calls": [{"type": "web", "function": {"name": "f"}}]}], None, "type"),
    ([{"role": "assistant", "tool_calls": {"name": "f"}}], None, "must be a list"),
    ([{"role": "tool", "content": "x", "tool_call_id": 5}], None, "tool_call_id"),
    ([{"role": "user", "content": "hi"}], [{"name": "has space"}], "invalid function name"),
    ([{"role": "user", "content": "hi"}], [CLOCK, CLOCK], "two tools"),
])
def test_bad_tool_messages_are_refused(smollm: PreTrainedTokenizerBase, messages: list[Any], tools: Any,
                                       match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        encode_prompt(smollm, messages=messages, tools=tools)
