"""Which cached entries a sequence keeps when it is compressed.

Inputs are per (layer, kv-head, logical entry): the attention the entry has received, its token position and
whether it exists. The first `sinks` tokens and the most recent `recent` tokens are always kept: attention
sinks and the local context carry much of every query's mass, and the newest entries have had no time to
collect any.

- variable: the lowest-scoring entries are evicted across all heads and layers of the sequence together, so a
  head whose attention is concentrated keeps few entries and a diffuse head keeps many (KV-Compress).
- uniform: every head keeps the same number, its highest-scoring ones (the per-head baseline).
- recent: every head keeps only its most recent entries (the sliding-window baseline; no sinks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inference.compression.settings import EvictionMethod


def pool_scores(scores: torch.Tensor, valid: torch.Tensor, window: int) -> torch.Tensor:
    """Each entry scores the most any entry within window // 2 of it received.

    A fact is several tokens, but queries attend to few of them (a name, not the digits after it); keeping the
    neighbourhood of what was attended keeps the fact whole.
    """
    if window <= 1:
        return scores
    layers, heads, width = scores.shape
    flat = scores.masked_fill(~valid, 0.0).reshape(layers * heads, 1, width)
    pooled = F.max_pool1d(flat, kernel_size=window, stride=1, padding=window // 2)[..., :width]
    return pooled.reshape(layers, heads, width)


def select_keep(scores: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, num_tokens: int,
                keep_per_head: int, method: EvictionMethod, sinks: int, recent: int,
                pool: int = 1) -> torch.Tensor:
    """[L, H, S] inputs -> [L, H, S] bool: the entries to keep. Keeps at least the protected ones."""
    layers, heads, _ = scores.shape
    scores = pool_scores(scores, valid, pool) if method is not EvictionMethod.RECENT else scores
    if method is EvictionMethod.RECENT:
        return _top_per_head(positions.float(), valid, torch.full((layers, heads), keep_per_head))
    protected = valid & ((positions < sinks) | (positions >= num_tokens - recent))
    candidates = valid & ~protected
    if method is EvictionMethod.UNIFORM:
        quota = (keep_per_head - protected.sum(dim=-1)).clamp(min=0)
        return protected | _top_per_head(scores, candidates, quota)
    extra = keep_per_head * layers * heads - int(protected.sum())
    keep = protected.clone()
    available = int(candidates.sum())
    if extra <= 0 or available == 0:
        return keep
    flat = scores.masked_fill(~candidates, float("-inf")).reshape(-1)
    chosen = torch.topk(flat, min(extra, available)).indices
    keep.view(-1)[chosen] = True
    return keep


def _top_per_head(scores: torch.Tensor, allowed: torch.Tensor, quota: torch.Tensor) -> torch.Tensor:
    """Per head, the `quota` highest-scoring allowed entries."""
    masked = scores.masked_fill(~allowed, float("-inf"))
    order = torch.argsort(masked, dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    return allowed & (rank < quota.to(rank.device).unsqueeze(-1))
