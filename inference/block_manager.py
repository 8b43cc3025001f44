"""Block allocation, per-sequence block tables and the automatic prefix cache.

A sequence's KV lives in a table of shape [layers, kv_heads, logical_blocks]: column i lists the physical
blocks (one per layer and head) holding tokens [i*bs, (i+1)*bs). Keeping a row per (layer, head) lets a later
compression pass give each head its own length without changing this structure.

Prefix cache: every full column is keyed by a hash chain (parent hash, the block's token ids, extra keys such
as an adapter id). A keyed column (a "group") is shared read-only by every sequence whose prompt starts with
the same tokens, ref-counted, and when no sequence uses it any more it stays cached until memory is needed,
evicted least-recently-released first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from inference.kv_cache import KVLayout


def block_hash(parent: bytes | None, tokens: Sequence[int], extra_keys: tuple) -> bytes:
    """A collision-resistant key: tenants share the cache, so a forged collision must not be feasible."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def prefix_chain(token_ids: Sequence[int], block_size: int, extra_keys: tuple = ()) -> list[bytes]:
    """The prefix-cache keys of every full block of token_ids, in order: what `match_prefix` looks up. A fleet
    router computes the same chain to find the replica already holding a prompt's longest prefix."""
    keys: list[bytes] = []
    parent: bytes | None = None
    for column in range(len(token_ids) // block_size):
        parent = block_hash(parent, token_ids[column * block_size: (column + 1) * block_size], extra_keys)
        keys.append(parent)
    return keys


@dataclass(slots=True)
class CachedGroup:
    blocks: np.ndarray  # [layers * kv_heads] physical block ids
    ref_count: int = 0


@dataclass(slots=True)
class SeqBlocks:
    """One sequence's view of the cache."""

    table: np.ndarray  # [L, H, capacity] physical block ids; columns >= num_columns are unused
    lens: np.ndarray  # [L, H] entries cached per head
    num_columns: int = 0
    shared: list[bytes | None] = field(default_factory=list)  # per column: prefix-cache key if shared
    hashes: list[bytes] = field(default_factory=list)  # hash chain of the full columns seen so far
    # Set once KV compression has dropped entries: every block is then private and each head holds its own
    # number of blocks (the columns no longer line up with token ranges).
    head_blocks: np.ndarray | None = None  # [L, H] blocks held per head, only when compressed

    @property
    def num_cached(self) -> int:
        """Entries held by the fullest head (every head, until compression is applied)."""
        return int(self.lens.max()) if self.lens.size else 0

    @property
    def compressed(self) -> bool:
        return self.head_blocks is not None

    @property
    def num_entries(self) -> int:
        """Entries held over all layers and heads."""
        return int(self.lens.sum())


@dataclass(slots=True)
class CompactionPlan:
    """Where each kept entry that moves goes: flat slot ids, in the same order (gather all, then write all)."""

    src: np.ndarray  # [n] int64
    dst: np.ndarray  # [n] int64
    blocks_before: int  # blocks the sequence referenced (shared ones included)
    blocks_after: int  # blocks it holds now, all private


class BlockManager:
    def __init__(self, layout: KVLayout, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.group_size = layout.heads_per_token
        # A stack of free block ids; the top is at the end.
        self._free = np.arange(num_blocks - 1, -1, -1, dtype=np.int32)
        self._num_free = num_blocks
        self._groups: dict[bytes, CachedGroup] = {}
        self._evictable: OrderedDict[bytes, None] = OrderedDict()  # unreferenced groups, oldest first
        self.evictable_blocks = 0
        # Prefix-cache statistics (in prompt tokens).
        self.query_tokens = 0
        self.hit_tokens = 0

    # ----------------------------------------------------------------- accounting
    @property
    def num_free_blocks(self) -> int:
        """Blocks available now: free ones plus cached ones nobody references (reclaimable)."""
        return self._num_free + self.evictable_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_groups(self) -> int:
        return len(self._groups)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        columns = -(-num_tokens // self.layout.block_size)
        return columns * self.group_size

    def new_sequence(self) -> SeqBlocks:
        lay = self.layout
        return SeqBlocks(table=np.zeros((lay.num_layers, lay.num_kv_heads, 4), dtype=np.int32),
                         lens=np.zeros((lay.num_layers, lay.num_kv_heads), dtype=np.int32))

    # ----------------------------------------------------------------- raw blocks
    def _take(self, count: int) -> np.ndarray | None:
        if count > self.num_free_blocks:
            return None
        while self._num_free < count:
            self._evict_one()
        start = self._num_free - count
        taken = self._free[start: self._num_free][::-1].copy()
        self._num_free = start
        return taken

    def _give(self, blocks: np.ndarray) -> None:
        count = len(blocks)
        if self._num_free + count > len(self._free):
            raise RuntimeError("block freed twice")
        self._free[self._num_free: self._num_free + count] = blocks[::-1]
        self._num_free += count

    def _evict_one(self) -> None:
        key, _ = self._evictable.popitem(last=False)
        group = self._groups.pop(key)
        self.evictable_blocks -= len(group.blocks)
        self._give(group.blocks)

    # ----------------------------------------------------------------- sequences
    def _ensure_capacity(self, seq: SeqBlocks, columns: int) -> None:
        capacity = seq.table.shape[2]
        if columns <= capacity:
            return
        grown = np.zeros((*seq.table.shape[:2], max(columns, capacity * 2)), dtype=np.int32)
        grown[:, :, :capacity] = seq.table
        seq.table = grown

    def allocate(self, seq: SeqBlocks, num_new_tokens: int) -> bool:
        """Make room for num_new_tokens more entries per head. All or nothing."""
        if seq.compressed:
            return self._allocate_per_head(seq, num_new_tokens)
        needed_columns = -(-(seq.num_cached + num_new_tokens) // self.layout.block_size)
        extra = needed_columns - seq.num_columns
        if extra <= 0:
            return True
        blocks = self._take(extra * self.group_size)
        if blocks is None:
            return False
        self._ensure_capacity(seq, needed_columns)
        lay = self.layout
        new = blocks.reshape(extra, lay.num_layers, lay.num_kv_heads).transpose(1, 2, 0)
        seq.table[:, :, seq.num_columns: needed_columns] = new
        seq.shared.extend([None] * extra)
        seq.num_columns = needed_columns
        return True

    def _allocate_per_head(self, seq: SeqBlocks, num_new_tokens: int) -> bool:
        assert seq.head_blocks is not None
        bs = self.layout.block_size
        need = np.maximum(-(-(seq.lens + num_new_tokens) // bs) - seq.head_blocks, 0)
        total = int(need.sum())
        if total == 0:
            return True
        blocks = self._take(total)
        if blocks is None:
            return False
        self._ensure_capacity(seq, int((seq.head_blocks + need).max()))
        taken = 0
        for layer, head in zip(*np.nonzero(need), strict=True):
            count, start = int(need[layer, head]), int(seq.head_blocks[layer, head])
            seq.table[layer, head, start: start + count] = blocks[taken: taken + count]
            taken += count
        seq.head_blocks += need
        seq.num_columns = int(seq.head_blocks.max())
        return True

    def plan_compaction(self, seq: SeqBlocks, keep: np.ndarray) -> CompactionPlan | None:
        """Keep, per head, the entries whose logical index `keep` marks ([L, H, S] bool, S >= every head's
        length), packed to the front in their order; give back the blocks that are no longer needed.

        The sequence stops sharing prefix-cache blocks (they stay cached for others): its kept entries go to
        its own private blocks, reusing those it has, so a compacted head never writes into a shared block.
        None (and nothing changed) when the pool cannot supply the few fresh blocks that may need.
        """
        lay, bs = self.layout, self.layout.block_size
        kept = keep.sum(axis=2).astype(np.int32)
        blocks_before = int(seq.head_blocks.sum()) if seq.compressed else seq.num_columns * self.group_size
        if np.any(kept > seq.lens):
            raise ValueError("keep marks entries beyond a head's length")
        need = -(-kept // bs)
        if seq.compressed:
            owned = [[list(seq.table[layer, head, : seq.head_blocks[layer, head]]) for head in range(lay.num_kv_heads)]
                     for layer in range(lay.num_layers)]
        else:
            private = [c for c in range(seq.num_columns) if seq.shared[c] is None]
            owned = [[list(seq.table[layer, head, private]) for head in range(lay.num_kv_heads)]
                     for layer in range(lay.num_layers)]
        fresh_needed = sum(max(0, int(need[layer, head]) - len(owned[layer][head]))
                           for layer in range(lay.num_layers) for head in range(lay.num_kv_heads))
        fresh = self._take(fresh_needed) if fresh_needed else np.zeros(0, dtype=np.int32)
        if fresh is None:
            return None
        new_table = np.zeros((lay.num_layers, lay.num_kv_heads, max(1, int(need.max()))), dtype=np.int32)
        spare: list[int] = []
        used_fresh = 0
        for layer in range(lay.num_layers):
            for head in range(lay.num_kv_heads):
                mine, n = owned[layer][head], int(need[layer, head])
                extra = max(0, n - len(mine))
                dest = mine[:n] + list(fresh[used_fresh: used_fresh + extra])
                used_fresh += extra
                new_table[layer, head, :n] = dest
                spare.extend(mine[n:])
        # Every kept entry at once, in (layer, head, entry) order: where it is, and where it goes (its rank among
        # its head's kept entries). Entries before a head's first eviction stay where they are, in the blocks the
        # head keeps: only the others move (a decode-time pass evicts a block's worth from a few hundred).
        layer_at, head_at, entry_at = np.nonzero(keep)
        counts = kept.reshape(-1).astype(np.int64)
        rank = np.arange(entry_at.size, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        src = seq.table[layer_at, head_at, entry_at // bs].astype(np.int64) * bs + entry_at % bs
        dst = new_table[layer_at, head_at, rank // bs].astype(np.int64) * bs + rank % bs
        moves = src != dst
        # Drop the sequence's references to shared groups; they stay in the prefix cache for other requests.
        for column in range(seq.num_columns):
            key = seq.shared[column] if not seq.compressed else None
            if key is not None:
                self._release_group(key)
        if spare:
            self._give(np.asarray(spare, dtype=np.int32))
        seq.table = new_table
        seq.lens = kept
        seq.head_blocks = need.astype(np.int32)
        seq.num_columns = int(need.max())
        seq.shared = [None] * seq.num_columns
        seq.hashes.clear()
        return CompactionPlan(src=src[moves], dst=dst[moves], blocks_before=blocks_before,
                              blocks_after=int(need.sum()))

    def _release_group(self, key: bytes) -> None:
        group = self._groups[key]
        group.ref_count -= 1
        if group.ref_count == 0:
            self._evictable[key] = None
            self.evictable_blocks += len(group.blocks)

    def free(self, seq: SeqBlocks) -> None:
        """Release a sequence's blocks; its shared full blocks stay cached for later requests."""
        if seq.compressed:
            assert seq.head_blocks is not None
            owned = [seq.table[layer, head, : seq.head_blocks[layer, head]]
                     for layer in range(self.layout.num_layers) for head in range(self.layout.num_kv_heads)]
            self._give(np.concatenate(owned))
            seq.head_blocks = None
            seq.num_columns = 0
            seq.shared.clear()
            seq.hashes.clear()
            seq.lens[:] = 0
            return
        for column in range(seq.num_columns):
            key = seq.shared[column]
            if key is None:
                self._give(seq.table[:, :, column].reshape(-1).copy())
                continue
            self._release_group(key)
        seq.num_columns = 0
        seq.shared.clear()
        seq.hashes.clear()
        seq.lens[:] = 0

    # ----------------------------------------------------------------- prefix cache
    def match_prefix(self, seq: SeqBlocks, token_ids: Sequence[int], extra_keys: tuple = (),
                     min_uncached: int = 1) -> int:
        """Adopt the longest cached run of full blocks at the start of token_ids; returns tokens reused.

        At least `min_uncached` tokens (and always one) are left to compute: the last one's logits are what
        the first sample needs, and KV compression observes the attention of the prompt's final queries.
        """
        bs = self.layout.block_size
        self.query_tokens += len(token_ids)
        if not self.enable_prefix_caching or seq.num_columns:
            return 0
        keys = self._cached_run(token_ids, extra_keys, min_uncached)
        if not keys:
            return 0
        self._ensure_capacity(seq, len(keys))
        lay = self.layout
        for column, key in enumerate(keys):
            group = self._groups[key]
            if group.ref_count == 0:
                del self._evictable[key]
                self.evictable_blocks -= len(group.blocks)
            group.ref_count += 1
            seq.table[:, :, column] = group.blocks.reshape(lay.num_layers, lay.num_kv_heads)
        seq.shared.extend(keys)
        seq.hashes.extend(keys)
        seq.num_columns = len(keys)
        reused = len(keys) * bs
        seq.lens[:] = reused
        self.hit_tokens += reused
        return reused

    def cached_prefix(self, token_ids: Sequence[int], extra_keys: tuple = (), min_uncached: int = 1) -> int:
        """Tokens match_prefix would reuse for this prompt now, adopting nothing and counting nothing."""
        if not self.enable_prefix_caching:
            return 0
        return len(self._cached_run(token_ids, extra_keys, min_uncached)) * self.layout.block_size

    def _cached_run(self, token_ids: Sequence[int], extra_keys: tuple, min_uncached: int) -> list[bytes]:
        """The keys of the cached full blocks that start token_ids, leaving at least min_uncached (and one)."""
        bs = self.layout.block_size
        max_columns = max(0, len(token_ids) - max(1, min_uncached)) // bs
        parent: bytes | None = None
        keys: list[bytes] = []
        for column in range(max_columns):
            key = block_hash(parent, token_ids[column * bs: (column + 1) * bs], extra_keys)
            if key not in self._groups:
                break
            keys.append(key)
            parent = key
        return keys

    def commit_full_blocks(self, seq: SeqBlocks, token_ids: Sequence[int], extra_keys: tuple = ()) -> None:
        """Key every newly completed column so later requests can reuse it."""
        if not self.enable_prefix_caching or seq.compressed:
            return
        bs = self.layout.block_size
        full = seq.num_cached // bs
        while len(seq.hashes) < full:
            column = len(seq.hashes)
            parent = seq.hashes[-1] if seq.hashes else None
            key = block_hash(parent, token_ids[column * bs: (column + 1) * bs], extra_keys)
            seq.hashes.append(key)
            if seq.shared[column] is not None or key in self._groups:
                # Already shared, or another sequence computed the same block first: keep ours private.
                continue
            self._groups[key] = CachedGroup(blocks=seq.table[:, :, column].reshape(-1).copy(), ref_count=1)
            seq.shared[column] = key

    def cached_keys(self, limit: int) -> list[bytes]:
        """The keys of at most `limit` cached groups, newest first. Safe from another thread: a snapshot of the
        dict's keys is one C-level copy, and a resize racing it only costs a retry."""
        for _ in range(3):
            try:
                keys = list(self._groups)
            except RuntimeError:  # changed size during the copy
                continue
            return keys[::-1][:limit]
        return []

    def reset_prefix_cache(self) -> int:
        """Drop every unreferenced cached block; returns how many groups were dropped."""
        dropped = len(self._evictable)
        while self._evictable:
            self._evict_one()
        return dropped

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0
