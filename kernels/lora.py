"""Batched LoRA for many adapters in one batch: the pure-torch reference (and the engine's CPU path).

One fused projection (q|k|v, gate|up, o or down) of a layer is `n_sub` sub-modules stacked along the output.
Every loaded adapter sits in a slot of two stacked tensors:

    a [S, n_sub, R, in]     the LoRA A matrices of each sub-module, zero-padded to R ranks
    b [S, out, R]           the B rows; output column c belongs to sub-module j when bounds[j] <= c < bounds[j+1]
                            and reads only the rank vector of that sub-module

so for a row x of adapter s:  y[c] += scale[s] * sum_r b[s, c, r] * (a[s, j(c), r, :] . x).
A sub-module the adapter does not target has zero A and B, and padded ranks are zero, so both add nothing.
Each row names its slot; -1 means the base model alone.

On CPU the engine calls `lora_apply_grouped` with the rows of each slot found once per step, so a layer costs a
few small matmuls per adapter present and nothing for the others. On CUDA the Triton kernels in
`triton_lora.py` do the same from the per-row slot index in two launches (shrink, then expand).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def slot_groups(slot: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(slot, row indices) for every slot present in `slot` [T] (int64, -1 = none)."""
    present = [int(s) for s in torch.unique(slot).tolist() if s >= 0]
    return [(s, torch.nonzero(slot == s).flatten()) for s in present]


def lora_apply_grouped(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       groups: Sequence[tuple[int, torch.Tensor]], scale: Sequence[float],
                       bounds: Sequence[int], ranks: Sequence[int] | None = None,
                       targets: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
    """y [T, out] += LoRA(x [T, in]) for the rows of each group; returns y (changed in place).

    ranks: each slot's true rank (<= R) and targets: the sub-modules each slot adapts, so that padding and
    untargeted sub-modules cost nothing; None means all of them."""
    n_sub = a.shape[1]
    for s, rows in groups:
        r = a.shape[2] if ranks is None else ranks[s]
        subs = range(n_sub) if targets is None else targets[s]
        if r == 0 or not subs:
            continue
        xs = x.index_select(0, rows).to(a.dtype)
        # [n_sub, n, r]: every sub-module's rank vector for these rows.
        t = torch.matmul(xs.unsqueeze(0), a[s, :, :r, :].transpose(-1, -2))
        if len(subs) == n_sub:
            delta = torch.empty(rows.numel(), y.shape[1], dtype=a.dtype, device=y.device)
        else:
            delta = torch.zeros(rows.numel(), y.shape[1], dtype=a.dtype, device=y.device)
        for j in subs:
            lo, hi = bounds[j], bounds[j + 1]
            torch.matmul(t[j], b[s, lo:hi, :r].t(), out=delta[:, lo:hi])
        y.index_add_(0, rows, delta.to(y.dtype), alpha=float(scale[s]))
    return y


def lora_apply_ref(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slot: torch.Tensor,
                   scale: torch.Tensor, bounds: Sequence[int]) -> torch.Tensor:
    """The definition, row by row in fp32: what every faster path is tested against. Returns a new tensor."""
    out = y.float().clone()
    for row in range(x.shape[0]):
        s = int(slot[row])
        if s < 0:
            continue
        xf = x[row].float()
        for j in range(a.shape[1]):
            lo, hi = bounds[j], bounds[j + 1]
            rank_vector = a[s, j].float() @ xf  # [R]
            out[row, lo:hi] += float(scale[s]) * (b[s, lo:hi].float() @ rank_vector)
    return out.to(y.dtype)
