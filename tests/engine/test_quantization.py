"""Weight-only int8 models (`quantization: "int8"`): the engine's forward against transformers running the same
model with every quantized weight replaced by its dequantized value, so only the order of the fp32 sums differs;
and the quality evaluation that measures what quantization costs against fp32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from inference import LLM, EngineConfig
from inference.errors import InvalidRequestError
from inference.eval import quant
from kernels import cpu_int8
from tests.engine.conftest import build_tiny_model
from tests.engine.test_parity import PROMPTS, _check_logits, _greedy_agreement


def _dequantized_reference(path: Path) -> AutoModelForCausalLM:
    """transformers' model on the weights an int8 engine computes with: every projection and the head rounded to
    int8 per output row and back; the embedding table itself stays as it was (only the head reads it as int8)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    head = model.get_output_embeddings()
    with torch.no_grad():
        if model.config.tie_word_embeddings:
            model.config.tie_word_embeddings = False
            head.weight = torch.nn.Parameter(head.weight.detach().clone())
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and (name.endswith("_proj") or module is head):
                module.weight.copy_(cpu_int8.dequantize(*cpu_int8.quantize(module.weight)))
    assert model.get_input_embeddings().weight.data_ptr() != head.weight.data_ptr()
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3_text"])
def test_int8_engine_matches_transformers_on_the_dequantized_weights(arch: str, tmp_path: Path) -> None:
    path = build_tiny_model(arch, tmp_path / arch, seed=11)
    llm = LLM(path, EngineConfig(device="cpu", dtype="float32", kv_cache_memory="32MiB", quantization="int8"))
    assert all(layer.qkv.weight.packed.dtype == torch.int8 for layer in llm.engine.model.layers)
    reference = _dequantized_reference(path)
    _check_logits(llm, reference, PROMPTS[:3], chunk_sizes=(None, 7))  # prefill: many rows per product
    assert _greedy_agreement(llm, reference, PROMPTS) >= 9  # decode: one row per product


def test_quantization_setting_is_checked() -> None:
    with pytest.raises(InvalidRequestError, match="quantization must be one of"):
        EngineConfig(quantization="int4")
    with pytest.raises(InvalidRequestError, match="CPU only"):  # its products are CPU kernels
        EngineConfig(device="cuda", quantization="int8")


def test_quality_eval_compares_variants_with_fp32(tiny_llama: Path) -> None:
    result = quant.evaluate(str(tiny_llama), [("float32", "int8"), ("float32", "none")], tokens=12,
                            texts=quant.TEXTS[1:], prompts=quant.PROMPTS[:3])
    ref, int8, same = result["rows"]
    assert (ref["quantization"], int8["quantization"]) == ("none", "int8")
    assert ref["agreement"] == ref["first_miss"] == 1.0 and ref["identical_answers"] == 3
    assert same["perplexity"] == pytest.approx(ref["perplexity"], rel=1e-4)  # the same model measures the same
    assert int8["weight_bytes"] < ref["weight_bytes"] / 3.5
    assert int8["perplexity"] != ref["perplexity"] and 0 < int8["agreement"] <= 1
    assert "int8" in quant.markdown(result)
