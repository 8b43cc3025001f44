"""Batched LoRA for many adapters in one batch: the pure-torch reference (and the engine's CPU path).

One fused projection (q|k|v, gate|up, o or down) of a layer is `n_sub` sub-modules stacked along the output.
Every loaded adapter sits in a slot of two stacked tensors:

    a [S, n_sub, R, in]     the LoRA A matrices of each sub-module, zero-padded to R ranks
    b [S, out, R]           the B rows; output column c belongs to sub-module j when bounds[j] <= c < bounds[j+1]
                            and reads only the rank vector of that sub-module

so for a row x of adapter s:  y[c] += scale[s] * sum_r b[s, c, r] * (a[s, j(c), r, :] . x).
A sub-module the adapter does not target has zero A and B, and padded ranks are zero, so both add nothing.
Each row names its slot; -1 means the base model alone.

On CUDA the Triton kernels in `triton_lora.py` compute this from the per-row slot index in two launches
(shrink, then expand). On CPU the cost is the number of small ops, not flops, so the engine keeps each adapter
*packed* instead (`pack`): one A of the sub-modules it adapts stacked [k*r, in], and one B [out, k*r] that puts
each sub-module's ranks under its own output columns, with the scale folded in. With the step's rows sorted by
adapter once (`lora_apply_packed`), a projection then costs one gather, two products per adapter present and one
scatter-add, whatever the sub-modules and ranks. The engine runs those products on its own CPU layers
(inference/models/layers.Linear: the GEMV and GEMM that stream the base's weights), which read the adapters'
weights faster than torch's matmul at a few rows each.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def pack(subs: Sequence[tuple[int, torch.Tensor, torch.Tensor]], bounds: Sequence[int], scale: float,
         dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One adapter's weights for one fused projection, packed: subs are (sub-module j, A_j [r, in],
    B_j [out_j, r]) for the sub-modules it adapts. Returns A [k*r, in] and scale * B [out, k*r]."""
    r = subs[0][1].shape[0]
    dtype = dtype or subs[0][1].dtype
    a = torch.cat([a_j for _, a_j, _ in subs]).to(dtype)
    b = torch.zeros(bounds[-1], len(subs) * r, dtype=torch.float32, device=a.device)
    for i, (j, _, b_j) in enumerate(subs):
        b[bounds[j]:bounds[j + 1], i * r:(i + 1) * r] = b_j.float() * scale
    return a, b.to(dtype)


Product = Callable[[torch.Tensor], torch.Tensor]  # rows [m, in] -> rows times a matrix: [m, out]


def matmuls(a: torch.Tensor, b: torch.Tensor) -> tuple[Product, Product]:
    """A packed adapter's two products as plain torch matmuls (the engine passes its CPU layers instead)."""
    return (lambda rows: rows @ a.t()), (lambda rows: rows @ b.t())


def lora_apply_packed(y: torch.Tensor, x: torch.Tensor, weights: Sequence[tuple[Product, Product] | None],
                      order: torch.Tensor, spans: Sequence[tuple[int, int, int]],
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """y [T, out] += LoRA(x [T, in]) with packed adapters, computed in `dtype`; returns y (changed in place).

    weights: per slot, the products by its packed A and B (see `pack`), or None where it does not adapt this
    projection (its rows add nothing); order: the rows that use an adapter, sorted so each adapter's rows are
    contiguous; spans: (slot, start, end) ranges of `order`."""
    xs = x.index_select(0, order).to(dtype)
    delta = torch.zeros(order.numel(), y.shape[1], dtype=dtype, device=y.device)
    for slot, start, end in spans:
        w = weights[slot]
        if w is not None:
            shrink, expand = w
            delta[start:end] = expand(shrink(xs[start:end]))
    return y.index_add_(0, order, delta.to(y.dtype))


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
