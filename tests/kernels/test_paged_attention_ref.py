"""The paged attention references against plain dense attention on fresh random inputs (fp32)."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import paged_attention as pa


def _dense(q, keys, values, q_pos, key_pos, scale, window=None):
    """Naive per-head softmax attention: q [Hq, D] at q_pos over keys [Hkv][S_h, D] with positions."""
    hq = q.shape[0]
    groups = hq // len(keys)
    out = torch.empty_like(q)
    for h in range(hq):
        k, v, pos = keys[h // groups], values[h // groups], key_pos[h // groups]
        ok = pos <= q_pos
        if window is not None:
            ok &= pos > q_pos - window
        s = (k @ q[h]) * scale
        s = s.masked_fill(~ok, float("-inf"))
        out[h] = torch.softmax(s, 0) @ v
    return out


def _scatter(lengths, block_size, num_blocks, head_dim, gen, last=None):
    """A pool holding each head's entries in randomly chosen blocks; returns pool, table, keys, values, positions.

    Every head's last entry sits at position `last` (the token being decoded, written before attention).
    """
    last = last if last is not None else 3 * max(lengths) + 1
    k_cache = torch.randn(num_blocks, block_size, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, head_dim, generator=gen)
    pos_cache = torch.full((num_blocks, block_size), -1, dtype=torch.int32)
    width = max(math.ceil(n / block_size) for n in lengths)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.zeros(len(lengths), width, dtype=torch.long)
    keys, values, positions = [], [], []
    for h, n in enumerate(lengths):
        blocks = [perm.pop() for _ in range(math.ceil(n / block_size))]
        table[h, : len(blocks)] = torch.tensor(blocks)
        # A head that dropped entries keeps increasing but gapped positions.
        pos = torch.sort(torch.randperm(3 * n + 1, generator=gen)[: n - 1]).values
        pos = torch.cat([pos, torch.tensor([last])])
        flat = torch.tensor(blocks).repeat_interleave(block_size)[:n] * block_size + torch.arange(n) % block_size
        pos_cache.view(-1)[flat] = pos.int()
        keys.append(k_cache.view(-1, head_dim)[flat])
        values.append(v_cache.view(-1, head_dim)[flat])
        positions.append(pos)
    return k_cache, v_cache, pos_cache, table, keys, values, positions


@pytest.mark.parametrize("lengths,groups,window", [
    ([1, 17, 33], 3, None),  # a head with one entry left, partial blocks
    ([40, 40], 1, None),
    ([5, 64, 23, 9], 2, 11),  # sliding window
])
def test_decode_reference_matches_dense(lengths, groups, window) -> None:
    gen = torch.Generator().manual_seed(len(lengths) * 100 + groups)
    block_size, head_dim = 8, 16
    batch = 3
    hkv = len(lengths)
    k_cache, v_cache, pos_cache, *_ = _scatter(lengths, block_size, 128, head_dim, gen)
    tables, lens, qpos, refs, qs = [], [], [], [], []
    for b in range(batch):
        per_seq = [max(1, n - 3 * b) for n in lengths]
        k_c, v_c, p_c, table, keys, values, positions = _scatter(per_seq, block_size, 128, head_dim, gen)
        offset = b * 128
        tables.append(table + offset)
        k_cache = k_c if b == 0 else torch.cat([k_cache, k_c])
        v_cache = v_c if b == 0 else torch.cat([v_cache, v_c])
        pos_cache = p_c if b == 0 else torch.cat([pos_cache, p_c])
        q_position = int(positions[0][-1])
        q = torch.randn(hkv * groups, head_dim, generator=gen)
        refs.append(_dense(q, keys, values, q_position, positions, 0.25, window))
        qs.append(q)
        lens.append(torch.tensor(per_seq))
        qpos.append(q_position)
    width = max(t.shape[1] for t in tables)
    block_tables = torch.stack([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in tables])
    kv_lens = torch.stack(lens)
    q_positions = torch.tensor(qpos)
    mask = pa.decode_mask(pos_cache, block_tables, kv_lens, q_positions, window)
    out = pa.paged_decode_attention_ref(torch.stack(qs), k_cache, v_cache, block_tables, mask, 0.25)
    assert torch.allclose(out, torch.stack(refs), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 7])
def test_prefill_reference_matches_dense(window) -> None:
    gen = torch.Generator().manual_seed(5)
    lengths, groups, block_size, head_dim = [30, 30], 2, 8, 16
    k_cache, v_cache, pos_cache, table, keys, values, positions = _scatter(lengths, block_size, 64, head_dim, gen)
    # Queries are the last 6 entries' positions of each head (identical positions across heads here).
    for p in positions[1:]:
        p.copy_(positions[0])
        pos_cache.view(-1)[(table[1].repeat_interleave(block_size)[:30] * block_size
                            + torch.arange(30) % block_size)] = p.int()
    q_positions = positions[0][-6:]
    q = torch.randn(6, len(lengths) * groups, head_dim, generator=gen)
    out = pa.paged_prefill_attention_ref(q, k_cache, v_cache, pos_cache, table, torch.tensor(lengths),
                                         q_positions, 0.25, window)
    for t in range(6):
        ref = _dense(q[t], keys, values, int(q_positions[t]), positions, 0.25, window)
        assert torch.allclose(out[t], ref, atol=1e-5, rtol=1e-5)


def test_dense_mask_equals_the_stored_position_mask() -> None:
    block_size, n = 4, 13
    pos_cache = torch.full((16, block_size), -1, dtype=torch.int32)
    table = torch.tensor([[3, 7, 1, 9]])
    flat = table[0].repeat_interleave(block_size)[:n] * block_size + torch.arange(n) % block_size
    pos_cache.view(-1)[flat] = torch.arange(n, dtype=torch.int32)
    lens, qpos = torch.tensor([[n]]), torch.tensor([n - 1])
    for window in (None, 5):
        general = pa.decode_mask(pos_cache, table.unsqueeze(0), lens, qpos, window)
        dense = pa.dense_decode_mask(lens[:, 0], qpos, 16, window)
        assert torch.equal(general, dense.expand_as(general))
