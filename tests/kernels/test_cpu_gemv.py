"""The CPU fp32 and bf16 GEMV kernel against F.linear on fresh random inputs, and the Linear layer's dispatch to it."""

from __future__ import annotations

import pytest
import torch

from inference.models.layers import Linear
from kernels import cpu_build, cpu_gemv
from tests.cpu_builds import forget_libraries
from tests.kernels.products import head_inputs

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
        k = int(torch.randint(1, 1600, (), generator=gen))  # steps left over after the unrolled ones included
        x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) / k ** 0.5
        bias = torch.randn(n, generator=gen) if seed % 2 else None
        _close(cpu_gemv.gemv(x, cpu_gemv.pack(w), bias), cpu_gemv.gemv_ref(x, w, bias))


@pytest.mark.parametrize(("product", "rows"), [("gemv", 3), ("gemm", 40)])  # gemm: kernels/csrc/gemm.c
def test_products_take_a_non_contiguous_input_and_any_thread_count(product: str, rows: int) -> None:
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(96, 64, generator=gen)
    x = torch.randn(64, rows, generator=gen).t()  # [rows, 64], not contiguous
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3, 5):  # 96 outputs are three or six blocks: five threads, more than some have blocks
            torch.set_num_threads(count)
            _close(getattr(cpu_gemv, product)(x, cpu_gemv.pack(w)), cpu_gemv.gemv_ref(x, w))
    finally:
        torch.set_num_threads(threads)


def test_linear_uses_the_kernel_for_few_rows_and_the_packed_path_beyond(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(3)
    w, b = torch.randn(200, 128, generator=gen), torch.randn(200, generator=gen)
    layer = Linear(w, b)
    assert layer.gemv_weight is not None and torch.equal(layer.gemv_weight.unpacked(), w)  # the same weights
    calls: list[int] = []
    gemv = cpu_gemv.gemv
    monkeypatch.setattr(cpu_gemv, "gemv", lambda x, *a: calls.append(x.shape[0]) or gemv(x, *a))
    for rows in (1, cpu_gemv.MAX_ROWS, cpu_gemv.MAX_ROWS + 1, 300):
        x = torch.randn(rows, 128, generator=gen)
        _close(layer(x), torch.nn.functional.linear(x, w, b))
    assert calls == [1, cpu_gemv.MAX_ROWS]
    # Weights the kernel cannot take keep the other paths: fp16, a bias of another dtype.
    assert Linear(torch.randn(16, 16, dtype=torch.float16)).gemv_weight is None
    assert Linear(torch.randn(16, 16, dtype=torch.bfloat16), torch.randn(16)).gemv_weight is None
    assert Linear(torch.randn(16, 16, dtype=torch.bfloat16)).gemv_weight is not None
    assert Linear(torch.randn(16, 13)).gemv_weight is not None  # fp32: any k


@pytest.mark.parametrize("seed", range(4))
def test_bf16_gemv_is_the_fp32_product_of_the_bf16_values_rounded_once(seed: int) -> None:
    gen = torch.Generator().manual_seed(50 + seed)
    for _ in range(6):
        m = int(torch.randint(1, cpu_gemv.MAX_ROWS + 1, (), generator=gen))
        n = int(torch.randint(1, 500, (), generator=gen))
        k = 2 * int(torch.randint(1, 600, (), generator=gen))  # even: AVX-512 BF16 packs pairs of k
        x = torch.randn(m, k, generator=gen).bfloat16()
        w = (torch.randn(n, k, generator=gen) / k ** 0.5).bfloat16()
        bias = torch.randn(n, generator=gen).bfloat16() if seed % 2 else None
        got = cpu_gemv.gemv(x, cpu_gemv.pack(w), bias)
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
        assert not cpu_gemv.available() and Linear(torch.randn(16, 16)).gemv_weight is None
    finally:
        monkeypatch.delenv("HEARTH_CPU_GEMV")
        cpu_gemv._library.cache_clear()
    assert cpu_gemv.available()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packing_keeps_every_weight_and_any_row_count_works(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(11)
    for n, k in ((1, 2), (33, 10), (70, 576), (129, 98)):  # one output, partial blocks, whole ones
        w = torch.randn(n, k, generator=gen).to(dtype)
        packed = cpu_gemv.pack(w)
        assert torch.equal(packed.unpacked(), w)
        x = torch.randn(5, k, generator=gen).to(dtype)  # more rows than decode sends: two at a time
        got = cpu_gemv.gemv(x, packed).float()
        torch.testing.assert_close(got, cpu_gemv.gemv_ref(x.float(), w.float()), rtol=2 ** -7, atol=1e-4)


@pytest.mark.parametrize("pairs", [False, True])
def test_blocks_hold_each_output_at_its_place_and_zeros_past_the_last(pairs: bool) -> None:
    gen = torch.Generator().manual_seed(12)
    for n, k, block in ((1, 2, 16), (33, 10, 16), (64, 8, 32), (70, 6, 32)):
        w = torch.randn(n, k, generator=gen)
        out = cpu_gemv.pack_blocks(w, block, pairs)
        count = -(-n // block)
        padded = torch.cat([w, torch.zeros(count * block - n, k)])
        # the definition: output b * block + j, input i lies at [b, i, j], or at [b, i // 2, j, i % 2] in pairs
        for b in range(count):
            for j in range(block):
                row = out[b, :, j].reshape(-1) if pairs else out[b, :, j]
                assert torch.equal(row, padded[b * block + j]), (n, k, block, b, j)


@pytest.mark.parametrize("team", [1, 2, 7])
def test_argmax_of_one_or_two_rows_is_torchs_argmax_of_the_products(team: int) -> None:
    """A greedy decode's tokens from the head without storing its outputs (`gemv_argmax`, `Linear.argmax` for
    one or two rows): torch.argmax of what `gemv` stores, on every build, dtype and team (7 threads on fewer
    cores: blocks taken out of order). Small integers make exact ties, which go to the first index wherever the
    tied blocks land; a NaN output wins, a row's first NaN first."""
    gen = torch.Generator().manual_seed(40 + team)
    block = int(cpu_gemv._library().hearth_gemv_block_width())
    before = torch.get_num_threads()
    torch.set_num_threads(team)
    try:
        for dtype in (torch.float32, torch.bfloat16):
            for m in (1, 2):
                for n, k, ties in ((1000, 64, True), (23 * block + 3, 96, True), (5 * block, 576, False),
                                   (77, 66, False), (49152 // 8, 40, False)):
                    x, w, bias = head_inputs(gen, m, n, k, ties, dtype)
                    layer = Linear(w, bias)
                    want = cpu_gemv.gemv(x, layer.gemv_weight, bias).float().argmax(dim=-1)
                    assert torch.equal(want, layer.fp32(x).argmax(dim=-1))
                    got = cpu_gemv.gemv_argmax(x, layer.gemv_weight, bias)
                    assert got.dtype == torch.int64 and torch.equal(got, want), (dtype, m, n, k)
                    assert torch.equal(layer.argmax(x), want)
                n, k = 9 * block + 5, 64
                w = torch.randn(n, k, generator=gen).to(dtype)
                w[7 * block + 2] = float("nan")
                w[block + 1] = float("nan")
                x = torch.randn(m, k, generator=gen).to(dtype)
                if m == 2:
                    x[1, 3] = float("nan")  # NaN everywhere in that row: its first output wins
                layer = Linear(w)
                want = layer.fp32(x).argmax(dim=-1)
                assert want[0] == block + 1 and (m == 1 or want[1] == 0)
                assert torch.equal(cpu_gemv.gemv_argmax(x, layer.gemv_weight), want)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_l2_prefetch_changes_no_result(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Built with and without HEARTH_PREFETCH_L2 (kernels/cpu_build.defines: on for Intel CPUs), the products and
    their argmax are the same bit for bit, and the reference's within rounding: both builds run on any machine."""
    gen = torch.Generator().manual_seed(7)
    n, k = 1000, 700  # blocks past the prefetch distance, a partial last block, steps left after the unrolled ones
    x, w = torch.randn(2, k, generator=gen).to(dtype), (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
    results, libraries = [], set()
    for choice in ("on", "off"):
        monkeypatch.setenv("HEARTH_CPU_PREFETCH", choice)
        forget_libraries()
        libraries.add(cpu_build.build("gemv"))
        packed = cpu_gemv.pack(w)
        results.append((cpu_gemv.gemv(x[:1], packed), cpu_gemv.gemv(x, packed), cpu_gemv.gemv_argmax(x, packed)))
    forget_libraries()
    assert len(libraries) == 2  # the define reached the build
    for on, off in zip(*results, strict=True):
        assert torch.equal(on, off)
    want = cpu_gemv.gemv_ref(x.float(), w.float(), None)
    torch.testing.assert_close(results[0][1].float(), want, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=1e-2 if dtype == torch.bfloat16 else 1e-4)
