"""What weight-only int8 (and bf16) cost in quality against fp32, on the bundled chat models.

    python -m benchmarks.run --only quant

Runs `inference.eval.quant` (perplexity on fixed texts, greedy agreement by teacher forcing) for SmolLM2-135M and
Qwen2.5-Coder-0.5B. bf16 rows are included: they are what a bf16 machine serves by default, a yardstick for
int8's cost. Speed is measured beside vLLM in `benchmarks/cpu_peers.py`.
"""

from __future__ import annotations

from typing import Any

from inference.eval import quant

MODELS = ["@hearth/smollm2-135m-instruct", "@hearth/qwen2.5-coder-0.5b-instruct"]


def run(quick: bool = False) -> dict[str, Any]:
    tokens = 32 if quick else 128
    prompts = quant.PROMPTS[:2] if quick else quant.PROMPTS
    return {"results": [quant.evaluate(m, quant.VARIANTS, tokens, prompts=prompts) for m in MODELS]}


def markdown(r: dict[str, Any]) -> str:
    return "\n\n".join(quant.markdown(result) for result in r["results"])
