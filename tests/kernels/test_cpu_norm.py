"""The fused residual add + RMSNorm kernel against the torch reference on fresh random rows."""

from __future__ import annotations

import pytest
import torch

from inference.models import layers
from kernels import cpu_norm

pytestmark = [pytest.mark.skipif(not cpu_norm.supports(torch.zeros(1, 8)),
                                 reason="the CPU norm kernel needs a C compiler and a CPU with AVX2 and FMA"),
              pytest.mark.usefixtures("isa")]  # native and AVX2 builds: tests/kernels/conftest.py


@pytest.mark.parametrize("seed", range(6))
def test_add_rms_norm_matches_the_reference(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    rows, dim = int(torch.randint(1, 40, (), generator=gen)), 8 * int(torch.randint(1, 200, (), generator=gen))
    h = torch.randn(rows, dim, generator=gen) * 3
    x = torch.randn(rows, dim, generator=gen) if seed % 3 else None
    w = torch.randn(dim, generator=gen)
    offset = seed % 2 == 1
    want_h, want = cpu_norm.add_rms_norm_ref(h.clone(), x, w, 1e-6, offset)
    got_h, got = cpu_norm.add_rms_norm(h, x, w, 1e-6, offset)
    assert got_h.data_ptr() == h.data_ptr()  # the residual stream is updated in place
    torch.testing.assert_close(got_h, want_h, rtol=0, atol=0)  # the add is the same fp32 add
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not cpu_norm.supports(torch.zeros(2, 12)) and not cpu_norm.supports(torch.zeros(2, 16).t())


@pytest.mark.parametrize("seed", range(6))
def test_bf16_rows_round_where_the_torch_ops_round(seed: int) -> None:
    gen = torch.Generator().manual_seed(100 + seed)
    rows = [1, 2, 33, 130, 5, 1][seed]  # 130 rows x 576 run the threaded loop
    dim = [576, 64, 960, 576, 8, 2048][seed]
    h = (torch.randn(rows, dim, generator=gen) * 3).bfloat16()
    x = (torch.randn(rows, dim, generator=gen)).bfloat16() if seed % 3 else None
    w = torch.randn(dim, generator=gen).bfloat16()
    offset = seed % 2 == 1
    want_h, want = cpu_norm.add_rms_norm_ref(h.clone(), x, w, 1e-6, offset)
    # The reference is the decoder's own torch path.
    assert torch.equal(want, layers.rms_norm(want_h, w, 1e-6, offset=offset))
    got_h, got = cpu_norm.add_rms_norm(h, x, w, 1e-6, offset)
    assert got.dtype == torch.bfloat16 and got_h.data_ptr() == h.data_ptr()
    assert torch.equal(got_h, want_h)  # bf16(h + x): the same rounding
    # Sums of squares in another order can move a rounding by one bf16 step, rarely.
    torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=1e-6)
    assert (got != want).float().mean() < 0.02


def test_nan_stays_nan_in_bf16() -> None:
    h = torch.ones(1, 16, dtype=torch.bfloat16)
    h[0, 3] = float("nan")
    _, out = cpu_norm.add_rms_norm(h, None, torch.ones(16, dtype=torch.bfloat16), 1e-6, False)
    assert bool(out.isnan().all())
