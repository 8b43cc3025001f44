"""The CPU causal-attention kernel for prompts, fresh or after a cached start, against the torch references, on
fresh random inputs."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_paged_attention as cpa
from kernels import paged_attention as pa

pytestmark = [pytest.mark.skipif(not cpa.available(),
                                 reason="the CPU attention kernels need a C compiler and a CPU with AVX2 and FMA"),
              pytest.mark.usefixtures("isa")]  # native and AVX2 builds: tests/kernels/conftest.py


def _qkv(gen: torch.Generator, tokens: int, q_heads: int, kv_heads: int, head_dim: int) -> tuple:
    """q, k and v as the decoder has them: views into one fused [T, (Hq + 2 Hkv) * D] product."""
    fused = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=gen)
    heads = fused.view(tokens, q_heads + 2 * kv_heads, head_dim)
    return heads[:, :q_heads], heads[:, q_heads: q_heads + kv_heads], heads[:, q_heads + kv_heads:]


# tokens: 1, inside one key tile, tile edges (16, 32, 64 keys per tile by build) and several tiles
@pytest.mark.parametrize("seed", range(10))
def test_kernel_matches_the_reference(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    tokens = (1, 5, 16, 17, 33, 64, 65, 130, 200, 31)[seed]
    kv_heads = int(torch.randint(1, 4, (), generator=gen))
    q_heads = kv_heads * int(torch.randint(1, 8, (), generator=gen))
    head_dim = (16, 32, 64, 48, 128, 64, 80, 64, 16, 256)[seed]
    q, k, v = _qkv(gen, tokens, q_heads, kv_heads, head_dim)
    assert cpa.supports_causal(q, k, v)
    scale = head_dim ** -0.5
    want = pa.causal_attention_ref(q, k, v, torch.arange(tokens), scale)
    got = cpa.causal_attention(q, k, v, scale)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("seed", range(6))
def test_bf16_matches_the_fp32_reference_within_bf16_rounding(seed: int) -> None:
    """bf16 inputs are widened and all arithmetic is fp32: as close to the fp32 reference over the same
    (bf16-valued) inputs as the bf16 reference gets, or closer. Where bf16 pairs are multiplied (AMX tiles, AVX-512
    BF16 dot products) the probabilities are rounded to bf16 before the value product, as the bf16 reference
    (torch's flash attention) rounds them: as close as it, on average and at worst."""
    gen = torch.Generator().manual_seed(50 + seed)
    # on AMX tiles: key blocks of 64 and a last partial one, 16 query vectors a tile and fewer, channels four
    # tiles of 16 at a time and two; by dot products: 6 query vectors a tile and fewer, 1-4 vectors of channels
    tokens, q_heads, kv_heads, head_dim = ((165, 9, 3, 64), (40, 14, 2, 64), (97, 8, 8, 128), (3, 4, 1, 32),
                                           (300, 14, 2, 64), (70, 6, 2, 96))[seed]
    q, k, v = (x.bfloat16() for x in _qkv(gen, tokens, q_heads, kv_heads, head_dim))
    scale = head_dim ** -0.5
    positions = torch.arange(tokens)
    want = pa.causal_attention_ref(q.float(), k.float(), v.float(), positions, scale)
    assert cpa.supports_causal(q, k, v)
    got = cpa.causal_attention(q, k, v, scale)
    assert got.dtype == torch.bfloat16
    ref16 = pa.causal_attention_ref(q, k, v, positions, scale).float()
    error, ref_error = (got.float() - want).abs(), (ref16 - want).abs()
    if cpa.causal_pairs(head_dim):
        assert error.mean() <= ref_error.mean() * 1.05
    else:
        torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=1e-3)
    assert error.max() <= ref_error.max() + 1e-3


def _pool_with_prompt(gen: torch.Generator, dtype: torch.dtype, total: int, kv_heads: int, head_dim: int,
                      block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A paged pool whose kv heads each hold positions 0..total - 1 in order, in blocks placed at random among
    others holding noise: caches [N, block, D], positions [N, block], the block table [Hkv, nb]."""
    per_head = -(-total // block)
    blocks = kv_heads * per_head + 5
    k = torch.randn(blocks, block, head_dim, generator=gen).to(dtype)
    v = torch.randn(blocks, block, head_dim, generator=gen).to(dtype)
    pos = torch.full((blocks, block), 10 ** 6, dtype=torch.int32)  # noise: never visible
    table = torch.randperm(blocks, generator=gen)[: kv_heads * per_head].view(kv_heads, per_head)
    for h in range(kv_heads):
        for t in range(total):
            pos[table[h, t // block], t % block] = t
    return k, v, pos, table


@pytest.mark.parametrize("seed", range(8))
def test_chunk_after_a_cached_start_matches_the_paged_reference(seed: int) -> None:
    gen = torch.Generator().manual_seed(80 + seed)
    # (context, chunk): one token after many, a chunk in the first key tile, across tile edges, long ones
    context, tokens = ((1, 1), (100, 1), (3, 40), (64, 64), (150, 77), (17, 130), (300, 200), (31, 33))[seed]
    kv_heads = int(torch.randint(1, 4, (), generator=gen))
    q_heads = kv_heads * int(torch.randint(1, 8, (), generator=gen))
    head_dim = (16, 64, 32, 64, 128, 48, 64, 80)[seed]
    block = (16, 8, 16, 32, 16, 4, 16, 64)[seed]
    dtype = torch.bfloat16 if seed % 2 else torch.float32
    k, v, pos, table = _pool_with_prompt(gen, dtype, context + tokens, kv_heads, head_dim, block)
    q = torch.randn(tokens, q_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim ** -0.5
    lens = torch.full((kv_heads,), context + tokens)
    positions = torch.arange(context, context + tokens)
    got = cpa.prefill_attention(q, k, v, table, context, scale)
    want = pa.paged_prefill_attention_ref(q.float(), k.float(), v.float(), pos, table, lens, positions, scale)
    assert got.dtype == dtype and got.shape == q.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    else:  # fp32 arithmetic on bf16 inputs rounded once (on AMX tiles, the probabilities rounded too, as the bf16
        # reference rounds them): no further from fp32 than that reference
        ref16 = pa.paged_prefill_attention_ref(q, k, v, pos, table, lens, positions, scale).float()
        assert (got.float() - want).abs().max() <= (ref16 - want).abs().max() + 1e-3


def test_results_land_in_the_given_rows_and_the_kept_work_space_serves_any_size() -> None:
    """Calls of growing and shrinking sizes share one per-thread work space; `out` rows are written in place."""
    gen = torch.Generator().manual_seed(7)
    calls = [_qkv(gen, tokens, 6, 2, 64) for tokens in (70, 9, 300, 33)]
    target = torch.full((300 + 9, 6, 64), float("nan"))
    for (q, k, v), rows in zip(calls, (slice(0, 70), slice(0, 9), slice(9, 309), slice(0, 33)), strict=True):
        want = pa.causal_attention_ref(q, k, v, torch.arange(q.shape[0]), 0.125)
        got = cpa.causal_attention(q, k, v, 0.125, out=target[rows])
        assert got.data_ptr() == target[rows].data_ptr()
        torch.testing.assert_close(target[rows], want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(cpa.causal_attention(q, k, v, 0.125), want, rtol=1e-4, atol=1e-5)


def test_what_the_kernel_does_not_take(monkeypatch: pytest.MonkeyPatch) -> None:
    q, kv = torch.zeros(4, 2, 16), torch.zeros(4, 1, 16)
    assert cpa.supports_causal(q, kv, kv)
    assert not cpa.supports_causal(q.half(), kv.half(), kv.half())
    assert not cpa.supports_causal(q.bfloat16(), kv, kv)
    assert not cpa.supports_causal(torch.zeros(4, 2, 12), torch.zeros(4, 1, 12), torch.zeros(4, 1, 12))
    assert not cpa.supports_causal(torch.zeros(4, 3, 16), torch.zeros(4, 2, 16), torch.zeros(4, 2, 16))
    monkeypatch.setenv("HEARTH_CPU_ATTENTION", "off")
    assert not cpa.supports_causal(q, kv, kv)
