"""The fused rotary + KV write and SiLU * up kernels against their torch references on fresh random inputs:
the same bits for the rotary and the cache, SiLU to a few ulp, in fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_build, cpu_fused
from tests.cpu_builds import forget_libraries

pytestmark = [pytest.mark.skipif(not cpu_fused.supports(torch.zeros(1)),
                                 reason="the fused CPU kernels need a C compiler and a CPU with AVX2 and FMA"),
              pytest.mark.usefixtures("isa")]  # native and AVX2 builds: tests/kernels/conftest.py

DTYPES = [torch.float32, torch.bfloat16]


def _tables(max_pos: int, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.arange(max_pos).float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(4))
def test_rope_write_kv_matches_the_reference_bit_for_bit(dtype: torch.dtype, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    hq, hkv, dim = [(9, 3, 64), (4, 4, 32), (14, 2, 64), (8, 1, 128)][seed]
    tokens = [1, 3, 200, 37][seed]  # 200 tokens run the threaded loop
    qkv = (torch.randn(tokens, (hq + 2 * hkv) * dim, generator=gen) * 2).to(dtype)
    # Views into one fused projection output, as the decoder passes them: rows are strided.
    qk = qkv[:, : (hq + hkv) * dim].view(tokens, hq + hkv, dim)
    v = qkv[:, (hq + hkv) * dim:].view(tokens, hkv, dim)
    cos, sin = _tables(512, dim, dtype)
    positions = torch.randint(0, 512, (tokens,), generator=gen)
    num_blocks, block = 64, 16
    slots = torch.randperm(num_blocks * block, generator=gen)[: hkv * tokens].view(hkv, tokens)
    caches = [torch.randn(num_blocks, block, dim, generator=gen).to(dtype) for _ in range(2)]
    pos_cache = torch.randint(0, 99, (num_blocks, block), generator=gen, dtype=torch.int32)

    want_qkv, want_k, want_v, want_pos = qkv.clone(), caches[0].clone(), caches[1].clone(), pos_cache.clone()
    cpu_fused.rope_write_kv_ref(want_qkv[:, : (hq + hkv) * dim].view(tokens, hq + hkv, dim),
                                want_qkv[:, (hq + hkv) * dim:].view(tokens, hkv, dim), cos, sin, positions, slots,
                                want_k, want_v, want_pos, hq)
    assert cpu_fused.rope_write_kv(qk, v, cos, sin, positions, slots, caches[0], caches[1], pos_cache, hq)
    assert torch.equal(qkv, want_qkv)  # q and k rotated in place, v untouched
    assert torch.equal(caches[0], want_k) and torch.equal(caches[1], want_v) and torch.equal(pos_cache, want_pos)


def test_rope_write_kv_declines_what_it_cannot_do() -> None:
    qk, v = torch.randn(2, 3, 8), torch.randn(2, 1, 8)
    cos, sin = _tables(16, 8, torch.float32)
    cache, pos = torch.zeros(4, 4, 8), torch.zeros(4, 4, dtype=torch.int32)
    slots = torch.tensor([[0, 1]])
    before = qk.clone()
    # A partial rotary table, a transposed (non-contiguous heads) qk, mixed dtypes: nothing is touched.
    assert not cpu_fused.rope_write_kv(qk, v, cos[:, :4], sin[:, :4], torch.tensor([1, 2]), slots, cache, cache,
                                       pos, 2)
    assert not cpu_fused.rope_write_kv(qk.transpose(1, 2).contiguous().transpose(1, 2), v, cos, sin,
                                       torch.tensor([1, 2]), slots, cache, cache, pos, 2)
    assert not cpu_fused.rope_write_kv(qk, v.double(), cos, sin, torch.tensor([1, 2]), slots, cache, cache, pos, 2)
    assert torch.equal(qk, before) and int(cache.count_nonzero()) == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 33])
def test_silu_mul_matches_the_reference(dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    inter = 1536
    gate_up = (torch.randn(rows, 2 * inter, generator=gen) * 4).to(dtype)
    got, want = cpu_fused.silu_mul(gate_up), cpu_fused.silu_mul_ref(gate_up)
    assert got.shape == (rows, inter) and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:  # exp a few ulp apart in fp32 can move a bf16 rounding by one step, rarely
        torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=1e-5)
        assert (got != want).float().mean() < 0.01


@pytest.mark.skipif(cpu_build.flags() == cpu_build.FLAGS,
                    reason="without AVX-512 both builds are the AVX2 one: nothing to compare")
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_gives_the_same_bits_on_both_builds(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sixteen-lane loop (AVX-512 builds) does the eight-lane loop's arithmetic lane by lane: the same bits,
    including the eight-lane tail (1544 = 96 x 16 + 8), large magnitudes, infinities and NaN."""
    gen = torch.Generator().manual_seed(5)
    gate_up = (torch.randn(37, 2 * 1544, generator=gen) * 30).to(dtype)  # 37 x 1544: the threaded loop
    gate_up[0, :5] = torch.tensor([float("nan"), float("inf"), -float("inf"), -100.0, 100.0]).to(dtype)
    outs = []
    for build in ("auto", "off"):
        monkeypatch.setenv("HEARTH_CPU_AVX512", build)
        forget_libraries()
        outs.append(cpu_fused.silu_mul(gate_up))
    assert torch.equal(outs[0].view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       outs[1].view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
