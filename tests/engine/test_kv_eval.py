"""The long-context compression evaluation, short form, on the real Qwen2.5-Coder-0.5B (bf16, greedy)."""

from __future__ import annotations

import pytest

from inference import LLM, EngineConfig
from inference.compression import EvictionMethod
from inference.eval.kv import _agreement, _score, build_items, evaluate, markdown
from tests.engine.conftest import QWEN, require_installed


def test_items_are_reproducible_and_hold_their_facts() -> None:
    count = len  # characters stand in for tokens: the generator only needs a monotone length
    items = build_items(8, [3000], count, seed=5)
    assert [i.kind for i in items[:4]] == ["lookup", "needle", "multi", "agreement"]
    assert [i.messages for i in build_items(8, [3000], count, seed=5)] == [i.messages for i in items]
    for item in items:
        text = item.messages[0]["content"]
        assert len(text) >= 3000 and all(e in text for e in item.expected)
    assert _agreement([1, 2, 3, 4], [1, 2, 9, 4]) == 0.5
    multi = items[2]
    first, second = multi.expected
    assert len(multi.expected) == 2 and first != second
    assert _score(multi, f"Name: {first}\nOther: {second}") == 1.0
    assert _score(multi, f"Name: {first}\nOther: 12345") == 0.5  # one of the two facts
    assert _score(items[0], "I do not know") == 0.0
    only_agreement = {"kinds": ["agreement"], "rows": [
        {"method": "variable", "rate": r, "qa": None, "agreement": a, "achieved_rate": r} for r, a in ((1.0, 1.0),
                                                                                                     (2.0, 0.5))]}
    assert markdown(only_agreement).splitlines()[-1] == "| variable | 2× | 2.0× | – | 0.50 |"


@pytest.mark.real_model
def test_short_evaluation_on_qwen() -> None:
    require_installed(QWEN)
    llm = LLM(QWEN, EngineConfig(kv_cache_memory="1GiB", max_num_batched_tokens=2048, kv_min_prompt_tokens=128))
    items = build_items(3, [1000], lambda text: len(llm.tokenizer.encode(text)), kinds=("lookup", "needle", "multi"))
    result = evaluate(llm, items, [1, 8], [EvictionMethod.VARIABLE, EvictionMethod.RECENT])
    rows = {(r["method"], r["rate"]): r for r in result["rows"]}
    assert set(rows) == {("variable", 1.0), ("variable", 8.0), ("recent", 1.0), ("recent", 8.0)}
    assert rows[("variable", 1.0)]["qa"] >= 2 / 3  # the full cache answers
    assert 6.0 < rows[("variable", 8.0)]["achieved_rate"] <= 8.5
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks
