"""Compiling constraints into xgrammar grammars, once per distinct content, off the engine's step loop.

`GrammarCache` belongs to one engine (one tokenizer, one logits width). `compile(constraint)` returns the
compiled grammar from a bounded LRU keyed by `Constraint.key`, or compiles it: in the caller's thread, which
`AsyncEngine` makes a worker thread, never the event loop or the engine's loop thread. Two threads asking for
the same new constraint wait for one compile. A constraint that cannot compile raises `InvalidRequestError`
naming the reason; no xgrammar exception type leaves this module.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass

import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from inference.constrained.constraint import Constraint, ConstraintKind
from inference.errors import InvalidRequestError

# Tokens that end a turn in the chat templates we serve; a grammar may end on any of them as well as on the
# model's EOS ids (SmolLM2 and Qwen end turns with <|im_end|>, Qwen's base text with <|endoftext|>, Gemma with
# <end_of_turn>, Llama 3 with <|eot_id|>). Only names the vocabulary holds as special tokens count.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<|eot_id|>", "<|end|>")

# JSON layout under a schema: one line, `json.dumps` separators (", " and ": "), no other whitespace. Small
# models run away on whitespace when the grammar allows it anywhere (newline after newline until max_tokens),
# and even a cap per gap leaves every gap open, so no key or separator is ever the only continuation and
# jump-forward has nothing to skip. The compact form is what json.dumps writes, which every model has seen.
JSON_SEPARATORS = (", ", ": ")

_XGRAMMAR_PREFIX = re.compile(r"^\s*\[[\d:.]+\]\s+\S+:\d+:\s*")  # "[21:03:43] /path/file.cc:83: "
_CHECK_FAILED = re.compile(r"^Check failed: \(.*?\) is false:\s*")


def _reason(exc: BaseException) -> str:
    """xgrammar's message without its log prefix (time, C++ file, line) or assertion text."""
    text = str(exc).strip() or type(exc).__name__
    lines = [_CHECK_FAILED.sub("", _XGRAMMAR_PREFIX.sub("", line)).strip() for line in text.splitlines()]
    return " ".join(line for line in lines if line)[:500]


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, eos_token_ids: Iterable[int], vocab_size: int) -> list[int]:
    """Where a grammar may end: the model's EOS ids and the end-of-turn tokens its vocabulary holds."""
    ids = {int(t) for t in eos_token_ids if 0 <= int(t) < vocab_size}
    special = _special_ids(tokenizer)
    for name in END_OF_TURN_TOKENS:
        token_id = tokenizer.convert_tokens_to_ids(name)  # the unknown token's id when there is none
        if isinstance(token_id, int) and token_id in special and token_id < vocab_size \
                and tokenizer.convert_ids_to_tokens(token_id) == name:
            ids.add(token_id)
    if not ids:
        raise ValueError("the model has no EOS token: a grammar would have no way to end")
    return sorted(ids)


def _special_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return {int(i) for i, token in added.items() if getattr(token, "special", False)} | {
        int(i) for i in tokenizer.all_special_ids}


def build_tokenizer_info(tokenizer: PreTrainedTokenizerBase, vocab_size: int,
                         stops: list[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary, `vocab_size` wide (the logits' width: Qwen's is wider than its
    tokenizer, and the extra ids are never allowed).

    Special tokens other than the stops are blanked, which xgrammar treats as never allowed: left as they are,
    their names count as text, so `<|im_start|>` could appear inside a JSON string while the detokenizer (which
    skips special tokens) would drop it from the text the caller parses."""
    detected = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stops)
    encoded = [""] * vocab_size
    for token, token_id in tokenizer.get_vocab().items():
        if token_id < vocab_size:
            encoded[token_id] = token
    for token_id in _special_ids(tokenizer) - set(stops):
        if token_id < vocab_size:
            encoded[token_id] = ""
    return xgr.TokenizerInfo(encoded, detected.vocab_type, vocab_size=vocab_size, stop_token_ids=stops,
                             add_prefix_space=detected.add_prefix_space)


@dataclass(slots=True)
class GrammarCacheStats:
    compiles: int = 0
    hits: int = 0
    failures: int = 0
    evictions: int = 0
    compile_s_total: float = 0.0

    def as_dict(self) -> dict:
        return {"compiles": self.compiles, "hits": self.hits, "failures": self.failures,
                "evictions": self.evictions,
                "compile_ms_avg": 1000 * self.compile_s_total / self.compiles if self.compiles else 0.0}


class GrammarCache:
    """Compiled grammars for one engine, least recently used dropped first past `memory_limit` bytes.

    The xgrammar tokenizer info (a fraction of a second to several seconds for a large vocabulary) is built at
    the first compile, so engines that never see a constraint never pay for it. Running sequences hold their
    own reference to a grammar's compiled form: eviction never affects them."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: Iterable[int],
                 memory_limit: int, max_threads: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids(tokenizer, eos_token_ids, vocab_size)
        self.memory_limit = memory_limit
        self.max_threads = max_threads or max(1, min(4, os.cpu_count() or 1))
        self.stats = GrammarCacheStats()
        self._entries: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self._sizes: dict[str, int] = {}
        self._bytes = 0
        self._inflight: dict[str, Future[xgr.CompiledGrammar]] = {}
        self._lock = threading.Lock()
        self._setup_lock = threading.Lock()
        self._compiler: xgr.GrammarCompiler | None = None

    # ----------------------------------------------------------------- lookups
    def lookup(self, constraint: Constraint) -> xgr.CompiledGrammar | None:
        """The compiled grammar when cached (and now most recently used), else None; never compiles."""
        with self._lock:
            grammar = self._entries.get(constraint.key)
            if grammar is not None:
                self._entries.move_to_end(constraint.key)
                self.stats.hits += 1
            return grammar

    def compile(self, constraint: Constraint) -> xgr.CompiledGrammar:
        if not isinstance(constraint, Constraint):
            raise InvalidRequestError("constraint must be a Constraint")
        key = constraint.key
        with self._lock:
            grammar = self._entries.get(key)
            if grammar is not None:
                self._entries.move_to_end(key)
                self.stats.hits += 1
                return grammar
            pending = self._inflight.get(key)
            owner = pending is None
            if owner:
                pending = self._inflight[key] = Future()
        assert pending is not None
        if not owner:
            return pending.result()  # the same constraint is compiling in another thread: share its result
        try:
            compiler = self.compiler  # built at the first compile; not counted as compile time
            started = time.perf_counter()
            grammar = self._compile(compiler, constraint)
            elapsed = time.perf_counter() - started
        except BaseException as exc:
            with self._lock:
                self.stats.failures += 1
                del self._inflight[key]
            pending.set_exception(exc)
            raise
        with self._lock:
            self.stats.compiles += 1
            self.stats.compile_s_total += elapsed
            self._insert(key, grammar)
            del self._inflight[key]
        pending.set_result(grammar)
        return grammar

    @property
    def num_cached(self) -> int:
        return len(self._entries)

    @property
    def cached_bytes(self) -> int:
        return self._bytes

    def _insert(self, key: str, grammar: xgr.CompiledGrammar) -> None:
        size = max(1, int(grammar.memory_size_bytes))
        self._entries[key] = grammar
        self._sizes[key] = size
        self._bytes += size
        # The newest entry always stays, even alone over the limit: it is about to be used.
        while self._bytes > self.memory_limit and len(self._entries) > 1:
            old, _ = self._entries.popitem(last=False)
            self._bytes -= self._sizes.pop(old)
            self.stats.evictions += 1

    # ----------------------------------------------------------------- compiling
    @property
    def compiler(self) -> xgr.GrammarCompiler:
        if self._compiler is None:
            with self._setup_lock:
                if self._compiler is None:
                    info = build_tokenizer_info(self.tokenizer, self.vocab_size, self.stop_token_ids)
                    # xgrammar's own cache is off: ours is bounded and keyed by content, and one is enough.
                    self._compiler = xgr.GrammarCompiler(info, max_threads=self.max_threads, cache_enabled=False)
        return self._compiler

    @staticmethod
    def _compile(compiler: xgr.GrammarCompiler, constraint: Constraint) -> xgr.CompiledGrammar:
        kind, spec = constraint.kind, constraint.spec
        try:
            if kind is ConstraintKind.JSON_SCHEMA:
                # strict_mode: properties and items the schema does not name are not generated (a schema that
                # allows extra ones by default still validates what comes out; models stop inventing keys).
                return compiler.compile_json_schema(spec, any_whitespace=False, separators=JSON_SEPARATORS,
                                                    strict_mode=True)
            if kind is ConstraintKind.JSON_OBJECT:
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                    separators=JSON_SEPARATORS, strict_mode=False)
            if kind is ConstraintKind.REGEX:
                return compiler.compile_regex(spec)
            if kind is ConstraintKind.CHOICE:
                # A JSON string literal is also a valid EBNF literal (same escapes), so any option text is safe.
                options = json.loads(spec)
                return compiler.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options))
            if kind is ConstraintKind.EBNF:
                return compiler.compile_grammar(spec, root_rule_name="root")
            if kind is ConstraintKind.STRUCTURAL_TAG:
                return compiler.compile_structural_tag(spec)
        except Exception as exc:  # noqa: BLE001 - whatever xgrammar raises, the caller sees one error type
            raise InvalidRequestError(f"invalid {kind.value}: {_reason(exc)}") from None
        raise InvalidRequestError(f"unsupported constraint kind {kind.value!r}")
