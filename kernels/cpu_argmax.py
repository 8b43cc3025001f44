"""Row-wise argmax of fp32 or bf16 logits on CPU (csrc/argmax.c): a greedy step's token choice.

`argmax(x)` equals `x.argmax(dim=-1)` (first index of the maximum; a row with a NaN gives its first NaN) and
falls back to it wherever the kernel does not apply (another device or dtype, a non-unit column stride, no
kernel build). torch's CPU argmax walks each row on one thread; this one runs at memory speed, rows split
over torch's threads (one row a thread at most: a single row takes 10 us of SmolLM2's 49,152 entries on a Zen 4
core against torch's 43). bf16 rows are ranked widened in registers, as their fp32 copy would rank, without it.
"""

from __future__ import annotations

import ctypes
import functools

import torch


@functools.cache
def _library() -> ctypes.CDLL | None:
    from kernels import cpu_build

    lib = cpu_build.load("argmax")
    if lib is not None:
        for fn in (lib.hearth_argmax_f32, lib.hearth_argmax_bf16):
            fn.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p, ctypes.c_int64]
            fn.restype = None
    return lib


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x [rows, n] -> int64 [rows]: the index of each row's largest value, as torch.argmax(x, dim=-1)."""
    lib = _library()
    if (lib is None or x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16) or x.dim() != 2
            or x.stride(-1) != 1 or x.shape[0] == 0 or x.shape[-1] == 0 or x.shape[-1] >= 2**31):
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    kernel = lib.hearth_argmax_f32 if x.dtype == torch.float32 else lib.hearth_argmax_bf16
    kernel(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr(), torch.get_num_threads())
    return out
