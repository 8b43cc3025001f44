"""Converting a bundled GGUF file into a plain Hugging Face checkpoint (inference/models/install.py calls it).

transformers dequantizes the weights and rebuilds the config and tokenizer from the GGUF metadata; this module
pins what the GGUF does not carry (Gemma 3's layout, extra stop tokens), keeps transformers' progress bars
quiet, and lets it parse each file's header once per conversion.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from inference.models.catalog import BundledModel, InstallError


def fix_gemma3_config(config: Any, gguf_file: Path) -> None:
    """Pin the parts of the Gemma 3 layout that the GGUF file does not carry.

    llama.cpp's converter stores head_dim (key_length), the sliding window, the global rope base and the
    context length; the rest is hard-coded in llama.cpp's gemma3 hparams (llama-model.cpp, LLM_ARCH_GEMMA3).
    Transformers' GGUF loader leaves those to the Gemma3TextConfig defaults, which happen to be right for
    270M but would silently change the model if the defaults moved, so they are written out here with
    the values llama.cpp runs the file with:
    - queries scaled by 1/sqrt(head_dim), i.e. query_pre_attn_scalar = head_dim (the 27B model, 62 layers,
      is the exception and uses hidden_size / num_heads);
    - with a sliding window, every 6th layer attends globally and the rest locally (swa pattern 6); local
      layers use rope base 10000, global ones the file's rope.freq_base; without one, all layers are global;
    - no attention-logit soft-capping; final-logit soft-capping only if the file sets it (270M does not);
    - no rope scaling: the 270M file has no rope.scaling keys, and one that has them is refused rather
      than converted wrong.
    """
    from gguf import GGUFReader

    fields = GGUFReader(gguf_file).fields

    def meta(key: str) -> Any:
        field = fields.get(f"gemma3.{key}")
        return field.contents() if field is not None else None

    if meta("rope.scaling.type") not in (None, "none") or meta("rope.scaling.factor") not in (None, 1.0):
        raise InstallError("this Gemma 3 GGUF uses rope scaling, which the installer does not map yet")
    head_dim = int(meta("attention.key_length") or config.head_dim)
    config.head_dim = head_dim
    if config.num_hidden_layers == 62:
        config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads
    else:
        config.query_pre_attn_scalar = head_dim
    global_base = float(meta("rope.freq_base") or 1_000_000.0)
    window = int(meta("attention.sliding_window") or 0)
    if window > 0:
        config.sliding_window = window
        config.layer_types = [
            "full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
            for i in range(config.num_hidden_layers)
        ]
    else:
        config.sliding_window = None
        config.layer_types = ["full_attention"] * config.num_hidden_layers
    config.rope_parameters = {
        "full_attention": {"rope_type": "default", "rope_theta": global_base},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    }
    config.attn_logit_softcapping = None
    softcap = float(meta("final_logit_softcapping") or 0.0)
    config.final_logit_softcapping = softcap if softcap > 0 else None
    context = meta("context_length")
    if context is not None:
        config.max_position_embeddings = int(context)


# GGUF metadata holds a single EOS id; upstream generation configs stop on more than one. Qwen2.5
# instruct models end a turn with <|im_end|> but may also emit <|endoftext|> (upstream eos list).
EXTRA_STOP_TOKENS: dict[str, list[str]] = {
    "@hearth/qwen2.5-coder-0.5b-instruct": ["<|im_end|>", "<|endoftext|>"],
    "@hearth/qwen2.5-coder-1.5b-instruct": ["<|im_end|>", "<|endoftext|>"],
}


@contextlib.contextmanager
def quiet_progress() -> Iterator[None]:
    """Silence the per-tensor progress bar of transformers' GGUF dequantizer while converting.

    One line per model is the installer's output. That bar is a bare tqdm (not transformers' switchable
    one) and TQDM_DISABLE is read only when tqdm is first imported, which happens before we run, so the
    module's tqdm is swapped for a disabled one for the duration.
    """
    from functools import partial

    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    original = getattr(gguf_utils, "tqdm", None)
    if original is None:
        yield
        return
    gguf_utils.tqdm = partial(original, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = original


@contextlib.contextmanager
def read_once() -> Iterator[None]:
    """Let transformers parse a GGUF file's header once per conversion, not once per use.

    Its loader opens a fresh `gguf.GGUFReader` for the config, the weights and the tokenizer, and each one
    parses every metadata field in Python (a vocabulary of 49k-262k strings and merges: 9 s a parse for
    SmolLM2 on a 2-core EPYC), then builds a `TensorNameMap` of every tensor name for each of the model's
    ~400 modules (13 s). Both are read-only once built, so within this context the same reader serves every
    open of a path and the name map is built once per (architecture, layers). The reader also slices a plain
    view of the file instead of the `np.memmap` itself: each slice of a memmap runs numpy's Python-level
    subclass hooks, millions of times over a vocabulary. Default models on that machine: 237 s -> ~100 s,
    the same files written (the installer's tests compare them with the GGUF model).
    """
    import gguf
    import numpy as np

    open_reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    class PlainReader(open_reader):  # type: ignore[misc, valid-type]
        @property
        def data(self) -> Any:
            return self._plain

        @data.setter
        def data(self, mapped: Any) -> None:
            self._plain = np.asarray(mapped)  # a view: the mapping stays open through its base

    readers: dict[tuple[str, str], Any] = {}

    def reader(path: Any, mode: str = "r") -> Any:
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = PlainReader(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    gguf.get_tensor_name_map = functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = open_reader, name_map
        readers.clear()


def convert_gguf(model: BundledModel, gguf_file: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    with quiet_progress(), read_once():
        lm = AutoModelForCausalLM.from_pretrained(
            gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)

    quantizer = getattr(lm, "hf_quantizer", None)
    if quantizer is not None:
        # The weights are dequantized on load; without this the saved config would claim GGUF quantization.
        quantizer.remove_quantization_config(lm)
    if model.architecture == "gemma3":
        fix_gemma3_config(lm.config, gguf_file)
    # The GGUF's general.name ("Smollm2 135M 8k Lc100K ...") is not a path anything could load from.
    lm.config._name_or_path = model.name
    stop_tokens = EXTRA_STOP_TOKENS.get(model.name)
    if stop_tokens:
        ids = [tokenizer.convert_tokens_to_ids(t) for t in stop_tokens]
        if any(i is None or i == tokenizer.unk_token_id for i in ids):
            raise InstallError(f"{model.name}: stop tokens {stop_tokens} are not all in the vocabulary")
        lm.generation_config.eos_token_id = ids
    # transformers 5 always writes safetensors (the safe_serialization switch is gone).
    lm.save_pretrained(out)

    if not model.has_chat_template:
        # Base models are served with raw prompts only; a template some GGUFs carry anyway would let a
        # chat request through that the model was never trained to follow.
        tokenizer.chat_template = None
    elif not tokenizer.chat_template:
        raise InstallError(f"{model.name}: the GGUF has no chat template")
    # GGUF tokenizers come back with an "unlimited" length; the real limit is the context window.
    tokenizer.model_max_length = int(lm.config.max_position_embeddings)
    # The template goes inside tokenizer_config.json (not chat_template.jinja) so every reader finds it.
    tokenizer.save_pretrained(out, save_jinja_files=False)
