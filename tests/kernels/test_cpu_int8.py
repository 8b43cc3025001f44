"""Weight-only int8: quantization, the C product against its torch reference on fresh random inputs (fp32 and
bf16 activations, every tile height and leftover row), and the Int8Linear layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inference.models.layers import Int8Linear, linear
from kernels import cpu_build, cpu_int8
from tests.cpu_builds import forget_libraries

pytestmark = [pytest.mark.skipif(not cpu_int8.available(),
                                 reason="the CPU int8 kernel needs a C compiler and a CPU with AVX2 and FMA"),
              pytest.mark.usefixtures("isa")]  # native and AVX2 builds: tests/kernels/conftest.py


def test_quantize_rounds_each_row_to_its_own_scale() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(37, 48, generator=gen) * torch.logspace(-3, 1, 37)[:, None]  # rows of very different sizes
    w[5] = 0.0
    q, scale = cpu_int8.quantize(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and q.shape == w.shape
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    torch.testing.assert_close(scale[6:], w[6:].abs().amax(1) / 127)
    assert scale[5] == 1.0 and not q[5].any()  # a zero row divides by nothing
    error = (cpu_int8.dequantize(q, scale) - w).abs()
    assert bool((error <= scale[:, None] / 2 * (1 + 1e-5)).all())  # round to nearest: at most half a step


def test_packing_keeps_every_weight_and_pads_with_zeros() -> None:
    gen = torch.Generator().manual_seed(1)
    for n in (1, 31, 32, 33, 100):
        weight = cpu_int8.Int8Weight.from_float(torch.randn(n, 40, generator=gen))
        block = weight.block
        assert block in (16, 32) and weight.packed.shape == (-(-n // block), 40, block)
        q, _ = cpu_int8.quantize(torch.randn(n, 40, generator=gen))
        packed = cpu_int8.pack(q, block)
        assert torch.equal(packed.transpose(1, 2).reshape(-1, 40)[:n], q)
        assert not packed.transpose(1, 2).reshape(-1, 40)[n:].any()


def _bf16_pairs() -> bool:
    lib = cpu_int8._library()
    return lib is not None and bool(lib.hearth_i8_bf16_pairs())


@pytest.mark.parametrize("k", [40, 41])
def test_a_bf16_models_weights_pack_in_pairs_of_k_where_the_build_has_bf16_dot_products(k: int) -> None:
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(45, k, generator=gen).to(torch.bfloat16)
    weight = cpu_int8.Int8Weight.from_float(w)
    pairs = _bf16_pairs() and k % 2 == 0  # an odd k keeps the plain layout
    assert weight.pairs == pairs
    block = weight.block
    assert weight.packed.shape == ((-(-45 // block), k // 2, block, 2) if pairs else (-(-45 // block), k, block))
    q, _ = cpu_int8.quantize(w)
    assert torch.equal(weight.unpacked(), q)
    assert not cpu_int8.Int8Weight.from_float(w, activations=torch.float32).pairs  # fp32 x reads k-major


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(4))
def test_product_matches_the_reference_on_random_shapes(dtype: torch.dtype, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(6):
        m = int(torch.randint(1, 41, (), generator=gen))  # every tile height, and partial tiles
        n = int(torch.randint(1, 300, (), generator=gen))  # a last block of outputs partly empty
        k = int(torch.randint(1, 600, (), generator=gen))
        # bf16 x gets weights packed for it: in pairs of k where the build has bf16 dot products and k is even
        weight = cpu_int8.Int8Weight.from_float(torch.randn(n, k, generator=gen), activations=dtype)
        x = torch.randn(m, k, generator=gen).to(dtype)
        bias = torch.randn(n, generator=gen).to(dtype) if seed % 2 else None
        got = cpu_int8.linear(x, weight, bias)
        want = cpu_int8.linear_ref(x, weight.unpacked(), weight.scale, bias)
        assert got.dtype == dtype and got.shape == (m, n)
        if dtype == torch.float32:  # only the order of the fp32 additions differs
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        else:  # the same fp32 sum rounded once: at most one bf16 step apart where the orders differ
            torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-3)


def test_weights_packed_for_bf16_still_take_fp32_x() -> None:
    gen = torch.Generator().manual_seed(5)
    weight = cpu_int8.Int8Weight.from_float(torch.randn(70, 64, generator=gen), activations=torch.bfloat16)
    x = torch.randn(3, 64, generator=gen)
    torch.testing.assert_close(cpu_int8.linear(x, weight), cpu_int8.linear_ref(x, weight.unpacked(), weight.scale),
                               rtol=1e-5, atol=1e-4)


def test_weights_packed_in_pairs_still_give_the_product_under_a_build_without_dot_products(
        monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(6)
    weight = cpu_int8.Int8Weight.from_float(torch.randn(70, 64, generator=gen).to(torch.bfloat16))
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    # The AVX2 build: no bf16 dot products, no pairs kernel, and blocks 16 wide (an AVX-512 build without BF16
    # packs this weight in blocks of 32, not in pairs: the AVX2 kernel must not read those either).
    monkeypatch.setenv("HEARTH_CPU_AVX512", "off")
    cpu_build.load.cache_clear()
    cpu_int8._library.cache_clear()
    torch.testing.assert_close(cpu_int8.linear(x, weight), cpu_int8.linear_ref(x, weight.unpacked(), weight.scale))


# rows: one and two (the pairs' fp32 multiply-adds), then x tiles of 16 rows two a unit on AMX: every remainder
# of a tile, both heights of a unit, and past a chunk of 512 rows
@pytest.mark.parametrize("rows", [1, 2, 3, 15, 16, 17, 33, 47, 100, 530])
def test_pairs_on_amx_tiles_and_few_rows_match_the_reference(rows: int, isa: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Where bf16 products of int8 weights in pairs run on AMX tiles (k a multiple of 32; other k keep the dot
    products) and one or two rows take fp32 multiply-adds: each output within one bf16 step of the exact
    product, and close to the AVX-512 BF16 build's dot products, which take every row there."""
    if isa != "native" or not _bf16_pairs() or not cpu_int8._library().hearth_i8_amx():
        pytest.skip("int8 products on AMX tiles need a CPU with them (Intel Sapphire Rapids and later)")
    gen = torch.Generator().manual_seed(100 + rows)
    threads = torch.get_num_threads()
    cases = []
    try:
        shapes = ((33, 32, True), (96, 896, False), (300, 1536, True), (40, 66, True))  # partial blocks; k off tiles
        for count, (n, k, with_bias) in zip((2, 1, 3, 2), shapes, strict=True):
            weight = cpu_int8.Int8Weight.from_float(torch.randn(n, k, generator=gen) / k ** 0.5, torch.bfloat16)
            assert weight.pairs
            x = torch.randn(rows, k, generator=gen).bfloat16()
            bias = torch.randn(n, generator=gen).bfloat16() if with_bias else None
            torch.set_num_threads(count)  # any team, more threads than cores included
            got = cpu_int8.linear(x, weight, bias)
            want = cpu_int8.linear_ref(x, weight.unpacked(), weight.scale, bias)
            torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-3)
            cases.append((x, weight, bias, got))
        monkeypatch.setenv("HEARTH_CPU_AMX", "off")
        forget_libraries()
        assert not cpu_int8._library().hearth_i8_amx() and _bf16_pairs()
        for x, weight, bias, got in cases:
            dots = cpu_int8.linear(x, weight, bias)  # the same sums in another order
            torch.testing.assert_close(got.float(), dots.float(), rtol=2 ** -7, atol=1e-3)
            assert (got == dots).float().mean() > 0.9
    finally:
        torch.set_num_threads(threads)


def test_product_takes_leading_dims_strided_input_and_any_thread_count() -> None:
    gen = torch.Generator().manual_seed(7)
    weight = cpu_int8.Int8Weight.from_float(torch.randn(96, 64, generator=gen))
    x = torch.randn(64, 6, generator=gen).t().reshape(2, 3, 64)  # built from a transposed (strided) tensor
    want = cpu_int8.linear_ref(x, weight.unpacked(), weight.scale)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            got = cpu_int8.linear(x, weight)
            assert got.shape == (2, 3, 96)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    finally:
        torch.set_num_threads(threads)


def test_int8_layer_stays_within_the_rounding_of_its_weights() -> None:
    gen = torch.Generator().manual_seed(3)
    w, b = torch.randn(200, 128, generator=gen) / 128 ** 0.5, torch.randn(200, generator=gen)
    layer = linear(w, b, quantization="int8")
    assert isinstance(layer, Int8Linear) and layer.weight.packed.dtype == torch.int8
    assert layer.nbytes == 200 * 128 + 200 * 4 + 200 * 4  # a quarter of fp32's weight bytes, plus scales
    x = torch.randn(5, 128, generator=gen)
    exact = F.linear(x, w, b)
    got = layer(x)
    dequantized = cpu_int8.dequantize(layer.weight.unpacked(), layer.weight.scale)
    torch.testing.assert_close(got, F.linear(x, dequantized, b), rtol=1e-5, atol=1e-4)
    # Each weight is off by at most half its row's step: the error is bounded by |x| * that step, far under it.
    bound = x.abs().sum(1, keepdim=True) * layer.weight.scale[None, :] / 2
    assert bool(((got - exact).abs() <= bound).all())
    assert 0 < float((got - exact).abs().max()) < 0.05 * float(exact.abs().max())
