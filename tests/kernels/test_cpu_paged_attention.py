"""The CPU paged decode-attention kernel against the torch reference on fresh random pools and tables."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_paged_attention as cpa
from kernels import kv_compress as kc
from kernels import paged_attention as pa

pytestmark = [pytest.mark.skipif(not cpa.available(),
                                 reason="the CPU attention kernel needs a C compiler and a CPU with AVX2 and FMA"),
              pytest.mark.usefixtures("isa")]  # native and AVX2 builds: tests/kernels/conftest.py


def _case(gen: torch.Generator, batch: int, q_heads: int, kv_heads: int, head_dim: int, block_size: int,
          dropped: bool) -> tuple:
    """A pool with random blocks per (sequence, kv head); positions either dense (entry i = position i) or
    with gaps, as after KV compression."""
    num_blocks = 4 + batch * kv_heads * 8
    k = torch.randn(num_blocks, block_size, head_dim, generator=gen)
    v = torch.randn(num_blocks, block_size, head_dim, generator=gen)
    pos = torch.zeros(num_blocks, block_size, dtype=torch.int32)
    width = 1 + int(torch.randint(1, 8, (), generator=gen))
    tables = torch.zeros(batch, kv_heads, width, dtype=torch.long)
    lens = torch.zeros(batch, kv_heads, dtype=torch.int32)
    q_pos = torch.zeros(batch, dtype=torch.long)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    for b in range(batch):
        top = int(torch.randint(width * block_size, 4 * width * block_size, (), generator=gen))
        q_pos[b] = top
        for h in range(kv_heads):
            n = int(torch.randint(1, width * block_size + 1, (), generator=gen))
            lens[b, h] = n
            kept = (torch.randperm(top, generator=gen)[: n - 1].sort().values.tolist() if dropped
                    else list(range(top - n + 1, top)))
            entries = kept + [top]  # the new token's own entry, always last
            for j in range(width):
                tables[b, h, j] = free.pop()
            for i, p in enumerate(entries):
                pos[tables[b, h, i // block_size], i % block_size] = p
    q = torch.randn(batch, q_heads, head_dim, generator=gen)
    return q, k, v, pos, tables, lens, q_pos


@pytest.mark.parametrize("seed", range(10))
def test_kernel_matches_the_reference(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    batch = int(torch.randint(1, 6, (), generator=gen))
    kv_heads = int(torch.randint(1, 4, (), generator=gen))
    # 1-8 query heads per kv head: every register tile shape (3, 2 and 1 heads) and their mixes
    q_heads = kv_heads * int(torch.randint(1, 9, (), generator=gen))
    head_dim = 8 * int(torch.randint(1, 17, (), generator=gen))
    block_size = (4, 16, 32)[seed % 3]
    window = (None, 7, None, 40)[seed % 4]
    softcap = 50.0 if seed % 5 == 4 else None
    q, k, v, pos, tables, lens, q_pos = _case(gen, batch, q_heads, kv_heads, head_dim, block_size, seed % 2 == 1)
    scale = head_dim ** -0.5
    mask = pa.decode_mask(pos, tables, lens, q_pos, window)
    want = pa.paged_decode_attention_ref(q, k, v, tables, mask, scale, softcap)
    assert cpa.supports(q, k, kv_heads)
    got = cpa.paged_decode_attention(q, k, v, pos, tables, lens, q_pos, scale, window, softcap)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("seed", range(8))
def test_bf16_pools_match_the_fp32_reference_within_bf16_rounding(seed: int) -> None:
    """bf16 entries are widened (or multiplied in exact pairs) and all sums are fp32: the result is the fp32
    reference over the same (bf16-valued) inputs, rounded once to bf16. Where the values are weighed by AVX-512
    BF16 dot products (`decode_pairs`) the probabilities are rounded to bf16 first, as the bf16 reference rounds
    them: as close as it, on average and at worst. head_dim 32, 64, 96, 128, 256 take the 32-entries-a-load path on
    AVX-512 builds (odd and even chunks of entries), 40 the eight-lane one; every block size, window and softcap."""
    gen = torch.Generator().manual_seed(100 + seed)
    kv_heads = 1 + seed % 3
    q_heads = kv_heads * (1, 3, 7, 4, 2, 5, 3, 8)[seed]
    head_dim = (64, 40, 128, 256, 64, 32, 96, 64)[seed]
    block_size = (16, 4, 32, 64, 16, 8, 16, 1)[seed]
    q, k, v, pos, tables, lens, q_pos = _case(gen, 3, q_heads, kv_heads, head_dim, block_size, seed % 2 == 1)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    scale = head_dim ** -0.5
    window = 9 if seed in (2, 5) else None
    softcap = 30.0 if seed in (4, 7) else None
    mask = pa.decode_mask(pos, tables, lens, q_pos, window)
    want = pa.paged_decode_attention_ref(q.float(), k.float(), v.float(), tables, mask, scale, softcap)
    assert cpa.supports(q, k, kv_heads)
    got = cpa.paged_decode_attention(q, k, v, pos, tables, lens, q_pos, scale, window, softcap)
    assert got.dtype == torch.bfloat16
    ref16 = pa.paged_decode_attention_ref(q, k, v, tables, mask, scale, softcap).float()
    error, ref_error = (got.float() - want).abs(), (ref16 - want).abs()
    if cpa.decode_pairs(head_dim):
        assert error.mean() <= ref_error.mean() * 1.05
    else:
        torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=1e-3)
    # and as close to it as the bf16 reference gets, or closer
    assert error.max() <= ref_error.max() + 1e-3


@pytest.mark.parametrize("seed", range(8))
def test_the_received_attention_matches_the_reference(seed: int) -> None:
    """With `received`, the pass also gives the attention each entry received (a sequence being compressed),
    as the reference computes it from the same probabilities: fp32 and bf16 pools, dense and compressed heads,
    every tile shape, windows and softcaps, entries past each head's length and masked ones at 0; the output is
    the plain call's, bit for bit."""
    gen = torch.Generator().manual_seed(300 + seed)
    kv_heads = 1 + seed % 3
    q_heads = kv_heads * (1, 3, 7, 4, 2, 5, 3, 9)[seed]
    head_dim = (64, 40, 128, 64, 16, 32, 96, 64)[seed]
    block_size = (16, 4, 32, 64, 16, 8, 16, 1)[seed]
    window = 9 if seed in (2, 5) else None
    softcap = 30.0 if seed in (4, 7) else None
    q, k, v, pos, tables, lens, q_pos = _case(gen, 1 + seed % 4, q_heads, kv_heads, head_dim, block_size,
                                              seed % 2 == 1)
    if seed >= 4:
        q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    scale = head_dim ** -0.5
    mask = pa.decode_mask(pos, tables, lens, q_pos, window)
    want_out, want = kc.paged_decode_attention_received_ref(q, k, v, tables, mask, scale, softcap)
    received = torch.full((q.shape[0], kv_heads, tables.shape[-1] * block_size), float("nan"))
    out = cpa.paged_decode_attention(q, k, v, pos, tables, lens, q_pos, scale, window, softcap, received=received)
    torch.testing.assert_close(received, want, rtol=1e-4, atol=1e-6)
    assert torch.equal(out, cpa.paged_decode_attention(q, k, v, pos, tables, lens, q_pos, scale, window, softcap))
    # each query head's probabilities sum to one: a kv head's entries received its query heads' count
    torch.testing.assert_close(received.sum(-1), torch.full(lens.shape, float(q_heads // kv_heads)))
    if q.dtype == torch.float32:
        torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("seed", range(6))
def test_a_prompts_last_queries_received_attention_matches_the_reference(seed: int) -> None:
    """What a prompt's observed queries give the entries of their sequence (KV compression after prefill), as
    the torch reference computes it: each query sees the entries at or before its own position (the chunk's
    later keys are already written), fp32 and bf16, windows and softcaps, heads with gaps."""
    gen = torch.Generator().manual_seed(400 + seed)
    kv_heads = 1 + seed % 3
    q_heads = kv_heads * (3, 1, 7, 2, 4, 3)[seed]
    head_dim = (64, 32, 128, 40, 64, 96)[seed]
    block_size = (16, 8, 32, 4, 16, 64)[seed]
    window = 20 if seed in (1, 4) else None
    softcap = 30.0 if seed in (2, 5) else None
    _, k, v, pos, tables, lens, q_pos = _case(gen, 1, q_heads, kv_heads, head_dim, block_size, seed % 2 == 1)
    tokens = int(torch.randint(1, 33, (), generator=gen))
    top = int(q_pos[0])
    positions = torch.arange(top - tokens + 1, top + 1)  # the chunk's last queries; the last sees every entry
    q = torch.randn(tokens, q_heads, head_dim, generator=gen)
    if seed >= 3:
        q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    scale = head_dim ** -0.5
    want = kc.prefill_received_attention_ref(q, k, pos, tables[0], lens[0], positions, scale, window, softcap)
    got = cpa.prefill_received_attention(q, k, v, pos, tables[0], lens[0], positions, scale, window, softcap)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_the_kernel_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k = torch.zeros(1, 2, 8), torch.zeros(4, 16, 8)
    assert cpa.supports(q, k, 1)
    assert cpa.supports(q.bfloat16(), k.bfloat16(), 1)
    assert not cpa.supports(q.half(), k.half(), 1) and not cpa.supports(q.bfloat16(), k, 1)
    assert not cpa.supports(torch.zeros(1, 2, 12), k, 1)
    monkeypatch.setenv("HEARTH_CPU_ATTENTION", "off")
    assert not cpa.supports(q, k, 1)
