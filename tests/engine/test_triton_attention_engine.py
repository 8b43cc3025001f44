"""The engine with the Triton decode kernel (forced; on CPU under TRITON_INTERPRET=1) against the torch path.

On CUDA the kernel is the default; this checks that its wiring into the forward pass (per-layer tables, per-head
lengths, GQA, sliding windows, soft-capping) gives the same greedy tokens as the reference path, in fp32.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from inference import LLM, EngineConfig, SamplingParams  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "a b c d e f g a b c d e f g a b c"]


def _generate(path, backend: str, monkeypatch: pytest.MonkeyPatch) -> tuple[list[list[int]], bool]:
    monkeypatch.setenv("HEARTH_ATTENTION", backend)
    llm = LLM(path, EngineConfig(dtype="float32", kv_cache_memory="8MiB"))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(PROMPTS, params)], llm.engine.model.triton is not None


def test_triton_decode_gives_the_reference_tokens(tiny_model, monkeypatch: pytest.MonkeyPatch) -> None:
    reference, used_kernel = _generate(tiny_model, "torch", monkeypatch)
    assert not used_kernel
    tokens, used_kernel = _generate(tiny_model, "triton", monkeypatch)
    assert used_kernel
    assert tokens == reference


def test_triton_extend_and_compression_kernels_give_the_reference_tokens(tiny_llama,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Speculative verification and prefix hits run the extend kernel; compression runs the score kernel."""
    prompts = [list(range(5, 90)), list(range(5, 60)) + list(range(200, 230)), [7, 8, 9, 10] * 20]
    # Few tokens: every kernel launch is interpreted on CPU, and 8 already give drafts, hits and compression.
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    config = dict(dtype="float32", kv_cache_memory="8MiB", speculation="ngram", spec_max_batch=64,
                  kv_compression_rate=2.0, kv_min_prompt_tokens=16, kv_recent_tokens=8)
    results = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("HEARTH_ATTENTION", backend)
        llm = LLM(tiny_llama, EngineConfig(**config))
        outs = llm.generate(prompts, params) + llm.generate(prompts, params)  # the second pass hits the cache
        results[backend] = [o.token_ids for o in outs]
        m = llm.engine.metrics()
        assert m.kv_compressions_total > 0 and m.spec_proposed > 0 and llm.engine.blocks.hit_tokens > 0
    assert results["triton"] == results["torch"]


def test_unknown_attention_backend_is_refused(tiny_llama, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HEARTH_ATTENTION", "flash")
    with pytest.raises(ValueError, match="HEARTH_ATTENTION"):
        LLM(tiny_llama, EngineConfig(dtype="float32", kv_cache_memory="8MiB"))


def test_triton_lora_kernels_in_the_engine_give_the_reference_tokens(tiny_llama, tmp_path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Three adapters and the base model in one batch: the stacked layout and the Triton LoRA kernels (CUDA's
    path) against the packed torch path (CPU's)."""
    from inference import LoRARequest
    from tests.lora_support import make_peft_adapter

    targets = [("q_proj", "v_proj"), ("o_proj", "gate_proj", "up_proj", "down_proj"), ("k_proj",)]
    adapters = [LoRARequest(f"t{i}", make_peft_adapter(tiny_llama, tmp_path / f"t{i}", rank=(4, 8, 2)[i],
                                                       targets=t, seed=int.from_bytes(os.urandom(3), "little")))
                for i, t in enumerate(targets)]
    prompts = PROMPTS + ["Once upon a time"]
    choice = [*adapters, None]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    results = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("HEARTH_ATTENTION", backend)
        llm = LLM(tiny_llama, EngineConfig(dtype="float32", kv_cache_memory="8MiB"))
        assert llm.engine.lora is not None and llm.engine.lora.stacked == (backend == "triton")
        results[backend] = [o.token_ids for o in llm.generate(prompts, params, choice)]
    assert results["triton"] == results["torch"]
    assert len({tuple(t) for t in results["torch"]}) == len(prompts)
