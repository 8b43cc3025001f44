"""Turns a scheduled step into tensors, runs the model, and returns logits for the rows that sample."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from inference.batch import AttentionBatch, DecodeGroup, PrefillSegment
from inference.compression.compressor import CompressionState
from inference.kv_cache import KVLayout, KVPool
from inference.lora.slots import LoRASlots
from inference.models.decoder import DecoderLM
from inference.scheduler import ScheduledChunk


@dataclass(slots=True)
class StepResult:
    logits: torch.Tensor  # [N, vocab] fp32: per completing chunk, one row (plus one per draft token)
    sampled_chunks: list[ScheduledChunk]
    tokens: torch.Tensor | None = None  # a greedy step's int64 [N] argmax of those rows, in place of logits


def _slots(table: np.ndarray, lens: np.ndarray, count: int, block_size: int) -> np.ndarray:
    """Flat slot ids [L, H, count] for `count` new entries appended after each head's current length."""
    index = lens[:, :, None] + np.arange(count, dtype=np.int64)[None, None, :]
    blocks = np.take_along_axis(table, index // block_size, axis=2).astype(np.int64)
    return blocks * block_size + index % block_size


def _group_by_length(decodes: list[ScheduledChunk], block_size: int,
                     slack: float = 1.3) -> list[list[ScheduledChunk]]:
    """Split length-sorted decodes so no group pads a sequence beyond `slack` times its own blocks.

    Each group costs a few more calls per layer, so short caches (cheap to pad) stay together.
    """
    groups: list[list[ScheduledChunk]] = []
    floor = 0
    for chunk in decodes:
        blocks = -(-(chunk.seq.blocks.num_cached + 1) // block_size)
        if groups and blocks <= max(floor * slack, floor + 2):
            groups[-1].append(chunk)
        else:
            groups.append([chunk])
            floor = blocks
    return groups


def _observer(chunk: ScheduledChunk) -> CompressionState | None:
    """The sequence's compression state, when its KV is being compressed (draft-model sequences have none)."""
    return getattr(chunk.seq, "compression", None)


class ModelRunner:
    def __init__(self, model: DecoderLM, pool: KVPool, lora: LoRASlots | None = None) -> None:
        self.model = model
        self.pool = pool
        self.layout: KVLayout = pool.layout
        self.device = model.device
        self.lora = lora

    def _decode_groups(self, decodes: list[ScheduledChunk]) -> list[list[ScheduledChunk]]:
        """One group when the CPU attention kernel serves every decode: it reads each sequence's own length, so
        padding costs nothing there, while each extra group is another call per layer with its own thread
        start-up and tail. Otherwise groups by length (the gathering references pay for padding)."""
        if decodes and getattr(self.model, "cpu_attention", False) and not any(map(_observer, decodes)):
            return [decodes]
        return _group_by_length(decodes, self.layout.block_size)

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device, non_blocking=True)

    def build(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, AttentionBatch]:
        """Decodes first (one token each, sharing one batched attention call), then prompt chunks."""
        bs = self.layout.block_size
        decodes = sorted((c for c in chunks if c.num_tokens == 1 and c.seq.num_computed > 0),
                         key=lambda c: c.seq.blocks.num_cached)
        prefills = [c for c in chunks if not (c.num_tokens == 1 and c.seq.num_computed > 0)]
        chunks[:] = decodes + prefills  # the caller reads rows in this order

        ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        adapters: list[np.ndarray] = []  # each row's LoRA slot, -1 for the base model
        for chunk in chunks:
            seq, start = chunk.seq, chunk.seq.num_computed
            known = chunk.num_tokens - chunk.num_draft
            tokens = seq.token_ids()[start: start + known] + seq.draft[: chunk.num_draft]
            ids.extend(tokens)
            positions.append(np.arange(start, start + chunk.num_tokens, dtype=np.int64))
            slots.append(_slots(seq.blocks.table, seq.blocks.lens, chunk.num_tokens, bs))
            observer = _observer(chunk)
            if observer is not None:
                observer.reset_entries(seq.blocks.lens, chunk.num_tokens)
            adapter = getattr(seq, "lora_slot", None)
            adapters.append(np.full(chunk.num_tokens, -1 if adapter is None else adapter, dtype=np.int64))

        batch = AttentionBatch(
            positions=self._tensor(np.concatenate(positions)),
            slots=self._tensor(np.concatenate(slots, axis=2)),
            num_decode=len(decodes),
            dense=not any(c.seq.blocks.compressed for c in chunks),
        )
        if self.lora is not None:
            batch.lora = self.lora.batch(np.concatenate(adapters))
        start = 0
        for group in self._decode_groups(decodes):
            width = -(-(group[-1].seq.blocks.num_cached + 1) // bs)
            tables = np.zeros((len(group), self.layout.num_layers, self.layout.num_kv_heads, width), np.int32)
            lens = np.zeros((len(group), self.layout.num_layers, self.layout.num_kv_heads), np.int32)
            for row, chunk in enumerate(group):
                blocks = chunk.seq.blocks
                used = min(width, blocks.num_columns)
                tables[row, :, :, :used] = blocks.table[:, :, :used]
                lens[row] = blocks.lens + 1
            observers = [_observer(chunk) for chunk in group]
            batch.decode_groups.append(DecodeGroup(
                start=start, end=start + len(group),
                block_tables=self._tensor(tables.transpose(1, 0, 2, 3)).long(),
                kv_lens=self._tensor(lens.transpose(1, 0, 2)),
                observers=observers if any(o is not None for o in observers) else None))
            start += len(group)
        offset = len(decodes)
        for chunk in prefills:
            blocks = chunk.seq.blocks
            fresh = chunk.seq.num_computed == 0
            width = -(-(blocks.num_cached + chunk.num_tokens) // bs)
            # The prompt's last chunk shows the compressor which entries its final queries attend to.
            observer = _observer(chunk) if chunk.completes and chunk.num_draft == 0 else None
            paged = not fresh or observer is not None
            batch.prefills.append(PrefillSegment(
                start=offset, end=offset + chunk.num_tokens, fresh=fresh,
                block_table=self._tensor(blocks.table[:, :, :width]).long() if paged else None,
                kv_lens=self._tensor(blocks.lens + chunk.num_tokens) if paged else None,
                observer=observer,
                observe=min(chunk.num_tokens, observer.observe_window) if observer is not None else 0,
            ))
            offset += chunk.num_tokens
        return self._tensor(np.asarray(ids, dtype=np.int64)), batch

    def execute(self, chunks: list[ScheduledChunk],
                head: Callable[[torch.Tensor], torch.Tensor] | None = None,
                between_layers: Callable[[], None] | None = None, greedy: bool = False) -> StepResult:
        """head: maps final hidden rows to the returned rows (default: the model's full-vocabulary logits).
        between_layers: see DecoderLM.forward. greedy: the result holds each sampled row's argmax token instead
        of its logits (DecoderLM.greedy_tokens), for steps whose rows read nothing else from them."""
        input_ids, batch = self.build(chunks)
        rows, sampled = self._sampled_rows(chunks)
        keep = None if len(rows) == input_ids.shape[0] else torch.tensor(rows, dtype=torch.long, device=self.device)
        hidden = self.model.forward(input_ids, batch, self.pool, between_layers, keep=keep)
        for group in batch.decode_groups:
            group.flush_observations()
        for chunk in chunks:
            chunk.seq.blocks.lens += chunk.num_tokens
        if not rows:
            return StepResult(torch.empty(0, self.model.vocab_size), sampled)
        if greedy:
            return StepResult(torch.empty(0, self.model.vocab_size), sampled, self.model.greedy_tokens(hidden))
        return StepResult((head or self.model.logits)(hidden), sampled)

    def execute_all_logits(self, chunk: ScheduledChunk) -> torch.Tensor:
        """Logits at every position of one chunk (scoring a prompt), fp32 [num_tokens, vocab]."""
        input_ids, batch = self.build([chunk])
        hidden = self.model.forward(input_ids, batch, self.pool)
        chunk.seq.blocks.lens += chunk.num_tokens
        return self.model.logits(hidden)

    @staticmethod
    def _sampled_rows(chunks: list[ScheduledChunk]) -> tuple[list[int], list[ScheduledChunk]]:
        """The step rows whose next tokens are sampled (a completing chunk's last token and its draft tokens),
        and those chunks, in step order."""
        rows: list[int] = []
        sampled: list[ScheduledChunk] = []
        end = 0
        for chunk in chunks:
            end += chunk.num_tokens
            if chunk.completes:
                rows.extend(range(end - 1 - chunk.num_draft, end))
                sampled.append(chunk)
        return rows, sampled
