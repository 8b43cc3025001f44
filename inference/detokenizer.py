"""Streaming text out of a token stream: incremental detokenization and stop-string matching.

IncrementalDetokenizer turns one token at a time into finalised text. It decodes only a small window of
recent tokens each step (the prefix_offset/read_offset technique): `prefix` is the text of the tokens
already emitted in the window, and the new text is whatever decoding the whole window adds after it.
Decoding a window, rather than the lone new token, keeps word-initial spaces right for SentencePiece
("▁word") and byte-level BPE ("Ġword") vocabularies, and lets the bytes of one character spread over
several tokens come together before anything is emitted.

StopStringMatcher sits after it and cuts the text at the first stop string, holding back any tail that
might still grow into one, so that streamed text never shows a stop string (or part of one).
"""

from __future__ import annotations

import contextlib
import re
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

REPLACEMENT_CHAR = "\ufffd"

# How many prompt tokens seed the window: enough for any tokenizer's word-boundary context.
_PROMPT_CONTEXT_TOKENS = 4

_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


@dataclass(frozen=True, slots=True)
class _TokenizerTraits:
    byte_ids: frozenset[int]  # SentencePiece byte-fallback tokens, when the decoder fuses their runs
    special_ids: frozenset[int]  # what decode(skip_special_tokens=True) drops


_traits_cache: weakref.WeakKeyDictionary[Any, _TokenizerTraits] = weakref.WeakKeyDictionary()


class Tokenizer(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def _traits(tokenizer: Any) -> _TokenizerTraits:
    try:
        return _traits_cache[tokenizer]
    except (KeyError, TypeError):
        pass
    byte_ids: frozenset[int] = frozenset()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None) if backend is not None else None
    slow_spm = getattr(tokenizer, "sp_model", None) is not None
    if (decoder is not None and "ByteFallback" in str(decoder)) or slow_spm:
        vocab = tokenizer.get_vocab()
        byte_ids = frozenset(i for tok, i in vocab.items() if len(tok) == 6 and _BYTE_TOKEN.fullmatch(tok))
    special = set(getattr(tokenizer, "all_special_ids", None) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    special.update(i for i, tok in added.items() if getattr(tok, "special", False))
    traits = _TokenizerTraits(byte_ids=byte_ids, special_ids=frozenset(special))
    # A tokenizer that is not weak-referenceable just gets its traits recomputed per detokenizer.
    with contextlib.suppress(TypeError):
        _traits_cache[tokenizer] = traits
    return traits


def byte_fallback_ids(tokenizer: Any) -> frozenset[int]:
    """Ids of SentencePiece byte-fallback tokens (<0x00>..<0xFF>) when the decoder fuses them, else empty.

    A run of such tokens is decoded as one byte string, and a later byte token can turn characters
    already complete into U+FFFD (the whole run becomes invalid), so text ending in one is held back.
    """
    return _traits(tokenizer).byte_ids


class IncrementalDetokenizer:
    """Push output tokens one by one; get back the text each one finalises.

    Invariant: the pushes plus flush() concatenate to ``tokenizer.decode(output_ids, skip_special_tokens)``
    for tokenizers whose decoding of a token does not depend on its position in the sequence (byte-level
    BPE, and SentencePiece vocabularies such as Gemma's that keep the "▁" space). The last few prompt
    tokens seed the window, so for a decoder that strips the leading space of a sequence (Llama-2 style) the
    first output token keeps the space it has after the prompt: the text continues the prompt.

    Cost per token: two decodes of a window that is usually two or three tokens long; it only grows while
    text is held back (an unfinished multi-byte character, or tokens that decode to nothing).
    """

    __slots__ = ("_tokenizer", "_skip_special", "_ids", "_read_offset", "_prefix_text", "_hold_ids",
                 "_pieces", "_text_cache")

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        traits = _traits(tokenizer)
        # Tokens that must not end a push's text: a byte-fallback token (its run may go on) and, when
        # skipped, a special token (it adds no text, and the byte runs on either side of it fuse).
        self._hold_ids = traits.byte_ids | traits.special_ids if skip_special_tokens else traits.byte_ids
        # The window: ids[:read_offset] were emitted already (the prefix), the rest are still held.
        self._ids: list[int] = self._prompt_context(prompt_token_ids, traits.byte_ids)
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None
        self._pieces: list[str] = []
        self._text_cache: str | None = ""

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _prompt_context(self, prompt_token_ids: Sequence[int], byte_ids: frozenset[int]) -> list[int]:
        context = [int(t) for t in prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]]
        # A prompt tail that is itself an unfinished character (or a byte-fallback run the output could
        # extend) would merge with the first output bytes; starting from nothing is the lesser evil.
        if not context or any(t in byte_ids for t in context):
            return []
        text = self._decode(context)
        if not text or REPLACEMENT_CHAR in text:
            return []
        return context

    def push(self, token_id: int) -> str:
        """Add one output token; return the text it finalises (often all of its text, sometimes none)."""
        token_id = int(token_id)
        self._ids.append(token_id)
        if token_id in self._hold_ids:
            return ""
        return self._emit(final=False)

    def flush(self) -> str:
        """At the end of the sequence: the text still held back (e.g. an incomplete character as U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[:self._read_offset])
        prefix = self._prefix_text
        window = self._decode(self._ids)
        if len(window) <= len(prefix) or (not final and window.endswith(REPLACEMENT_CHAR)):
            return ""
        new_text = window[len(prefix):]
        # Slide the window: what was just read becomes the next step's prefix. The ids before it are
        # no longer needed, which keeps memory and decode cost flat over long outputs.
        del self._ids[:self._read_offset]
        self._read_offset = len(self._ids)
        self._prefix_text = None
        self._pieces.append(new_text)
        self._text_cache = None
        return new_text

    @property
    def text(self) -> str:
        """All output text finalised so far."""
        if self._text_cache is None:
            self._text_cache = "".join(self._pieces)
            self._pieces = [self._text_cache]
        return self._text_cache


class StopStringMatcher:
    """Cuts streamed text at the first stop string.

    The first stop string to be completed in the stream wins (ties: the one starting earliest), so the
    outcome does not depend on how the text was split into feeds. Without include_stop_str the output ends
    just before it, with it just after. Any tail that is a proper prefix of some stop string is held back
    until it either completes one or can no longer do so; flush() releases it when the sequence ends for
    another reason. An empty list of stops passes text straight through.
    """

    __slots__ = ("_stops", "_include", "_held", "_stopped", "stop_str")

    def __init__(self, stops: Sequence[str], include_stop_str: bool = False) -> None:
        self._stops = [s for s in dict.fromkeys(stops) if s]
        self._include = include_stop_str
        self._held = ""
        self._stopped = False
        self.stop_str: str | None = None  # the stop string that matched, once stopped

    @property
    def stopped(self) -> bool:
        return self._stopped

    def feed(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit now, whether a stop string has matched)."""
        if self._stopped:
            return "", True
        if not self._stops:
            return text, False
        buf = self._held + text
        match = self._first_match(buf)
        if match is not None:
            start, stop = match
            self._stopped = True
            self.stop_str = stop
            self._held = ""
            return buf[:start + len(stop)] if self._include else buf[:start], True
        hold = self._holdback(buf)
        self._held = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold], False

    def flush(self) -> str:
        """The held-back text, for a sequence that ends without a stop string."""
        held, self._held = self._held, ""
        return "" if self._stopped else held

    def _first_match(self, buf: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            # Only matches ending in the new text are possible: the held tail alone matched none.
            start = buf.find(stop)
            if start < 0:
                continue
            end = start + len(stop)
            if best is None or (end, start) < best[:2]:
                best = (end, start, stop)
        return None if best is None else (best[1], best[2])

    def _holdback(self, buf: str) -> int:
        """Length of the longest tail of buf that is a proper prefix of some stop string."""
        hold = 0
        for stop in self._stops:
            # Candidates start where the stop's first character occurs in the last len(stop) - 1 chars;
            # the leftmost one that fits is the longest tail for this stop.
            # Only a start left of len(buf) - hold would beat the longest tail found so far.
            first, end = stop[0], len(buf) - hold
            i = buf.find(first, max(len(buf) - len(stop) + 1, 0), end)
            while i != -1:
                if stop.startswith(buf[i:]):
                    hold = len(buf) - i
                    break
                i = buf.find(first, i + 1, end)
        return hold
