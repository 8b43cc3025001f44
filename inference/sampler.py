"""Batched token sampling: one call per engine step turns a [B, V] block of logits into B tokens.

Every row carries its own SamplingParams and rows mix freely. Per row, in this order:

1. penalties on the raw logits (fp32):
   - repetition_penalty (CTRL / transformers rule) over the prompt and output tokens seen so far:
     a positive logit is divided by the penalty, a negative one multiplied by it;
   - frequency_penalty and presence_penalty (OpenAI rule) over the output tokens only:
     ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``;
2. temperature: rows with temperature below ``GREEDY_EPS`` are greedy (argmax of the penalised logits);
   the others divide their logits by the temperature;
3. top_k, then top_p (the smallest set of most likely tokens whose mass reaches top_p, measured on the
   distribution left by top_k), then min_p (drop tokens whose probability is below min_p times the most
   likely token's);
4. sampling from the softmax of what is left.

All three filters reduce to one threshold per row on its temperature-scaled logits (the k-th largest value;
the value of the last nucleus token; the maximum plus log(min_p)); tokens below the highest of them get
probability zero. Tokens tied with a threshold stay, so with distinct logits top_k keeps exactly k tokens
and top_p exactly the minimal nucleus. Masking probabilities rather than writing -inf into logits keeps
every pass over the [B, V] block on PyTorch's vectorised CPU kernels (masked_fill and where are not).

Reported logprobs are the log-softmax of the penalised logits, before temperature and filtering, so they
describe the model's distribution (with penalties) rather than the truncated sampling one. A constrained
request's logits arrive with the grammar's mask already applied (-inf where a token is not allowed), so its
logprobs are over the allowed tokens, and its top alternatives list only tokens that may be chosen (fewer than
asked when the grammar allows fewer).

Randomness: each sampled row draws exactly one uniform number per step from its own generator (a CPU
``torch.Generator``, seeded from ``SamplingParams.seed`` when set) and picks its token by inverting the
cumulative distribution. A row's token therefore depends only on its logits and its generator, never on
which other rows share the batch or where it sits in it; and the batch costs B random numbers, not B*V.
"""

from __future__ import annotations

import array
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from inference.sampling_params import SamplingParams
from kernels.cpu_argmax import argmax

# Below this temperature the scaled logits overflow into a one-hot distribution anyway; treating the row
# as greedy gives the same token without the numerical risk.
GREEDY_EPS = 1e-5

# Up to this k, torch.topk beats sorting the whole row (on CPU and GPU alike).
_TOPK_MAX = 128


@dataclass(slots=True)
class SamplingRow:
    """One sequence's view for this step."""

    params: SamplingParams
    generator: torch.Generator | None  # per request (CPU); None draws from the sampler's own generator
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float | None  # set when params.logprobs is not None
    top: list[tuple[int, float]] | None  # the params.logprobs most likely (token_id, logprob), descending


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded with `seed`, or from a fresh non-deterministic seed when None."""
    generator = torch.Generator(device="cpu")
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def _as_long_tensor(ids: Sequence[int]) -> Tensor:
    # Engines that keep token ids in arrays skip the slow per-element conversion of a Python list.
    if isinstance(ids, Tensor):
        return ids.to(torch.long).flatten()
    if isinstance(ids, np.ndarray):
        return torch.from_numpy(ids.astype(np.int64, copy=False)).flatten()
    if isinstance(ids, array.array) and ids.itemsize == 8 and ids.typecode in "lq" and len(ids):
        return torch.frombuffer(ids, dtype=torch.long)
    return torch.tensor(list(ids), dtype=torch.long)


def _flat_ids(seqs: Sequence[Sequence[int]]) -> tuple[Tensor, Tensor]:
    """Row index and token id of every token of every sequence, as two flat CPU tensors."""
    parts = [_as_long_tensor(s) for s in seqs]
    lengths = torch.tensor([p.numel() for p in parts], dtype=torch.long)
    tokens = torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)
    row_ids = torch.repeat_interleave(torch.arange(len(parts)), lengths)
    return row_ids, tokens


@dataclass(slots=True)
class _Prepared:
    logits: Tensor  # [B, V] fp32 after penalties (logprobs come from here)
    greedy: list[int]  # row indices of greedy rows
    sampled: list[int]  # row indices of sampled rows
    weights: Tensor | None  # [S, V] unnormalised probabilities of the sampled rows, 0 where filtered out


class Sampler:
    """Stateless apart from the generator used by rows that bring none; safe to reuse every step."""

    def __init__(self, seed: int | None = None) -> None:
        self._generator = make_generator(seed)

    @torch.no_grad()
    def __call__(self, logits: Tensor, rows: Sequence[SamplingRow]) -> list[SampledToken]:
        _check_shapes(logits, rows)
        batch = len(rows)
        if batch == 0:
            return []
        want_logprobs = [r.params.logprobs is not None for r in rows]
        if not any(want_logprobs) and all(_is_greedy(r.params) and not r.params.needs_penalties for r in rows):
            ids = argmax(logits).tolist()
            return [SampledToken(token_id=t, logprob=None, top=None) for t in ids]

        prep = self._prepare(logits, rows)
        device = prep.logits.device
        if prep.weights is None:
            token_ids = argmax(prep.logits)
        else:
            uniforms = self._uniforms([rows[i] for i in prep.sampled]).to(device, non_blocking=True)
            drawn = _inverse_cdf_sample(prep.weights, uniforms)
            if prep.greedy:
                token_ids = torch.empty(batch, dtype=torch.long, device=device)
                greedy_dev = _index(prep.greedy, device)
                token_ids[greedy_dev] = prep.logits.index_select(0, greedy_dev).argmax(dim=-1)
                token_ids[_index(prep.sampled, device)] = drawn
            else:
                token_ids = drawn

        out = [SampledToken(token_id=t, logprob=None, top=None) for t in token_ids.tolist()]
        self._fill_logprobs(out, prep.logits, rows, token_ids)
        return out

    @torch.no_grad()
    def score(self, logits: Tensor, rows: Sequence[SamplingRow], token_ids: Sequence[int]) -> list[SampledToken]:
        """Logprob reports for tokens chosen elsewhere (speculative verification), as __call__ would give."""
        _check_shapes(logits, rows)
        out = [SampledToken(token_id=int(t), logprob=None, top=None) for t in token_ids]
        if rows and any(r.params.logprobs is not None for r in rows):
            prep = self._prepare(logits, rows)
            ids = torch.tensor([int(t) for t in token_ids], dtype=torch.long, device=prep.logits.device)
            self._fill_logprobs(out, prep.logits, rows, ids)
        return out

    @staticmethod
    def _fill_logprobs(out: list[SampledToken], penalised: Tensor, rows: Sequence[SamplingRow],
                       token_ids: Tensor) -> None:
        logprob_rows = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if not logprob_rows:
            return
        device = penalised.device
        idx = _index(logprob_rows, device)
        lp = torch.log_softmax(penalised.index_select(0, idx), dim=-1)
        chosen_lp = lp.gather(1, token_ids.index_select(0, idx).unsqueeze(1)).squeeze(1).tolist()
        top_ids: list[list[int]] = []
        top_lps: list[list[float]] = []
        n_max = max(rows[i].params.logprobs or 0 for i in logprob_rows)
        if n_max:
            vals, ids = lp.topk(min(n_max, lp.shape[-1]), dim=-1)
            top_ids, top_lps = ids.tolist(), vals.tolist()
        for k, i in enumerate(logprob_rows):
            n = rows[i].params.logprobs or 0
            out[i].logprob = chosen_lp[k]
            # A masked token (-inf) is no alternative, and -inf has no JSON form for the API to send.
            out[i].top = [(t, v) for t, v in zip(top_ids[k][:n], top_lps[k][:n], strict=True)
                          if v != -math.inf] if n else []

    @torch.no_grad()
    def probabilities(self, logits: Tensor, rows: Sequence[SamplingRow]) -> Tensor:
        """[B, V] fp32: the exact distribution each row samples from this step, after all processing.

        Greedy rows get a one-hot of their argmax. No randomness is consumed, so speculative decoding can
        score draft tokens against these without disturbing a row's seeded sequence.
        """
        _check_shapes(logits, rows)
        if not rows:
            return torch.empty(0, logits.shape[-1], dtype=torch.float32, device=logits.device)
        prep = self._prepare(logits, rows)
        device = prep.logits.device
        probs = torch.zeros_like(prep.logits)
        if prep.greedy:
            greedy_dev = _index(prep.greedy, device)
            best = prep.logits.index_select(0, greedy_dev).argmax(dim=-1)
            probs[greedy_dev, best] = 1.0
        if prep.weights is not None:
            probs[_index(prep.sampled, device)] = prep.weights / prep.weights.sum(dim=-1, keepdim=True)
        return probs

    def _uniforms(self, rows: Sequence[SamplingRow]) -> Tensor:
        # One draw per row from that row's own generator, so neighbours never shift its random stream.
        own = torch.rand(len(rows), generator=self._generator)
        for k, row in enumerate(rows):
            if row.generator is not None:
                own[k] = torch.rand((), generator=row.generator)
        return own

    def _prepare(self, logits: Tensor, rows: Sequence[SamplingRow]) -> _Prepared:
        x = logits.float()  # the caller's own tensor when already fp32: penalties must work on a copy
        if any(r.params.needs_penalties for r in rows):
            if x is logits:
                x = x.clone()
            _apply_repetition_penalty(x, rows)
            _apply_frequency_presence(x, rows)

        greedy = [i for i, r in enumerate(rows) if _is_greedy(r.params)]
        sampled = [i for i, r in enumerate(rows) if not _is_greedy(r.params)]
        if not sampled:
            return _Prepared(logits=x, greedy=greedy, sampled=sampled, weights=None)

        device = x.device
        params = [rows[i].params for i in sampled]
        scaled = x if not greedy else x.index_select(0, _index(sampled, device))
        temps = [p.temperature for p in params]
        if any(t != 1.0 for t in temps):
            scaled = scaled / torch.tensor(temps, dtype=torch.float32).to(device).unsqueeze(1)
        weights = torch.softmax(scaled, dim=-1)
        threshold = _filter_threshold(scaled, params)
        if threshold is not None:
            weights.mul_(_float_mask(torch.ge, scaled, threshold))
        return _Prepared(logits=x, greedy=greedy, sampled=sampled, weights=weights)


def _float_mask(compare: Callable[..., Tensor], a: Tensor, b: Tensor) -> Tensor:
    """compare(a, b) as 1.0 / 0.0: on CPU, writing a float result is several times faster than a bool one
    and multiplying by it avoids a bool-to-float conversion pass."""
    out = torch.empty(torch.broadcast_shapes(a.shape, b.shape), dtype=torch.float32, device=a.device)
    return compare(a, b, out=out)


def _index(rows: list[int], device: torch.device) -> Tensor:
    return torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)


def _is_greedy(params: SamplingParams) -> bool:
    return params.temperature < GREEDY_EPS


def _check_shapes(logits: Tensor, rows: Sequence[SamplingRow]) -> None:
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [B, V] with B = {len(rows)} rows, got {tuple(logits.shape)}")


def _apply_repetition_penalty(x: Tensor, rows: Sequence[SamplingRow]) -> None:
    which = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if not which:
        return
    seqs: list[Sequence[int]] = []
    for i in which:
        seqs.append(rows[i].prompt_token_ids)
        seqs.append(rows[i].output_token_ids)
    row_ids, tokens = _flat_ids(seqs)
    row_ids = torch.tensor(which, dtype=torch.long)[row_ids // 2]  # two sequences per penalised row
    penalty = torch.tensor([rows[i].params.repetition_penalty for i in range(len(rows))], dtype=torch.float32)
    device = x.device
    r, t = row_ids.to(device), tokens.to(device)
    p = penalty.to(device)[r]
    vals = x[r, t]
    # Every copy of a repeated (row, token) writes the same value, computed from the unpenalised logit,
    # so a token seen many times is still penalised once.
    x[r, t] = torch.where(vals > 0, vals / p, vals * p)


def _apply_frequency_presence(x: Tensor, rows: Sequence[SamplingRow]) -> None:
    which = [i for i, r in enumerate(rows)
             if r.params.frequency_penalty != 0.0 or r.params.presence_penalty != 0.0]
    if not which:
        return
    row_ids, tokens = _flat_ids([rows[i].output_token_ids for i in which])
    if not tokens.numel():
        return
    row_ids = torch.tensor(which, dtype=torch.long)[row_ids]
    keys, counts = torch.unique(row_ids * x.shape[1] + tokens, return_counts=True)
    r = keys // x.shape[1]
    freq = torch.tensor([rows[i].params.frequency_penalty for i in range(len(rows))], dtype=torch.float32)
    pres = torch.tensor([rows[i].params.presence_penalty for i in range(len(rows))], dtype=torch.float32)
    delta = freq[r] * counts.to(torch.float32) + pres[r]
    device = x.device
    x.index_put_((r.to(device), (keys % x.shape[1]).to(device)), -delta.to(device), accumulate=True)


def _sorted_desc(x: Tensor) -> Tensor:
    """Each row's values in descending order (values only: the filters need thresholds, not positions)."""
    if x.device.type == "cpu":
        # numpy's vectorised float sort is ~30x faster than torch's CPU sort, and values-only halves it again.
        return torch.from_numpy(-np.sort(-x.detach().numpy(), axis=-1))
    return x.sort(dim=-1, descending=True).values


def _filter_threshold(scaled: Tensor, params: Sequence[SamplingParams]) -> Tensor | None:
    """[S, 1]: per row, the lowest scaled logit that top_k, top_p and min_p all let through (None: no filters)."""
    vocab = scaled.shape[1]
    device = scaled.device
    top_kp = [i for i, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0]
    min_p = [i for i, p in enumerate(params) if p.min_p > 0.0]
    if not top_kp and not min_p:
        return None
    threshold = torch.full((len(params), 1), float("-inf"), device=device)

    # Rows with a small top_k need only their top k values (topk); the others sort the whole row.
    small_k = [i for i in top_kp if 0 < params[i].top_k <= _TOPK_MAX]
    large_k = [i for i in top_kp if not 0 < params[i].top_k <= _TOPK_MAX]
    for group in (small_k, large_k):
        if not group:
            continue
        every = len(group) == len(params)
        idx = None if every else _index(group, device)
        sub = scaled if idx is None else scaled.index_select(0, idx)
        ks = [min(params[i].top_k, vocab) if params[i].top_k > 0 else vocab for i in group]
        group_threshold = _top_k_top_p_threshold(sub, ks, [params[i].top_p for i in group])
        if idx is None:
            threshold = group_threshold
        else:
            threshold[idx] = group_threshold

    if min_p:
        idx = _index(min_p, device)
        # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p): no softmax needed.
        log_min_p = torch.tensor([params[i].min_p for i in min_p], dtype=torch.float32).log().to(device)
        row_max = scaled.index_select(0, idx).max(dim=-1, keepdim=True).values
        threshold[idx] = torch.maximum(threshold[idx], row_max + log_min_p.unsqueeze(1))
    return threshold


def _top_k_top_p_threshold(sub: Tensor, ks: list[int], top_p: list[float]) -> Tensor:
    """[n, 1]: the value of the last token each row keeps after top_k (ks, vocab = off) then top_p."""
    device = sub.device
    width = max(ks)
    vals = sub.topk(width, dim=-1).values if width <= _TOPK_MAX else _sorted_desc(sub)[:, :width]
    keep = torch.tensor(ks, dtype=torch.long).to(device).unsqueeze(1)  # how many stay, per row
    if any(p < 1.0 for p in top_p):
        probs = torch.softmax(vals, dim=-1)
        if min(ks) < width:
            probs.mul_(_float_mask(torch.lt, torch.arange(width, device=device).unsqueeze(0), keep))
        cum = torch.cumsum(probs, dim=-1)
        # A token stays while the mass of the strictly more likely ones (out of what top_k left) is
        # still short of top_p: the minimal nucleus, never empty. With cum[j] the mass of the first
        # j + 1 tokens, that is one more than the number of j with cum[j] < top_p * total.
        p_t = torch.tensor(top_p, dtype=torch.float32).to(device).unsqueeze(1)
        nucleus = torch.searchsorted(cum, p_t * cum[:, -1:]) + 1
        keep = torch.minimum(keep, torch.where(p_t < 1.0, nucleus, width))
    return vals.gather(1, keep - 1)


def _inverse_cdf_sample(weights: Tensor, uniforms: Tensor) -> Tensor:
    """Token per row from unnormalised probabilities, picked by one uniform draw per row: [S, V], [S] -> [S]."""
    cdf = torch.cumsum(weights, dim=-1)
    total = cdf[:, -1:]
    # Strictly below the total, so the search can never run past the last token with weight.
    target = torch.minimum(uniforms.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    # First position whose cumulative weight exceeds the target: a zero-weight token never qualifies.
    return torch.searchsorted(cdf, target, right=True).squeeze(1)
