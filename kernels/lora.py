"""Batched LoRA for many adapters in one batch: the pure-torch reference (and the engine's CPU path).

One fused projection (q|k|v, gate|up, o or down) of a layer is `n_sub` sub-modules stacked along the output.
Every loaded adapter sits in a slot of two stacked tensors:

    a [S, n_sub, R, in]     the LoRA A matrices of each sub-module, zero-padded to R ranks
    b [S, out, R]           the B rows; output column c belongs to sub-module j when bounds[j] <= c < bounds[j+1]
                            and reads only the rank vector of that sub-module

so for a row x of adapter s:  y[c] += scale[s] * sum_r b[s, c, r] * (a[s, j(c), r, :] . x).
A sub-module the adapter does not target has zero A and B, and padded ranks are zero, so both add nothing.
Each row names its slot; -1 means the base model alone.

On CUDA the Triton kernels in `triton_lora.py` compute this from the per-row slot index in two launches (shrink,
then expand). On CPU the cost is the number of small ops and the bytes read, so the engine keeps each adapter
*packed* instead (`pack`): one A of the sub-modules it adapts stacked [k*r, in], and for each of them its own B
[out_j, r] (scale folded in) with the first output column it writes. One product gives every rank vector of a
row, then each sub-module's B expands its r of them into its own columns. (A single B [out, k*r] holding every
sub-module's ranks under its own columns would be one product, but two thirds zeros for q|k|v and half for
gate|up: at decode, where reading the adapters is what costs, eight rank-32 adapters on every projection of
SmolLM2-135M read 233 MB a step that way against 156 MB.) With the step's rows sorted by adapter once
(`lora_apply_packed`), a projection then costs one gather, 1 + k products per adapter present and one
scatter-add, whatever the ranks. The engine runs those products on its own CPU layers
(inference/models/layers.Linear: the GEMV and GEMM that stream the base's weights), which read the adapters'
weights faster than torch's matmul at a few rows each.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Packed:
    """One adapter's weights for one fused projection (see the module's doc)."""

    a: torch.Tensor  # [k*r, in]: the A of each sub-module it adapts, stacked in `parts`' order
    parts: tuple[tuple[int, torch.Tensor], ...]  # per sub-module: its first output column, scale * B_j [out_j, r]

    def to(self, device: torch.device) -> Packed:
        return Packed(self.a.to(device), tuple((column, b.to(device)) for column, b in self.parts))


def pack(subs: Sequence[tuple[int, torch.Tensor, torch.Tensor]], bounds: Sequence[int], scale: float,
         dtype: torch.dtype | None = None) -> Packed:
    """One adapter's weights for one fused projection, packed: subs are (sub-module j, A_j [r, in],
    B_j [out_j, r]) for the sub-modules it adapts."""
    dtype = dtype or subs[0][1].dtype
    a = torch.cat([a_j for _, a_j, _ in subs]).to(dtype)
    for j, _, b_j in subs:
        if b_j.shape[0] != bounds[j + 1] - bounds[j]:
            raise ValueError(f"sub-module {j}'s B has {b_j.shape[0]} rows for {bounds[j + 1] - bounds[j]} outputs")
    # Scaled in fp32, then rounded once to the products' dtype.
    return Packed(a, tuple((bounds[j], (b_j.float() * scale).to(dtype)) for j, _, b_j in subs))


Product = Callable[[torch.Tensor], torch.Tensor]  # rows [m, in] -> rows times a matrix: [m, out]
# One packed adapter's products: the shrink by its stacked A, and each sub-module's first column and expand by B_j.
Products = tuple[Product, Sequence[tuple[int, Product]]]


def matmuls(packed: Packed) -> Products:
    """A packed adapter's products as plain torch matmuls (the engine passes its CPU layers instead)."""
    return (functools.partial(_times_t, packed.a),
            [(column, functools.partial(_times_t, b)) for column, b in packed.parts])


def _times_t(weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return rows @ weight.t()


def lora_apply_packed(y: torch.Tensor, x: torch.Tensor, weights: Sequence[Products | None],
                      order: torch.Tensor, spans: Sequence[tuple[int, int, int]],
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """y [T, out] += LoRA(x [T, in]) with packed adapters, computed in `dtype`; returns y (changed in place).

    weights: per slot, the products of its packed weights (see `pack`), or None where it does not adapt this
    projection (its rows add nothing); order: the rows that use an adapter, sorted so each adapter's rows are
    contiguous; spans: (slot, start, end) ranges of `order`."""
    xs = x.index_select(0, order).to(dtype)
    delta = torch.zeros(order.numel(), y.shape[1], dtype=dtype, device=y.device)
    for slot, start, end in spans:
        w = weights[slot]
        if w is not None:
            shrink, expands = w
            vectors = shrink(xs[start:end])
            rank = vectors.shape[1] // len(expands)
            for i, (column, expand) in enumerate(expands):
                part = vectors if len(expands) == 1 else vectors[:, i * rank:(i + 1) * rank].contiguous()
                out = expand(part)
                delta[start:end, column:column + out.shape[1]] = out
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
