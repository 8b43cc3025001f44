"""KV compression primitives (torch references): attention received by cached entries, and the cache move.

Layout as in kernels.paged_attention: blocks of `block_size` entries of one (layer, kv-head), per-head block
tables and lengths, stored entry positions.

The eviction metric is the attention probability each cached entry receives, summed over the observed queries
and over the query heads that share its kv-head (grouped-query attention: one entry serves G query heads, so
its worth is what all of them draw from it).
"""

from __future__ import annotations

import torch

from kernels.paged_attention import _visible, gather_blocks


def _probabilities(scores: torch.Tensor, mask: torch.Tensor, softcap: float | None) -> torch.Tensor:
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.nan_to_num(probs, nan=0.0)  # a query that sees nothing contributes nothing


def decode_received_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """One query per sequence. q [B, Hq, D]; block_tables [B, Hkv, nb]; mask [B, Hkv or 1, S] -> [B, Hkv, S] fp32."""
    return _decode_probabilities(q, k_cache, block_tables, mask, scale, softcap).sum(dim=2)


def _decode_probabilities(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor, mask: torch.Tensor,
                          scale: float, softcap: float | None) -> torch.Tensor:
    """fp32 attention probabilities of one query per sequence: [B, Hkv, G, S]."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = block_tables.shape[1]
    k = gather_blocks(k_cache, block_tables).flatten(2, 3).float()  # [B, Hkv, S, D]
    qg = q.view(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim).float()
    return _probabilities(torch.matmul(qg, k.transpose(-1, -2)) * scale, mask.unsqueeze(2), softcap)


def paged_decode_attention_received_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention and the attention each entry received, from one pass over the gathered blocks.

    A sequence being compressed needs both every step; computed apart, its keys were gathered and widened twice,
    and on CPU that was over a third of a compressed decode step's attention time. q [B, Hq, D] -> (out
    [B, Hq, D] in q's dtype, as paged_decode_attention_ref; received [B, Hkv, S] fp32, as
    decode_received_attention_ref)."""
    probs = _decode_probabilities(q, k_cache, block_tables, mask, scale, softcap)
    v = gather_blocks(v_cache, block_tables).flatten(2, 3).float()
    return torch.matmul(probs, v).reshape(q.shape).to(q.dtype), probs.sum(dim=2)


def prefill_received_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    pos_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_lens: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Several queries of ONE sequence. q [Tq, Hq, D]; block_table [Hkv, nb]; kv_lens [Hkv] -> [Hkv, S] fp32."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = block_table.shape[0]
    groups = num_q_heads // num_kv_heads
    k = gather_blocks(k_cache, block_table).flatten(1, 2).float()  # [Hkv, S, D]
    key_pos = gather_blocks(pos_cache, block_table).flatten(1, 2)  # [Hkv, S]
    index = torch.arange(key_pos.shape[-1], device=q.device)
    entry_ok = (index < kv_lens.unsqueeze(-1)).unsqueeze(1)  # [Hkv, 1, S]
    mask = _visible(key_pos.unsqueeze(1), entry_ok, q_positions.view(1, -1, 1), sliding_window)  # [Hkv, Tq, S]
    qh = q.view(num_tokens, num_kv_heads, groups, head_dim).permute(1, 2, 0, 3).float()  # [Hkv, G, Tq, D]
    scores = torch.matmul(qh, k.unsqueeze(1).transpose(-1, -2)) * scale  # [Hkv, G, Tq, S]
    return _probabilities(scores, mask.unsqueeze(1), softcap).sum(dim=(1, 2))


def move_entries_ref(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos_cache: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
) -> None:
    """The cache move after eviction: entry src[i] -> dst[i] (flat slot ids). All reads happen before any write,
    so destinations may overlap sources (compaction within a head's own blocks)."""
    head_dim = k_cache.shape[-1]
    for cache in (k_cache.view(-1, head_dim), v_cache.view(-1, head_dim), pos_cache.view(-1, 1)):
        cache.index_copy_(0, dst, cache.index_select(0, src))
