"""Residual add + RMSNorm in one call on CPU in fp32 or bf16 (csrc/norm.c); `add_rms_norm_ref` is the reference.

Built by kernels/cpu_build; where it cannot be (or with HEARTH_CPU_KERNELS=off), `supports` is False and the
decoder keeps its torch ops.
"""

from __future__ import annotations

import ctypes
import functools

import torch


@functools.cache
def _library() -> ctypes.CDLL | None:
    from kernels import cpu_build

    lib = cpu_build.load("norm")
    if lib is not None:
        for fn in (lib.hearth_add_rms_norm_f32, lib.hearth_add_rms_norm_bf16):
            fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_float] + [ctypes.c_int64] * 2
            fn.restype = None
    return lib


def supports(h: torch.Tensor) -> bool:
    return (h.device.type == "cpu" and h.dtype in (torch.float32, torch.bfloat16) and h.dim() == 2
            and h.is_contiguous() and h.shape[1] % 8 == 0 and _library() is not None)


def add_rms_norm(h: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """h += x in place (when x is given), and RMSNorm(h) scaled by weight (by 1 + weight with offset).
    On tensors `supports` accepted; x and weight in h's dtype and contiguous like h."""
    lib = _library()
    assert lib is not None
    out = torch.empty_like(h)
    x = x.contiguous() if x is not None else None  # held until the call returns
    kernel = lib.hearth_add_rms_norm_f32 if h.dtype == torch.float32 else lib.hearth_add_rms_norm_bf16
    kernel(h.data_ptr(), x.data_ptr() if x is not None else None, weight.data_ptr(), out.data_ptr(),
           h.shape[0], h.shape[1], eps, int(offset), torch.get_num_threads())
    return h, out


def add_rms_norm_ref(h: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if x is not None:
        h = h + x
    hf = h.float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    # As layers.rms_norm: a plain weight scales the row already rounded to h's dtype.
    return h, (normed * (1.0 + weight.float())).to(h.dtype) if offset else weight * normed.to(h.dtype)
