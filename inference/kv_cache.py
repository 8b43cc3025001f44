"""The physical KV pool: fixed-size blocks, each holding block_size entries of one (layer, kv-head)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference import memory
from inference.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVLayout.{name} must be positive")

    @property
    def heads_per_token(self) -> int:
        """Physical blocks one logical block of a sequence spans: one per (layer, kv-head)."""
        return self.num_layers * self.num_kv_heads

    @property
    def bytes_per_block(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        # K and V, plus the int32 position of each entry.
        return self.block_size * (2 * self.head_dim * element + 4)

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_block * self.heads_per_token // self.block_size


class KVPool:
    """K, V and entry positions for every physical block. Shared by all layers and heads."""

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device) -> None:
        if num_blocks < layout.heads_per_token:
            raise InvalidRequestError(
                f"the KV cache budget holds {num_blocks} blocks, fewer than the {layout.heads_per_token} "
                "one token of this model needs; raise kv_cache_memory")
        self.layout = layout
        self.num_blocks = num_blocks
        shape = (num_blocks, layout.block_size, layout.head_dim)
        # On huge pages on CPU: decode reads blocks scattered over the whole pool (inference/memory.py).
        self.k = memory.zeros(shape, layout.dtype, device)
        self.v = memory.zeros(shape, layout.dtype, device)
        self.pos = memory.zeros((num_blocks, layout.block_size), torch.int32, device)

    @classmethod
    def from_budget(cls, layout: KVLayout, budget_bytes: int, device: torch.device) -> KVPool:
        return cls(layout, budget_bytes // layout.bytes_per_block, device)

    @property
    def capacity_tokens(self) -> int:
        """Tokens a sequence could cache if it had the whole pool (no compression)."""
        return (self.num_blocks // self.layout.heads_per_token) * self.layout.block_size
