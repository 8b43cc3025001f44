"""Engine configuration: one validated dataclass, built by the caller or from a catalog entry's settings."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from inference.compression.settings import KVCompressionSettings
from inference.errors import InvalidRequestError

log = logging.getLogger("inference")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
          "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}


def parse_bytes(value: int | str) -> int:
    """'512MiB' -> 536870912; plain integers are bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = _SIZE.match(str(value))
    if not match:
        raise InvalidRequestError(f"cannot read a memory size from {value!r} (try '512MiB' or '2GB')")
    unit = (match.group(2) or "").upper().removesuffix("B") if (match.group(2) or "").upper() != "B" else "B"
    return int(float(match.group(1)) * _UNITS[unit])


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str) -> torch.dtype:
    """bf16 where the hardware does it natively (CUDA, or a CPU with AVX512-BF16/AMX), else fp32."""
    if device.startswith("cuda"):
        return torch.bfloat16
    capability = torch.backends.cpu.get_cpu_capability()
    if capability in ("AVX512", "AMX") or "AMX" in capability:
        try:
            with open("/proc/cpuinfo") as f:
                flags = f.read()
            if "avx512_bf16" in flags or "amx_bf16" in flags:
                return torch.bfloat16
        except OSError:
            pass
    return torch.float32


QUANTIZATIONS = ("none", "int8")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@dataclass(slots=True)
class EngineConfig:
    """How an engine instance runs. Everything is checked in __post_init__."""

    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    quantization: str = "none"  # none | int8 (weight-only, per output channel: a quarter of fp32's weight bytes)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    kv_cache_memory: int | str = "512MiB"
    block_size: int = 16
    max_num_seqs: int = 64  # sequences in one step
    max_num_batched_tokens: int = 1024  # per-step token budget (chunked prefill)
    max_model_len: int | None = None  # defaults to the model's context window
    enable_prefix_caching: bool = True
    max_batch_class_seqs: int | None = None  # cap on BATCH-priority sequences running at once
    # While BATCH sequences run, waiting BATCH prompts join them in groups of this many (or all that wait, if
    # fewer): a step that computes prompts costs a fixed extra (the Python forward, not the one-call layers).
    batch_admission_group: int = 8
    serve_arrivals_mid_step: bool = True  # start arriving interactive prompts between a step's layers
    max_queue: int = 4096  # waiting requests before submission is refused
    num_threads: int | None = None  # torch intra-op threads on CPU
    speculation: str = "off"  # default for requests that don't say: off | ngram | draft
    num_speculative_tokens: int = 4
    draft_model: str | None = None  # catalog name or checkpoint dir sharing the target's tokenizer
    draft_vocab: int = 32768  # ids the draft model's head scores: this many common ones plus the sequence's own
    draft_min_confidence: float = 0.5  # the draft stops extending after a token it gives less probability than this
    draft_lookup_first: bool = True  # in draft mode, use a prompt-lookup match when there is one (free)
    kv_compression: bool = True  # server-wide switch: False ignores every request's kv_compression
    kv_compression_rate: float | None = None  # the model's default: keep 1/rate of the KV entries
    kv_compression_max_tokens: int | None = None  # ... or at most this many entries per head
    kv_sink_tokens: int = 4  # the first tokens are never evicted
    kv_prefix_tokens: int = 32  # ... and up to this many of them while they take at most kv_prefix_share of the
    kv_prefix_share: float = 0.125  # budget: the prompt's opening (chat preamble) is context every continuation uses
    kv_recent_tokens: int = 32  # nor the most recent ones
    kv_protected_share: float = 0.5  # ... but together they take at most this share of a head's budget
    kv_min_prompt_tokens: int = 256  # prompts shorter than this are never compressed
    kv_observation_window: int = 32  # last prompt tokens whose attention scores the entries after prefill
    kv_spread_before: int = 8  # an entry scores the most any of the 8 entries before it received
    kv_spread_after: int = 4  # ... or of the 4 after it
    kv_spread_skip_prefix: int = 32  # ... except the first 32 positions, whose scores are sinks' (lent to none)
    spec_max_batch: int = 8  # more decoding sequences than this: no speculation that step
    spec_min_acceptance: float = 0.3  # a sequence whose acceptance falls below this pauses drafting
    enable_lora: bool = True  # serve requests that name a LoRA adapter
    max_loras: int = 8  # adapters resident at once (slots); more wait or are swapped in LRU
    max_lora_rank: int = 32  # the largest rank an adapter may have (slots are sized for it)
    grammar_cache_memory: int | str = "256MiB"  # compiled grammars kept (LRU by content) for constrained requests
    grammar_jump_forward: bool = True  # draft a grammar's forced continuation (keys, punctuation) for verification

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise InvalidRequestError(f"dtype must be auto or one of {sorted(DTYPES)}, got {self.dtype!r}")
        self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
        self.grammar_cache_memory = parse_bytes(self.grammar_cache_memory)
        checks = {
            "kv_cache_memory": self.kv_cache_memory >= 1,
            "block_size": self.block_size in (1, 2, 4, 8, 16, 32, 64, 128),
            "max_num_seqs": self.max_num_seqs >= 1,
            "max_num_batched_tokens": self.max_num_batched_tokens >= self.block_size,
            "max_queue": self.max_queue >= 1,
            "max_loras": self.max_loras >= 1,
            "max_lora_rank": 1 <= self.max_lora_rank <= 256,
            "grammar_cache_memory": self.grammar_cache_memory >= 1,
        }
        for name, ok in checks.items():
            if not ok:
                raise InvalidRequestError(f"invalid {name}: {getattr(self, name)!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise InvalidRequestError("max_model_len must be at least 2")
        if self.quantization not in QUANTIZATIONS:
            raise InvalidRequestError(f"quantization must be one of {list(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.quantization == "int8" and self.resolved_device().type != "cpu":
            # The int8 products are CPU kernels (kernels/cpu_int8); on a card the weights would never reach them.
            raise InvalidRequestError("quantization 'int8' runs on the CPU only; use quantization 'none' on "
                                      f"{self.resolved_device()}")
        if self.speculation not in ("off", "ngram", "draft"):
            raise InvalidRequestError(f"speculation must be off, ngram or draft, got {self.speculation!r}")
        if self.speculation == "draft" and not self.draft_model:
            raise InvalidRequestError("speculation 'draft' needs draft_model")
        if not 1 <= self.num_speculative_tokens <= 16 or self.spec_max_batch < 1:
            raise InvalidRequestError("num_speculative_tokens must be in [1, 16] and spec_max_batch >= 1")
        if not 0.0 <= self.spec_min_acceptance <= 1.0 or not 0.0 <= self.draft_min_confidence <= 1.0:
            raise InvalidRequestError("spec_min_acceptance and draft_min_confidence must be in [0, 1]")
        if self.kv_compression_rate is not None or self.kv_compression_max_tokens is not None:
            self.default_kv_compression()  # validates
        if min(self.kv_sink_tokens, self.kv_recent_tokens, self.kv_min_prompt_tokens) < 0 \
                or self.kv_observation_window < 1 \
                or min(self.kv_spread_before, self.kv_spread_after, self.kv_spread_skip_prefix) < 0:
            raise InvalidRequestError("kv sink/recent/min-prompt tokens and score spreads must be >= 0, the "
                                      "observation window >= 1")
        if not 0.0 < self.kv_protected_share <= 1.0:
            raise InvalidRequestError("kv_protected_share must be in (0, 1]")
        if self.kv_prefix_tokens < 0 or not 0.0 <= self.kv_prefix_share <= 1.0:
            raise InvalidRequestError("kv_prefix_tokens must be >= 0 and kv_prefix_share in [0, 1]")
        if self.draft_vocab < 1:
            raise InvalidRequestError("draft_vocab must be at least 1")
        if self.max_batch_class_seqs is not None and self.max_batch_class_seqs < 1:
            raise InvalidRequestError("max_batch_class_seqs must be at least 1")
        if self.batch_admission_group < 1:
            raise InvalidRequestError("batch_admission_group must be at least 1")

    def default_kv_compression(self) -> KVCompressionSettings | None:
        if self.kv_compression_rate is None and self.kv_compression_max_tokens is None:
            return None
        return KVCompressionSettings(rate=self.kv_compression_rate, max_cache_tokens=self.kv_compression_max_tokens)

    def resolved_device(self) -> torch.device:
        return torch.device(default_device() if self.device == "auto" else self.device)

    def resolved_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return default_dtype(self.resolved_device().type)
        return DTYPES[self.dtype]

    @classmethod
    def from_settings(cls, engine_settings: Mapping[str, Any]) -> EngineConfig:
        """From a catalog entry's engine settings: keys the engine does not know are logged and skipped (the
        catalog also carries settings for the fleet and the control plane)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(engine_settings) - known - {"fleet"})
        if unknown:
            log.warning("ignoring unknown engine settings %s", unknown)
        return cls(**{k: v for k, v in engine_settings.items() if k in known})
