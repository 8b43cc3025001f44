"""Paged attention over a KV pool whose blocks each hold `block_size` tokens of ONE (layer, kv-head).

Layout (shared by the reference here and the Triton kernels that replace it on CUDA):
- k_cache, v_cache: [num_blocks, block_size, head_dim]; pos_cache: [num_blocks, block_size] int32, the token
  position of each cached entry. Positions are stored, not implied by the index, so that a head that dropped
  entries (KV compression) still masks causally and by sliding window.
- A block table row lists, per kv-head, the physical blocks holding that head's entries in order; kv_lens says
  how many entries each head holds. Heads of one sequence may hold different numbers of entries.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos_cache: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
) -> None:
    """Store new entries. slots: [Hkv, T] flat slot ids (block * block_size + offset); k, v: [T, Hkv, D]."""
    head_dim = k_cache.shape[-1]
    flat = slots.reshape(-1)
    k_cache.view(-1, head_dim).index_copy_(0, flat, k.transpose(0, 1).reshape(-1, head_dim))
    v_cache.view(-1, head_dim).index_copy_(0, flat, v.transpose(0, 1).reshape(-1, head_dim))
    pos_cache.view(-1).index_copy_(0, flat, positions.to(pos_cache.dtype).expand(slots.shape[0], -1).reshape(-1))


def gather_blocks(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """cache[table] for block ids of any shape: [*table.shape, *cache.shape[1:]].

    index_select copies whole rows; plain advanced indexing is about ten times slower on CPU here.
    """
    return cache.index_select(0, table.reshape(-1)).view(*table.shape, *cache.shape[1:])


def _visible(
    key_pos: torch.Tensor, entry_ok: torch.Tensor, q_pos: torch.Tensor, sliding_window: int | None
) -> torch.Tensor:
    mask = entry_ok & (key_pos <= q_pos)
    if sliding_window is not None:
        mask &= key_pos > q_pos - sliding_window
    return mask


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float | None
) -> torch.Tensor:
    """q [..., Hkv, G, Tq, D], k/v [..., Hkv, S, D], mask broadcastable to [..., Hkv, G, Tq, S]."""
    groups = q.shape[-3]
    # Expanded (stride-0) keys keep every batch dim equal, which lets torch pick its flash kernel on CPU;
    # broadcasting them instead silently falls back to the slower math path.
    k = k.unsqueeze(-3).expand(*k.shape[:-2], groups, *k.shape[-2:])
    v = v.unsqueeze(-3).expand(*v.shape[:-2], groups, *v.shape[-2:])
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)


def decode_mask(
    pos_cache: torch.Tensor,
    block_tables: torch.Tensor,
    kv_lens: torch.Tensor,
    q_positions: torch.Tensor,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Which gathered entries each decode query sees: [B, Hkv, S] from the stored entry positions."""
    key_pos = gather_blocks(pos_cache, block_tables).flatten(2, 3)  # [B, Hkv, S]
    index = torch.arange(key_pos.shape[-1], device=key_pos.device)
    entry_ok = index < kv_lens.unsqueeze(-1)
    return _visible(key_pos, entry_ok, q_positions.view(-1, 1, 1), sliding_window)


def dense_decode_mask(
    kv_lens: torch.Tensor, q_positions: torch.Tensor, width: int, sliding_window: int | None = None
) -> torch.Tensor:
    """The same mask when no entry was ever evicted, so entry i holds position i: [B, 1, S].

    It needs no gather and is shared by every layer of a step, which matters for single-stream decode.
    """
    index = torch.arange(width, device=kv_lens.device)
    mask = index < kv_lens.unsqueeze(-1)
    if sliding_window is not None:
        mask &= index > q_positions.view(-1, 1) - sliding_window
    return mask.unsqueeze(1)


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """One query token per sequence. q [B, Hq, D]; block_tables [B, Hkv, nb]; mask [B, Hkv or 1, S] -> [B, Hq, D]."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = block_tables.shape[1]
    k = gather_blocks(k_cache, block_tables).flatten(2, 3)  # [B, Hkv, S, D]
    v = gather_blocks(v_cache, block_tables).flatten(2, 3)
    groups = num_q_heads // num_kv_heads
    if softcap is None:
        # One query per sequence: the grouped heads attend as a [G, D] x [S, D] product per kv head.
        out = F.scaled_dot_product_attention(q.view(batch, num_kv_heads, groups, head_dim), k, v,
                                             attn_mask=mask.unsqueeze(2), scale=scale)
        return out.reshape(batch, num_q_heads, head_dim)
    out = _attend(q.view(batch, num_kv_heads, groups, 1, head_dim), k, v, mask[:, :, None, None, :], scale, softcap)
    return out.reshape(batch, num_q_heads, head_dim)


def paged_prefill_attention_ref(
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
    """Several query tokens of ONE sequence over its cached entries (new ones already written).

    q [Tq, Hq, D]; block_table [Hkv, nb]; kv_lens [Hkv]; q_positions [Tq] -> [Tq, Hq, D].
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = block_table.shape[0]
    k = gather_blocks(k_cache, block_table).flatten(1, 2)  # [Hkv, S, D]
    v = gather_blocks(v_cache, block_table).flatten(1, 2)
    key_pos = gather_blocks(pos_cache, block_table).flatten(1, 2)  # [Hkv, S]
    index = torch.arange(key_pos.shape[-1], device=q.device)
    entry_ok = (index < kv_lens.unsqueeze(-1)).unsqueeze(1)  # [Hkv, 1, S]
    mask = _visible(key_pos.unsqueeze(1), entry_ok, q_positions.view(1, -1, 1), sliding_window)  # [Hkv, Tq, S]
    groups = num_q_heads // num_kv_heads
    qh = q.view(num_tokens, num_kv_heads, groups, head_dim).permute(1, 2, 0, 3)  # [Hkv, G, Tq, D]
    out = _attend(qh, k, v, mask.unsqueeze(1), scale, softcap)  # [Hkv, G, Tq, D]
    return out.permute(2, 0, 1, 3).reshape(num_tokens, num_q_heads, head_dim)


def causal_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """A fresh prompt (nothing cached before it): attend over its own new k/v. q [T, Hq, D], k/v [T, Hkv, D]."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    groups = num_q_heads // num_kv_heads
    qh = q.view(num_tokens, num_kv_heads, groups, head_dim).permute(1, 2, 0, 3)
    kh, vh = k.transpose(0, 1), v.transpose(0, 1)  # [Hkv, T, D]
    if sliding_window is None and softcap is None:
        shape = (num_kv_heads, groups, num_tokens, head_dim)
        out = F.scaled_dot_product_attention(qh, kh.unsqueeze(1).expand(shape), vh.unsqueeze(1).expand(shape),
                                             is_causal=True, scale=scale)
    else:
        pos = positions.view(1, -1)
        entry_ok = torch.ones(1, 1, num_tokens, dtype=torch.bool, device=q.device)
        mask = _visible(pos.unsqueeze(1), entry_ok, positions.view(1, -1, 1), sliding_window)
        out = _attend(qh, kh, vh, mask.unsqueeze(1), scale, softcap)
    return out.permute(2, 0, 1, 3).reshape(num_tokens, num_q_heads, head_dim)
