"""benchmarks.random_models: a checkpoint packed without its weights comes back with random ones in the same layout,
and the engine and transformers both load it (what a lent GPU machine runs the benchmarks on)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from benchmarks.random_models import LAYOUT, WEIGHTS, pack_checkpoint, read_layout, unpack
from inference import LLM, EngineConfig, SamplingParams


def test_packed_checkpoint_unpacks_to_the_same_layout_with_fresh_values(tiny_llama: Path, tmp_path: Path) -> None:
    packed = pack_checkpoint(tiny_llama, tmp_path / "packed" / "tiny")
    assert not list(packed.glob("*.safetensors")) and (packed / LAYOUT).is_file()
    assert (packed / "tokenizer.json").is_file() and (packed / "config.json").is_file()

    data = unpack(tmp_path / "packed", tmp_path / "data", seed=3)
    model_dir = data / "models" / "tiny"
    assert read_layout(model_dir / WEIGHTS) == read_layout(tiny_llama / WEIGHTS)
    with safe_open(str(model_dir / WEIGHTS), "pt") as fresh, safe_open(str(tiny_llama / WEIGHTS), "pt") as real:
        for name in fresh.keys():  # noqa: SIM118 (safe_open is not a mapping)
            a, b = fresh.get_tensor(name), real.get_tensor(name)
            assert torch.isfinite(a).all() and not torch.equal(a, b)
            if name.endswith("norm.weight"):
                assert (a - 1).abs().max() < 0.5
            else:
                assert 0.01 < float(a.float().std()) < 0.04

    llm = LLM(model_dir, EngineConfig(dtype="float32", kv_cache_memory="8MiB"))
    prompt = llm.encode("The capital of France is")
    out = llm.generate_ids([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert out[0].token_ids == expected[0, len(prompt):].tolist()
