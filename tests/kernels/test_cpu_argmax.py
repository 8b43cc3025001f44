"""The CPU argmax kernel against torch.argmax on fresh random logits: ties, NaN, -inf rows, strided rows."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_argmax

pytestmark = pytest.mark.skipif(cpu_argmax._library() is None,
                                reason="the CPU argmax kernel needs a C compiler and a CPU with AVX2 and FMA")


@pytest.mark.parametrize("seed", range(8))
def test_matches_torch_on_random_rows(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    rows = int(torch.randint(1, 40, (), generator=gen)) if seed > 1 else seed + 1  # one and two rows too
    n = int(torch.randint(1, 70000, (), generator=gen))
    x = torch.randn(rows, n, generator=gen)
    if seed % 2:  # bf16-valued logits: many exact ties, which must resolve to the first index
        x = x.bfloat16().float()
    got = cpu_argmax.argmax(x)
    assert got.dtype == torch.int64
    assert torch.equal(got, x.argmax(dim=-1))
    # bf16 rows: read in place, ranked as their fp32 copy ranks them
    assert torch.equal(cpu_argmax.argmax(x.bfloat16()), x.bfloat16().float().argmax(dim=-1))


def test_ties_nan_and_infinities_resolve_as_torch_does() -> None:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(8, 1000, generator=gen)
    x[0, [5, 600, 998]] = 9.0  # three equal maxima: the first
    x[1, 300] = float("nan")
    x[1, 900] = float("nan")  # NaN ranks above everything: the first NaN
    x[2, 999] = float("nan")  # in the scalar tail
    x[3] = float("-inf")  # nothing but -inf: index 0
    x[4, 3] = float("inf")
    x[5, :4] = float("nan")  # inside the first vector
    x[6] = 0.0
    x[7, 999] = 50.0  # the maximum is the very last entry
    assert torch.equal(cpu_argmax.argmax(x), x.argmax(dim=-1))
    assert torch.equal(cpu_argmax.argmax(x.bfloat16()), x.argmax(dim=-1))  # each case exact in bf16 too
    short = torch.tensor([[1.0, 3.0, 3.0], [float("nan"), 2.0, 1.0], [-1.0, -2.0, -1.0],
                          [0.0, 0.0, 5.0]])  # rows shorter than a vector
    assert torch.equal(cpu_argmax.argmax(short), short.argmax(dim=-1))


def test_strided_rows_and_fallbacks() -> None:
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(10, 5000, generator=gen)
    view = base[::2, 17:4100]  # rows 2 apart, each starting mid-row: the kernel reads in place
    assert torch.equal(cpu_argmax.argmax(view), view.argmax(dim=-1))
    assert torch.equal(cpu_argmax.argmax(view.bfloat16()), view.bfloat16().argmax(dim=-1))
    for x in (base.half(), base.t(), torch.empty(0, 5)):  # other dtype, column stride, empty: torch's
        assert torch.equal(cpu_argmax.argmax(x), x.argmax(dim=-1))
