"""Tool calls read out of generated text as it streams.

`ToolCallParser.feed(delta)` takes text in pieces of any size (token boundaries fall anywhere, a tag may be split
across pieces) and returns events: `ContentDelta` (text for the user, never any part of a call),
`ToolCallStart` (index, id, name: sent once, before any of that call's arguments) and `ArgumentsDelta` (a piece
of the call's arguments JSON; a call's pieces concatenate to its arguments text). `finish()` flushes what
was held back. However the text is split, the events concatenate to the same content and calls, and
`parse(text)` is the same parser fed everything at once.

What counts as a call (see `inference.tools.syntax` for the syntax):

* `<tool_call>`, JSON whitespace, then `{"name": "<name>", "arguments": ` (any JSON whitespace around the
  punctuation), then an object. Until that object's opening brace arrives nothing is committed: text held
  back that could still become a call is released as content as soon as it cannot (a name that is not one of
  the tools, keys in another order, no JSON at all, or the output ends first). So `<tool_call>` merely
  mentioned in prose is content.
* From the brace on, the call is committed and its arguments stream as they arrive, checked as JSON
  character by character. The call ends with the object's closing brace; then `}` and `</tool_call>` are
  expected (each whitespace-separated; the brace may be missing).
* A committed call whose arguments break off (invalid JSON, or the output ends inside them, e.g. at
  max_tokens) is kept with `complete=False` and the arguments it had; anything after a broken call up to its
  closing tag (or the next `<tool_call>`) is dropped, never shown as content. Under the tool-call grammar
  only truncation can happen.
* Whitespace between calls, before a call and after the last one is formatting, not content.
* Arguments are checked as JSON, not against the function's schema: that is the grammar's job.
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

from inference.tools.jsonscan import WHITESPACE, JsonScanner
from inference.tools.syntax import CLOSE, OPEN

_SPACE = "".join(sorted(WHITESPACE))  # for str.strip: formatting whitespace is JSON's, nothing wider
_NAME_CHARS = frozenset(string.ascii_letters + string.digits + "_-")
_MAX_NAME = 64


@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    index: int  # 0, 1, ... in the order the calls appear
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ArgumentsDelta:
    index: int
    text: str


ToolEvent = ContentDelta | ToolCallStart | ArgumentsDelta


@dataclass(frozen=True, slots=True)
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str  # JSON text of an object when complete
    complete: bool  # False: the output ended, or the JSON broke, inside the arguments

    def arguments_object(self) -> dict[str, Any] | None:
        """The arguments as a dict, or None for an incomplete call."""
        return json.loads(self.arguments) if self.complete else None


def new_call_id() -> str:
    """An OpenAI-style call id: `call_` and 24 hex digits."""
    return "call_" + secrets.token_hex(12)


class _Mode(Enum):
    CONTENT = auto()
    HEADER = auto()  # after <tool_call>, before the arguments: nothing committed yet
    ARGUMENTS = auto()
    TAIL = auto()  # after the arguments object: `}` and </tool_call>
    SKIP = auto()  # after a broken call: drop text up to </tool_call> or the next <tool_call>


class _Item(Enum):
    SPACE = auto()
    NAME = auto()


# What follows <tool_call> up to the arguments' opening brace; strings are matched literally.
_HEADER: tuple[str | _Item, ...] = (
    _Item.SPACE, "{", _Item.SPACE, '"name"', _Item.SPACE, ":", _Item.SPACE, '"', _Item.NAME, _Item.SPACE, ",",
    _Item.SPACE, '"arguments"', _Item.SPACE, ":", _Item.SPACE)


@dataclass(slots=True)
class _Call:
    index: int
    id: str
    name: str
    parts: list[str] = field(default_factory=list)
    complete: bool = False

    def frozen(self) -> ToolCall:
        return ToolCall(self.index, self.id, self.name, "".join(self.parts), self.complete)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of text that is a proper beginning of tag (text that may become the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ToolCallParser:
    """Incremental parser of Hermes tool calls (see the module docstring for what counts as a call).

    names: the functions offered; a call naming another is not a call (None accepts any valid name).
    make_id: where call ids come from (tests pass a deterministic one).
    """

    def __init__(self, names: Iterable[str] | None = None, *, make_id: Callable[[], str] = new_call_id) -> None:
        self._names = frozenset(names) if names is not None else None
        self._make_id = make_id
        self._buf = ""  # received, not yet decided
        self._mode = _Mode.CONTENT
        self._after_call = False  # nothing but whitespace since the last call ended
        self._events: list[ToolEvent] = []
        self._calls: list[_Call] = []
        self._finished = False
        # header state
        self._space_before = ""  # whitespace right before <tool_call>: content again if this is no call
        self._raw = ""  # header text consumed so far
        self._step = 0
        self._pos = 0  # position inside the current literal
        self._name: list[str] = []
        # arguments and tail state
        self._scanner = JsonScanner()
        self._tail_brace = False
        self._tail_close = 0  # characters of </tool_call> matched

    @property
    def calls(self) -> list[ToolCall]:
        """Every call committed so far (the last one may still be streaming)."""
        return [c.frozen() for c in self._calls]

    def feed(self, text: str) -> list[ToolEvent]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._buf += text
        self._run(final=False)
        return self._take()

    def finish(self) -> list[ToolEvent]:
        """The end of the output: releases held text and closes (or marks incomplete) an open call."""
        if not self._finished:
            self._finished = True
            self._run(final=True)
        return self._take()

    # ------------------------------------------------------------------ driver
    def _run(self, final: bool) -> None:
        handlers = {_Mode.CONTENT: self._content_mode, _Mode.HEADER: self._header_mode,
                    _Mode.ARGUMENTS: self._arguments_mode, _Mode.TAIL: self._tail_mode, _Mode.SKIP: self._skip_mode}
        while handlers[self._mode](final):  # each handler returns whether it switched mode and has more to do
            pass

    def _take(self) -> list[ToolEvent]:
        events, self._events = self._events, []
        return events

    def _emit_content(self, text: str) -> None:
        if not text:
            return
        self._after_call = False
        if self._events and isinstance(self._events[-1], ContentDelta):
            text = self._events.pop().text + text  # type: ignore[union-attr]
        self._events.append(ContentDelta(text))

    def _emit_arguments(self, text: str) -> None:
        if not text:
            return
        call = self._calls[-1]
        call.parts.append(text)
        last = self._events[-1] if self._events else None
        if isinstance(last, ArgumentsDelta) and last.index == call.index:
            self._events[-1] = ArgumentsDelta(call.index, last.text + text)
        else:
            self._events.append(ArgumentsDelta(call.index, text))

    def _end_call(self, mode: _Mode, rest: str) -> None:
        self._mode, self._buf, self._after_call = mode, rest, True

    # ------------------------------------------------------------------ modes
    def _content_mode(self, final: bool) -> bool:
        buf = self._buf
        at = buf.find(OPEN)
        if at >= 0:
            before = buf[:at]
            kept = before.rstrip(_SPACE)
            self._emit_content(kept)
            self._space_before = before[len(kept):]
            self._buf = buf[at + len(OPEN):]
            self._mode, self._raw, self._step, self._pos, self._name = _Mode.HEADER, "", 0, 0, []
            return True
        if final:
            if not (self._after_call and not buf.strip(_SPACE)):  # trailing whitespace after calls is formatting
                self._emit_content(buf)
            self._buf = ""
            return False
        # Hold back what may still become <tool_call>, and the whitespace before it.
        kept = buf[:len(buf) - _partial_suffix(buf, OPEN)].rstrip(_SPACE)
        self._emit_content(kept)
        self._buf = buf[len(kept):]
        return False

    def _header_mode(self, final: bool) -> bool:
        buf = self._buf
        for i, c in enumerate(buf):
            verdict = self._header_char(c)
            if verdict is not None:
                self._raw += buf[:i]
                self._buf = buf[i:]  # the failing character, or the arguments' brace, is looked at again
                if verdict:
                    self._commit()
                else:
                    self._reject_header()
                return True
        self._raw += buf
        self._buf = ""
        if final:
            self._reject_header()
            return True
        return False

    def _header_char(self, c: str) -> bool | None:
        """None: consumed, the header goes on. True: c opens the arguments. False: this is no call."""
        while True:
            if self._step == len(_HEADER):
                return c == "{"
            item = _HEADER[self._step]
            if item is _Item.SPACE:
                if c in WHITESPACE:
                    return None
                self._step += 1
                continue
            if item is _Item.NAME:
                if c == '"':
                    name = "".join(self._name)
                    if not name or (self._names is not None and name not in self._names):
                        return False
                    self._step += 1
                    return None
                if c not in _NAME_CHARS or len(self._name) >= _MAX_NAME:
                    return False
                self._name.append(c)
                return None
            assert isinstance(item, str)
            if c != item[self._pos]:
                return False
            self._pos += 1
            if self._pos == len(item):
                self._step, self._pos = self._step + 1, 0
            return None

    def _reject_header(self) -> None:
        """Not a call after all: what was held is content, and scanning resumes at the failing character
        (trailing whitespace stays held, as content's always does)."""
        raw = self._space_before + OPEN + self._raw
        kept = raw.rstrip(_SPACE)
        self._emit_content(kept)
        self._mode, self._buf = _Mode.CONTENT, raw[len(kept):] + self._buf

    def _commit(self) -> None:
        call = _Call(len(self._calls), self._make_id(), "".join(self._name))
        self._calls.append(call)
        self._events.append(ToolCallStart(call.index, call.id, call.name))
        self._mode, self._scanner = _Mode.ARGUMENTS, JsonScanner()
        self._tail_brace, self._tail_close = False, 0

    def _arguments_mode(self, final: bool) -> bool:
        buf, scanner = self._buf, self._scanner
        for i, c in enumerate(buf):
            if not scanner.push(c):
                self._emit_arguments(buf[:i])
                self._end_call(_Mode.SKIP, buf[i:])
                return True
            if scanner.done:
                self._emit_arguments(buf[:i + 1])
                self._calls[-1].complete = True
                self._mode, self._buf = _Mode.TAIL, buf[i + 1:]
                return True
        self._emit_arguments(buf)
        self._buf = ""
        if final:  # the output ended inside the arguments: the call stays incomplete
            self._end_call(_Mode.CONTENT, "")
        return False

    def _tail_mode(self, final: bool) -> bool:
        buf = self._buf
        for i, c in enumerate(buf):
            if not self._tail_close and c in WHITESPACE:
                continue
            if not self._tail_close and c == "}" and not self._tail_brace:
                self._tail_brace = True
                continue
            if c == CLOSE[self._tail_close]:
                self._tail_close += 1
                if self._tail_close == len(CLOSE):
                    self._end_call(_Mode.CONTENT, buf[i + 1:])
                    return True
                continue
            # Something else before the closing tag (extra keys, say): drop it with SKIP. The part of the tag
            # matched so far goes back, since it may begin <tool_call> (a model that forgot to close).
            self._end_call(_Mode.SKIP, CLOSE[:self._tail_close] + buf[i:])
            return True
        self._buf = ""
        if final:  # arguments whole, closing tag missing: the call stands
            self._end_call(_Mode.CONTENT, "")
        return False

    def _skip_mode(self, final: bool) -> bool:
        buf = self._buf
        close, reopen = buf.find(CLOSE), buf.find(OPEN)
        if reopen >= 0 and (close < 0 or reopen < close):
            self._end_call(_Mode.CONTENT, buf[reopen:])
            return True
        if close >= 0:
            self._end_call(_Mode.CONTENT, buf[close + len(CLOSE):])
            return True
        if final:
            self._end_call(_Mode.CONTENT, "")
            return False
        keep = max(_partial_suffix(buf, CLOSE), _partial_suffix(buf, OPEN))
        self._buf = buf[len(buf) - keep:]
        return False


def parse(text: str, names: Iterable[str] | None = None) -> tuple[str, list[ToolCall]]:
    """A whole output's content (calls removed) and its calls, exactly as streaming would give them."""
    parser = ToolCallParser(names, make_id=new_call_id)
    events = parser.feed(text) + parser.finish()
    return "".join(e.text for e in events if isinstance(e, ContentDelta)), parser.calls
