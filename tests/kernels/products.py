"""Inputs for the head's argmax tests (tests/kernels/test_cpu_gemv.py, test_cpu_gemm.py)."""

from __future__ import annotations

import torch


def head_inputs(gen: torch.Generator, m: int, n: int, k: int, ties: bool,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(x [m, k], w [n, k], bias [n] or None) in `dtype`. ties: sums of a few small integers, exact in fp32 and
    bf16 and tied in most rows (the first index must win wherever the tied blocks land); otherwise normal values
    scaled so the sums stay near 1, with a bias."""
    if ties:
        x = torch.randint(-2, 3, (m, k), generator=gen).to(dtype)
        w = torch.randint(-1, 2, (n, k), generator=gen).to(dtype)
        return x, w, None
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
    return x, w, torch.randn(n, generator=gen).to(dtype)
