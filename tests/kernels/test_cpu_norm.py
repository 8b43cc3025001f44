"""The fused residual add + RMSNorm kernel against the torch reference on fresh random rows."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_norm

pytestmark = pytest.mark.skipif(not cpu_norm.supports(torch.zeros(1, 8)),
                                reason="the CPU norm kernel needs a C compiler and a CPU with AVX2 and FMA")


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
