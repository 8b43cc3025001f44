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

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inference.compression.settings import EvictionMethod


@dataclass(frozen=True, slots=True)
class ScoreSpread:
    """How an entry borrows the score of its neighbours before eviction.

    A fact is several tokens, but a question attends to few of them: the name in "the access code for Nils Sato
    is 38631", and the first digit. The other digits draw attention only while they are being copied, after
    compression has run, so an entry scores the most any of the `before` entries before it or the `after` entries
    after it received. The first `skip_prefix` positions lend nothing: the start of a prompt (the chat template's
    preamble) is where heads park attention they do not need, and spreading those sink scores filled whole
    budgets of retrieval heads with preamble at 32× (docs/benchmarks.md).
    """

    before: int = 8
    after: int = 4
    skip_prefix: int = 32

    def __post_init__(self) -> None:
        if min(self.before, self.after, self.skip_prefix) < 0:
            raise ValueError("score spread: before, after and skip_prefix must be >= 0")

    def apply(self, scores: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        if self.before == 0 and self.after == 0:
            return scores
        layers, heads, width = scores.shape
        own = scores.masked_fill(~valid, 0.0)
        lent = own.masked_fill(positions < self.skip_prefix, 0.0).reshape(layers * heads, 1, width)
        window = self.before + self.after + 1
        spread = F.max_pool1d(F.pad(lent, (self.before, self.after)), kernel_size=window, stride=1)
        return torch.maximum(own, spread.reshape(layers, heads, width))


NO_SPREAD = ScoreSpread(0, 0, 0)


def select_keep(scores: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, num_tokens: int,
                keep_per_head: int, method: EvictionMethod, sinks: int, recent: int,
                spread: ScoreSpread = NO_SPREAD) -> torch.Tensor:
    """[L, H, S] inputs -> [L, H, S] bool: the entries to keep. Keeps at least the protected ones."""
    layers, heads, _ = scores.shape
    if method is EvictionMethod.RECENT:
        return _top_per_head(positions.float(), valid, torch.full((layers, heads), keep_per_head))
    scores = spread.apply(scores, positions, valid)
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
