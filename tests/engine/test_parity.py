"""Our forward pass against transformers on the same weights: prefill logits and greedy continuations (fp32)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from inference import LLM, EngineConfig, SamplingParams
from tests.engine.conftest import GEMMA, QWEN, SMOLLM, require_installed

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "List three colours: red,",
    "import numpy as np\nx = np.",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Q: What is 12 times 12?\nA:",
    "Les élèves de l'école ont mangé des crêpes et",
    "1, 2, 3, 5, 8, 13,",
    "SELECT name FROM users WHERE",
]


def _hf(path) -> AutoModelForCausalLM:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def _check_logits(llm: LLM, hf, prompts: list[str], chunk_sizes: tuple[int | None, ...]) -> None:
    for prompt in prompts:
        ids = llm.encode(prompt, raw=True)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
        for size in chunk_sizes:
            ours = llm.engine.prompt_logits(ids, chunk_size=size)
            diff = (ours - ref).abs().max().item()
            assert diff < 1e-3, f"{prompt!r} chunk={size}: max |Δlogit| = {diff:.2e}"


def _greedy_agreement(llm: LLM, hf, prompts: list[str], tokens: int = 32) -> int:
    """Prompts agreeing token for token up to 32 tokens or EOS. transformers runs them as one left-padded batch."""
    outs = llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0))
    encoded = [llm.encode(p, raw=True) for p in prompts]
    width = max(len(ids) for ids in encoded)
    pad = llm.tokenizer.pad_token_id if llm.tokenizer.pad_token_id is not None else 0
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in encoded])
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in encoded])
    with torch.no_grad():
        ref = hf.generate(input_ids, attention_mask=mask, max_new_tokens=tokens, do_sample=False,
                          pad_token_id=pad)[:, width:].tolist()
    eos = llm.info.eos_token_ids
    agree = 0
    for out, expected in zip(outs, ref, strict=True):
        cut = next((i + 1 for i, t in enumerate(expected) if t in eos), len(expected))
        agree += out.token_ids == expected[:cut]
    return agree


def test_tiny_prefill_logits_match_transformers(tiny_model) -> None:
    llm = LLM(tiny_model, EngineConfig(dtype="float32", kv_cache_memory="32MiB"))
    long_prompt = " ".join(PROMPTS)  # longer than the tiny gemma's sliding window
    _check_logits(llm, _hf(tiny_model), PROMPTS[:3] + [long_prompt], chunk_sizes=(None, 16, 7))


def test_tiny_greedy_matches_transformers(tiny_model) -> None:
    llm = LLM(tiny_model, EngineConfig(dtype="float32", kv_cache_memory="32MiB"))
    assert _greedy_agreement(llm, _hf(tiny_model), PROMPTS) >= 9


@pytest.mark.real_model
# Qwen2.5-Coder-0.5B is the slowest case of the default suite (36-41 s on a 2-core VM); its architecture (q/k/v
# biases) is checked against transformers on every run by the tiny qwen2 model above, its real weights by
# `make test-full`.
@pytest.mark.parametrize("name", [SMOLLM, pytest.param(QWEN, marks=pytest.mark.slow), GEMMA])
def test_real_model_matches_transformers(name: str) -> None:
    """Real weights of each architecture: prefill logits (whole and in chunks of 5), then greedy continuations.
    One test per model, so each model and its transformers twin load once (a few seconds each on two cores)."""
    path = require_installed(name)
    llm = LLM(name, EngineConfig(dtype="float32", kv_cache_memory="256MiB"))
    hf = _hf(path)
    _check_logits(llm, hf, PROMPTS[:2], chunk_sizes=(None, 5))
    assert _greedy_agreement(llm, hf, PROMPTS) >= 9
