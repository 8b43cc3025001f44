"""Load a checkpoint (bundled name or local directory) into our decoder, with its tokenizer and facts."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import GenerationConfig, PreTrainedTokenizerBase

from inference.config import EngineConfig
from inference.models.catalog import BUNDLED_MODELS, resolve_model
from inference.models.checkpoint import load_checkpoint
from inference.models.decoder import ARCHITECTURES, DecoderLM, text_config


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    architecture: str
    context_window: int
    has_chat_template: bool
    vocab_size: int
    eos_token_ids: frozenset[int]


@dataclass(slots=True)
class LoadedModel:
    model: DecoderLM
    tokenizer: PreTrainedTokenizerBase
    info: ModelInfo
    path: Path


def _eos_ids(path: Path, tokenizer: PreTrainedTokenizerBase, config) -> frozenset[int]:
    ids: set[int] = set()
    candidates = [getattr(config, "eos_token_id", None), tokenizer.eos_token_id]
    with contextlib.suppress(OSError, ValueError):
        candidates.append(GenerationConfig.from_pretrained(path).eos_token_id)
    for value in candidates:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return frozenset(ids)


def load_model(name_or_path: str | os.PathLike[str], config: EngineConfig | None = None) -> LoadedModel:
    config = config or EngineConfig()
    path = resolve_model(name_or_path)
    device, dtype = config.resolved_device(), config.resolved_dtype()
    if device.type == "cpu" and config.num_threads:
        torch.set_num_threads(config.num_threads)
    checkpoint = load_checkpoint(path, dtype)
    hf_config = text_config(checkpoint.config)
    if hf_config.model_type not in ARCHITECTURES:
        raise ValueError(f"{path} is a {hf_config.model_type!r} model; supported: {sorted(ARCHITECTURES)}")
    context = int(getattr(hf_config, "max_position_embeddings", 2048))
    if config.max_model_len:
        context = min(context, config.max_model_len)
    model = DecoderLM(hf_config, checkpoint.tensors(), dtype, device, max_positions=context,
                      quantization=config.quantization)
    tokenizer = checkpoint.tokenizer
    name = str(name_or_path) if str(name_or_path) in BUNDLED_MODELS else path.name
    info = ModelInfo(
        name=name,
        architecture=hf_config.model_type,
        context_window=context,
        has_chat_template=bool(getattr(tokenizer, "chat_template", None)),
        vocab_size=model.vocab_size,
        eos_token_ids=_eos_ids(path, tokenizer, hf_config),
    )
    return LoadedModel(model=model, tokenizer=tokenizer, info=info, path=path)
