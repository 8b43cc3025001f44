"""Attention on CPU in fp32 or bf16: decode over the paged KV pool, reading blocks in place (csrc/paged_decode.c),
and causal attention of a prompt (csrc/causal_attention.c): a fresh one, or the next chunk of one whose start
is cached.

Decode has the same contract as `triton_paged_attention.paged_decode_attention`, and the same reference:
`paged_attention.paged_decode_attention_ref` with `decode_mask`; the prompt kernel stands in for
`paged_attention.causal_attention_ref` without a sliding window or softcap. Built by kernels/cpu_build;
`supports` and `supports_causal` say whether a call can take these paths (fp32 or bf16 on CPU, head_dim a
multiple of the vector width, the kernels' stack bounds). All sums are fp32 and bf16 outputs are rounded once at
the end, so bf16 results are at least as close to an fp32 computation as the references'. Where the CPU multiplies
bf16 pairs (AMX tiles, or AVX-512 BF16 dot products) bf16 prompts do (`causal_pairs`), and bf16 decode weighs its
values that way (`decode_pairs`), their probabilities rounded to bf16 as in torch's bf16 attention: as close as
that reference, no closer. The chunk after a
cached start stands in for `paged_attention.paged_prefill_attention_ref` where nothing was evicted from the
sequence's blocks (entry t holds position t), also without a sliding window or softcap.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading

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
                           + [ctypes.c_float, ctypes.c_int64, ctypes.c_float, ctypes.c_int64, ctypes.c_void_p])
            fn.restype = None
        lib.hearth_paged_decode_pairs.argtypes = [ctypes.c_int64]
        lib.hearth_paged_decode_pairs.restype = ctypes.c_int64
    return lib


def available() -> bool:
    return os.environ.get("HEARTH_CPU_ATTENTION", "auto") != "off" and _library() is not None


def decode_pairs(head_dim: int) -> bool:
    """Whether decode over bf16 pools of this head_dim weighs the values by AVX-512 BF16 dot products
    (csrc/paged_decode_tiles.h's values_dot): the probabilities rounded to bf16 first, as torch's bf16 attention
    rounds them, so as close to an fp32 computation as that reference, no closer."""
    lib = _library()
    return lib is not None and bool(lib.hearth_paged_decode_pairs(head_dim))


def supports(q: torch.Tensor, k_cache: torch.Tensor, num_kv_heads: int) -> bool:
    num_q_heads, head_dim = q.shape[-2:]
    return (q.device.type == "cpu" and q.dtype == k_cache.dtype and q.dtype in DTYPES and head_dim % 8 == 0
            and k_cache.shape[1] <= MAX_BLOCK and num_q_heads // num_kv_heads <= MAX_GROUPS
            and num_q_heads // num_kv_heads * head_dim <= MAX_GROUP_DIM and available())


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos_cache: torch.Tensor,
                           block_tables: torch.Tensor, kv_lens: torch.Tensor, q_positions: torch.Tensor,
                           scale: float, sliding_window: int | None = None,
                           softcap: float | None = None, received: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, D]; caches [N, block_size, D] and [N, block_size] int32; block_tables [B, Hkv, nb];
    kv_lens [B, Hkv]; q_positions [B] -> [B, Hq, D].

    received: None, or fp32 [B, Hkv, nb * block_size] to fill, from the same pass, with the attention each entry
    received (its probabilities summed over the kv head's query heads, 0 where no query saw it): what
    `kv_compress.paged_decode_attention_received_ref` returns beside the output, for sequences being compressed."""
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    _decode(q, k_cache, v_cache, pos_cache, block_tables, kv_lens, q_positions, scale, sliding_window, softcap,
            out, received)
    return out


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos_cache: torch.Tensor,
            block_tables: torch.Tensor, kv_lens: torch.Tensor, q_positions: torch.Tensor, scale: float,
            sliding_window: int | None, softcap: float | None, out: torch.Tensor | None,
            received: torch.Tensor | None) -> None:
    """The kernel's call: out (contiguous, q's shape) and received as `paged_decode_attention` fills them; out
    None (with received) for the received scores alone, the values left unread."""
    lib = _library()
    assert lib is not None and (out is not None or received is not None)
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, width = block_tables.shape[1], block_tables.shape[2]
    q = q.contiguous()
    tables = block_tables.to(torch.int64).contiguous()
    lens = kv_lens.to(torch.int32).contiguous()
    positions = q_positions.to(torch.int64).contiguous()
    if received is not None:
        assert received.dtype == torch.float32 and received.is_contiguous() and received.shape == (
            batch, num_kv_heads, width * k_cache.shape[1])
    kernel = lib.hearth_paged_decode_f32 if q.dtype == torch.float32 else lib.hearth_paged_decode_bf16
    kernel(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), pos_cache.data_ptr(), tables.data_ptr(),
           lens.data_ptr(), positions.data_ptr(), out.data_ptr() if out is not None else None, batch, num_q_heads,
           num_kv_heads, head_dim, k_cache.shape[1], width, scale, sliding_window or 0, softcap or 0.0,
           torch.get_num_threads(), received.data_ptr() if received is not None else None)


def prefill_received_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               pos_cache: torch.Tensor, block_table: torch.Tensor, kv_lens: torch.Tensor,
                               q_positions: torch.Tensor, scale: float, sliding_window: int | None = None,
                               softcap: float | None = None) -> torch.Tensor:
    """The attention each entry of ONE sequence received from several of its queries (a prompt's last ones, for
    KV compression): `kv_compress.prefill_received_attention_ref`'s result. q [Tq, Hq, D]; block_table [Hkv, nb];
    kv_lens [Hkv] -> [Hkv, nb * block_size] fp32. Each query is a decode of the decode kernel over the same
    blocks, masked by its own position, and their received scores are summed (no outputs: the values unread)."""
    tokens, width = q.shape[0], block_table.shape[-1]
    received = torch.empty(tokens, block_table.shape[0], width * k_cache.shape[1], dtype=torch.float32)
    _decode(q, k_cache, v_cache, pos_cache, block_table.expand(tokens, -1, -1), kv_lens.expand(tokens, -1),
            q_positions, scale, sliding_window, softcap, None, received)
    return received.sum(dim=0)


@functools.cache
def _causal_library() -> ctypes.CDLL | None:
    lib = cpu_build.load("causal_attention")
    if lib is not None:
        lib.hearth_causal_attention.argtypes = ([ctypes.c_void_p] * 4 + [ctypes.c_int64] * 7
                                                + [ctypes.c_float, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64])
        lib.hearth_prefill_attention.argtypes = ([ctypes.c_void_p] * 5 + [ctypes.c_int64] * 8
                                                 + [ctypes.c_float, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64])
        lib.hearth_causal_attention.restype = lib.hearth_prefill_attention.restype = None
        lib.hearth_causal_attention_tile.argtypes, lib.hearth_causal_attention_tile.restype = [], ctypes.c_int64
        lib.hearth_causal_attention_pairs.argtypes = [ctypes.c_int64]
        lib.hearth_causal_attention_pairs.restype = ctypes.c_int64
    return lib


MAX_CAUSAL_DIM = 512  # head_dim the prompt kernel's stack buffers hold


def causal_pairs(head_dim: int) -> bool:
    """Whether bf16 prompts of this head_dim multiply bf16 pairs: on AMX tiles (csrc/causal_attention_amx.h) or by
    AVX-512 BF16 dot products (csrc/causal_attention_pairs.h), the probabilities rounded to bf16 for the value
    product, as torch's own bf16 attention rounds them."""
    lib = _causal_library()
    return lib is not None and bool(lib.hearth_causal_attention_pairs(head_dim))


def supports_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether `causal_attention` takes q [T, Hq, D], k and v [T, Hkv, D]."""
    if not (available() and q.device.type == "cpu" and q.dtype in DTYPES and q.dtype == k.dtype == v.dtype):
        return False
    lib = _causal_library()
    head_dim = q.shape[-1]
    return (lib is not None and head_dim % (lib.hearth_causal_attention_tile() // 4) == 0
            and head_dim <= MAX_CAUSAL_DIM and q.shape[1] % k.shape[1] == 0)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] with heads packed in each row (any row stride): views of the fused qkv product pass as they are."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


# The prompt kernel's fp32 work space (widened queries, transposed keys, widened values), kept per thread up to
# this size (16 MB) rather than allocated per call: a few hundred KB allocated per call and layer would be mapped
# and faulted in afresh each time (glibc maps buffers that large on their own). Per thread: engines of several
# models may run prompts at once.
SCRATCH_KEEP_FLOATS = 4 << 20
_scratch = threading.local()


def _scratch_floats(count: int) -> torch.Tensor:
    if count > SCRATCH_KEEP_FLOATS:
        return torch.empty(count, dtype=torch.float32)
    kept = getattr(_scratch, "buffer", None)
    if kept is None or kept.numel() < count:
        kept = _scratch.buffer = torch.empty(max(count, 1 << 16), dtype=torch.float32)
    return kept


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """A fresh prompt's causal self-attention: q [T, Hq, D], k and v [T, Hkv, D] -> [T, Hq, D] in q's dtype,
    written into `out` when given (contiguous, that shape and dtype)."""
    lib = _causal_library()
    assert lib is not None
    tokens, q_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    q, k, v = _rows(q), _rows(k), _rows(v)
    tile = lib.hearth_causal_attention_tile()
    padded = -(-tokens // tile) * tile
    scratch = _scratch_floats(tokens * q_heads * head_dim + 2 * kv_heads * head_dim * padded)
    if out is None:
        out = torch.empty(tokens, q_heads, head_dim, dtype=q.dtype)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    lib.hearth_causal_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), q.stride(0), k.stride(0),
                                v.stride(0), tokens, q_heads, kv_heads, head_dim, scale,
                                int(q.dtype == torch.bfloat16), scratch.data_ptr(), torch.get_num_threads())
    return out


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                      context: int, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """The next T tokens of a prompt after `context` cached ones: q [T, Hq, D] at positions context..context + T - 1,
    whose keys and values are already written to the pool; caches [N, block_size, D]; block_table [Hkv, nb], in
    which entry t of every kv head holds position t for t < context + T (nothing evicted). -> [T, Hq, D] in q's
    dtype, written into `out` when given (contiguous, that shape and dtype). What it takes is what `supports_causal`
    accepts for the chunk's own q, k and v (the caller checks)."""
    lib = _causal_library()
    assert lib is not None
    tokens, q_heads, head_dim = q.shape
    kv_heads = block_table.shape[0]
    q = _rows(q)
    table = block_table.to(torch.int64).contiguous()
    tile = lib.hearth_causal_attention_tile()
    padded = -(-(context + tokens) // tile) * tile
    scratch = _scratch_floats(tokens * q_heads * head_dim + 2 * kv_heads * head_dim * padded)
    if out is None:
        out = torch.empty(tokens, q_heads, head_dim, dtype=q.dtype)
    assert out.shape == q.shape and out.dtype == q.dtype == k_cache.dtype and out.is_contiguous()
    lib.hearth_prefill_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(),
                                 out.data_ptr(), q.stride(0), table.shape[1], k_cache.shape[1], tokens, context,
                                 q_heads, kv_heads, head_dim, scale, int(q.dtype == torch.bfloat16),
                                 scratch.data_ptr(), torch.get_num_threads())
    return out
