"""Verification of draft tokens against the target model: greedy matching and speculative sampling.

Both functions take one batch of N sequences with different numbers of draft tokens, padded to k_max:
`draft_tokens` is [N, k_max] and only the first `num_draft[i]` entries of row i count (the padding can hold
any id). The target scored all of them in one forward pass, so position j of its output is the
distribution for the token after draft token j - 1, i.e. [N, k_max + 1, ...], and position num_draft[i]
(the one after the last real draft) gives the bonus token. Each row emits between 1 and num_draft[i] + 1
tokens: the accepted draft prefix plus one token from the target.

Speculative sampling (Leviathan et al. 2023, Chen et al. 2023) for draft token x at position j, drawn from
q_j, with p_j the target's processed distribution (after temperature, penalties, top-k/p, min-p):
accept with probability min(1, p_j(x) / q_j(x)); at the first rejection emit a token from
normalize(max(p_j - q_j, 0)) and stop; if every draft is accepted, emit a token from p_{num_draft}. The
emitted tokens are then distributed exactly as if the target had sampled them one by one.

Numerics:
- the acceptance test is `u * q(x) < p(x)` with u uniform in [0, 1): no division, q(x) = 0 with p(x) > 0
  always accepts (the limit of the ratio) and p(x) = 0 always rejects, whatever q says;
- a residual with no mass (p <= q everywhere, possible only through rounding since a rejection means
  p(x) < q(x) somewhere, hence p > q somewhere else) falls back to p;
- deterministic drafts (draft_probs None) mean q is one-hot, so the residual is p with x removed;
- greedy rows (temperature 0) arrive as one-hot p: a draft is accepted iff it is the argmax and the
  emitted token is the argmax, exactly verify_greedy.

Randomness: row i draws num_draft[i] + 1 uniforms from its own generator (one per draft, one for the
emitted token), whether or not it rejects early, so a seeded row's random stream depends only on its own
drafts, never on its neighbours in the batch or on k_max. Rows without a generator draw from `fallback`
(the global default CPU generator when that is None too).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def _check_batch(draft_tokens: Tensor, num_draft: Tensor, n: int, k_max: int) -> None:
    if draft_tokens.dim() != 2 or tuple(draft_tokens.shape) != (n, k_max):
        raise ValueError(f"draft_tokens must be [N, k_max] = [{n}, {k_max}], got {tuple(draft_tokens.shape)}")
    if num_draft.dim() != 1 or num_draft.shape[0] != n:
        raise ValueError(f"num_draft must be [N] = [{n}], got {tuple(num_draft.shape)}")
    if n and (int(num_draft.min()) < 0 or int(num_draft.max()) > k_max):
        raise ValueError(f"num_draft must lie in [0, k_max = {k_max}]")


def _accepted_lengths(accept: Tensor) -> Tensor:
    """[N, k] bool -> [N]: how many leading positions of each row are accepted."""
    if accept.shape[1] == 0:
        return torch.zeros(accept.shape[0], dtype=torch.long, device=accept.device)
    return accept.long().cumprod(dim=1).sum(dim=1)


def _valid(num_draft: Tensor, k_max: int) -> Tensor:
    return torch.arange(k_max, device=num_draft.device).unsqueeze(0) < num_draft.unsqueeze(1)


def _emit(draft_rows: list[list[int]], accepted: list[int], last: list[int]) -> list[list[int]]:
    return [row[:a] + [t] for row, a, t in zip(draft_rows, accepted, last, strict=True)]


@torch.no_grad()
def verify_greedy(target_argmax: Tensor, draft_tokens: Tensor, num_draft: Tensor) -> list[list[int]]:
    """Greedy verification: the longest draft prefix equal to the target's argmax, plus the target's next
    token. target_argmax [N, k_max + 1], draft_tokens [N, k_max], num_draft [N] (any device)."""
    if target_argmax.dim() != 2:
        raise ValueError(f"target_argmax must be [N, k_max + 1], got {tuple(target_argmax.shape)}")
    n, k_max = target_argmax.shape[0], target_argmax.shape[1] - 1
    device = target_argmax.device
    draft_tokens, num_draft = draft_tokens.to(device), num_draft.to(device)
    _check_batch(draft_tokens, num_draft, n, k_max)
    accept = (draft_tokens == target_argmax[:, :k_max]) & _valid(num_draft, k_max)
    accepted = _accepted_lengths(accept)
    # Accepted drafts equal the target's argmax there, so the emitted tokens are its first accepted + 1.
    argmax_rows = target_argmax.tolist()
    return [row[: a + 1] for row, a in zip(argmax_rows, accepted.tolist(), strict=True)]


def _row_uniforms(
    counts: list[int], generators: Sequence[torch.Generator | None], fallback: torch.Generator | None
) -> Tensor:
    """[N, max(counts)] CPU uniforms; row i's first counts[i] come from its own generator in order."""
    width = max(counts, default=0)
    out = torch.zeros(len(counts), width)
    shared = [i for i, g in enumerate(generators) if g is None]
    if shared:
        # One draw for all generator-less rows, dealt out row by row in batch order (a row-major boolean
        # mask assignment does exactly that).
        index = torch.tensor(shared, dtype=torch.long)
        shared_counts = torch.tensor([counts[i] for i in shared], dtype=torch.long)
        mask = torch.arange(width).unsqueeze(0) < shared_counts.unsqueeze(1)
        block = torch.zeros(len(shared), width)
        block[mask] = torch.rand(int(shared_counts.sum()), generator=fallback)
        out[index] = block
    for i, g in enumerate(generators):
        if g is not None:
            out[i, : counts[i]] = torch.rand(counts[i], generator=g)
    return out


def _sample_rows(weights: Tensor, uniforms: Tensor) -> Tensor:
    """One token per row of non-negative [N, V] weights by inverting the CDF at uniforms [N]."""
    cdf = torch.cumsum(weights, dim=-1)
    total = cdf[:, -1:]
    # Strictly below the total, and searching for the first cdf entry above the target, so a token with
    # zero weight can never be picked (its cdf entry equals the previous one).
    target = torch.minimum(uniforms.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=weights.shape[-1] - 1)


@torch.no_grad()
def rejection_sample(
    target_probs: Tensor,
    draft_tokens: Tensor,
    num_draft: Tensor,
    draft_probs: Tensor | None,
    generators: Sequence[torch.Generator | None],
    *,
    fallback: torch.Generator | None = None,
) -> list[list[int]]:
    """Speculative rejection sampling (see the module docstring).

    target_probs [N, k_max + 1, V]: the target's processed distributions (Sampler.probabilities per
    position); draft_tokens [N, k_max]; num_draft [N]; draft_probs [N, k_max, V] or None for deterministic
    drafts; generators: one CPU generator (or None) per row. Returns the emitted tokens of each row.
    """
    if target_probs.dim() != 3:
        raise ValueError(f"target_probs must be [N, k_max + 1, V], got {tuple(target_probs.shape)}")
    n, k_max, vocab = target_probs.shape[0], target_probs.shape[1] - 1, target_probs.shape[2]
    device = target_probs.device
    draft_tokens, num_draft = draft_tokens.to(device), num_draft.to(device)
    _check_batch(draft_tokens, num_draft, n, k_max)
    if len(generators) != n:
        raise ValueError(f"need one generator (or None) per row: {len(generators)} for {n} rows")
    if draft_probs is not None and tuple(draft_probs.shape) != (n, k_max, vocab):
        raise ValueError(f"draft_probs must be [N, k_max, V] = [{n}, {k_max}, {vocab}], "
                         f"got {tuple(draft_probs.shape)}")
    if n == 0:
        return []
    p = target_probs.float()
    q = None if draft_probs is None else draft_probs.to(device=device, dtype=torch.float32)
    counts = num_draft.tolist()
    uniforms = _row_uniforms([c + 1 for c in counts], generators, fallback).to(device)
    rows = torch.arange(n, device=device)

    index = draft_tokens.clamp(0, vocab - 1).unsqueeze(-1)  # padding may hold any id, e.g. -1
    p_draft = p[:, :k_max].gather(2, index).squeeze(-1)  # [N, k_max]
    q_draft = torch.ones_like(p_draft) if q is None else q.gather(2, index).squeeze(-1)
    accept = (uniforms[:, :k_max] * q_draft < p_draft) & _valid(num_draft, k_max)
    accepted = _accepted_lengths(accept)  # position of the emitted token, in 0..num_draft
    rejected = accepted < num_draft

    # [N, V], a fresh copy: the distribution each row's last token comes from. Accepting rows keep p; the
    # residual is formed for the rejecting rows only and mostly in place: on CPU every pass over [N, V]
    # (N x 152k for Qwen) costs milliseconds.
    weights = p[rows, accepted]
    bad = rejected.nonzero().squeeze(1)
    if bad.numel():
        at = accepted.index_select(0, bad)
        x = draft_tokens[bad, at]
        if q is None:
            # q is one-hot on x, so max(p - q, 0) is p with x removed.
            removed = weights[bad, x]
            weights[bad, x] = 0.0
            empty = weights.sum(dim=-1).index_select(0, bad) <= 0
            if bool(empty.any()):
                weights[bad[empty], x[empty]] = removed[empty]
        else:
            residual = weights[bad].sub_(q[bad, at]).clamp_(min=0.0)
            empty = residual.sum(dim=-1) <= 0
            if bool(empty.any()):
                residual[empty] = weights[bad[empty]]
            weights[bad] = residual
    last = _sample_rows(weights, uniforms[rows, num_draft])
    return _emit(draft_tokens.tolist(), accepted.tolist(), last.tolist())
