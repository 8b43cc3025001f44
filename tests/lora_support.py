"""Real PEFT LoRA adapters for tests: made with `peft` on a real base model, saved in PEFT's own format.

PEFT initialises B to zero (an adapter that changes nothing); tests want one that changes the output, so B is
filled with random values scaled to move logits without swamping the base model.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch


def make_peft_adapter(base_dir: str | Path, out_dir: str | Path, *, rank: int = 8, alpha: float = 16,
                      targets: Sequence[str] = ("q_proj", "v_proj"), seed: int = 0, strength: float = 0.5,
                      use_rslora: bool = False, dtype: torch.dtype = torch.float32) -> Path:
    """Build a LoRA adapter for the model in base_dir with PEFT and save it (adapter_config.json +
    adapter_model.safetensors) into out_dir. `strength` scales B's random values relative to A's."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                        bias="none", task_type="CAUSAL_LM", use_rslora=use_rslora)
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name:
                param.copy_(torch.randn(param.shape, generator=generator) / param.shape[1] ** 0.5)
            elif "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * strength / rank ** 0.5)
    model = model.to(dtype)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def peft_reference(base_dir: str | Path, adapter_dir: str | Path):
    """The PEFT model (transformers + PeftModel) the engine is compared against, fp32, eval mode."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).eval()
