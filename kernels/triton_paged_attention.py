"""Triton paged attention over per-(layer, kv-head) block tables; reference: kernels.paged_attention.

One program per (sequence, kv-head) handles all the query heads of its group (GQA): the head's keys and values
are read once, whatever the group size. It walks the head's own block table up to the head's own length, so
heads that kept different numbers of entries (KV compression) cost what they hold. Visibility comes from the
stored positions (causal and sliding window), as in the reference. Softmax is online, in fp32.

On CPU this runs only under TRITON_INTERPRET=1 (tests); there the interpreter computes bf16 arithmetic wrongly,
so every load is widened to fp32 before use.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install has no Triton; the engine uses the torch reference there
    triton = None
    tl = None

# Compiled Triton reads module globals only when they are constexpr (the interpreter reads any, so tests on CPU
# cannot tell; tests/kernels/test_triton_globals.py checks every kernel's globals instead).
NEG_INF = tl.constexpr(float("-inf")) if tl is not None else float("-inf")


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def block_scores(q, k_ptr, pos_ptr, row_ptr, i, kv_len, q_pos, scale, softcap, window,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr):
        """Scores [G, S] of the group's queries q [G, D] against block i of a head's table (row_ptr), -inf where
        an entry is past the head's length or not visible from q_pos; also the entries' slots and indices."""
        s = tl.arange(0, BLOCK_SIZE)
        d = tl.arange(0, BLOCK_D)
        block = tl.load(row_ptr + i).to(tl.int64)
        index = i * BLOCK_SIZE + s
        entry = block * BLOCK_SIZE + s
        key_pos = tl.load(pos_ptr + entry)
        ok = (index < kv_len) & (key_pos <= q_pos)
        if USE_WINDOW:
            ok = ok & (key_pos > q_pos - window)
        k = tl.load(k_ptr + entry[:, None] * HEAD_DIM + d[None, :], mask=(d < HEAD_DIM)[None, :], other=0.0)
        scores = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2) * scale
        if USE_SOFTCAP:
            # tanh(x) = 2 sigmoid(2x) - 1: portable across Triton backends and the interpreter
            scores = softcap * (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0)
        return tl.where(ok[None, :], scores, NEG_INF), entry, index

    @triton.jit
    def load_group(q_ptr, b, h, stride_qb, stride_qh, GROUPS: tl.constexpr, BLOCK_G: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
        """The query rows [G, D] (fp32) of the query heads that share kv-head h, for sequence b."""
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        rows = q_ptr + b * stride_qb + (h * GROUPS + g)[:, None] * stride_qh + d[None, :]
        return tl.load(rows, mask=(g < GROUPS)[:, None] & (d < HEAD_DIM)[None, :], other=0.0).to(tl.float32)

    @triton.jit
    def _decode_kernel(
        q_ptr, k_ptr, v_ptr, pos_ptr, table_ptr, lens_ptr, qpos_ptr, out_ptr,
        stride_qb, stride_qh, stride_tb, stride_th, stride_lb, stride_ob, stride_oh,
        scale, softcap, window,
        GROUPS: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        g_ok = g < GROUPS
        d_ok = d < HEAD_DIM
        q = load_group(q_ptr, b, h, stride_qb, stride_qh, GROUPS, BLOCK_G, HEAD_DIM, BLOCK_D)
        kv_len = tl.load(lens_ptr + b * stride_lb + h)
        q_pos = tl.load(qpos_ptr + b)
        row_ptr = table_ptr + b * stride_tb + h * stride_th

        best = tl.full([BLOCK_G], NEG_INF, tl.float32)
        total = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for i in range(0, tl.cdiv(kv_len, BLOCK_SIZE)):
            scores, entry, _ = block_scores(q, k_ptr, pos_ptr, row_ptr, i, kv_len, q_pos, scale, softcap, window,
                                            HEAD_DIM, BLOCK_D, BLOCK_SIZE, USE_SOFTCAP, USE_WINDOW)
            v = tl.load(v_ptr + entry[:, None] * HEAD_DIM + d[None, :], mask=d_ok[None, :], other=0.0)
            new_best = tl.maximum(best, tl.max(scores, axis=1))
            # A row that has seen nothing visible yet keeps -inf; subtracting it must not produce NaN.
            safe = tl.where(new_best == NEG_INF, 0.0, new_best)
            p = tl.exp(scores - safe[:, None])
            rescale = tl.exp(best - safe)
            total = total * rescale + tl.sum(p, axis=1)
            acc = acc * rescale[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
            best = new_best
        out = acc / tl.where(total > 0, total, 1.0)[:, None]
        o_rows = out_ptr + b * stride_ob + (h * GROUPS + g)[:, None] * stride_oh + d[None, :]
        tl.store(o_rows, out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos_cache: torch.Tensor,
    block_tables: torch.Tensor,
    kv_lens: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [B, Hq, D]; caches [N, block_size, D] and [N, block_size]; block_tables [B, Hkv, nb]; kv_lens [B, Hkv];
    q_positions [B] -> [B, Hq, D], the same as paged_decode_attention_ref with decode_mask."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = block_tables.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads do not group over {num_kv_heads} kv heads")
    groups = num_q_heads // num_kv_heads
    q = q.contiguous()
    # Broadcast (stride-0) tables and lengths stay broadcast: the kernel reads them through their strides.
    tables = block_tables if block_tables.dtype == torch.int32 else block_tables.to(torch.int32)
    lens = kv_lens if kv_lens.dtype == torch.int32 else kv_lens.to(torch.int32)
    if tables.stride(-1) != 1:
        tables = tables.contiguous()
    if lens.shape != tables.shape[:2]:
        raise ValueError(f"kv_lens {tuple(lens.shape)} must be [B, Hkv] = {tuple(tables.shape[:2])}")
    out = torch.empty_like(q)
    _decode_kernel[(batch, num_kv_heads)](
        q, k_cache.contiguous(), v_cache.contiguous(), pos_cache.to(torch.int32).contiguous(), tables, lens,
        q_positions.to(torch.int32).contiguous(), out,
        q.stride(0), q.stride(1), tables.stride(0), tables.stride(1), lens.stride(0), out.stride(0), out.stride(1),
        float(scale), float(softcap or 1.0), int(sliding_window or 0),
        GROUPS=groups, BLOCK_G=max(2, triton.next_power_of_2(groups)), HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=k_cache.shape[1],
        USE_SOFTCAP=softcap is not None, USE_WINDOW=sliding_window is not None,
    )
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_lens: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Several queries of ONE sequence over its cached entries (a prompt chunk after a prefix hit, or tokens to
    verify): q [Tq, Hq, D]; block_table [Hkv, nb]; kv_lens [Hkv]; q_positions [Tq] -> [Tq, Hq, D], the same as
    paged_prefill_attention_ref.

    Each query is one program row over the sequence's table (broadcast, never copied): causality and windows
    come from stored positions, exactly as for decode. Every query re-reads the head's entries, so this is
    for chunks and extends; a fresh long prompt wants a tiled kernel.
    """
    num_tokens = q.shape[0]
    tables = block_table.unsqueeze(0).expand(num_tokens, *block_table.shape)
    lens = kv_lens.unsqueeze(0).expand(num_tokens, *kv_lens.shape)
    return paged_decode_attention(q, k_cache, v_cache, pos_cache, tables, lens, q_positions, scale,
                                  sliding_window, softcap)
