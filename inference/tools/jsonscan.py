"""A JSON syntax checker fed one character at a time, so a stream can tell where a JSON value ends (and
whether it is still valid) without waiting for the whole text."""

from __future__ import annotations

import re
from enum import Enum, auto

WHITESPACE = frozenset(" \t\n\r")  # JSON's whitespace; Python's str.isspace() accepts far more
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_HEX = frozenset("0123456789abcdefABCDEF")
_ESCAPES = frozenset('"\\/bfnrtu')
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}


class _State(Enum):
    VALUE = auto()  # a value must come
    ARRAY_FIRST = auto()  # just after '[': a value or ']'
    OBJECT_FIRST = auto()  # just after '{': a key or '}'
    KEY = auto()  # after ',' in an object: a key
    COLON = auto()
    AFTER = auto()  # after a value inside a container: ',' or the closing bracket
    STRING = auto()
    ESCAPE = auto()
    UNICODE = auto()
    NUMBER = auto()
    LITERAL = auto()
    DONE = auto()


class JsonScanner:
    """Checks one JSON value, character by character.

    `push(c)` returns False at the first character that cannot continue valid JSON (and then must not be
    called again); `done` turns true on the character that completes the value. A number is only known to
    end at the character after it, so its syntax is checked there; a top-level number is never `done`.
    """

    def __init__(self) -> None:
        self._state = _State.VALUE
        self._stack: list[str] = []  # '{' or '[' per open container
        self._in_key = False
        self._rest = ""  # the letters a literal still needs
        self._hex_left = 0
        self._number: list[str] = []

    @property
    def done(self) -> bool:
        return self._state is _State.DONE

    def push(self, c: str) -> bool:
        state = self._state
        if state is _State.STRING:
            if c == '"':
                if self._in_key:
                    self._state = _State.COLON
                else:
                    self._value_done()
            elif c == "\\":
                self._state = _State.ESCAPE
            return c >= " "  # raw control characters are not allowed inside strings
        if state is _State.ESCAPE:
            if c not in _ESCAPES:
                return False
            if c == "u":
                self._state, self._hex_left = _State.UNICODE, 4
            else:
                self._state = _State.STRING
            return True
        if state is _State.UNICODE:
            if c not in _HEX:
                return False
            self._hex_left -= 1
            if not self._hex_left:
                self._state = _State.STRING
            return True
        if state is _State.NUMBER:
            if c in _NUMBER_CHARS:
                self._number.append(c)
                return True
            if not _NUMBER.fullmatch("".join(self._number)):
                return False
            self._value_done()
            return self.push(c)  # the character after a number belongs to what follows it
        if state is _State.LITERAL:
            if c != self._rest[0]:
                return False
            self._rest = self._rest[1:]
            if not self._rest:
                self._value_done()
            return True
        if state is _State.DONE:
            return False
        if c in WHITESPACE:
            return True
        return self._structural(state, c)

    def _structural(self, state: _State, c: str) -> bool:
        if state is _State.COLON:
            if c != ":":
                return False
            self._state = _State.VALUE
            return True
        if state is _State.AFTER:
            top = self._stack[-1]
            if c == ",":
                self._state = _State.KEY if top == "{" else _State.VALUE
                return True
            if c == ("}" if top == "{" else "]"):
                self._close()
                return True
            return False
        if state in (_State.OBJECT_FIRST, _State.KEY):
            if c == "}" and state is _State.OBJECT_FIRST:
                self._close()
                return True
            if c != '"':
                return False
            self._state, self._in_key = _State.STRING, True
            return True
        if state is _State.ARRAY_FIRST and c == "]":
            self._close()
            return True
        return self._value_start(c)

    def _value_start(self, c: str) -> bool:
        if c == "{":
            self._stack.append(c)
            self._state = _State.OBJECT_FIRST
        elif c == "[":
            self._stack.append(c)
            self._state = _State.ARRAY_FIRST
        elif c == '"':
            self._state, self._in_key = _State.STRING, False
        elif c == "-" or "0" <= c <= "9":
            self._state, self._number = _State.NUMBER, [c]
        elif c in _LITERALS:
            self._state, self._rest = _State.LITERAL, _LITERALS[c]
        else:
            return False
        return True

    def _close(self) -> None:
        self._stack.pop()
        self._value_done()

    def _value_done(self) -> None:
        self._state = _State.AFTER if self._stack else _State.DONE
