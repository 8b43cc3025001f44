"""Deterministic prompts for the benchmarks: real English text cut to exact token counts."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

SENTENCES = [
    "The committee met on Tuesday to review the budget for the coming year.",
    "Rain had fallen all night, and the river was higher than anyone could remember.",
    "She opened the old notebook and found a list of names written in pencil.",
    "Most of the engineers agreed that the bridge needed a new set of cables.",
    "A small bakery on the corner sells bread that is still warm at seven in the morning.",
    "The train was delayed by forty minutes because of a signal failure near the station.",
    "He explained that the algorithm sorts the records by date before merging them.",
    "Visitors to the museum can see a collection of maps drawn in the sixteenth century.",
    "The garden behind the library is full of roses, herbs and a few tall sunflowers.",
    "When the power went out, the whole street gathered around a single lantern.",
    "The report recommends that schools start later so that students can sleep longer.",
    "Our team measured the temperature of the lake every hour for three weeks.",
    "The recipe calls for two cups of flour, one egg and a pinch of salt.",
    "In the final chapter, the detective finally reveals who stole the painting.",
    "The software update fixed a bug that caused the application to crash on startup.",
    "Farmers in the valley grow apples, pears and a little wheat on the higher fields.",
]


def text_of_tokens(tokenizer, num_tokens: int, seed: int) -> list[int]:
    """Token ids of exactly num_tokens, from shuffled sentences (seeded, so every run sees the same prompts)."""
    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < num_tokens:
        ids += tokenizer(" " + rng.choice(SENTENCES), add_special_tokens=False)["input_ids"]
    return ids[:num_tokens]


def concurrent_prompts(tokenizer, count: int = 32, low: int = 50, high: int = 500, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [text_of_tokens(tokenizer, rng.randint(low, high), seed * 1000 + i) for i in range(count)]


def alternating_pairs(one: Callable[[bool], T], pairs: int) -> tuple[list[T], list[T]]:
    """`one(True)` and `one(False)` once each untimed, then `pairs` pairs whose first side alternates (on/off,
    off/on, ...), so drift of the machine during the run falls on both sides alike: (on results, off results)."""
    one(True), one(False)
    on: list[T] = []
    off: list[T] = []
    for i in range(pairs):
        for side in ((True, False) if i % 2 == 0 else (False, True)):
            (on if side else off).append(one(side))
    return on, off


def mean_seconds(fn: Callable[[], object], repeat: int) -> float:
    """Seconds per call of `fn`, over `repeat` calls in a row."""
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def switched_passes(llm: Any, prompts: list[list[int]], params: Any, switch: Callable[[bool], None],
                    pairs: int) -> dict[str, Any]:
    """Whole passes of `prompts` on one loaded engine (an inference.LLM), `switch(True)` or `switch(False)` before
    each, in `alternating_pairs` (the prefix cache reset each pass, so every pass computes its prompts), switched
    back on at the end: each side's median tok/s, the median and range of the per-pair ratios (on over off), and
    how many sequences gave the same tokens on both sides in every pair (`same` of `sequences`)."""

    def one(on: bool) -> tuple[float, list[list[int]]]:
        switch(on)
        llm.engine.blocks.reset_prefix_cache()
        start = time.perf_counter()
        out = llm.generate_ids(prompts, params)
        return time.perf_counter() - start, [list(o.token_ids) for o in out]

    try:
        on, off = alternating_pairs(one, pairs)
    finally:
        switch(True)
    ratios = [b[0] / a[0] for a, b in zip(on, off, strict=True)]
    tokens = len(prompts) * params.max_tokens
    return {"on_tok_s": tokens / statistics.median(a[0] for a in on),
            "off_tok_s": tokens / statistics.median(b[0] for b in off),
            "ratio": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
            "same": min(sum(x == y for x, y in zip(a[1], b[1], strict=True)) for a, b in zip(on, off, strict=True)),
            "sequences": len(prompts)}
