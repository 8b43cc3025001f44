"""Weight-only int8 linear layers on CPU: per-output-channel symmetric quantization, the product in C
(csrc/gemv_i8.c), and `linear_ref`, the torch reference it is tested against.

A decode step's cost is reading the weights; int8 weights are a quarter of fp32's bytes and half of bf16's.
Activations stay in the model's dtype and every sum is fp32: only the weights are rounded, once, when the model
loads. Each row of W keeps scale = max|row| / 127 and W ~= scale * q with q in [-127, 127].

Built by kernels/cpu_build. Without a C compiler, AVX2 and FMA, or with HEARTH_CPU_KERNELS=off (or off the
CPU), `available()` is False and `linear` runs the reference (correct, not fast).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import cpu_build, cpu_gemv

DTYPES = (torch.float32, torch.bfloat16)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [n, k] -> (q int8 [n, k], scale fp32 [n]) with weight ~= scale[:, None] * q, rounded to nearest.
    A row of zeros keeps scale 1 (and q 0) so that nothing divides by zero."""
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale[:, None]).to(dtype)


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = cpu_build.load("gemv_i8")
    if lib is not None:
        lib.hearth_gemv_i8_f32.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 4
        lib.hearth_gemv_i8_bf16.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 4 + [ctypes.c_void_p]
        lib.hearth_gemv_i8_f32.restype = lib.hearth_gemv_i8_bf16.restype = None
        lib.hearth_gemv_i8_bf16_pairs.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 4
        lib.hearth_gemv_i8_bf16_pairs.restype = None
        for fn in (lib.hearth_i8_block_width, lib.hearth_i8_bf16_pairs, lib.hearth_i8_amx):
            fn.argtypes, fn.restype = [], ctypes.c_int64
        # read once: `linear` compares it with each weight's block on every call
        lib.block_width = int(lib.hearth_i8_block_width())
    return lib


def available() -> bool:
    return _library() is not None


@dataclass(frozen=True, slots=True)
class Int8Weight:
    """A quantized [n, k] weight as the kernel reads it: `packed` holds ceil(n / block) column blocks of
    [k, block] int8 (outputs past n are zero), `block` being this machine's build's width (32 with AVX-512, 16
    with AVX2), or with `pairs` blocks of [k / 2, block, 2]: a bf16 model's weights on a build with AVX-512 BF16
    dot products, which take bf16 x only. Block 0 means no kernel here, and `packed` is the plain [n, k]
    matrix for the reference."""

    packed: torch.Tensor
    scale: torch.Tensor  # [n] fp32
    out_features: int
    in_features: int
    block: int
    pairs: bool = False

    @classmethod
    def from_float(cls, weight: torch.Tensor, activations: torch.dtype | None = None,
                   zeros: cpu_gemv.Zeros = cpu_gemv.plain_zeros) -> Int8Weight:
        """Quantized and packed for products with x of dtype `activations` (default: the weight's own), the
        blocks in a buffer from `zeros`."""
        q, scale = quantize(weight)
        lib = _library() if weight.device.type == "cpu" else None
        block = int(lib.hearth_i8_block_width()) if lib is not None else 0
        pairs = bool(block and lib.hearth_i8_bf16_pairs()) and (activations or weight.dtype) == torch.bfloat16 \
            and q.shape[1] % 2 == 0
        packed = cpu_gemv.pack_blocks(q, block, pairs, zeros) if block else q
        return cls(packed, scale.to(weight.device), q.shape[0], q.shape[1], block, pairs)

    def unpacked(self) -> torch.Tensor:
        """The plain [n, k] int8 matrix."""
        if not self.block:
            return self.packed
        # pairs of k: [blocks, k / 2, block, 2] -> [blocks, block, k / 2, 2]; else [blocks, block, k]
        p = self.packed.permute(0, 2, 1, 3) if self.pairs else self.packed.transpose(1, 2)
        return p.reshape(-1, self.in_features)[: self.out_features]

    @property
    def nbytes(self) -> int:
        return self.out_features * self.in_features + self.scale.numel() * self.scale.element_size()


def pack(q: torch.Tensor, block: int) -> torch.Tensor:
    """q [n, k] -> [ceil(n / block), k, block]: each block of outputs one contiguous stream, k-major."""
    return cpu_gemv.pack_blocks(q, block)


def linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., k] @ (scale * q)^T + bias, in x's dtype (bias in x's dtype too): fp32 sums, each output rounded
    once."""
    lib = _library()
    # Weights in pairs take bf16 x, and only from a build that has the dot product; and the blocks must be this
    # build's width (the library a process loads never changes, but a test may load the AVX2 build, 16 wide,
    # after packing 32 wide for an AVX-512 one).
    if not weight.block or lib is None or x.device.type != "cpu" or x.dtype not in DTYPES \
            or weight.block != lib.block_width \
            or (weight.pairs and (x.dtype != torch.bfloat16 or not lib.hearth_i8_bf16_pairs())):
        return linear_ref(x, weight.unpacked(), weight.scale, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    m, k = x2.shape
    n = weight.out_features
    y = torch.empty(m, n, dtype=x.dtype)
    bias = bias.contiguous() if bias is not None else None
    b = bias.data_ptr() if bias is not None else None
    threads = torch.get_num_threads()
    packed, scale = weight.packed.data_ptr(), weight.scale.data_ptr()
    if x.dtype == torch.float32:
        lib.hearth_gemv_i8_f32(x2.data_ptr(), packed, scale, b, y.data_ptr(), m, n, k, threads)
    elif weight.pairs:
        lib.hearth_gemv_i8_bf16_pairs(x2.data_ptr(), packed, scale, b, y.data_ptr(), m, n, k, threads)
    else:
        widened = torch.empty(m, k, dtype=torch.float32)
        lib.hearth_gemv_i8_bf16(x2.data_ptr(), packed, scale, b, y.data_ptr(), m, n, k, threads, widened.data_ptr())
    return y.view(*lead, n)


def linear_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    y = F.linear(x.float(), q.float()) * scale.to(x.device)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
