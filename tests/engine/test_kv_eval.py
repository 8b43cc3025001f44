"""The long-context compression evaluation, short form, on the real Qwen2.5-Coder-0.5B (bf16, greedy)."""

from __future__ import annotations

import pytest

from inference import LLM, EngineConfig
from inference.compression import EvictionMethod
from inference.eval.kv import _score, agreement_scores, build_items, evaluate, head_to_head, markdown
from tests.engine.conftest import QWEN, require_installed


def test_items_are_reproducible_and_hold_their_facts() -> None:
    count = len  # characters stand in for tokens: the generator only needs a monotone length
    items = build_items(8, [3000], count, seed=5)
    assert [i.kind for i in items[:4]] == ["lookup", "needle", "multi", "agreement"]
    assert [i.messages for i in build_items(8, [3000], count, seed=5)] == [i.messages for i in items]
    for item in items:
        text = item.messages[0]["content"]
        assert len(text) >= 3000 and all(e in text for e in item.expected)
    assert agreement_scores([1, 2, 3, 4], [1, 2, 9, 4]) == (0.75, 0.5)  # a miss does not end the comparison
    assert agreement_scores([1, 2, 3, 4], [1, 2, 3, 4]) == (1.0, 1.0)
    multi = items[2]
    first, second = multi.expected
    assert len(multi.expected) == 2 and first != second
    assert _score(multi, f"Name: {first}\nOther: {second}") == 1.0
    assert _score(multi, f"Name: {first}\nOther: 12345") == 0.5  # one of the two facts
    assert _score(items[0], "I do not know") == 0.0
    only_agreement = {"kinds": ["agreement"], "rows": [
        {"method": "variable", "rate": r, "qa": None, "agreement": a, "first_miss": a / 2, "achieved_rate": r}
        for r, a in ((1.0, 1.0), (2.0, 0.5))]}
    table = markdown(only_agreement).splitlines()
    assert table[0].endswith("| agreement | run before first miss |")
    assert table[-1] == "| variable | 2× | 2.0× | – | 0.50 | 0.25 |"


def test_head_to_head_counts_items_each_method_wins() -> None:
    def item(kind: str, variable: float, uniform: float) -> dict:
        return {"kind": kind, "scores": {"full 1": 1.0, "variable 8": variable, "uniform 8": uniform}}

    result = {"kinds": ["agreement", "lookup"], "per_item": [
        item("lookup", 1.0, 0.0), item("lookup", 0.5, 0.5), item("lookup", 0.0, 0.5),
        item("agreement", 0.7, 0.6), item("agreement", 0.8, 0.5), item("agreement", 0.4, 0.4)],
        "rows": [{"method": m, "rate": r, "qa": 0.5, "agreement": 0.5, "first_miss": 0.1, "lookup": 0.5,
                  "achieved_rate": r} for m in ("variable", "uniform") for r in (1.0, 8.0)]}
    assert head_to_head(result) == [{"rate": 8.0, "qa": {"higher": 1, "lower": 1, "items": 3},
                                     "agreement": {"higher": 2, "lower": 0, "items": 3}}]
    assert markdown(result).splitlines()[-1] == "| 8× | 1 / 1 of 3 | 2 / 0 of 3 |"
    assert head_to_head(result, "variable", "recent") == []  # nothing to compare with


@pytest.mark.real_model
@pytest.mark.slow  # 16 passes of a 0.5B model over 1,000-token documents: ~40 s on two cores (make test-full)
def test_short_evaluation_on_qwen() -> None:
    require_installed(QWEN)
    llm = LLM(QWEN, EngineConfig(kv_cache_memory="1GiB", max_num_batched_tokens=2048, kv_min_prompt_tokens=128))
    items = build_items(4, [1000], lambda text: len(llm.tokenizer.encode(text)))
    result = evaluate(llm, items, [1, 8], [EvictionMethod.VARIABLE, EvictionMethod.RECENT])
    rows = {(r["method"], r["rate"]): r for r in result["rows"]}
    assert set(rows) == {("variable", 1.0), ("variable", 8.0), ("recent", 1.0), ("recent", 8.0)}
    assert rows[("variable", 1.0)]["qa"] >= 2 / 3  # the full cache answers
    assert 6.0 < rows[("variable", 8.0)]["achieved_rate"] <= 8.5
    assert rows[("variable", 1.0)]["agreement"] == rows[("variable", 1.0)]["first_miss"] == 1.0
    for method in ("variable", "recent"):
        row = rows[(method, 8.0)]
        assert 0.0 <= row["first_miss"] <= row["agreement"] <= 1.0
    # Keeping only the last 1/8 of a 1,000-token document loses more of its continuation than evicting by attention.
    assert rows[("recent", 8.0)]["agreement"] < rows[("variable", 8.0)]["agreement"]
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks
