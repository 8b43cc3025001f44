"""Triton paged attention over per-(layer, kv-head) block tables; reference: kernels.paged_attention.

A program handles all the query heads of a group (GQA) over one stretch of a kv-head's entries: the head's keys
and values are read once, whatever the group size. It walks the head's own block table up to the head's own
length, 64 entries (several blocks) at a time through the matrix units, so heads that kept different numbers of
entries (KV compression) cost what they hold. Long heads are split over several programs (flash-decoding) and a
second launch merges their partial softmaxes: the first CUDA run (H100) showed one program per (sequence,
kv-head) reaching 1-6% of the card's copy bandwidth. Visibility comes from the stored positions (causal and
sliding window), as in the reference. Softmax is online, in fp32.

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
    def load_group(q_ptr, b, h, stride_qb, stride_qh, GROUPS: tl.constexpr, BLOCK_G: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
        """The query rows [G, D] (fp32) of the query heads that share kv-head h, for sequence b."""
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        rows = q_ptr + b * stride_qb + (h * GROUPS + g)[:, None] * stride_qh + d[None, :]
        return tl.load(rows, mask=(g < GROUPS)[:, None] & (d < HEAD_DIM)[None, :], other=0.0).to(tl.float32)

    @triton.jit
    def tile_scores(q, k_ptr, pos_ptr, row_ptr, t, kv_len, q_pos, scale, softcap, window,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
                    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, EXACT: tl.constexpr):
        """Scores [G, TILE] of the group's queries against tile t of a head's entries (TILE / BLOCK_SIZE blocks
        gathered through its table at once, so a program keeps many loads in flight), -inf where an entry is
        past the head's length or not visible from q_pos; also the entries' slots and which exist."""
        index = t * TILE + tl.arange(0, TILE)
        d = tl.arange(0, BLOCK_D)
        live = index < kv_len
        block = tl.load(row_ptr + index // BLOCK_SIZE, mask=live, other=0).to(tl.int64)
        entry = block * BLOCK_SIZE + index % BLOCK_SIZE
        key_pos = tl.load(pos_ptr + entry, mask=live, other=0)
        ok = live & (key_pos <= q_pos)
        if USE_WINDOW:
            ok = ok & (key_pos > q_pos - window)
        k = tl.load(k_ptr + entry[:, None] * HEAD_DIM + d[None, :], mask=live[:, None] & (d < HEAD_DIM)[None, :],
                    other=0.0).to(tl.float32)
        # bf16 and fp16 values are exact in tf32, so the matrix units' tf32 mode loses nothing on those caches.
        if EXACT:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            scores = tl.dot(q, tl.trans(k), input_precision="tf32") * scale
        if USE_SOFTCAP:
            scores = softcap * (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0)
        return tl.where(ok[None, :], scores, NEG_INF), entry, live

    @triton.jit
    def _decode_kernel(
        q_ptr, k_ptr, v_ptr, pos_ptr, table_ptr, lens_ptr, qpos_ptr, out_ptr, part_ptr,
        stride_qb, stride_qh, stride_tb, stride_th, stride_lb, stride_ob, stride_oh,
        scale, softcap, window, tiles_per_split,
        GROUPS: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr,
        EXACT: tl.constexpr, SPLIT: tl.constexpr,
    ):
        """One program per (sequence, kv-head, split): the group's attention over one stretch of the head's
        entries. Unsplit, it writes the output; split, its running maximum, normaliser and unnormalised sum."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        split = tl.program_id(2)
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
        first = split * tiles_per_split
        last = tl.minimum(first + tiles_per_split, tl.cdiv(kv_len, TILE))
        for t in range(first, last):
            scores, entry, live = tile_scores(q, k_ptr, pos_ptr, row_ptr, t, kv_len, q_pos, scale, softcap, window,
                                              HEAD_DIM, BLOCK_D, BLOCK_SIZE, TILE, USE_SOFTCAP, USE_WINDOW, EXACT)
            v = tl.load(v_ptr + entry[:, None] * HEAD_DIM + d[None, :], mask=live[:, None] & d_ok[None, :],
                        other=0.0).to(tl.float32)
            new_best = tl.maximum(best, tl.max(scores, axis=1))
            # A row that has seen nothing visible yet keeps -inf; subtracting it must not produce NaN.
            safe = tl.where(new_best == NEG_INF, 0.0, new_best)
            p = tl.exp(scores - safe[:, None])
            rescale = tl.exp(best - safe)
            total = total * rescale + tl.sum(p, axis=1)
            if EXACT:
                acc = acc * rescale[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * rescale[:, None] + tl.dot(p, v, input_precision="tf32")
            best = new_best
        if SPLIT:
            # [B, Hkv, splits, BLOCK_G, BLOCK_D + 2]: each row's sum, then its maximum and normaliser.
            width = BLOCK_D + 2
            base = part_ptr + ((b * tl.num_programs(1) + h) * tl.num_programs(2) + split) * (BLOCK_G * width)
            tl.store(base + g[:, None] * width + d[None, :], acc)
            tl.store(base + g * width + BLOCK_D, best)
            tl.store(base + g * width + BLOCK_D + 1, total)
        else:
            out = acc / tl.where(total > 0, total, 1.0)[:, None]
            o_rows = out_ptr + b * stride_ob + (h * GROUPS + g)[:, None] * stride_oh + d[None, :]
            tl.store(o_rows, out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])

    @triton.jit
    def _merge_kernel(part_ptr, out_ptr, stride_ob, stride_oh, num_splits,
                      GROUPS: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
        """One program per (sequence, kv-head): the splits' partial softmaxes merged into the output."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        width = BLOCK_D + 2
        base = part_ptr + (b * tl.num_programs(1) + h) * num_splits * (BLOCK_G * width)
        best = tl.full([BLOCK_G], NEG_INF, tl.float32)
        total = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for split in range(0, num_splits):
            part = base + split * (BLOCK_G * width)
            m = tl.load(part + g * width + BLOCK_D)
            new_best = tl.maximum(best, m)
            safe = tl.where(new_best == NEG_INF, 0.0, new_best)
            old_scale = tl.exp(best - safe)
            part_scale = tl.exp(m - safe)
            total = total * old_scale + tl.load(part + g * width + BLOCK_D + 1) * part_scale
            acc = acc * old_scale[:, None] + tl.load(part + g[:, None] * width + d[None, :]) * part_scale[:, None]
            best = new_best
        out = acc / tl.where(total > 0, total, 1.0)[:, None]
        o_rows = out_ptr + b * stride_ob + (h * GROUPS + g)[:, None] * stride_oh + d[None, :]
        tl.store(o_rows, out.to(out_ptr.dtype.element_ty), mask=(g < GROUPS)[:, None] & (d < HEAD_DIM)[None, :])


TILE_ENTRIES = 64  # entries a program scores per iteration (several blocks at once)
TARGET_PROGRAMS = 1024  # about eight per multiprocessor on an H100: enough to hide the gathers' latency
MIN_TILES_PER_SPLIT = 4  # shorter stretches would spend more on merging than they save


def decode_splits(batch: int, num_kv_heads: int, max_entries: int, tile: int = TILE_ENTRIES) -> tuple[int, int]:
    """(splits, tiles per split) for a decode over heads of at most max_entries entries.

    One program per (sequence, kv-head) walks its head's entries in order, and a few sequences of long context
    leave most of the card idle while each program waits on one gather after another. So each head's entries
    are cut into splits, as many as it takes to reach about TARGET_PROGRAMS programs, but never into stretches
    shorter than MIN_TILES_PER_SPLIT tiles; a second launch merges the splits' partial softmaxes."""
    tiles = max(1, -(-max_entries // tile))
    wanted = -(-TARGET_PROGRAMS // max(1, batch * num_kv_heads))
    splits = max(1, min(wanted, tiles // MIN_TILES_PER_SPLIT))
    per_split = -(-tiles // splits)
    return -(-tiles // per_split), per_split


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
    num_splits: int | None = None,
) -> torch.Tensor:
    """q [B, Hq, D]; caches [N, block_size, D] and [N, block_size]; block_tables [B, Hkv, nb]; kv_lens [B, Hkv];
    q_positions [B] -> [B, Hq, D], the same as paged_decode_attention_ref with decode_mask.

    num_splits: how many stretches each head's entries are cut into (default: decode_splits, from the table's
    width, so no length is read back from the device)."""
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
    block_size = k_cache.shape[1]
    tile = max(TILE_ENTRIES, block_size)
    splits, per_split = decode_splits(batch, num_kv_heads, tables.shape[-1] * block_size, tile)
    if num_splits is not None:
        tiles = max(1, -(-tables.shape[-1] * block_size // tile))
        per_split = -(-tiles // max(1, min(num_splits, tiles)))
        splits = -(-tiles // per_split)
    # tl.dot wants at least 16 rows: a group's query heads are padded up to that.
    block_g, block_d = max(16, triton.next_power_of_2(groups)), max(16, triton.next_power_of_2(head_dim))
    out = torch.empty_like(q)
    part = (torch.empty((batch, num_kv_heads, splits, block_g, block_d + 2), dtype=torch.float32, device=q.device)
            if splits > 1 else out)
    _decode_kernel[(batch, num_kv_heads, splits)](
        q, k_cache.contiguous(), v_cache.contiguous(), pos_cache.to(torch.int32).contiguous(), tables, lens,
        q_positions.to(torch.int32).contiguous(), out, part,
        q.stride(0), q.stride(1), tables.stride(0), tables.stride(1), lens.stride(0), out.stride(0), out.stride(1),
        float(scale), float(softcap or 1.0), int(sliding_window or 0), per_split,
        GROUPS=groups, BLOCK_G=block_g, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size, TILE=tile,
        USE_SOFTCAP=softcap is not None, USE_WINDOW=sliding_window is not None,
        EXACT=q.dtype == torch.float32, SPLIT=splits > 1,
    )
    if splits > 1:
        _merge_kernel[(batch, num_kv_heads)](part, out, out.stride(0), out.stride(1), splits,
                                             GROUPS=groups, BLOCK_G=block_g, HEAD_DIM=head_dim, BLOCK_D=block_d)
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
