"""The per-step description of which KV slots each new token writes and which entries each query reads.

Built by the model runner from the scheduler's decisions; read by the model's attention layers. All tensors
are on the model's device. Layer comes first in every per-layer tensor so a layer's slice is contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from inference.compression.compressor import CompressionState
    from inference.lora.slots import LoRABatch


@dataclass(slots=True)
class PrefillSegment:
    """A run of query tokens of one sequence (a prompt chunk, or draft tokens to verify)."""

    start: int  # token range [start, end) in the flat step batch
    end: int
    fresh: bool  # nothing was cached before this chunk: attend over the chunk's own keys only
    block_table: torch.Tensor | None  # [L, Hkv, nb] (None when fresh)
    kv_lens: torch.Tensor | None  # [L, Hkv] entries per head after this step's write (None when fresh)
    # KV compression: the last `observe` queries' attention is added to the sequence's entry scores.
    # block_table and kv_lens are then set even for a fresh chunk.
    observer: CompressionState | None = None
    observe: int = 0


@dataclass(slots=True)
class DecodeGroup:
    """Single-token decodes of sequences with similar cache lengths, attended in one batched call.

    Gathering a batch's cache pads every sequence to the longest; grouping by length bounds that waste.
    """

    start: int  # token range [start, end) in the flat step batch, one token per sequence
    end: int
    block_tables: torch.Tensor  # [L, B, Hkv, nb]
    kv_lens: torch.Tensor  # [L, B, Hkv] entries per head after this step's write
    observers: list[CompressionState | None] | None = None  # per row, when any row compresses
    received: list[torch.Tensor] = field(default_factory=list)  # per layer [B, Hkv, nb * block_size], observed
    # or every layer's at once, [L, B, Hkv, nb * block_size], where the one-call CPU layers wrote them
    received_layers: torch.Tensor | None = None

    def flush_observations(self) -> None:
        """Hand each observed row the attention its entries received in every layer of the step: one add per
        sequence, not one per sequence and layer (on a GPU each add is a launch; 57 sequences over 30 layers
        made decoding host-bound)."""
        if self.observers is None or not (self.received or self.received_layers is not None):
            return
        stacked = self.received_layers if self.received_layers is not None else torch.stack(self.received)
        self.received.clear()
        self.received_layers = None
        for row, observer in enumerate(self.observers):
            if observer is not None:
                observer.add_layers(stacked[:, row])


@dataclass(slots=True)
class AttentionBatch:
    positions: torch.Tensor  # [T] token positions
    slots: torch.Tensor  # [L, Hkv, T] flat slot id each new token's K/V goes to, per layer and kv-head
    num_decode: int  # the first num_decode tokens are single-token decodes, one per sequence
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillSegment] = field(default_factory=list)
    # True while no head of any scheduled sequence has dropped entries: entry i then holds position i,
    # so masks can be built once per step instead of per layer from stored positions.
    dense: bool = True
    memo: dict = field(default_factory=dict)  # per-step values shared by all layers (rope rows, masks)
    lora: LoRABatch | None = None  # which rows add which adapter; None when no row has one

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])
