"""Decode attention over the paged KV pool on CPU in fp32 or bf16, reading blocks in place (csrc/paged_decode.c).

The same contract as `triton_paged_attention.paged_decode_attention`, and the same reference:
`paged_attention.paged_decode_attention_ref` with `decode_mask`. Built by kernels/cpu_build; `supports` says
whether a call can take this path (fp32 or bf16 on CPU, head_dim a multiple of 8, the kernel's stack bounds).
bf16 pools are widened to fp32 as they are read and the output rounded once at the end, so bf16 results are
at least as close to an fp32 computation as the reference's.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from kernels import cpu_build

MAX_BLOCK = 64  # the kernel's per-block score buffer
MAX_GROUPS = 64  # query heads per kv head
MAX_GROUP_DIM = 4096  # query heads per kv head x head_dim its accumulators hold
DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = cpu_build.load("paged_decode")
    if lib is not None:
        for fn in (lib.hearth_paged_decode_f32, lib.hearth_paged_decode_bf16):
            fn.argtypes = ([ctypes.c_void_p] * 8 + [ctypes.c_int64] * 6
                           + [ctypes.c_float, ctypes.c_int64, ctypes.c_float, ctypes.c_int64])
            fn.restype = None
    return lib


def available() -> bool:
    return os.environ.get("HEARTH_CPU_ATTENTION", "auto") != "off" and _library() is not None


def supports(q: torch.Tensor, k_cache: torch.Tensor, num_kv_heads: int) -> bool:
    num_q_heads, head_dim = q.shape[-2:]
    return (q.device.type == "cpu" and q.dtype == k_cache.dtype and q.dtype in DTYPES and head_dim % 8 == 0
            and k_cache.shape[1] <= MAX_BLOCK and num_q_heads // num_kv_heads <= MAX_GROUPS
            and num_q_heads // num_kv_heads * head_dim <= MAX_GROUP_DIM and available())


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos_cache: torch.Tensor,
                           block_tables: torch.Tensor, kv_lens: torch.Tensor, q_positions: torch.Tensor,
                           scale: float, sliding_window: int | None = None,
                           softcap: float | None = None) -> torch.Tensor:
    """q [B, Hq, D]; caches [N, block_size, D] and [N, block_size] int32; block_tables [B, Hkv, nb];
    kv_lens [B, Hkv]; q_positions [B] -> [B, Hq, D]."""
    lib = _library()
    assert lib is not None
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, width = block_tables.shape[1], block_tables.shape[2]
    q = q.contiguous()
    tables = block_tables.to(torch.int64).contiguous()
    lens = kv_lens.to(torch.int32).contiguous()
    positions = q_positions.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    kernel = lib.hearth_paged_decode_f32 if q.dtype == torch.float32 else lib.hearth_paged_decode_bf16
    kernel(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), pos_cache.data_ptr(), tables.data_ptr(),
           lens.data_ptr(), positions.data_ptr(), out.data_ptr(), batch, num_q_heads, num_kv_heads, head_dim,
           k_cache.shape[1], width, scale, sliding_window or 0, softcap or 0.0, torch.get_num_threads())
    return out
