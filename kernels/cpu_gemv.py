"""fp32 and bf16 matrix-vector products on CPU for decode steps, with `torch.nn.functional.linear` as the
reference.

Decoding one token reads every weight once and does two flops per weight read, so its speed is the rate at
which weights stream from memory. On the 2-core AVX2 EPYC of docs/benchmarks.md a plain read runs at ~29 GB/s,
oneDNN's packed fp32 GEMV at ~19 GB/s and the generic `F.linear` at ~10 GB/s: `csrc/gemv_f32.c` closes most of
that gap for one or two rows (see its header). More rows go to oneDNN, which is as fast from three or four rows
on and far ahead once the product is compute-bound. bf16 weights are half the bytes: the same kernel widens
them to fp32 as it loads them, sums in fp32 and rounds each output once (as oneDNN's bf16 products do).

Built by kernels/cpu_build. Without a C compiler, AVX2 and FMA, or with HEARTH_CPU_GEMV=off (or
HEARTH_CPU_KERNELS=off), `available()` is False and callers keep the oneDNN path.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch
import torch.nn.functional as F

from kernels import cpu_build

MAX_ROWS = 2  # from 3-4 rows on, oneDNN's packed GEMM is as fast (measured: docs/benchmarks.md)
ALIGN = 8  # the kernel walks k eight floats at a time


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = cpu_build.load("gemv")
    if lib is not None:
        for fn in (lib.hearth_gemv_f32, lib.hearth_gemv_bf16):
            fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4
            fn.restype = None
    return lib


def available() -> bool:
    return os.environ.get("HEARTH_CPU_GEMV", "auto") != "off" and _library() is not None


def supports(weight: torch.Tensor) -> bool:
    """Whether gemv can take this weight: CPU, fp32 or bf16, contiguous, k a multiple of ALIGN."""
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16) and weight.dim() == 2
            and weight.is_contiguous() and weight.shape[1] % ALIGN == 0 and available())


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, k] @ weight[n, k]^T (+ bias [n]) for m <= MAX_ROWS, on weights `supports` accepted; x and bias
    in the weight's dtype, which the result has too."""
    lib = _library()
    assert lib is not None
    m, k = x.shape
    n = weight.shape[0]
    x = x.contiguous()
    y = torch.empty(m, n, dtype=weight.dtype)
    kernel = lib.hearth_gemv_f32 if weight.dtype == torch.float32 else lib.hearth_gemv_bf16
    kernel(x.data_ptr(), weight.data_ptr(), bias.data_ptr() if bias is not None else None,
           y.data_ptr(), m, n, k, torch.get_num_threads())
    return y


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)
