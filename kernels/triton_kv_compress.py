"""Triton kernels for KV compression; references in kernels.kv_compress.

- decode_received_attention: the attention each cached entry receives from one decode query per sequence,
  summed over the query heads sharing its kv-head. One program per (sequence, kv-head) makes two passes over
  the head's blocks: the first finds each query head's softmax maximum and normaliser, the second writes the
  normalised probabilities, summed over the group, to the entry's slot in the output.
- move_entries: the cache move after eviction, as two launches (gather into a scratch buffer, then scatter),
  because a head's kept entries move down into its own blocks and a single in-place pass would race.
"""

from __future__ import annotations

import torch

from kernels.triton_paged_attention import NEG_INF, triton

if triton is not None:
    import triton.language as tl

    from kernels.triton_paged_attention import block_scores, load_group

    @triton.jit
    def _received_kernel(
        q_ptr, k_ptr, pos_ptr, table_ptr, lens_ptr, qpos_ptr, out_ptr,
        stride_qb, stride_qh, stride_tb, stride_th, stride_lb, stride_ob, stride_oh,
        scale, softcap, window,
        GROUPS: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        g_ok = tl.arange(0, BLOCK_G) < GROUPS
        q = load_group(q_ptr, b, h, stride_qb, stride_qh, GROUPS, BLOCK_G, HEAD_DIM, BLOCK_D)
        kv_len = tl.load(lens_ptr + b * stride_lb + h)
        q_pos = tl.load(qpos_ptr + b)
        row_ptr = table_ptr + b * stride_tb + h * stride_th
        num_blocks = tl.cdiv(kv_len, BLOCK_SIZE)

        best = tl.full([BLOCK_G], NEG_INF, tl.float32)
        total = tl.zeros([BLOCK_G], tl.float32)
        for i in range(0, num_blocks):  # pass 1: softmax statistics per query head
            scores, _, _ = block_scores(q, k_ptr, pos_ptr, row_ptr, i, kv_len, q_pos, scale, softcap, window,
                                        HEAD_DIM, BLOCK_D, BLOCK_SIZE, USE_SOFTCAP, USE_WINDOW)
            new_best = tl.maximum(best, tl.max(scores, axis=1))
            safe = tl.where(new_best == NEG_INF, 0.0, new_best)
            total = total * tl.exp(best - safe) + tl.sum(tl.exp(scores - safe[:, None]), axis=1)
            best = new_best

        safe = tl.where(best == NEG_INF, 0.0, best)
        inv = tl.where(total > 0, 1.0 / total, 0.0)
        for i in range(0, num_blocks):  # pass 2: normalised probabilities, summed over the group
            scores, _, index = block_scores(q, k_ptr, pos_ptr, row_ptr, i, kv_len, q_pos, scale, softcap, window,
                                            HEAD_DIM, BLOCK_D, BLOCK_SIZE, USE_SOFTCAP, USE_WINDOW)
            p = tl.where(g_ok[:, None], tl.exp(scores - safe[:, None]) * inv[:, None], 0.0)
            tl.store(out_ptr + b * stride_ob + h * stride_oh + index, tl.sum(p, axis=0))

    @triton.jit
    def _gather_kernel(src_ptr, cache_ptr, scratch_ptr, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr):
        i = tl.program_id(0)
        w = tl.arange(0, BLOCK_W)
        slot = tl.load(src_ptr + i).to(tl.int64)
        row = tl.load(cache_ptr + slot * WIDTH + w, mask=w < WIDTH)
        tl.store(scratch_ptr + i * WIDTH + w, row, mask=w < WIDTH)

    @triton.jit
    def _scatter_kernel(dst_ptr, scratch_ptr, cache_ptr, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr):
        i = tl.program_id(0)
        w = tl.arange(0, BLOCK_W)
        slot = tl.load(dst_ptr + i).to(tl.int64)
        row = tl.load(scratch_ptr + i * WIDTH + w, mask=w < WIDTH)
        tl.store(cache_ptr + slot * WIDTH + w, row, mask=w < WIDTH)


def decode_received_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    pos_cache: torch.Tensor,
    block_tables: torch.Tensor,
    kv_lens: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [B, Hq, D]; block_tables [B, Hkv, nb]; kv_lens [B, Hkv]; q_positions [B] -> [B, Hkv, nb * block_size] fp32,
    the same as decode_received_attention_ref with decode_mask (zero past each head's length)."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, width = block_tables.shape[1], block_tables.shape[2] * k_cache.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads do not group over {num_kv_heads} kv heads")
    groups = num_q_heads // num_kv_heads
    q = q.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = kv_lens.to(torch.int32).contiguous()
    out = torch.zeros(batch, num_kv_heads, width, dtype=torch.float32, device=q.device)
    _received_kernel[(batch, num_kv_heads)](
        q, k_cache.contiguous(), pos_cache.to(torch.int32).contiguous(), tables, lens,
        q_positions.to(torch.int32).contiguous(), out,
        q.stride(0), q.stride(1), tables.stride(0), tables.stride(1), lens.stride(0), out.stride(0), out.stride(1),
        float(scale), float(softcap or 1.0), int(sliding_window or 0),
        GROUPS=groups, BLOCK_G=max(2, triton.next_power_of_2(groups)), HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=k_cache.shape[1],
        USE_SOFTCAP=softcap is not None, USE_WINDOW=sliding_window is not None,
    )
    return out


def move_entries(k_cache: torch.Tensor, v_cache: torch.Tensor, pos_cache: torch.Tensor, src: torch.Tensor,
                 dst: torch.Tensor) -> None:
    """Entry src[i] -> dst[i] (flat slot ids) in all three caches, as move_entries_ref."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    count = int(src.numel())
    if count == 0:
        return
    src = src.to(torch.int64).contiguous()
    dst = dst.to(torch.int64).contiguous()
    for cache in (k_cache, v_cache, pos_cache):
        width = cache.shape[-1] if cache.dim() == 3 else 1
        flat = cache.view(-1)
        scratch = torch.empty(count * width, dtype=cache.dtype, device=cache.device)
        block = max(16, triton.next_power_of_2(width))
        _gather_kernel[(count,)](src, flat, scratch, WIDTH=width, BLOCK_W=block)
        _scatter_kernel[(count,)](dst, scratch, flat, WIDTH=width, BLOCK_W=block)
