"""The CPU fp32 GEMM of many rows (kernels/csrc/gemm.c) against F.linear on fresh random inputs, and the Linear
layer's dispatch to it."""

from __future__ import annotations

import pytest
import torch

from inference.models.layers import Linear
from kernels import cpu_build, cpu_gemv

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


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 11, 12, 13])
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


def test_linear_sends_many_fp32_rows_to_gemm_where_it_is_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(3)
    w, b = torch.randn(200, 128, generator=gen), torch.randn(200, generator=gen)
    layer = Linear(w, b)
    measured = "-mavx512f" not in cpu_build.flags()  # the AVX2 build: where it beat oneDNN
    assert layer.gemm == measured
    calls: list[int] = []
    gemm = cpu_gemv.gemm
    monkeypatch.setattr(cpu_gemv, "gemm", lambda x, *a: calls.append(x.shape[0]) or gemm(x, *a))
    for rows in (1, cpu_gemv.MAX_ROWS, cpu_gemv.MAX_ROWS + 1, 300):
        x = torch.randn(rows, 128, generator=gen)
        _close(layer(x), x, w, b)
    assert calls == ([cpu_gemv.MAX_ROWS + 1, 300] if measured else [])
    # On the GEMM every product runs on the packed blocks: no oneDNN copy, and any leading dims
    assert (layer.weight is None) == measured
    x = torch.randn(2, 5, 128, generator=gen)
    got = layer(x)
    assert got.shape == (2, 5, 200)
    _close(got.reshape(10, 200), x.reshape(10, 128), w, b)
    assert not Linear(torch.randn(16, 16, dtype=torch.bfloat16)).gemm  # bf16 stays with oneDNN
    monkeypatch.setenv("HEARTH_CPU_GEMM", "off")
    off = Linear(w, b)
    assert not off.gemm and off.weight is not None
    _close(off(x[0]), x[0], w, b)
