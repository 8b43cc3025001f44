"""Triton kernels for KV compression; references in kernels.kv_compress.

- decode_received_attention: the attention each cached entry receives from one decode query per sequence,
  summed over the query heads sharing its kv-head. Two launches, split as the decode kernel is
  (kernels.triton_paged_attention): the first cuts each (sequence, kv-head) into stretches and finds each query
  head's softmax maximum and normaliser over its stretch; the second is one program per 64-entry tile, which merges
  those few partial statistics, scores its tile again and writes the normalised probabilities, summed over the
  group, to the entries' slots in the output. One program per (sequence, kv-head) walking its blocks one at a time
  twice, as this was first written, reached 1-3% of an H200's copy bandwidth (docs/benchmarks.md).
- move_entries: the cache move after eviction, as two launches (gather into a scratch buffer, then scatter),
  because a head's kept entries move down into its own blocks and a single in-place pass would race.
"""

from __future__ import annotations

import torch

from kernels.triton_paged_attention import NEG_INF, TILE_ENTRIES, decode_splits, triton

if triton is not None:
    import triton.language as tl

    from kernels.triton_paged_attention import load_group, tile_scores

    @triton.jit
    def _received_stats_kernel(
        q_ptr, k_ptr, pos_ptr, table_ptr, lens_ptr, qpos_ptr, part_ptr,
        stride_qb, stride_qh, stride_tb, stride_th, stride_lb,
        scale, softcap, window, tiles_per_split,
        GROUPS: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr,
        EXACT: tl.constexpr,
    ):
        """One program per (sequence, kv-head, split): each query head's softmax maximum and normaliser over one
        stretch of the head's entries, into part [B, Hkv, splits, BLOCK_G, 2]."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        split = tl.program_id(2)
        g = tl.arange(0, BLOCK_G)
        q = load_group(q_ptr, b, h, stride_qb, stride_qh, GROUPS, BLOCK_G, HEAD_DIM, BLOCK_D)
        kv_len = tl.load(lens_ptr + b * stride_lb + h)
        q_pos = tl.load(qpos_ptr + b)
        row_ptr = table_ptr + b * stride_tb + h * stride_th
        best = tl.full([BLOCK_G], NEG_INF, tl.float32)
        total = tl.zeros([BLOCK_G], tl.float32)
        first = split * tiles_per_split
        last = tl.minimum(first + tiles_per_split, tl.cdiv(kv_len, TILE))
        for t in range(first, last):
            scores, _, _ = tile_scores(q, k_ptr, pos_ptr, row_ptr, t, kv_len, q_pos, scale, softcap, window,
                                       HEAD_DIM, BLOCK_D, BLOCK_SIZE, TILE, USE_SOFTCAP, USE_WINDOW, EXACT)
            new_best = tl.maximum(best, tl.max(scores, axis=1))
            safe = tl.where(new_best == NEG_INF, 0.0, new_best)  # nothing visible yet: no NaN from -inf - -inf
            total = total * tl.exp(best - safe) + tl.sum(tl.exp(scores - safe[:, None]), axis=1)
            best = new_best
        base = part_ptr + ((b * tl.num_programs(1) + h) * tl.num_programs(2) + split) * (BLOCK_G * 2)
        tl.store(base + g * 2, best)
        tl.store(base + g * 2 + 1, total)

    @triton.jit
    def _received_write_kernel(
        q_ptr, k_ptr, pos_ptr, table_ptr, lens_ptr, qpos_ptr, part_ptr, out_ptr,
        stride_qb, stride_qh, stride_tb, stride_th, stride_lb, stride_ob, stride_oh,
        scale, softcap, window, num_splits,
        GROUPS: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr,
        EXACT: tl.constexpr,
    ):
        """One program per (sequence, kv-head, tile): the splits' statistics merged, then the tile's normalised
        probabilities summed over the group, at the entries' indices in the head's table. Tiles past the head's
        length do nothing (the output starts zeroed)."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        t = tl.program_id(2)
        kv_len = tl.load(lens_ptr + b * stride_lb + h)
        if t * TILE < kv_len:
            g = tl.arange(0, BLOCK_G)
            base = part_ptr + (b * tl.num_programs(1) + h) * num_splits * (BLOCK_G * 2)
            best = tl.full([BLOCK_G], NEG_INF, tl.float32)
            total = tl.zeros([BLOCK_G], tl.float32)
            for split in range(0, num_splits):
                m = tl.load(base + split * (BLOCK_G * 2) + g * 2)
                new_best = tl.maximum(best, m)
                safe = tl.where(new_best == NEG_INF, 0.0, new_best)
                total = total * tl.exp(best - safe) + tl.load(base + split * (BLOCK_G * 2) + g * 2 + 1) * tl.exp(
                    m - safe)
                best = new_best
            q = load_group(q_ptr, b, h, stride_qb, stride_qh, GROUPS, BLOCK_G, HEAD_DIM, BLOCK_D)
            q_pos = tl.load(qpos_ptr + b)
            row_ptr = table_ptr + b * stride_tb + h * stride_th
            scores, _, live = tile_scores(q, k_ptr, pos_ptr, row_ptr, t, kv_len, q_pos, scale, softcap, window,
                                          HEAD_DIM, BLOCK_D, BLOCK_SIZE, TILE, USE_SOFTCAP, USE_WINDOW, EXACT)
            safe = tl.where(best == NEG_INF, 0.0, best)
            inv = tl.where(total > 0, 1.0 / total, 0.0)
            p = tl.where((g < GROUPS)[:, None], tl.exp(scores - safe[:, None]) * inv[:, None], 0.0)
            index = t * TILE + tl.arange(0, TILE)
            tl.store(out_ptr + b * stride_ob + h * stride_oh + index, tl.sum(p, axis=0), mask=live)

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
    num_kv_heads, block_size = block_tables.shape[1], k_cache.shape[1]
    width = block_tables.shape[2] * block_size
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads do not group over {num_kv_heads} kv heads")
    groups = num_q_heads // num_kv_heads
    q = q.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = kv_lens.to(torch.int32).contiguous()
    k, pos, q_pos = k_cache.contiguous(), pos_cache.to(torch.int32).contiguous(), q_positions.to(torch.int32).contiguous()
    tile = max(TILE_ENTRIES, block_size)
    splits, per_split = decode_splits(batch, num_kv_heads, width, tile)
    # tl.dot wants at least 16 rows: a group's query heads are padded up to that.
    block_g, block_d = max(16, triton.next_power_of_2(groups)), max(16, triton.next_power_of_2(head_dim))
    part = torch.empty((batch, num_kv_heads, splits, block_g, 2), dtype=torch.float32, device=q.device)
    out = torch.zeros(batch, num_kv_heads, width, dtype=torch.float32, device=q.device)
    shape = dict(GROUPS=groups, BLOCK_G=block_g, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size,
                 TILE=tile, USE_SOFTCAP=softcap is not None, USE_WINDOW=sliding_window is not None,
                 EXACT=q.dtype == torch.float32)
    common = (q.stride(0), q.stride(1), tables.stride(0), tables.stride(1), lens.stride(0))
    limits = (float(scale), float(softcap or 1.0), int(sliding_window or 0))
    _received_stats_kernel[(batch, num_kv_heads, splits)](q, k, pos, tables, lens, q_pos, part, *common, *limits,
                                                          per_split, **shape)
    _received_write_kernel[(batch, num_kv_heads, -(-width // tile))](
        q, k, pos, tables, lens, q_pos, part, out, *common, out.stride(0), out.stride(1), *limits, splits, **shape)
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
