"""The Triton paged decode kernel against the torch reference on fresh random inputs.

On CPU it runs under TRITON_INTERPRET=1 (set in a subprocess-free way: the variable must be set before Triton
is imported, so this module sets it when no GPU is present); on CUDA it runs the compiled kernel.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton_kernels = pytest.importorskip("kernels.triton_paged_attention")
if not triton_kernels.available():
    pytest.skip("Triton is not installed", allow_module_level=True)

from kernels import paged_attention as pa  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(seed: int, batch: int, lens_max: int, hkv: int, groups: int, head_dim: int, block_size: int,
          dtype: torch.dtype, one_left: bool, future: bool = False):
    """A pool with per-(sequence, head) random lengths, random block placement and gapped stored positions.

    future: each head's last entry (when it has others) lies after the query, as a draft's entries do when an
    earlier position of the same step attends: the kernel must mask it by its stored position.
    """
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, lens_max + 1, (batch, hkv), generator=gen)
    if one_left:
        lens[0, 0] = 1  # a head with a single entry: only the token being decoded
    width = int((lens.max() + block_size - 1) // block_size)
    num_blocks = int(batch * hkv * width + 3)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = perm[: batch * hkv * width].view(batch, hkv, width)
    k_cache = torch.randn(num_blocks, block_size, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, head_dim, generator=gen).to(dtype)
    pos_cache = torch.full((num_blocks, block_size), -1, dtype=torch.int32)
    q_positions = torch.empty(batch, dtype=torch.int32)
    for b in range(batch):
        q_pos = int(3 * lens[b].max()) + 1
        q_positions[b] = q_pos
        for h in range(hkv):
            n = int(lens[b, h])
            pos = torch.sort(torch.randperm(q_pos, generator=gen)[: n - 1]).values
            pos = torch.cat([pos, torch.tensor([q_pos + 5 if future and n > 1 else q_pos])]).int()
            idx = torch.arange(n)
            flat = tables[b, h, idx // block_size] * block_size + idx % block_size
            pos_cache.view(-1)[flat] = pos
    q = torch.randn(batch, hkv * groups, head_dim, generator=gen).to(dtype)
    return [t.to(DEVICE) for t in (q, k_cache, v_cache, pos_cache, tables, lens, q_positions)]


@pytest.mark.parametrize(("batch", "lens_max", "hkv", "groups", "head_dim", "block_size", "window", "softcap",
                          "one_left", "future"), [
    (2, 37, 2, 3, 16, 8, None, None, True, False),  # odd lengths, partial blocks, a head with one entry left
    (2, 29, 2, 2, 16, 8, None, None, True, True),  # entries after the query position are masked
    (3, 50, 3, 1, 32, 16, None, None, False, False),  # no grouping
    (2, 40, 1, 4, 24, 8, 9, None, True, False),  # sliding window; head_dim not a power of two
    (1, 33, 2, 2, 16, 4, None, 30.0, False, False),  # logit soft-capping (Gemma 2 style)
])
def test_decode_kernel_matches_reference_fp32(batch, lens_max, hkv, groups, head_dim, block_size, window,
                                              softcap, one_left, future) -> None:
    q, k_cache, v_cache, pos_cache, tables, lens, q_positions = _case(
        batch * 1000 + lens_max, batch, lens_max, hkv, groups, head_dim, block_size, torch.float32, one_left,
        future)
    scale = head_dim ** -0.5
    mask = pa.decode_mask(pos_cache, tables, lens, q_positions, window)
    ref = pa.paged_decode_attention_ref(q, k_cache, v_cache, tables, mask, scale, softcap)
    out = triton_kernels.paged_decode_attention(q, k_cache, v_cache, pos_cache, tables, lens, q_positions,
                                                scale, window, softcap)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_decode_kernel_bf16_inputs_accumulate_in_fp32() -> None:
    q, k_cache, v_cache, pos_cache, tables, lens, q_positions = _case(7, 2, 45, 2, 2, 16, 8, torch.bfloat16, False)
    mask = pa.decode_mask(pos_cache, tables, lens, q_positions)
    ref = pa.paged_decode_attention_ref(q.float(), k_cache.float(), v_cache.float(), tables, mask, 0.25)
    out = triton_kernels.paged_decode_attention(q, k_cache, v_cache, pos_cache, tables, lens, q_positions, 0.25)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)  # one bf16 rounding of the output


def test_decode_kernel_rejects_bad_shapes() -> None:
    q, k_cache, v_cache, pos_cache, tables, lens, q_positions = _case(3, 1, 10, 2, 2, 16, 8, torch.float32, False)
    with pytest.raises(ValueError):
        triton_kernels.paged_decode_attention(q[:, :3], k_cache, v_cache, pos_cache, tables, lens, q_positions, 1.0)
    with pytest.raises(ValueError):
        triton_kernels.paged_decode_attention(q, k_cache, v_cache, pos_cache, tables, lens[:, :1], q_positions, 1.0)


@pytest.mark.parametrize(("num_queries", "window", "softcap"), [(5, None, None), (9, 13, None), (3, None, 20.0)])
def test_prefill_kernel_matches_reference_fp32(num_queries, window, softcap) -> None:
    """Queries of one sequence at its last positions (a chunk after a prefix hit, or drafts to verify)."""
    q1, k_cache, v_cache, pos_cache, tables, lens, q_positions = _case(
        40 + num_queries, 1, 45, 2, 3, 16, 8, torch.float32, False)
    # The chunk's queries sit at the last positions each head stores; earlier ones see fewer entries.
    last = int(q_positions[0])
    positions = torch.arange(last - num_queries + 1, last + 1, dtype=torch.int32, device=q1.device)
    gen = torch.Generator().manual_seed(num_queries)
    q = torch.randn(num_queries, 6, 16, generator=gen).to(q1.device)
    ref = pa.paged_prefill_attention_ref(q, k_cache, v_cache, pos_cache, tables[0], lens[0], positions, 0.25,
                                         window, softcap)
    out = triton_kernels.paged_prefill_attention(q, k_cache, v_cache, pos_cache, tables[0], lens[0], positions,
                                                 0.25, window, softcap)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(("num_splits", "block_size", "window", "softcap", "dtype"), [
    (2, 16, None, None, torch.float32),  # two stretches, the second partly past most heads' ends
    (3, 8, None, None, torch.float32),
    (5, 4, 70, None, torch.float32),  # splits that fall wholly outside a window or past a head's length
    (4, 16, None, 30.0, torch.float32),
    (3, 16, None, None, torch.bfloat16),
])
def test_split_heads_merge_to_the_reference(num_splits, block_size, window, softcap, dtype) -> None:
    """Long heads cut into stretches (flash-decoding), each scored by its own program and merged by a second
    launch: the same as one pass. Lengths vary per head as compression leaves them, one head holds one entry."""
    q, k_cache, v_cache, pos_cache, tables, lens, q_positions = _case(
        900 + num_splits, 3, 300, 2, 3, 16, block_size, dtype, True, future=True)
    mask = pa.decode_mask(pos_cache, tables, lens, q_positions, window)
    ref = pa.paged_decode_attention_ref(q.float(), k_cache.float(), v_cache.float(), tables, mask, 0.25, softcap)
    out = triton_kernels.paged_decode_attention(q, k_cache, v_cache, pos_cache, tables, lens, q_positions, 0.25,
                                                window, softcap, num_splits=num_splits)
    assert out.dtype == dtype
    tolerance = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref, atol=tolerance, rtol=tolerance)


def test_splits_fill_the_card_without_short_stretches() -> None:
    splits = triton_kernels.decode_splits
    assert splits(1, 3, 140) == (1, 3)  # one short sequence: nothing to split
    assert splits(32, 2, 1024) == (4, 4)  # 16 tiles: four stretches of the shortest allowed length
    s, per = splits(32, 2, 8192)  # 64 programs unsplit: cut to about 1,024
    assert s * 32 * 2 >= 1024 and per >= triton_kernels.MIN_TILES_PER_SPLIT and s * per >= 8192 // 64
    s, per = splits(256, 2, 2048)
    assert s == 2 and per == 16
    assert splits(512, 8, 100_000)[0] == 1  # enough programs already
