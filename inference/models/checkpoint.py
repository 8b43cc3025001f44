"""Read a Hugging Face checkpoint dir: config, tokenizer and safetensors weights, without transformers models.

The engine runs its own forward passes; this only hands them the tensors under their HF names. Weights are
read with safetensors (memory-mapped), single-file or sharded. Pickle checkpoints (`*.bin`, `*.pt`) are
refused: unpickling runs arbitrary code, and every model Hearth ships is safetensors.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from inference.errors import ModelNotFoundError
from inference.models.catalog import resolve_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class CheckpointFormatError(ModelNotFoundError):
    """The directory exists but holds no weights Hearth will load (pickle only, missing or broken shards)."""


def weight_files(path: Path) -> tuple[Path, ...]:
    """The safetensors files of a checkpoint dir, in a stable order."""
    single = path / SAFETENSORS_FILE
    if single.is_file():
        return (single,)
    index = path / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointFormatError(f"{index} is not a valid safetensors index: {exc}") from exc
        shards = tuple(path / name for name in sorted(set(weight_map.values())))
        missing = [s.name for s in shards if not s.is_file()]
        if missing:
            raise CheckpointFormatError(
                f"{path}: shards listed in {SAFETENSORS_INDEX} are missing: {missing}"
            )
        return shards
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointFormatError(
            f"{path} only has pickle weights ({', '.join(pickles)}); Hearth loads safetensors only, since "
            "unpickling can run arbitrary code. Convert it, e.g. load it once with transformers in a trusted "
            "environment and call save_pretrained()."
        )
    loose = sorted(path.glob("*.safetensors"))
    if len(loose) == 1:
        return (loose[0],)
    raise CheckpointFormatError(f"{path} has no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX}")


@dataclass
class Checkpoint:
    """One loaded checkpoint: config and tokenizer in memory, weights read on demand."""

    path: Path
    config: Any  # transformers.PretrainedConfig
    tokenizer: Any  # transformers.PreTrainedTokenizerBase
    dtype: torch.dtype
    files: tuple[Path, ...]
    generation_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.dtype.is_floating_point:
            raise ValueError(f"checkpoint dtype must be a floating point type, not {self.dtype}")
        if not self.files:
            raise ValueError("a checkpoint needs at least one weight file")

    @property
    def architecture(self) -> str:
        """The config's model_type ("llama", "qwen2", "gemma3_text", "bert", ...)."""
        return str(self.config.model_type)

    @property
    def eos_token_ids(self) -> list[int]:
        """Every token id that ends generation: generation_config.json's list, else the config's/tokenizer's."""
        ids: list[int] = []
        for source in (
            self.generation_config.get("eos_token_id"),
            getattr(self.config, "eos_token_id", None),
        ):
            for value in source if isinstance(source, list) else [source]:
                if isinstance(value, int) and value not in ids:
                    ids.append(value)
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        if not ids and isinstance(tok_eos, int):
            ids.append(tok_eos)
        return ids

    def tensor_names(self) -> list[str]:
        names: list[str] = []
        for file in self.files:
            with safe_open(file, framework="pt") as f:
                names.extend(f.keys())
        return names

    def tensors(self, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """All weights under their HF names; floating ones in the checkpoint's dtype, others as stored.

        When the stored dtype already matches and device is the CPU, the tensors stay memory-mapped.
        """
        out: dict[str, torch.Tensor] = {}
        for file in self.files:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                    tensor = f.get_tensor(name)
                    if tensor.is_floating_point():
                        tensor = tensor.to(dtype=self.dtype)
                    out[name] = tensor.to(device)
        return out

    def state_dict(self, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        return self.tensors(device)


def load_checkpoint(path: str | os.PathLike[str], dtype: torch.dtype = torch.float32) -> Checkpoint:
    """Open a checkpoint dir (or a bundled model name) for the engine.

    Raises ModelNotFoundError (or its CheckpointFormatError) when nothing loadable is there.
    """
    from transformers import AutoConfig, AutoTokenizer

    root = resolve_model(path)
    files = weight_files(root)
    try:
        config = AutoConfig.from_pretrained(root)
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointFormatError(f"{root}: config.json cannot be read: {exc}") from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(root)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointFormatError(f"{root}: no usable tokenizer: {exc}") from exc
    generation: dict[str, Any] = {}
    gen_file = root / "generation_config.json"
    if gen_file.is_file():
        try:
            generation = json.loads(gen_file.read_text())
        except ValueError as exc:
            raise CheckpointFormatError(f"{gen_file} is not valid JSON: {exc}") from exc
    return Checkpoint(
        path=root, config=config, tokenizer=tokenizer, dtype=dtype, files=files, generation_config=generation
    )
