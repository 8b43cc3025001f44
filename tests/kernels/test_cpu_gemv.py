"""The CPU fp32 and bf16 GEMV kernel against F.linear on fresh random inputs, and the Linear layer's dispatch to it."""

from __future__ import annotations

import pytest
import torch

from inference.models.layers import Linear
from kernels import cpu_gemv

pytestmark = [pytest.mark.skipif(not cpu_gemv.available(),
                                 reason="the CPU GEMV kernel needs a C compiler and a CPU with AVX2 and FMA"),
              pytest.mark.usefixtures("isa")]  # native and AVX2 builds: tests/kernels/conftest.py


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    # Only the order of the fp32 additions differs from the reference.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("seed", range(6))
def test_gemv_matches_the_reference_on_random_shapes(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(8):
        m = int(torch.randint(1, cpu_gemv.MAX_ROWS + 1, (), generator=gen))
        n = int(torch.randint(1, 700, (), generator=gen))  # rows left over after the blocks of four included
        k = 8 * int(torch.randint(1, 200, (), generator=gen))
        x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) / k ** 0.5
        bias = torch.randn(n, generator=gen) if seed % 2 else None
        _close(cpu_gemv.gemv(x, w, bias), cpu_gemv.gemv_ref(x, w, bias))


def test_gemv_takes_a_non_contiguous_input_and_any_thread_count() -> None:
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(96, 64, generator=gen)
    x = torch.randn(64, 3, generator=gen).t()  # [3, 64], not contiguous
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            _close(cpu_gemv.gemv(x, w), cpu_gemv.gemv_ref(x, w))
    finally:
        torch.set_num_threads(threads)


def test_linear_uses_the_kernel_for_few_rows_and_the_packed_path_beyond(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(3)
    w, b = torch.randn(200, 128, generator=gen), torch.randn(200, generator=gen)
    layer = Linear(w, b)
    assert layer.plain is not None and torch.equal(layer.plain, w)  # the plain copy is the weight
    calls: list[int] = []
    gemv = cpu_gemv.gemv
    monkeypatch.setattr(cpu_gemv, "gemv", lambda x, *a: calls.append(x.shape[0]) or gemv(x, *a))
    for rows in (1, cpu_gemv.MAX_ROWS, cpu_gemv.MAX_ROWS + 1, 300):
        x = torch.randn(rows, 128, generator=gen)
        _close(layer(x), torch.nn.functional.linear(x, w, b))
    assert calls == [1, cpu_gemv.MAX_ROWS]
    # Weights the kernel cannot take keep the other paths: k not a multiple of eight, fp16, a bias of
    # another dtype.
    assert Linear(torch.randn(16, 12)).plain is None
    assert Linear(torch.randn(16, 16, dtype=torch.float16)).plain is None
    assert Linear(torch.randn(16, 16, dtype=torch.bfloat16), torch.randn(16)).plain is None
    assert Linear(torch.randn(16, 16, dtype=torch.bfloat16)).plain is not None


@pytest.mark.parametrize("seed", range(4))
def test_bf16_gemv_is_the_fp32_product_of_the_bf16_values_rounded_once(seed: int) -> None:
    gen = torch.Generator().manual_seed(50 + seed)
    for _ in range(6):
        m = int(torch.randint(1, cpu_gemv.MAX_ROWS + 1, (), generator=gen))
        n = int(torch.randint(1, 500, (), generator=gen))
        k = 8 * int(torch.randint(1, 150, (), generator=gen))
        x = torch.randn(m, k, generator=gen).bfloat16()
        w = (torch.randn(n, k, generator=gen) / k ** 0.5).bfloat16()
        bias = torch.randn(n, generator=gen).bfloat16() if seed % 2 else None
        got = cpu_gemv.gemv(x, w, bias)
        assert got.dtype == torch.bfloat16
        exact = cpu_gemv.gemv_ref(x.float(), w.float(), bias.float() if bias is not None else None)
        # within one bf16 rounding of the exact result (fp32 sums differ from it only in their order)
        torch.testing.assert_close(got.float(), exact, rtol=2 ** -8, atol=1e-4)
        # and at least as close as torch's own bf16 product
        ref16 = cpu_gemv.gemv_ref(x, w, bias).float()
        assert (got.float() - exact).abs().max() <= (ref16 - exact).abs().max() + 1e-4


def test_the_kernel_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HEARTH_CPU_GEMV", "off")
    cpu_gemv._library.cache_clear()
    try:
        assert not cpu_gemv.available() and Linear(torch.randn(16, 16)).plain is None
    finally:
        monkeypatch.delenv("HEARTH_CPU_GEMV")
        cpu_gemv._library.cache_clear()
    assert cpu_gemv.available()
