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
from inference.sequence import Sequence


@dataclass(slots=True)
class StepResult:
    logits: torch.Tensor  # [N, vocab] fp32: per completing chunk, one row (plus one per draft token)
    sampled_chunks: list[ScheduledChunk]
    tokens: torch.Tensor | None = None  # a greedy step's int64 [N] argmax of those rows, in place of logits


_NO_ROWS = torch.empty(0, dtype=torch.int64)  # a placeholder never written: build replaces it


def _slots(table: np.ndarray, lens: np.ndarray, count: int, block_size: int) -> np.ndarray:
    """Flat slot ids [L, H, count] for `count` new entries appended after each head's current length."""
    index = lens[:, :, None] + np.arange(count, dtype=np.int64)[None, None, :]
    blocks = np.take_along_axis(table, index // block_size, axis=2).astype(np.int64)
    return blocks * block_size + index % block_size


def _group_by_length(decodes: list[ScheduledChunk], cached: list[int], block_size: int,
                     slack: float = 1.3) -> list[list[ScheduledChunk]]:
    """Split length-sorted decodes (`cached`: each one's cached entries) so no group pads a sequence beyond
    `slack` times its own blocks.

    Each group costs a few more calls per layer, so short caches (cheap to pad) stay together.
    """
    groups: list[list[ScheduledChunk]] = []
    floor = 0
    for chunk, entries in zip(decodes, cached, strict=True):
        blocks = -(-(entries + 1) // block_size)
        if groups and blocks <= max(floor * slack, floor + 2):
            groups[-1].append(chunk)
        else:
            groups.append([chunk])
            floor = blocks
    return groups


def _adapter(seq: Sequence) -> int:
    """The sequence's LoRA slot, -1 for the base model (draft-model sequences have none)."""
    slot = getattr(seq, "lora_slot", None)
    return -1 if slot is None else slot


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

    def _decode_groups(self, decodes: list[ScheduledChunk],
                       cached: list[int]) -> list[tuple[list[ScheduledChunk], list[int]]]:
        """Length-sorted decodes (and their cached entries) in groups: one group when the CPU attention kernel
        serves every decode (sequences being compressed included: it gives their received attention too): it
        reads each sequence's own length, so padding costs nothing there, while each extra group is another call
        per layer with its own thread start-up and tail. Otherwise groups by length (the gathering references pay
        for padding)."""
        if not decodes:
            return []
        if getattr(self.model, "cpu_attention", False):
            return [(decodes, cached)]
        groups, start = [], 0
        for group in _group_by_length(decodes, cached, self.layout.block_size):
            groups.append((group, cached[start: start + len(group)]))
            start += len(group)
        return groups

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        # On the CPU the array's memory is the tensor's: no copy, and no call that would make none.
        return tensor if self.device.type == "cpu" else tensor.to(self.device, non_blocking=True)

    def build(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, AttentionBatch]:
        """Decodes first (one token each, sharing one batched attention call), then prompt chunks.

        A decode's rows come from its group's block tables in one array operation per group (its new entry's slot
        after each head's length, its token, position and adapter), not per sequence: with 32 sequences decoding,
        building a step per sequence cost about a millisecond of a 35 ms SmolLM2 step on a Zen 4 core, while the
        worker thread waited."""
        bs = self.layout.block_size
        decodes = [c for c in chunks if c.num_tokens == 1 and c.seq.num_computed > 0]
        cached = [c.seq.blocks.num_cached for c in decodes]
        order = sorted(range(len(decodes)), key=cached.__getitem__)
        decodes, cached = [decodes[i] for i in order], [cached[i] for i in order]
        prefills = [c for c in chunks if not (c.num_tokens == 1 and c.seq.num_computed > 0)]
        chunks[:] = decodes + prefills  # the caller reads rows in this order

        ids: list[int] = [c.seq.token_at(c.seq.num_computed) for c in decodes]
        positions: list[np.ndarray] = [np.array([c.seq.num_computed for c in decodes], np.int64)]
        slots: list[np.ndarray] = []
        adapters: list[np.ndarray] = [np.array([_adapter(c.seq) for c in decodes], np.int64)]
        batch = AttentionBatch(positions=_NO_ROWS, slots=_NO_ROWS, num_decode=len(decodes),  # both set below
                               dense=not any(c.seq.blocks.compressed for c in chunks))
        start = 0
        for group, lengths in self._decode_groups(decodes, cached):
            width = -(-(lengths[-1] + 1) // bs)
            # [L, rows, H, W] and [L, rows, H]: the layout the attention calls read, built in place
            tables = np.zeros((self.layout.num_layers, len(group), self.layout.num_kv_heads, width), np.int64)
            lens = np.zeros((self.layout.num_layers, len(group), self.layout.num_kv_heads), np.int32)
            for row, chunk in enumerate(group):
                blocks = chunk.seq.blocks
                used = min(width, blocks.num_columns)
                tables[:, row, :, :used] = blocks.table[:, :, :used]
                lens[:, row] = blocks.lens
                observer = _observer(chunk)
                if observer is not None:
                    observer.reset_entries(blocks.lens, 1)
            # each sequence's new entry goes right after each head's current length (indexing the flat tables:
            # take_along_axis built index grids that cost more than the rest of a one-sequence step's rows)
            columns = (lens // bs).ravel()
            blocks_at = tables.reshape(-1)[np.arange(0, tables.size, width) + columns].reshape(lens.shape)
            slots.append((blocks_at * bs + lens % bs).transpose(0, 2, 1))
            lens += 1
            observers = [_observer(chunk) for chunk in group]
            batch.decode_groups.append(DecodeGroup(
                start=start, end=start + len(group),
                block_tables=self._tensor(tables), kv_lens=self._tensor(lens),
                observers=observers if any(o is not None for o in observers) else None))
            start += len(group)

        offset = len(decodes)
        for chunk in prefills:
            seq, first = chunk.seq, chunk.seq.num_computed
            known = chunk.num_tokens - chunk.num_draft
            ids.extend(seq.token_ids()[first: first + known] + seq.draft[: chunk.num_draft])
            positions.append(np.arange(first, first + chunk.num_tokens, dtype=np.int64))
            slots.append(_slots(seq.blocks.table, seq.blocks.lens, chunk.num_tokens, bs))
            observer = _observer(chunk)
            if observer is not None:
                observer.reset_entries(seq.blocks.lens, chunk.num_tokens)
            adapters.append(np.full(chunk.num_tokens, _adapter(seq), dtype=np.int64))
            blocks = seq.blocks
            fresh = first == 0
            width = -(-(blocks.num_cached + chunk.num_tokens) // bs)
            # The prompt's last chunk shows the compressor which entries its final queries attend to.
            observer = observer if chunk.completes and chunk.num_draft == 0 else None
            paged = not fresh or observer is not None
            batch.prefills.append(PrefillSegment(
                start=offset, end=offset + chunk.num_tokens, fresh=fresh,
                block_table=self._tensor(blocks.table[:, :, :width]).long() if paged else None,
                kv_lens=self._tensor(blocks.lens + chunk.num_tokens) if paged else None,
                observer=observer,
                observe=min(chunk.num_tokens, observer.observe_window) if observer is not None else 0,
            ))
            offset += chunk.num_tokens
        batch.positions = self._tensor(np.concatenate(positions))
        batch.slots = self._tensor(np.concatenate(slots, axis=2))
        if self.lora is not None:
            batch.lora = self.lora.batch(np.concatenate(adapters))
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
