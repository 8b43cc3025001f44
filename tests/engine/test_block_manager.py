"""Block allocation, freeing and the prefix cache, on the block manager alone."""

from __future__ import annotations

import numpy as np
import torch

from inference.block_manager import BlockManager
from inference.kv_cache import KVLayout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=3, head_dim=8, block_size=4, dtype=torch.float32)
GROUP = LAYOUT.heads_per_token  # 6 physical blocks per logical block


def _manager(columns: int, caching: bool = True) -> BlockManager:
    return BlockManager(LAYOUT, columns * GROUP, enable_prefix_caching=caching)


def test_allocate_is_all_or_nothing_and_free_returns_everything() -> None:
    bm = _manager(columns=3)
    a, b = bm.new_sequence(), bm.new_sequence()
    assert bm.allocate(a, 5)  # 2 columns
    assert bm.num_free_blocks == GROUP
    assert not bm.allocate(b, 5)  # needs 2 columns, 1 left: nothing taken
    assert bm.num_free_blocks == GROUP
    assert bm.allocate(b, 4)
    assert bm.num_free_blocks == 0
    used = np.concatenate([a.table[:, :, :2].ravel(), b.table[:, :, :1].ravel()])
    assert len(set(used.tolist())) == len(used) == 3 * GROUP  # no block handed out twice
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == bm.num_blocks


def test_growing_within_a_column_takes_no_new_blocks() -> None:
    bm = _manager(columns=2)
    seq = bm.new_sequence()
    assert bm.allocate(seq, 3)
    seq.lens += 3
    free = bm.num_free_blocks
    assert bm.allocate(seq, 1)  # 4th entry fits the same block
    assert bm.num_free_blocks == free
    seq.lens += 1
    assert bm.allocate(seq, 1)
    assert bm.num_free_blocks == free - GROUP


def _fill(bm: BlockManager, seq, tokens: list[int]) -> None:
    assert bm.allocate(seq, len(tokens))
    seq.lens += len(tokens)
    bm.commit_full_blocks(seq, tokens)


def test_prefix_hits_share_blocks_and_leave_one_token_to_compute() -> None:
    bm = _manager(columns=8)
    tokens = list(range(10))  # two full blocks and a partial one
    first = bm.new_sequence()
    _fill(bm, first, tokens)
    second = bm.new_sequence()
    assert bm.match_prefix(second, tokens) == 8
    assert np.array_equal(second.table[:, :, :2], first.table[:, :, :2])
    # A prompt that is exactly the cached blocks still computes its last token.
    third = bm.new_sequence()
    assert bm.match_prefix(third, tokens[:8]) == 4
    # Different extra keys (e.g. another adapter) never share.
    fourth = bm.new_sequence()
    assert bm.match_prefix(fourth, tokens, extra_keys=("adapter-1",)) == 0
    # A different first block breaks the chain even if later tokens agree.
    fifth = bm.new_sequence()
    assert bm.match_prefix(fifth, [99] + tokens[1:]) == 0


def test_released_cached_blocks_are_reused_then_evicted_lru() -> None:
    bm = _manager(columns=4)
    old, new = [1, 2, 3, 4, 0], [5, 6, 7, 8, 0]
    for tokens in (old, new):
        seq = bm.new_sequence()
        _fill(bm, seq, tokens)
        bm.free(seq)  # the full block stays cached, the partial one is freed
    assert bm.num_cached_groups == 2
    assert bm.num_free_blocks == bm.num_blocks  # cached but reclaimable
    # Needing three columns evicts exactly one cached group: the least recently released (old).
    hog = bm.new_sequence()
    assert bm.allocate(hog, 12)
    assert bm.num_cached_groups == 1
    assert bm.match_prefix(bm.new_sequence(), old) == 0
    assert bm.match_prefix(bm.new_sequence(), new) == 4


def test_referenced_cached_blocks_are_never_evicted() -> None:
    bm = _manager(columns=3)
    owner = bm.new_sequence()
    _fill(bm, owner, [1, 2, 3, 4, 5])
    reader = bm.new_sequence()
    assert bm.match_prefix(reader, [1, 2, 3, 4, 5]) == 4
    bm.free(owner)
    hog = bm.new_sequence()
    assert not bm.allocate(hog, 12)  # only two columns are free: the shared one is still in use
    bm.free(reader)
    assert bm.allocate(hog, 12)


def test_caching_off_never_hits() -> None:
    bm = _manager(columns=4, caching=False)
    seq = bm.new_sequence()
    _fill(bm, seq, [1, 2, 3, 4, 5])
    bm.free(seq)
    assert bm.match_prefix(bm.new_sequence(), [1, 2, 3, 4, 5]) == 0
    assert bm.num_cached_groups == 0
