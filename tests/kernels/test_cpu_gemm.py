"""The CPU GEMM of many rows (kernels/csrc/gemm.c), fp32 and bf16 (AVX-512 BF16 builds), against F.linear on
fresh random inputs, and the Linear layer's dispatch to it."""

from __future__ import annotations

import pytest
import torch

from inference.models.layers import Linear
from kernels import cpu_fused, cpu_gemv
from tests.cpu_builds import forget_libraries
from tests.kernels.products import head_inputs

pytestmark = [pytest.mark.skipif(cpu_gemv._gemm_library() is None,
                                 reason="the CPU GEMM kernel needs a C compiler and a CPU with AVX2 and FMA"),
              pytest.mark.usefixtures("isa")]  # native and AVX2 builds: tests/kernels/conftest.py


def _close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    # Only the order of the fp32 additions differs from the fp64 product.
    want = torch.nn.functional.linear(x.double(), w.double(), bias.double() if bias is not None else None)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("seed", range(6))
def test_gemm_matches_the_reference_on_random_shapes(seed: int) -> None:
    gen = torch.Generator().manual_seed(100 + seed)
    for _ in range(6):
        # rows: every remainder of the 6-row tiles, one chunk of rows and several
        m = int(torch.randint(3, 700, (), generator=gen))
        n = int(torch.randint(1, 300, (), generator=gen))  # partial last blocks included
        k = int(torch.randint(1, 1600, (), generator=gen))
        x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) / k ** 0.5
        bias = torch.randn(n, generator=gen) if seed % 2 else None
        _close(cpu_gemv.gemm(x, cpu_gemv.pack(w), bias), x, w, bias)


def _bf16_pairs() -> bool:
    lib = cpu_gemv._gemm_library()
    return lib is not None and bool(lib.hearth_gemm_bf16_pairs())


def _close_bf16(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    # bf16 products are exact in fp32: the sums differ from the fp64 product only in the order of the fp32
    # additions, then each output is rounded once, so it lies within one bf16 step of the exact result rounded.
    exact = torch.nn.functional.linear(x.double(), w.double(), bias.double() if bias is not None else None)
    assert got.dtype == torch.bfloat16 and got.shape == exact.shape
    torch.testing.assert_close(got.double(), exact.to(torch.bfloat16).double(), rtol=2 ** -7, atol=1e-5)


@pytest.mark.parametrize("seed", range(4))
def test_bf16_gemm_matches_the_reference_where_the_build_has_pairs(seed: int) -> None:
    if not _bf16_pairs():
        assert cpu_gemv.gemm_kernel(cpu_gemv.pack(torch.randn(4, 4).bfloat16())) is None
        pytest.skip("bf16 products of many rows need AVX-512 BF16 dot products (oneDNN's elsewhere)")
    gen = torch.Generator().manual_seed(200 + seed)
    lib = cpu_gemv._gemm_library()
    rows = [int(torch.randint(3, 400, (), generator=gen)) for _ in range(3)] + [int(lib.hearth_gemm_tile_rows()) + 1]
    for m in rows:
        n = int(torch.randint(1, 300, (), generator=gen))
        k = 2 * int(torch.randint(1, 800, (), generator=gen))  # pairs of k
        x = torch.randn(m, k, generator=gen).bfloat16()
        w = (torch.randn(n, k, generator=gen) / k ** 0.5).bfloat16()
        bias = torch.randn(n, generator=gen).bfloat16() if seed % 2 else None
        packed = cpu_gemv.pack(w)
        assert cpu_gemv.gemm_kernel(packed) is not None
        _close_bf16(cpu_gemv.gemm(x, packed, bias), x, w, bias)


# Every tile height of both builds, alone and as the short or even tiles after full ones (AVX-512: 19 -> 10 + 9,
# 20 -> 10 + 10, 32 -> 11 + 11 + 10, 40 -> 12 + 12 + 12 + 4; AVX2: 10 -> 5 + 5, 11 -> 6 + 5, 8 -> 6 + 2).
@pytest.mark.parametrize("rows", [*range(1, 14), 17, 19, 20, 22, 23, 25, 32, 33, 40, 44])
def test_every_tile_height_and_every_chunk_boundary(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    lib = cpu_gemv._gemm_library()
    assert lib is not None
    chunk = int(lib.hearth_gemm_chunk_rows())
    for n, k in ((40, 64), (33, 1536), (7, 3)):
        w, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
        for m in (rows, chunk - 1 + rows, 2 * chunk + rows):  # tiles at the start, across and past chunk ends
            x = torch.randn(m, k, generator=gen)
            _close(cpu_gemv.gemm(x, cpu_gemv.pack(w), bias), x, w, bias)
            if _bf16_pairs() and k % 2 == 0:
                xb, wb, bb = x.bfloat16(), w.bfloat16(), bias.bfloat16()
                _close_bf16(cpu_gemv.gemm(xb, cpu_gemv.pack(wb), bb), xb, wb, bb)


def test_linear_sends_many_rows_to_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(3)
    w, b = torch.randn(200, 128, generator=gen), torch.randn(200, generator=gen)
    layer = Linear(w, b)
    assert layer.gemm
    calls: list[int] = []
    gemm = cpu_gemv.gemm
    monkeypatch.setattr(cpu_gemv, "gemm", lambda x, *a: calls.append(x.shape[0]) or gemm(x, *a))
    for rows in (1, cpu_gemv.MAX_ROWS, cpu_gemv.MAX_ROWS + 1, 300):
        x = torch.randn(rows, 128, generator=gen)
        _close(layer(x), x, w, b)
    assert calls == [cpu_gemv.MAX_ROWS + 1, 300]
    # On the GEMM every product runs on the packed blocks: no oneDNN copy, and any leading dims
    assert layer.weight is None
    x = torch.randn(2, 5, 128, generator=gen)
    got = layer(x)
    assert got.shape == (2, 5, 200)
    _close(got.reshape(10, 200), x.reshape(10, 128), w, b)
    # bf16 takes the GEMM where the build has its dot products, else oneDNN; and oneDNN where the CPU has AMX
    # tiles the GEMM does not use, as oneDNN does (HEARTH_CPU_GEMM=on keeps the GEMM there, to compare)
    tiles_elsewhere = cpu_gemv.amx_bf16() and not cpu_gemv.gemm_amx()
    assert Linear(torch.randn(16, 16, dtype=torch.bfloat16)).gemm == (_bf16_pairs() and not tiles_elsewhere)
    monkeypatch.setenv("HEARTH_CPU_GEMM", "on")
    assert Linear(torch.randn(16, 16, dtype=torch.bfloat16)).gemm == _bf16_pairs()
    monkeypatch.setenv("HEARTH_CPU_GEMM", "off")
    off = Linear(w, b)
    assert not off.gemm and off.weight is not None
    _close(off(x[0]), x[0], w, b)


@pytest.mark.parametrize("rows", [3, 11, 12, 13, 32, 97, 200])
def test_gate_up_with_silu_is_the_product_then_silu_mul_bit_for_bit(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    lib = cpu_gemv._gemm_library()
    assert lib is not None
    block = int(lib.hearth_gemm_block_width())
    dtypes = [torch.float32] + ([torch.bfloat16] if _bf16_pairs() else [])
    for dtype in dtypes:
        for inter, k, with_bias in ((block, 64, False), (3 * block, 576, True), (5 * block, 130, False)):
            w = (torch.randn(2 * inter, k, generator=gen) / k ** 0.5).to(dtype)
            bias = torch.randn(2 * inter, generator=gen).to(dtype) if with_bias else None
            x = torch.randn(rows, k, generator=gen).to(dtype)
            packed = cpu_gemv.pack(w)
            got = cpu_gemv.gemm_silu(x, packed, bias)
            assert got.shape == (rows, inter) and got.dtype == dtype
            assert torch.equal(got, cpu_fused.silu_mul(cpu_gemv.gemm(x, packed, bias)))
    # halves that are not whole blocks (or an odd number of outputs) have no fused entry point
    assert cpu_gemv.gemm_silu_kernel(cpu_gemv.pack(torch.randn(2 * block + 2, 8))) is None
    assert cpu_gemv.gemm_silu_kernel(cpu_gemv.pack(torch.randn(2 * block + 1, 8))) is None


@pytest.mark.parametrize("rows", [3, 12, 32, 100])
def test_fp32_outputs_are_the_bf16_products_widened(rows: int) -> None:
    """The LM head's logits: `gemm_fp32` stores each bf16 output widened, in the same pass (partial last blocks
    and biases included); fp32 weights and other builds take the product then `.float()`."""
    gen = torch.Generator().manual_seed(rows)
    for dtype in (torch.float32, torch.bfloat16):
        for n, k, with_bias in ((1000, 64, False), (77, 130, True)):
            w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
            bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
            x = torch.randn(rows, k, generator=gen).to(dtype)
            layer = Linear(w, bias)
            want = layer(x).float()
            got = layer.fp32(x)
            assert got.dtype == torch.float32 and torch.equal(got, want)
            if layer.gemm:
                assert torch.equal(cpu_gemv.gemm_fp32(x, layer.gemv_weight, bias), want)


@pytest.mark.parametrize("team", [1, 2, 7])
def test_argmax_of_the_products_is_torchs_argmax_of_the_logits(team: int) -> None:
    """A greedy step's tokens straight from the head (`gemm_argmax`, `Linear.argmax`): torch.argmax of the
    logits `Linear.fp32` gives, on every build, dtype and team (7 threads on fewer cores: some are preempted and
    the others take their blocks from the back, out of order). Small integer inputs make many exact ties, which
    must go to the first index wherever the tied blocks land; a NaN output wins, the first NaN of a row first."""
    gen = torch.Generator().manual_seed(team)
    lib = cpu_gemv._gemm_library()
    assert lib is not None
    chunk, block = int(lib.hearth_gemm_chunk_rows()), int(lib.hearth_gemm_block_width())
    before = torch.get_num_threads()
    torch.set_num_threads(team)
    try:
        for dtype in (torch.float32, torch.bfloat16):
            for m, n, k, ties in ((3, 1000, 64, True), (chunk + 7, 23 * block + 3, 96, True),
                                  (32, 5 * block, 896, False), (40, 77, 66, False), (17, 3000, 32, True)):
                x, w, bias = head_inputs(gen, m, n, k, ties, dtype)
                layer = Linear(w, bias)
                want = layer.fp32(x).argmax(dim=-1)
                got = layer.argmax(x)
                assert got.dtype == torch.int64 and torch.equal(got, want), (dtype, m, n, k)
                if layer.gemm:
                    assert torch.equal(cpu_gemv.gemm_argmax(x, layer.gemv_weight, bias), want)
            # NaN: a weight row of NaN makes that output NaN in every row (the later one must lose); a row of x
            # with a NaN is NaN everywhere (its first output wins)
            n, k = 9 * block + 5, 64
            w = torch.randn(n, k, generator=gen).to(dtype)
            w[7 * block + 2] = float("nan")
            w[block + 1] = float("nan")
            x = torch.randn(20, k, generator=gen).to(dtype)
            x[4, 3] = float("nan")
            layer = Linear(w)
            want = layer.fp32(x).argmax(dim=-1)
            assert want[0] == block + 1 and want[4] == 0
            assert torch.equal(layer.argmax(x), want)
    finally:
        torch.set_num_threads(before)


def _amx() -> None:
    if not cpu_gemv.gemm_amx():
        pytest.skip("the GEMM runs bf16 on AMX tiles only on a CPU with them (Intel Sapphire Rapids and later)")


# x tiles of 16 rows, two a pass: every remainder of a group, both heights of a pass, across chunk ends
@pytest.mark.parametrize("rows", [1, 3, 15, 16, 17, 31, 32, 33, 47, 48, 95, 96, 97, 130])
def test_amx_tiles_match_the_reference_and_the_dot_products(rows: int, monkeypatch: pytest.MonkeyPatch,
                                                            isa: str) -> None:
    """On AMX tiles (k a multiple of 32; other k keep the AVX-512 BF16 tiles): each output within one bf16 step
    of the exact product, like the AVX-512 BF16 build's, which it matches closely; the SiLU and widened entry
    points give the product's own results bit for bit there too."""
    _amx()
    gen = torch.Generator().manual_seed(rows)
    shapes = ((33, 32, True), (96, 896, False), (64, 1536, True), (40, 66, True))  # partial blocks; k not on tiles
    cases = []
    for n, k, with_bias in shapes:
        x = torch.randn(rows, k, generator=gen).bfloat16()
        w = (torch.randn(n, k, generator=gen) / k ** 0.5).bfloat16()
        bias = torch.randn(n, generator=gen).bfloat16() if with_bias else None
        packed = cpu_gemv.pack(w)
        got = cpu_gemv.gemm(x, packed, bias)
        _close_bf16(got, x, w, bias)
        assert torch.equal(cpu_gemv.gemm_fp32(x, packed, bias), got.float())
        if cpu_gemv.gemm_silu_kernel(packed) is not None:
            assert torch.equal(cpu_gemv.gemm_silu(x, packed, bias), cpu_fused.silu_mul(got))
        cases.append((x, packed, bias, got))
    monkeypatch.setenv("HEARTH_CPU_AMX", "off")
    forget_libraries()
    assert not cpu_gemv.gemm_amx() and cpu_gemv.gemm_kernel(cases[0][1]) is not None
    for x, packed, bias, got in cases:
        # the same sums in another order: at most one bf16 step apart, mostly equal
        dots = cpu_gemv.gemm(x, packed, bias)
        torch.testing.assert_close(got.float(), dots.float(), rtol=2 ** -7, atol=1e-5)
        assert (got == dots).float().mean() > 0.9


@pytest.mark.parametrize("threads", [2, 3, 7])
def test_results_do_not_depend_on_how_the_threads_share_the_work(threads: int) -> None:
    """Blocks are dealt in runs, and a thread that finishes early takes what is left of the others' (deal.h): any
    team, including more threads than cores (so some are preempted mid-run and the others take their items) and
    than blocks (empty runs), must give the one-thread result bit for bit, over several chunks of rows."""
    gen = torch.Generator().manual_seed(threads)
    lib = cpu_gemv._gemm_library()
    assert lib is not None
    chunk, block = int(lib.hearth_gemm_chunk_rows()), int(lib.hearth_gemm_block_width())
    dtypes = [torch.float32] + ([torch.bfloat16] if _bf16_pairs() else [])
    before = torch.get_num_threads()
    try:
        for dtype in dtypes:
            for m, n, k in ((2 * chunk + 5, 23 * block + 3, 96), (chunk + 1, 2 * block, 64), (40, 5, 32)):
                x = torch.randn(m, k, generator=gen).to(dtype)
                w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
                bias = torch.randn(n, generator=gen).to(dtype)
                packed = cpu_gemv.pack(w)
                silu = cpu_gemv.pack(torch.cat([w, w.flip(0)])) if n % block == 0 else None
                results = []
                for team in (1, threads):
                    torch.set_num_threads(team)
                    results.append([cpu_gemv.gemm(x, packed, bias)]
                                   + ([cpu_gemv.gemm_silu(x, silu)] if silu is not None else []))
                for one, many in zip(*results, strict=True):
                    assert torch.equal(one, many)
    finally:
        torch.set_num_threads(before)
