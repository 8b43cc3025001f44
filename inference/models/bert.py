"""Sentence embeddings: our own BERT encoder forward pass (all-MiniLM-L6-v2), mean-pooled and L2-normalised.

Weights come from the checkpoint via load_checkpoint; the forward pass is plain torch, matching
transformers' BertModel (absolute positions, post-LayerNorm, exact GELU) and sentence-transformers'
pooling, so the vectors agree with SentenceTransformer on the same directory.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from inference.errors import InvalidRequestError
from inference.models.catalog import BUNDLED_MODELS, DEFAULT_EMBEDDING_MODEL
from inference.models.checkpoint import CheckpointFormatError, load_checkpoint

# Padding is per batch, so one long text must not make a batch of short ones pay for its length.
_BATCH_TOKENS = 8192
_MAX_BATCH = 64
_SMALL_BATCH_TOKENS = 1024


def _batches(counts: Sequence[int]) -> list[list[int]]:
    """Row indices grouped into padded batches: longest first, within a token budget, little padding.

    A batch stops growing when it would exceed the token budget or pad more than a third of its tokens
    (short texts behind a truncated 256-token one would otherwise cost 256 tokens each); batches whose
    padded size is small anyway are not split, since per-batch overhead dominates there.
    """
    order = sorted(range(len(counts)), key=lambda i: counts[i], reverse=True)
    batches: list[list[int]] = []
    current: list[int] = []
    real = 0
    for i in order:
        if current:
            longest = counts[current[0]]
            padded = (len(current) + 1) * longest
            wasteful = padded > _SMALL_BATCH_TOKENS and padded > 1.5 * (real + counts[i])
            if len(current) >= _MAX_BATCH or padded > _BATCH_TOKENS or wasteful:
                batches.append(current)
                current, real = [], 0
        current.append(i)
        real += counts[i]
    if current:
        batches.append(current)
    return batches


@dataclass
class EmbeddingOutput:
    embeddings: torch.Tensor  # [N, dim] float32, unit length
    prompt_tokens: int  # all tokens fed to the encoder, special tokens included
    token_counts: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.embeddings.dim() != 2 or self.embeddings.shape[0] != len(self.token_counts):
            raise ValueError("embeddings must be [N, dim] with one token count per row")
        if self.prompt_tokens != sum(self.token_counts):
            raise ValueError("prompt_tokens must be the sum of token_counts")


@dataclass
class _Layer:
    qkv: torch.Tensor  # [3*hidden, hidden]: query, key, value fused into one matmul
    qkv_bias: torch.Tensor
    out: torch.Tensor
    out_bias: torch.Tensor
    attn_norm: tuple[torch.Tensor, torch.Tensor]
    up: torch.Tensor
    up_bias: torch.Tensor
    down: torch.Tensor
    down_bias: torch.Tensor
    ffn_norm: tuple[torch.Tensor, torch.Tensor]


_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class Embedder:
    """Encodes texts into sentence vectors. Thread-compatible, not thread-safe (one caller at a time)."""

    def __init__(
        self, name: str, path: Path, dtype: torch.dtype = torch.float32, device: str = "cpu"
    ) -> None:
        ckpt = load_checkpoint(path, dtype)
        config = ckpt.config
        if ckpt.architecture != "bert":
            raise CheckpointFormatError(f"{path} is a {ckpt.architecture!r} model, not a BERT encoder")
        if getattr(config, "position_embedding_type", "absolute") != "absolute":
            raise CheckpointFormatError(f"{path}: only absolute position embeddings are supported")
        if config.hidden_act not in _ACTIVATIONS:
            raise CheckpointFormatError(f"{path}: unsupported activation {config.hidden_act!r}")
        pooling = _read_json(path / "1_Pooling" / "config.json")
        if pooling is not None and not pooling.get("pooling_mode_mean_tokens", False):
            raise CheckpointFormatError(f"{path}: only mean pooling is supported")

        self._name = name
        self.path = path
        self.dtype = dtype
        self.device = torch.device(device)
        self.tokenizer = ckpt.tokenizer
        self._hidden = int(config.hidden_size)
        self._heads = int(config.num_attention_heads)
        self._eps = float(config.layer_norm_eps)
        self._act = _ACTIVATIONS[config.hidden_act]
        # sentence-transformers truncates to max_seq_length (256 for all-MiniLM-L6-v2), not the 512
        # positions BERT has; without its config fall back to what the model can take.
        st_config = _read_json(path / "sentence_bert_config.json") or {}
        limit = int(config.max_position_embeddings)
        self._max_tokens = min(int(st_config.get("max_seq_length") or limit), limit)
        self._lowercase = bool(st_config.get("do_lower_case", False))

        tensors = ckpt.tensors(self.device)
        prefix = "bert." if "bert.embeddings.word_embeddings.weight" in tensors else ""

        def get(key: str) -> torch.Tensor:
            try:
                return tensors[prefix + key]
            except KeyError:
                raise CheckpointFormatError(f"{path}: missing tensor {prefix + key}") from None

        def norm(key: str) -> tuple[torch.Tensor, torch.Tensor]:
            return get(key + ".weight"), get(key + ".bias")

        self._word = get("embeddings.word_embeddings.weight")
        self._position = get("embeddings.position_embeddings.weight")
        # Single-segment input: every token has type 0, so its embedding is a constant added to all.
        self._type0 = get("embeddings.token_type_embeddings.weight")[0]
        self._embed_norm = norm("embeddings.LayerNorm")
        self._layers: list[_Layer] = []
        for i in range(int(config.num_hidden_layers)):
            p = f"encoder.layer.{i}."
            self._layers.append(
                _Layer(
                    qkv=torch.cat([get(f"{p}attention.self.{n}.weight") for n in ("query", "key", "value")]),
                    qkv_bias=torch.cat(
                        [get(f"{p}attention.self.{n}.bias") for n in ("query", "key", "value")]
                    ),
                    out=get(p + "attention.output.dense.weight"),
                    out_bias=get(p + "attention.output.dense.bias"),
                    attn_norm=norm(p + "attention.output.LayerNorm"),
                    up=get(p + "intermediate.dense.weight"),
                    up_bias=get(p + "intermediate.dense.bias"),
                    down=get(p + "output.dense.weight"),
                    down_bias=get(p + "output.dense.bias"),
                    ffn_norm=norm(p + "output.LayerNorm"),
                )
            )

    @classmethod
    def from_model(
        cls,
        name_or_path: str | os.PathLike[str] = DEFAULT_EMBEDDING_MODEL,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
    ) -> Embedder:
        """Load a bundled embedding model by name, or a local BERT sentence-transformers dir by path."""
        from inference.models.catalog import resolve_model

        path = resolve_model(name_or_path)
        name = str(name_or_path) if str(name_or_path) in BUNDLED_MODELS else str(path)
        return cls(name, path, dtype=dtype, device=device)

    @property
    def name(self) -> str:
        return self._name

    @property
    def dim(self) -> int:
        return self._hidden

    @property
    def max_tokens(self) -> int:
        """Longer inputs are truncated to this many tokens, [CLS] and [SEP] included."""
        return self._max_tokens

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids per text, truncated to max_tokens, as the encoder sees them."""
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise InvalidRequestError(f"text {i} must be a string, not {type(text).__name__}")
            if not text.strip():
                raise InvalidRequestError(f"text {i} is empty")
        # sentence-transformers strips (and lowercases when configured) before tokenizing.
        prepared = [t.strip().lower() if self._lowercase else t.strip() for t in texts]
        encoded = self.tokenizer(
            prepared,
            truncation=True,
            max_length=self._max_tokens,
            padding=False,
            return_attention_mask=False,
            return_token_type_ids=False,
        )
        return [list(ids) for ids in encoded["input_ids"]]

    def embed(self, texts: Sequence[str]) -> EmbeddingOutput:
        if isinstance(texts, str):
            raise InvalidRequestError("texts must be a list of strings, not one string")
        texts = list(texts)
        if not texts:
            return EmbeddingOutput(torch.empty(0, self.dim, dtype=torch.float32), 0, [])
        ids = self.tokenize(texts)
        counts = [len(x) for x in ids]
        result = torch.empty(len(texts), self.dim, dtype=torch.float32)
        with torch.inference_mode():
            for rows in _batches(counts):
                result[rows] = self._encode([ids[i] for i in rows]).float().cpu()
        return EmbeddingOutput(result, sum(counts), counts)

    def _encode(self, batch: list[list[int]]) -> torch.Tensor:
        """Pooled, normalised vectors of one padded batch."""
        length = max(len(x) for x in batch)
        pad = self.tokenizer.pad_token_id or 0
        input_ids = torch.full((len(batch), length), pad, dtype=torch.long)
        mask = torch.zeros(len(batch), length, dtype=torch.bool)
        for row, seq in enumerate(batch):
            input_ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            mask[row, : len(seq)] = True
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)

        x = self._word[input_ids] + self._position[:length] + self._type0
        x = F.layer_norm(x, (self._hidden,), *self._embed_norm, self._eps)
        # Padding keys are masked out for every query; padded query rows are dropped by the pooling.
        attn_mask = mask[:, None, None, :]
        batch_size, head_dim = len(batch), self._hidden // self._heads
        for layer in self._layers:
            q, k, v = (
                F.linear(x, layer.qkv, layer.qkv_bias)
                .view(batch_size, length, 3, self._heads, head_dim)
                .permute(2, 0, 3, 1, 4)
            )
            attn = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, scale=1.0 / math.sqrt(head_dim)
            )
            attn = attn.transpose(1, 2).reshape(batch_size, length, self._hidden)
            x = F.layer_norm(
                F.linear(attn, layer.out, layer.out_bias) + x, (self._hidden,), *layer.attn_norm, self._eps
            )
            h = self._act(F.linear(x, layer.up, layer.up_bias))
            x = F.layer_norm(
                F.linear(h, layer.down, layer.down_bias) + x, (self._hidden,), *layer.ffn_norm, self._eps
            )

        # Mean over real tokens in float32 whatever the compute dtype, as sentence-transformers does.
        weights = mask.unsqueeze(-1).to(torch.float32)
        pooled = (x.float() * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
        return F.normalize(pooled, p=2, dim=1)
