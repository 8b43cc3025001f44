"""Triton KV-compression kernels against their torch references on fresh random inputs (fp32).

On CPU under TRITON_INTERPRET=1; on CUDA compiled.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton_kv = pytest.importorskip("kernels.triton_kv_compress")
if triton_kv.triton is None:
    pytest.skip("Triton is not installed", allow_module_level=True)

from kernels import kv_compress as kc  # noqa: E402
from kernels import paged_attention as pa  # noqa: E402
from tests.kernels.test_triton_decode import DEVICE, _case  # noqa: E402


@pytest.mark.parametrize(("batch", "lens_max", "hkv", "groups", "window", "softcap", "one_left", "future"), [
    (2, 37, 2, 3, None, None, True, False),  # partial blocks, a head with one entry
    (2, 29, 2, 2, None, None, False, True),  # entries after the query are masked
    (1, 40, 1, 4, 9, None, False, False),  # sliding window
    (2, 33, 2, 1, None, 25.0, False, False),  # soft-capping, no grouping
])
def test_received_attention_kernel_matches_reference(batch, lens_max, hkv, groups, window, softcap, one_left,
                                                    future) -> None:
    q, k_cache, _, pos_cache, tables, lens, q_positions = _case(
        batch * 77 + lens_max, batch, lens_max, hkv, groups, 16, 8, torch.float32, one_left, future)
    mask = pa.decode_mask(pos_cache, tables, lens, q_positions, window)
    ref = kc.decode_received_attention_ref(q, k_cache, tables, mask, 0.25, softcap)
    out = triton_kv.decode_received_attention(q, k_cache, pos_cache, tables, lens, q_positions, 0.25, window,
                                              softcap)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # Each query head's probabilities sum to one over what it sees: a group sums to its size.
    seen = mask.any(-1)
    torch.testing.assert_close(out.sum(-1)[seen], torch.full_like(out.sum(-1)[seen], float(groups)))


def test_received_attention_over_long_heads_merges_its_stretches() -> None:
    """Heads of up to 600 entries (Qwen2.5's groups of seven query heads): the first launch cuts each head into
    stretches, the second scores one 64-entry tile a program; the merged statistics must normalise every tile."""
    batch, hkv, groups = 2, 2, 7
    q, k_cache, _, pos_cache, tables, lens, q_positions = _case(601, batch, 600, hkv, groups, 16, 8, torch.float32,
                                                                False)
    splits, _ = triton_kv.decode_splits(batch, hkv, tables.shape[-1] * k_cache.shape[1], triton_kv.TILE_ENTRIES)
    assert splits > 1 and int(lens.max()) > 4 * triton_kv.TILE_ENTRIES  # the path this test is for
    mask = pa.decode_mask(pos_cache, tables, lens, q_positions)
    ref = kc.decode_received_attention_ref(q, k_cache, tables, mask, 0.125)
    out = triton_kv.decode_received_attention(q, k_cache, pos_cache, tables, lens, q_positions, 0.125)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.sum(-1), torch.full_like(out.sum(-1), float(groups)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_move_kernel_matches_reference_with_overlap(dtype) -> None:
    gen = torch.Generator().manual_seed(21)
    k = torch.randn(6, 8, 24, generator=gen).to(dtype).to(DEVICE)
    v = torch.randn(6, 8, 24, generator=gen).to(dtype).to(DEVICE)
    pos = torch.randint(0, 500, (6, 8), generator=gen, dtype=torch.int32).to(DEVICE)
    # Kept entries move down within the same blocks (overlap) and into another block.
    src = torch.tensor([3, 4, 9, 10, 17, 30, 41, 47], device=DEVICE)
    dst = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7], device=DEVICE) + torch.tensor([0] * 6 + [16, 16], device=DEVICE)
    ref = [t.clone() for t in (k, v, pos)]
    kc.move_entries_ref(*ref, src, dst)
    triton_kv.move_entries(k, v, pos, src, dst)
    for got, want in zip((k, v, pos), ref, strict=True):
        assert torch.equal(got, want)
