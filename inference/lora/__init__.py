"""LoRA adapters: the PEFT format checked without trust (format.py), adapter slots loaded on demand (slots.py)."""

from inference.lora.format import (
    MAX_RANK,
    REQUIRED_FILES,
    AdapterError,
    AdapterSpec,
    BaseDims,
    inspect_adapter,
    inspect_adapter_dir,
)

__all__ = ["MAX_RANK", "REQUIRED_FILES", "AdapterError", "AdapterSpec", "BaseDims", "inspect_adapter",
           "inspect_adapter_dir"]
