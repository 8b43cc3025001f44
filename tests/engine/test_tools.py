"""Tool calling in the engine library: tool specs, the streaming parser, and the grammar that keeps calls valid."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import pytest

from inference.errors import InvalidRequestError
from inference.tools import (
    HERMES,
    ArgumentsDelta,
    ContentDelta,
    ToolCall,
    ToolCallParser,
    ToolCallStart,
    ToolChoice,
    ToolSpec,
    as_tool_specs,
    parse,
)
from inference.tools.jsonscan import JsonScanner
from tests.engine.conftest import SMOLLM, installed

WEATHER = ToolSpec("get_weather", "The weather in a city", {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"], "additionalProperties": False})
TIME = ToolSpec("get_time", parameters={"type": "object", "properties": {"zone": {"type": "string"}},
                                        "required": ["zone"], "additionalProperties": False})
TOOLS = [WEATHER, TIME]
NAMES = [t.name for t in TOOLS]


def call(name: str, arguments: dict[str, Any]) -> str:
    return HERMES.render_call(name, arguments)


PARIS = call("get_weather", {"city": "Paris"})
TOKYO = call("get_time", {"zone": "Asia/Tokyo"})


# ---------------------------------------------------------------------------------------------- specs
def test_tool_spec_accepts_both_shapes_and_round_trips() -> None:
    schema = {"type": "object", "properties": {"q": {"type": "string"}}}
    nested = ToolSpec.from_openai({"type": "function", "function": {"name": "search", "description": "Find",
                                                                      "parameters": schema}})
    flat = ToolSpec.from_openai({"name": "search", "description": "Find", "parameters": schema})
    typed = ToolSpec.from_openai({"type": "function", "name": "search", "description": "Find", "parameters": schema})
    assert nested == flat == typed == ToolSpec("search", "Find", schema)
    assert ToolSpec.from_openai(nested.as_openai()) == nested
    schema["properties"]["q"]["type"] = "integer"  # the spec kept its own copy
    assert nested.parameters["properties"]["q"]["type"] == "string"
    bare = ToolSpec.from_openai({"name": "ping"})
    assert bare.parameters == {"type": "object", "properties": {}} and bare.description == ""
    assert ToolSpec("f", parameters={"properties": {}}).parameters["type"] == "object"


@pytest.mark.parametrize("bad", [
    {"name": "has space"}, {"name": "x" * 65}, {"name": ""}, {"name": 7}, {"description": "no name"},
    {"name": "f", "parameters": {"type": "string"}}, {"name": "f", "parameters": ["type", "object"]},
    {"name": "f", "parameters": {"type": "object", "default": {1, 2}}}, {"name": "f", "description": 3},
    {"type": "code_interpreter"}, {"type": "function", "function": "f"}, "f",
])
def test_tool_spec_refuses_bad_tools(bad: Any) -> None:
    with pytest.raises(InvalidRequestError):
        ToolSpec.from_openai(bad)


def test_tool_names_must_be_unique_and_choice_must_name_a_tool() -> None:
    with pytest.raises(InvalidRequestError, match="two tools"):
        as_tool_specs([WEATHER, WEATHER.as_openai()])
    assert ToolChoice.parse("auto", TOOLS) == ToolChoice("auto")
    assert ToolChoice.parse("get_time", TOOLS) == ToolChoice("function", "get_time")
    assert ToolChoice.parse({"type": "function", "function": {"name": "get_time"}}, TOOLS).function == "get_time"
    auto_tool = [ToolSpec("auto")]  # a function named like a mode is forced through the object form only
    assert ToolChoice.parse("auto", auto_tool).mode == "auto"
    assert ToolChoice.parse({"name": "auto"}, auto_tool) == ToolChoice("function", "auto")
    for bad in ("get_date", {"type": "function", "function": {"name": "nope"}}, {"type": "function"}, 3):
        with pytest.raises(InvalidRequestError):
            ToolChoice.parse(bad, TOOLS)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- parser
JSON_VALUES = [
    '0', '-0', '12', '-3.25', '1e5', '1E-2', '2.5e+3', '01', '1.', '.5', '-', '+1', '1e', '1e+', '--1', '0x1',
    '"plain"', '"esc \\" \\\\ \\/ \\b \\f \\n \\r \\t"', '"\\u00e9\\uD83D\\ude00"', '"\\u00g1"', '"\\x"',
    '"raw\nnewline"', '"tab\there"', '"é 😀"', 'true', 'false', 'null', 'tru', 'nul', 'True', 'NaN',
    '[]', '[1, 2]', '[1,]', '[,1]', '{}', '{"a": {"b": [null, {}]}}', '{"a" 1}', '{"a": 1,}', '{a: 1}',
    '{"a": 1 "b": 2}', '[1 2]', '{"a": 1}}', '{"a": [1}', '"unterminated', ' [ 1 , \n 2 ] ',
]


@pytest.mark.parametrize("value", JSON_VALUES)
def test_json_scanner_agrees_with_json_loads(value: str) -> None:
    text = '{"v": ' + value + "}"

    def refuse(constant: str) -> None:
        raise ValueError(constant)

    try:
        json.loads(text, parse_constant=refuse)
        valid = True
    except ValueError:
        valid = False
    scanner = JsonScanner()
    ok = True
    for i, c in enumerate(text):
        if scanner.done or not scanner.push(c):
            ok = False
            break
        assert scanner.done == (i == len(text) - 1) or not valid
    assert (ok and scanner.done) == valid


Expected = tuple[str, list[tuple[str, Any, bool]]]  # content, [(name, arguments object or text, complete)]

CASES: list[tuple[str, Expected]] = [
    ("Hello, world!\n", ("Hello, world!\n", [])),
    (PARIS, ("", [("get_weather", {"city": "Paris"}, True)])),
    ("Let me check.\n" + PARIS, ("Let me check.", [("get_weather", {"city": "Paris"}, True)])),
    (PARIS + "\n" + TOKYO + "\n", ("", [("get_weather", {"city": "Paris"}, True),
                                        ("get_time", {"zone": "Asia/Tokyo"}, True)])),
    (PARIS + "\nIt is sunny.", ("\nIt is sunny.", [("get_weather", {"city": "Paris"}, True)])),
    # Compact and spread-out JSON both parse; strings may hold braces, quotes and the tags themselves.
    ('<tool_call>{"name":"get_weather","arguments":{"city":"Par}is \\" </tool_call>","days":3}}</tool_call>',
     ("", [("get_weather", {"city": 'Par}is " </tool_call>', "days": 3}, True)])),
    ('<tool_call>\n {\n "name" : "get_weather" ,\n "arguments" :\n {\n  "city": "Rome",\n  "x": [1, -2.5e3, '
     'true, null, {"é": "\\u00e9"}]\n }\n}\n</tool_call>',
     ("", [("get_weather", {"city": "Rome", "x": [1, -2.5e3, True, None, {"é": "é"}]}, True)])),
    # Text that merely looks like a tag stays content.
    ("Wrap calls in <tool_call> tags, or <tool_calls>, or <tool_cal", (
        "Wrap calls in <tool_call> tags, or <tool_calls>, or <tool_cal", [])),
    ("a <tool_call>\n{\"name\": \"get_weather\", \"args\": {}}</tool_call> b",
     ("a <tool_call>\n{\"name\": \"get_weather\", \"args\": {}}</tool_call> b", [])),
    # An unknown name is no call; the known call after it still is.
    (call("get_date", {}) + "\n" + TOKYO, (call("get_date", {}), [("get_time", {"zone": "Asia/Tokyo"}, True)])),
    # The output ended inside the arguments (max_tokens): the call is incomplete, with what it had.
    ('Sure <tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',
     ("Sure", [("get_weather", '{"city": "Pa', False)])),
    # ... or before the call was committed: all of it is content.
    ('Sure <tool_call>\n{"name": "get_wea', ('Sure <tool_call>\n{"name": "get_wea', [])),
    # Broken JSON: the call breaks off and the rest of it, up to its closing tag, is dropped.
    ("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": 'Paris'}}\n</tool_call>\nDone.",
     ("\nDone.", [("get_weather", '{"city": ', False)])),
    # Extra keys after the arguments are dropped; a missing closing tag before the next call is forgiven.
    ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}, "id": 1}\n</tool_call>' + PARIS,
     ("", [("get_time", {"zone": "UTC"}, True), ("get_weather", {"city": "Paris"}, True)])),
    ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n' + PARIS,
     ("", [("get_time", {"zone": "UTC"}, True), ("get_weather", {"city": "Paris"}, True)])),
    ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}', ("", [("get_time", {"zone": "UTC"}, True)])),
    ("<tool_call><tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"zone\": \"UTC\"}}\n</tool_call>",
     ("<tool_call>", [("get_time", {"zone": "UTC"}, True)])),
]


def expected_shape(calls: list[ToolCall]) -> list[tuple[str, Any, bool]]:
    return [(c.name, c.arguments_object() if c.complete else c.arguments, c.complete) for c in calls]


def counter_ids() -> Any:
    ids = iter(range(1000))
    return lambda: f"call_{next(ids):024x}"


def stream(text: str, pieces: list[str] | None = None) -> tuple[list[Any], list[ToolCall]]:
    parser = ToolCallParser(NAMES, make_id=counter_ids())
    events = [e for piece in (pieces if pieces is not None else [text]) for e in parser.feed(piece)]
    return events + parser.finish(), parser.calls


def reassemble(events: list[Any]) -> tuple[str, dict[int, tuple[str, str, str]]]:
    """Content and {index: (id, name, arguments)} from events, checking the order OpenAI streaming needs."""
    content, calls = [], {}
    for event in events:
        if isinstance(event, ContentDelta):
            assert event.text, "an empty content event"
            content.append(event.text)
        elif isinstance(event, ToolCallStart):
            assert event.index == len(calls) and re.fullmatch(r"call_[0-9a-f]{24}", event.id)
            calls[event.index] = (event.id, event.name, "")
        else:
            assert isinstance(event, ArgumentsDelta) and event.text
            assert event.index in calls, "arguments before their call's start"
            call_id, name, arguments = calls[event.index]
            calls[event.index] = (call_id, name, arguments + event.text)
    return "".join(content), calls


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_parse_whole_outputs(text: str, expected: Expected) -> None:
    content, calls = parse(text, NAMES)
    assert (content, expected_shape(calls)) == expected
    assert [c.index for c in calls] == list(range(len(calls)))
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in calls) and len({c.id for c in calls}) == len(calls)


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_any_split_streams_the_same(text: str, expected: Expected) -> None:
    whole_events, whole_calls = stream(text)
    whole = reassemble(whole_events)
    assert whole[0] == expected[0]
    assert {i: (c.id, c.name, c.arguments) for i, c in enumerate(whole_calls)} == whole[1]
    rng = random.Random(text)
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    splits.append(list(text))  # one character at a time
    for _ in range(30):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 12))))
        splits.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    for pieces in splits:
        events, calls = stream(text, pieces)
        assert reassemble(events) == whole, pieces
        assert calls == whole_calls, pieces


def test_streaming_holds_back_only_what_may_be_a_tag() -> None:
    parser = ToolCallParser(NAMES, make_id=counter_ids())
    assert parser.feed("I will check <tool_") == [ContentDelta("I will check")]
    assert parser.feed("call>\n{\"name\": \"get_weather\", ") == []  # not committed before the arguments
    assert parser.feed('"arguments": {"ci') == [ToolCallStart(0, f"call_{0:024x}", "get_weather"),
                                                 ArgumentsDelta(0, '{"ci')]
    assert parser.feed('ty": "Oslo"}}\n</tool_') == [ArgumentsDelta(0, 'ty": "Oslo"}')]
    assert parser.calls == [ToolCall(0, f"call_{0:024x}", "get_weather", '{"city": "Oslo"}', True)]
    assert parser.feed("call>\n") == []
    assert parser.finish() == []  # whitespace after the last call is formatting


def test_rendered_calls_parse_back_and_names_are_filtered_only_when_given() -> None:
    arguments = {"city": "São Paulo", "nested": {"list": [1, 2, {"a": None}]}, "quote": "\"</tool_call>\""}
    content, calls = HERMES.parse(call("get_weather", arguments), TOOLS)
    assert content == "" and calls[0].arguments_object() == arguments
    assert parse(call("anything", {}))[1][0].name == "anything"
    assert parse(call("anything", {}), NAMES)[1] == []


# ---------------------------------------------------------------------------------------------- grammar
@pytest.fixture(scope="module")
def compiler() -> Any:
    xgr = pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(installed(SMOLLM))
    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer)))


def matcher(compiler: Any, tools: list[ToolSpec], choice: Any = "auto", parallel: bool = True) -> Any:
    import xgrammar as xgr
    constraint = HERMES.constraint(tools, choice, parallel)
    assert constraint.kind == "structural_tag"
    return xgr.GrammarMatcher(compiler.compile_structural_tag(constraint.spec))


def accepts(compiler: Any, text: str, choice: Any = "auto", parallel: bool = True) -> bool:
    m = matcher(compiler, TOOLS, choice, parallel)
    return m.accept_string(text) and m.is_completed()


BAD_ARGS = [call("get_weather", {"days": 3}), call("get_weather", {"city": 3}),
            call("get_weather", {"city": "Paris", "wind": True}), call("get_weather", {"city": "P", "days": 1.5})]


def test_auto_grammar(compiler: Any) -> None:
    spread = '<tool_call>\n{"name": "get_weather", "arguments": {\n  "city" : "Paris",\n  "days":2\n}}\n</tool_call>'
    for text in ["Just text, no call.", PARIS, "Checking.\n" + PARIS, PARIS + "\n" + TOKYO + "\nDone.", spread]:
        assert accepts(compiler, text), text
    for text in [*BAD_ARGS, call("get_date", {}), '<tool_call>\n{"name": "get_weather"}\n</tool_call>']:
        assert not accepts(compiler, text), text
    assert accepts(compiler, "Checking.\n" + PARIS, parallel=False)
    assert not accepts(compiler, PARIS + "\n" + TOKYO, parallel=False)
    assert not accepts(compiler, PARIS + " and more", parallel=False)


def test_grammar_keeps_the_schemas_property_order(compiler: Any) -> None:
    """The model writes properties in the order the prompt shows them; a grammar that sorted them would force
    a different order."""
    book = ToolSpec("book", parameters={"type": "object", "properties": {"to": {"type": "string"},
                                                                          "from": {"type": "string"}},
                                        "required": ["to", "from"]})
    m = matcher(compiler, [book], "required")
    assert m.accept_string(call("book", {"to": "Rome", "from": "Oslo"})) and m.is_completed()


def test_required_grammar(compiler: Any) -> None:
    assert accepts(compiler, PARIS, "required") and accepts(compiler, PARIS + "\n" + TOKYO, "required")
    for text in ["", "Let me check.\n" + PARIS, PARIS + "\nDone.", *BAD_ARGS, call("get_date", {})]:
        assert not accepts(compiler, text, "required"), text
    assert accepts(compiler, TOKYO, "required", parallel=False)
    assert not accepts(compiler, PARIS + "\n" + TOKYO, "required", parallel=False)


def test_named_and_none_grammars(compiler: Any) -> None:
    assert accepts(compiler, TOKYO, "get_time")
    assert accepts(compiler, TOKYO, {"type": "function", "function": {"name": "get_time"}})
    for text in [PARIS, "It is noon.", TOKYO + "\n" + TOKYO, "Sure. " + TOKYO]:
        assert not accepts(compiler, text, "get_time"), text
    assert accepts(compiler, "No tools today, <tool_response> is fine.", "none")
    assert not accepts(compiler, "Sure. " + PARIS, "none")
    with pytest.raises(InvalidRequestError):
        HERMES.constraint([], "auto")
    with pytest.raises(InvalidRequestError):
        HERMES.constraint(TOOLS, "get_date")


def test_what_the_grammar_writes_the_parser_reads(compiler: Any) -> None:
    """Random walks through the required-calls grammar (random allowed tokens, whitespace made rare): every
    finished output parses into complete calls of the tools whose arguments match their schema."""
    import torch
    import xgrammar as xgr
    from transformers import AutoTokenizer
    jsonschema = pytest.importorskip("jsonschema")
    tokenizer = AutoTokenizer.from_pretrained(installed(SMOLLM))
    tools = [ToolSpec("set_mode", parameters={
        "type": "object", "properties": {"mode": {"enum": ["on", "off"]}, "level": {"type": "integer"},
                                         "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
        "required": ["mode", "level"], "additionalProperties": False}), ToolSpec("noop")]
    vocab = len(tokenizer)
    texts = [tokenizer.decode([i]) for i in range(vocab)]
    blank = torch.tensor([not t.strip() for t in texts])
    rng = random.Random(0)
    finished = 0
    for walk in range(12):
        m = matcher(compiler, tools, "required")
        mask = xgr.allocate_token_bitmask(1, vocab)
        ids: list[int] = []
        while len(ids) < 120 and not (m.is_completed() and rng.random() < 0.5):
            m.fill_next_token_bitmask(mask)
            bits = (mask[0].unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
            allowed = bits.flatten()[:vocab].bool()
            allowed[m.stop_token_ids] = False  # the walk decides itself when to stop
            choices = (allowed & ~blank).nonzero().flatten().tolist() or allowed.nonzero().flatten().tolist()
            if not choices:
                break
            token = rng.choice(choices)
            assert m.accept_token(token)
            ids.append(token)
        if not m.is_completed():
            continue
        finished += 1
        content, calls = HERMES.parse(tokenizer.decode(ids), tools)
        assert content == "" and calls and all(c.complete for c in calls), (walk, tokenizer.decode(ids))
        for c in calls:
            schema = next(t.parameters for t in tools if t.name == c.name)
            jsonschema.validate(c.arguments_object(), schema)
    assert finished >= 6
