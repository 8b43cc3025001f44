"""fp32 and bf16 matrix-vector products on CPU for decode steps, with `torch.nn.functional.linear` as the
reference.

Decoding one token reads every weight once and does two flops per weight read, so its speed is the rate at
which weights stream from memory. oneDNN's packed GEMV streams fp32 at ~19 GB/s on the 2-core AVX2 EPYC of
docs/benchmarks.md, where a plain read runs at ~29: `csrc/gemv.c` closes that gap for one or two rows, on
weights packed once (`pack`) into column blocks that each stream sequentially (see its header). bf16 weights are
half the bytes: sums in fp32, each output rounded once (as oneDNN's bf16 products do).

Products of more rows are compute-bound. `gemm` runs them on the same packed weights with register tiles of 6
rows (AVX2) or 12 (AVX-512) (`csrc/gemm.c`), in fp32, and in bf16 on builds with AVX-512 BF16 dot products; it
is level with or ahead of oneDNN's packed products in both (docs/benchmarks.md); on a CPU with AMX tiles its bf16
products run on them (`csrc/gemm_amx.h`, for k a multiple of 32). bf16 without those dot products goes to oneDNN. `gemm_silu` computes an MLP's silu(gate) * up straight from its fused gate/up weight,
`gemm_fp32` stores bf16 products widened (logits), and `gemm_argmax` keeps only each row's argmax of them (a
greedy step's tokens): each the separate steps' results, in one pass.

Built by kernels/cpu_build. Without a C compiler, AVX2 and FMA, or with HEARTH_CPU_GEMV=off (or
HEARTH_CPU_KERNELS=off), `available()` is False and callers keep the oneDNN path; HEARTH_CPU_GEMM=off turns off
`gemm` alone.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels import cpu_build

MAX_ROWS = 2  # from 3-4 rows on, oneDNN's packed GEMM is as fast (measured: docs/benchmarks.md)


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = cpu_build.load("gemv")
    if lib is not None:
        lib.hearth_gemv_f32.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4
        lib.hearth_gemv_bf16.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4 + [ctypes.c_void_p]
        lib.hearth_gemv_f32.restype = lib.hearth_gemv_bf16.restype = None
        lib.hearth_gemv_argmax_f32.argtypes = lib.hearth_gemv_f32.argtypes
        lib.hearth_gemv_argmax_bf16.argtypes = lib.hearth_gemv_bf16.argtypes
        lib.hearth_gemv_argmax_f32.restype = lib.hearth_gemv_argmax_bf16.restype = ctypes.c_int64
        for fn in (lib.hearth_gemv_block_width, lib.hearth_gemv_bf16_pairs):
            fn.argtypes, fn.restype = [], ctypes.c_int64
    return lib


@functools.cache
def _gemm_library() -> ctypes.CDLL | None:
    lib = cpu_build.load("gemm")
    if lib is not None:
        lib.hearth_gemm_f32.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4
        lib.hearth_gemm_bf16.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4 + [ctypes.c_void_p]
        lib.hearth_gemm_bf16_wide.argtypes = lib.hearth_gemm_bf16.argtypes
        lib.hearth_gemm_bf16_wide.restype = None
        lib.hearth_gemm_silu_f32.argtypes = lib.hearth_gemm_f32.argtypes
        lib.hearth_gemm_silu_bf16.argtypes = lib.hearth_gemm_bf16.argtypes
        lib.hearth_gemm_f32.restype = lib.hearth_gemm_bf16.restype = None
        lib.hearth_gemm_silu_f32.restype = lib.hearth_gemm_silu_bf16.restype = None
        lib.hearth_gemm_argmax_f32.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4
        lib.hearth_gemm_argmax_bf16.argtypes = lib.hearth_gemm_argmax_f32.argtypes
        lib.hearth_gemm_argmax_f32.restype = lib.hearth_gemm_argmax_bf16.restype = ctypes.c_int64
        lib.hearth_gemm_bf16_shrinks.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3
        lib.hearth_gemm_bf16_shrinks.restype = ctypes.c_int64
        for fn in (lib.hearth_gemm_chunk_rows, lib.hearth_gemm_tile_rows, lib.hearth_gemm_bf16_pairs,
                   lib.hearth_gemm_block_width, lib.hearth_gemm_amx):
            fn.argtypes, fn.restype = [], ctypes.c_int64
    return lib


def available() -> bool:
    return os.environ.get("HEARTH_CPU_GEMV", "auto") != "off" and _library() is not None


def supports(weight: torch.Tensor) -> bool:
    """Whether gemv can take this weight: CPU, fp32 or bf16, 2-d (bf16 with an even k where the build packs bf16
    in pairs of k)."""
    if not (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16) and weight.dim() == 2
            and available()):
        return False
    return not (_pairs(weight.dtype) and weight.shape[1] % 2)


def _pairs(dtype: torch.dtype) -> bool:
    lib = _library()
    return dtype == torch.bfloat16 and lib is not None and bool(lib.hearth_gemv_bf16_pairs())


@dataclasses.dataclass(frozen=True, slots=True)
class GemvWeight:
    """A [n, k] weight as the kernel reads it: `packed` is [ceil(n / block), k, block] (fp32, or bf16 on a
    build without AVX-512 BF16) or [ceil(n / block), k / 2, block, 2] (bf16 in pairs of k for its dot
    product); outputs past n are zero."""

    packed: torch.Tensor
    out_features: int
    in_features: int

    @property
    def dtype(self) -> torch.dtype:
        return self.packed.dtype

    def unpacked(self) -> torch.Tensor:
        """The plain [n, k] matrix."""
        # pairs of k: [blocks, k / 2, block, 2] -> [blocks, block, k / 2, 2]; else [blocks, block, k]
        p = self.packed.permute(0, 2, 1, 3) if self.packed.dim() == 4 else self.packed.transpose(1, 2)
        return p.reshape(-1, self.in_features)[: self.out_features]


def plain_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


Zeros = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


def pack_blocks(w: torch.Tensor, block: int, pairs: bool = False, zeros: Zeros = plain_zeros) -> torch.Tensor:
    """w [n, k] -> [ceil(n / block), k, block], each block of outputs one contiguous stream, k-major; with
    `pairs`, [ceil(n / block), k / 2, block, 2]: each step holds a pair of k per output.

    The result is written once, straight into a buffer from `zeros` (the engine passes one on huge pages): no
    padded or transposed intermediate, so a model's load writes its weights' bytes once, not three times."""
    n, k = w.shape
    count = -(-n // block)
    if pairs:
        out = zeros((count, k // 2, block, 2), w.dtype)
        rows, src = out.permute(0, 2, 1, 3), w.reshape(n, k // 2, 2)  # rows[b, j]: output b * block + j
    else:
        out = zeros((count, k, block), w.dtype)
        rows, src = out.transpose(1, 2), w
    full = n // block
    if full:
        rows[:full].copy_(src[: full * block].reshape(full, block, *src.shape[1:]))
    if n > full * block:  # the last block's outputs past n stay zero
        rows[full, : n - full * block].copy_(src[full * block:])
    return out


def packed_nbytes(out_features: int, in_features: int, dtype: torch.dtype) -> int:
    """The bytes `pack` asks `zeros` for, for a weight [out_features, in_features] of dtype."""
    lib = _library()
    assert lib is not None
    block = int(lib.hearth_gemv_block_width())
    return -(-out_features // block) * block * in_features * torch.empty((), dtype=dtype).element_size()


def pack(weight: torch.Tensor, zeros: Zeros = plain_zeros) -> GemvWeight:
    """`weight` [n, k], which `supports` accepted, in this build's layout, in a buffer from `zeros`."""
    lib = _library()
    assert lib is not None
    packed = pack_blocks(weight.detach(), int(lib.hearth_gemv_block_width()), _pairs(weight.dtype), zeros)
    return GemvWeight(packed, weight.shape[0], weight.shape[1])


def gemv(x: torch.Tensor, weight: GemvWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, k] @ weight^T (+ bias [n]) for m <= MAX_ROWS (more rows work, at no gain over oneDNN); x and bias
    in the weight's dtype, which the result has too."""
    lib = _library()
    assert lib is not None
    m, k = x.shape
    n = weight.out_features
    x = x.contiguous()
    y = torch.empty(m, n, dtype=weight.dtype)
    b = bias.contiguous().data_ptr() if bias is not None else None
    threads = torch.get_num_threads()
    if weight.dtype == torch.float32:
        lib.hearth_gemv_f32(x.data_ptr(), weight.packed.data_ptr(), b, y.data_ptr(), m, n, k, threads)
    else:
        widened = None if weight.packed.dim() == 4 else torch.empty(m, k, dtype=torch.float32)
        lib.hearth_gemv_bf16(x.data_ptr(), weight.packed.data_ptr(), b, y.data_ptr(), m, n, k, threads,
                             widened.data_ptr() if widened is not None else None)
    return y


def gemv_argmax(x: torch.Tensor, weight: GemvWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [m]: each row's `torch.argmax(gemv(x, weight, bias), dim=-1)` (the first index of the maximum; a
    row with a NaN, its first NaN) for m <= MAX_ROWS, without storing the products: a greedy decode's tokens from
    the LM head, each thread folding the outputs it computed while they are in its cache."""
    lib = _library()
    assert lib is not None and x.shape[0] <= MAX_ROWS
    m, k = x.shape
    x = x.contiguous()
    out = torch.empty(m, dtype=torch.int64)
    b = bias.contiguous().data_ptr() if bias is not None else None
    threads = torch.get_num_threads()
    if weight.dtype == torch.float32:
        failed = lib.hearth_gemv_argmax_f32(x.data_ptr(), weight.packed.data_ptr(), b, out.data_ptr(), m,
                                            weight.out_features, k, threads)
    else:
        widened = None if weight.packed.dim() == 4 else torch.empty(m, k, dtype=torch.float32)
        failed = lib.hearth_gemv_argmax_bf16(x.data_ptr(), weight.packed.data_ptr(), b, out.data_ptr(), m,
                                             weight.out_features, k, threads,
                                             widened.data_ptr() if widened is not None else None)
    if failed == -2:
        raise ValueError(f"gemv_argmax: {m} rows, more than the kernel's scratch holds")
    if failed:
        raise MemoryError("gemv_argmax: no memory for the rows' running maxima")
    return out


def gemm_kernel(weight: GemvWeight) -> ctypes._CFuncPtr | None:
    """The GEMM's entry point for this weight's dtype and layout, where the build has one: fp32 anywhere, bf16
    on the pairs of k of an AVX-512 BF16 build."""
    lib = _gemm_library()
    if lib is None:
        return None
    if weight.dtype == torch.float32:
        return lib.hearth_gemm_f32
    paired = weight.packed.dim() == 4 and bool(lib.hearth_gemm_bf16_pairs())
    return lib.hearth_gemm_bf16 if paired else None


def gemm_fp32(x: torch.Tensor, weight: GemvWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`gemm(x, weight, bias).float()` in one pass where the GEMM takes the weight in bf16 (each output is the bf16
    value, stored widened): the LM head's logits, which sampling reads in fp32. Elsewhere the two steps."""
    lib = _gemm_library()
    if weight.dtype != torch.bfloat16 or lib is None or gemm_kernel(weight) is None:
        return gemm(x, weight, bias).float()
    m, k = x.shape
    x = x.contiguous()
    y = torch.empty(m, weight.out_features, dtype=torch.float32)
    b = bias.contiguous().data_ptr() if bias is not None else None
    lib.hearth_gemm_bf16_wide(x.data_ptr(), weight.packed.data_ptr(), b, y.data_ptr(), m, weight.out_features, k,
                              torch.get_num_threads(), None)
    return y


def gemm_argmax(x: torch.Tensor, weight: GemvWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [m]: each row's `torch.argmax(gemm_fp32(x, weight, bias), dim=-1)` (the first index of the maximum;
    a row with a NaN, its first NaN), without storing the [m, n] products: a greedy step's tokens from the LM
    head. For a weight `gemm_kernel` has an entry point for."""
    lib = _gemm_library()
    assert lib is not None and gemm_kernel(weight) is not None
    m, k = x.shape
    x = x.contiguous()
    y = torch.empty(m, dtype=torch.int64)
    b = bias.contiguous().data_ptr() if bias is not None else None
    fn = lib.hearth_gemm_argmax_f32 if weight.dtype == torch.float32 else lib.hearth_gemm_argmax_bf16
    if fn(x.data_ptr(), weight.packed.data_ptr(), b, y.data_ptr(), m, weight.out_features, k,
          torch.get_num_threads()):
        raise MemoryError("gemm_argmax: no memory for the rows' running maxima")
    return y


def gemm_silu_kernel(weight: GemvWeight) -> ctypes._CFuncPtr | None:
    """The GEMM's entry point computing silu(gate) * up straight from a fused [gate; up] weight (same arguments
    as `gemm_kernel`'s, with n the intermediate size), where the build has one for the weight and each half is a
    whole number of the GEMM's blocks."""
    lib = _gemm_library()
    if gemm_kernel(weight) is None or lib is None or weight.out_features % 2:
        return None
    if (weight.out_features // 2) % int(lib.hearth_gemm_block_width()):
        return None
    return lib.hearth_gemm_silu_f32 if weight.dtype == torch.float32 else lib.hearth_gemm_silu_bf16


def gemm_silu(x: torch.Tensor, weight: GemvWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up [m, n / 2] for x [m, k] and a fused gate/up weight [n, k] (gate first) that
    `gemm_silu_kernel` takes: cpu_fused.silu_mul(gemm(x, weight, bias)) bit for bit, without writing the n
    products and reading them back."""
    fn = gemm_silu_kernel(weight)
    assert fn is not None
    m, k = x.shape
    inter = weight.out_features // 2
    x = x.contiguous()
    y = torch.empty(m, inter, dtype=weight.dtype)
    b = bias.contiguous().data_ptr() if bias is not None else None
    args = (x.data_ptr(), weight.packed.data_ptr(), b, y.data_ptr(), m, inter, k, torch.get_num_threads())
    fn(*args) if weight.dtype == torch.float32 else fn(*args, None)
    return y


@functools.cache
def amx_bf16() -> bool:
    """Whether this CPU multiplies bf16 on AMX tiles (Intel Sapphire Rapids and later)."""
    return cpu_build.cpu_has("amx_bf16", "amx_tile")


def gemm_amx() -> bool:
    """Whether the GEMM's bf16 products run on AMX tiles (csrc/gemm_amx.h): a CPU and build with them
    (HEARTH_CPU_AMX=off builds without) and a process Linux lets use them; then for k a multiple of 32."""
    lib = _gemm_library()
    return lib is not None and bool(lib.hearth_gemm_amx())


def gemm_supports(weight: GemvWeight) -> bool:
    """Whether products of many rows with this weight go to `gemm` rather than to oneDNN: wherever it has an
    entry point for the weight (ahead of oneDNN's packed products in both dtypes where measured:
    docs/benchmarks.md), except bf16 on a CPU with AMX tiles that the GEMM does not use (a build with
    HEARTH_CPU_AMX=off), where oneDNN's products run on the tiles and outrun its AVX-512 dot products
    severalfold. HEARTH_CPU_GEMM=off never uses it, =on uses it there too (to compare)."""
    mode = os.environ.get("HEARTH_CPU_GEMM", "auto")
    if mode == "off" or gemm_kernel(weight) is None:
        return False
    return mode == "on" or not (weight.dtype == torch.bfloat16 and amx_bf16() and not gemm_amx())


def gemm(x: torch.Tensor, weight: GemvWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, k] @ weight^T (+ bias [n]) for any m (made for many rows: `gemv` is faster at one or two), on a
    weight `gemm_kernel` has an entry point for; x and bias in the weight's dtype, which the result has too."""
    fn = gemm_kernel(weight)
    assert fn is not None
    m, k = x.shape
    x = x.contiguous()
    y = torch.empty(m, weight.out_features, dtype=weight.dtype)
    b = bias.contiguous().data_ptr() if bias is not None else None
    args = (x.data_ptr(), weight.packed.data_ptr(), b, y.data_ptr(), m, weight.out_features, k,
            torch.get_num_threads())
    fn(*args) if weight.dtype == torch.float32 else fn(*args, None)
    return y


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)
