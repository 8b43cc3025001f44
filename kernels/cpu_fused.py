"""Rotary embedding + KV-cache write, and SiLU(gate) * up, each in one call on CPU in fp32 or bf16
(csrc/fused.c); `rope_write_kv_ref` and `silu_mul_ref` are the torch references, the decoder's own ops.

The kernels round as the torch ops do, so they give the references' results (SiLU's exp to a few ulp). Built by
kernels/cpu_build; where they cannot be (or with HEARTH_CPU_KERNELS=off), `supports` is False and the decoder
keeps its torch ops.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kernels import paged_attention as pa

DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def _library() -> ctypes.CDLL | None:
    from kernels import cpu_build

    lib = cpu_build.load("fused")
    if lib is not None:
        for fn in (lib.hearth_rope_write_kv_f32, lib.hearth_rope_write_kv_bf16):
            fn.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 7
                           + [ctypes.c_int64] * 5)
            fn.restype = None
        for fn in (lib.hearth_silu_mul_f32, lib.hearth_silu_mul_bf16):
            fn.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3
            fn.restype = None
    return lib


def supports(x: torch.Tensor) -> bool:
    """Whether tensors like x (a layer's activations) take the fused kernels."""
    return x.device.type == "cpu" and x.dtype in DTYPES and _library() is not None


def _rows_ok(t: torch.Tensor) -> bool:
    """[T, H, D] with contiguous heads and channels (rows may be strided: views into the fused qkv output)."""
    return t.stride(-1) == 1 and t.stride(-2) == t.shape[-1]


def rope_write_kv(qk: torch.Tensor, v: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
                  positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  pos_cache: torch.Tensor, num_q_heads: int) -> bool:
    """Rotate qk [T, Hq + Hkv, D] in place by the table rows at positions [T] (tables [max_pos, D], rotating all
    D channels), then store its keys and v [T, Hkv, D] at slots [Hkv, T] of the caches, as `rope_write_kv_ref`.
    Returns False, having done nothing, where the shapes do not fit the kernel (the caller then runs the ref)."""
    lib = _library()
    tokens, heads, dim = qk.shape
    if (lib is None or not _rows_ok(qk) or not _rows_ok(v) or cos_table.shape[-1] != dim or dim % 2
            or not (qk.dtype == v.dtype == cos_table.dtype == k_cache.dtype) or qk.dtype not in DTYPES
            or not (cos_table.is_contiguous() and sin_table.is_contiguous() and k_cache.is_contiguous()
                    and v_cache.is_contiguous() and pos_cache.dtype == torch.int32 and pos_cache.is_contiguous())):
        return False
    positions = positions.to(torch.int64).contiguous()
    slots = slots.to(torch.int64).contiguous()
    kernel = lib.hearth_rope_write_kv_f32 if qk.dtype == torch.float32 else lib.hearth_rope_write_kv_bf16
    kernel(qk.data_ptr(), qk.stride(0), v.data_ptr(), v.stride(0), cos_table.data_ptr(), sin_table.data_ptr(),
           positions.data_ptr(), slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), pos_cache.data_ptr(),
           tokens, num_q_heads, heads - num_q_heads, dim, torch.get_num_threads())
    return True


def rope_write_kv_ref(qk: torch.Tensor, v: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
                      positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      pos_cache: torch.Tensor, num_q_heads: int) -> None:
    cos, sin = cos_table[positions].unsqueeze(1), sin_table[positions].unsqueeze(1)
    half = qk.shape[-1] // 2
    qk.copy_(qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin)
    pa.write_kv(k_cache, v_cache, pos_cache, slots, qk[:, num_q_heads:], v, positions)


def silu_mul_fits(intermediate: int) -> bool:
    """Whether the kernel takes an MLP this wide (eight lanes at a time)."""
    return intermediate % 8 == 0


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (contiguous, gate first, `silu_mul_fits(I)`) -> silu(gate) * up [T, I]."""
    lib = _library()
    assert lib is not None and gate_up.is_contiguous() and gate_up.dtype in DTYPES
    assert silu_mul_fits(gate_up.shape[1] // 2)
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(rows, inter)
    kernel = lib.hearth_silu_mul_f32 if gate_up.dtype == torch.float32 else lib.hearth_silu_mul_bf16
    kernel(gate_up.data_ptr(), out.data_ptr(), rows, inter, torch.get_num_threads())
    return out


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
