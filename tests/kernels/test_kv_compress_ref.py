"""KV compression references against naive per-head computations on fresh random inputs (fp32)."""

from __future__ import annotations

import torch

from kernels import kv_compress as kc
from kernels import paged_attention as pa
from tests.kernels.test_paged_attention_ref import _scatter


def _naive_received(q_rows, keys, positions, q_positions, scale, groups, window=None):
    """[Hkv][S_h] attention received per entry: softmax per query and query head, summed over both."""
    out = []
    for h, (k, pos) in enumerate(zip(keys, positions, strict=True)):
        total = torch.zeros(k.shape[0])
        for t, q_pos in enumerate(q_positions):
            ok = pos <= q_pos
            if window is not None:
                ok &= pos > q_pos - window
            if not ok.any():
                continue  # a query that sees none of this head's entries gives them nothing
            for g in range(groups):
                s = (k @ q_rows[t, h * groups + g]) * scale
                total += torch.softmax(s.masked_fill(~ok, float("-inf")), 0)
        out.append(total)
    return out


def test_prefill_received_attention_matches_naive() -> None:
    gen = torch.Generator().manual_seed(11)
    lengths, groups, block_size, head_dim = [13, 30, 1], 2, 8, 16
    k_cache, v_cache, pos_cache, table, keys, _, positions = _scatter(lengths, block_size, 64, head_dim, gen)
    last = int(positions[0][-1])
    q_positions = torch.tensor([last - 3, last - 1, last])
    q = torch.randn(3, len(lengths) * groups, head_dim, generator=gen)
    for window in (None, 9):
        got = kc.prefill_received_attention_ref(q, k_cache, pos_cache, table, torch.tensor(lengths), q_positions,
                                                0.3, window)
        want = _naive_received(q, keys, positions, q_positions.tolist(), 0.3, groups, window)
        for h, n in enumerate(lengths):
            torch.testing.assert_close(got[h, :n], want[h], atol=1e-5, rtol=1e-5)
            assert torch.all(got[h, n:] == 0)  # padding past a head's length receives nothing


def test_decode_received_attention_matches_naive_and_sums_to_group_size() -> None:
    gen = torch.Generator().manual_seed(12)
    lengths, groups, block_size, head_dim = [9, 25], 3, 8, 16
    k_cache, _, pos_cache, table, keys, _, positions = _scatter(lengths, block_size, 64, head_dim, gen)
    q_pos = int(positions[0][-1])
    q = torch.randn(1, len(lengths) * groups, head_dim, generator=gen)
    tables, lens, qp = table[None], torch.tensor([lengths]), torch.tensor([q_pos])
    got = kc.decode_received_attention_ref(q, k_cache, tables, pa.decode_mask(pos_cache, tables, lens, qp), 0.25)
    want = _naive_received(q, keys, positions, [q_pos], 0.25, groups)
    for h, n in enumerate(lengths):
        torch.testing.assert_close(got[0, h, :n], want[h], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.sum(-1), torch.full((1, 2), float(groups)))


def test_move_entries_handles_overlapping_sources_and_destinations() -> None:
    gen = torch.Generator().manual_seed(13)
    k = torch.randn(4, 8, 16, generator=gen)
    v = torch.randn(4, 8, 16, generator=gen)
    pos = torch.arange(32, dtype=torch.int32).view(4, 8)
    src = torch.tensor([3, 5, 9, 17, 30])  # kept entries, moved to the front of the same blocks
    dst = torch.arange(5)
    k0, v0, p0 = k.clone(), v.clone(), pos.clone()
    kc.move_entries_ref(k, v, pos, src, dst)
    torch.testing.assert_close(k.view(-1, 16)[:5], k0.view(-1, 16)[src])
    torch.testing.assert_close(v.view(-1, 16)[:5], v0.view(-1, 16)[src])
    assert pos.view(-1)[:5].tolist() == p0.view(-1)[src].tolist()


def _random_pool(gen: torch.Generator, batch: int, hkv: int, lens_max: int, block_size: int, head_dim: int):
    """Per-(sequence, head) random lengths (one head with a single entry), blocks placed at random, gapped
    stored positions ending at the query's own."""
    lens = torch.randint(1, lens_max + 1, (batch, hkv), generator=gen)
    lens[0, -1] = 1
    width = -(-int(lens.max()) // block_size)
    num_blocks = batch * hkv * width + 3
    tables = torch.randperm(num_blocks, generator=gen)[: batch * hkv * width].view(batch, hkv, width)
    pos_cache = torch.full((num_blocks, block_size), -1, dtype=torch.int32)
    q_positions = torch.full((batch,), 3 * lens_max, dtype=torch.int32)
    for b in range(batch):
        for h in range(hkv):
            n = int(lens[b, h])
            pos = torch.sort(torch.randperm(3 * lens_max, generator=gen)[: n - 1]).values
            idx = torch.arange(n)
            flat = tables[b, h, idx // block_size] * block_size + idx % block_size
            pos_cache.view(-1)[flat] = torch.cat([pos, q_positions[b: b + 1].long()]).int()
    k_cache = torch.randn(num_blocks, block_size, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, head_dim, generator=gen)
    return k_cache, v_cache, pos_cache, tables, lens, q_positions


def test_fused_decode_attention_and_received_match_the_two_references() -> None:
    for seed, (batch, hkv, groups, lens_max, window, softcap) in enumerate(
            [(3, 2, 3, 37, None, None), (2, 3, 1, 20, 11, None), (4, 1, 4, 9, None, 5.0)]):
        gen = torch.Generator().manual_seed(100 + seed)
        k_cache, v_cache, pos_cache, tables, lens, q_positions = _random_pool(gen, batch, hkv, lens_max, 4, 16)
        q = torch.randn(batch, hkv * groups, 16, generator=gen)
        mask = pa.decode_mask(pos_cache, tables, lens, q_positions, window)
        out, received = kc.paged_decode_attention_received_ref(q, k_cache, v_cache, tables, mask, 0.3, softcap)
        torch.testing.assert_close(out, pa.paged_decode_attention_ref(q, k_cache, v_cache, tables, mask, 0.3,
                                                                      softcap), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(received, kc.decode_received_attention_ref(q, k_cache, tables, mask, 0.3,
                                                                              softcap), atol=1e-6, rtol=1e-6)
        assert torch.all(received.masked_fill(mask.expand_as(received), 0.0) == 0)  # unseen entries get nothing
        bf16 = kc.paged_decode_attention_received_ref(q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), tables,
                                                      mask, 0.3, softcap)[0]
        assert bf16.dtype == torch.bfloat16  # the output keeps the model's dtype
