"""Triton kernels for batched multi-adapter LoRA; reference and layout in kernels.lora.

Two launches, as in punica's BGMV: every row of the batch carries its own adapter slot, so a decode batch
that mixes many adapters costs one pass over the rows, not one matmul per adapter.

- shrink: t [T, n_sub, rank] (fp32) = a[slot[t], j, :rank] @ x[t] for every sub-module j. One program per
  (row tile, sub-module, rank tile); its rows may each name a different slot, so A is gathered per row.
- expand: y[t, c] += scale[s] * b[s, c, :rank] . t[t, j(c), :]. One program per (row tile, column tile); a
  tile may straddle sub-module bounds, so each column looks up its own sub-module j(c).

Rows whose slot is -1 are masked out of every load and store (t is left unwritten for them), and a program
whose rows are all -1 does nothing, so base-model rows cost no memory traffic. `max_rank` trims the rank loop
to the largest true rank present: padded ranks are zero, so the result does not change.

Everything accumulates in fp32. On CPU this runs only under TRITON_INTERPRET=1 (tests); the interpreter
computes bf16 arithmetic wrongly, so every load is widened to fp32 before use.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install has no Triton; the engine uses kernels.lora there
    triton = None
    tl = None


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _row_slots(slot_ptr, num_rows, BLOCK_T: tl.constexpr):
        """This program's rows, their slots (-1 past the end) and whether any of them has an adapter."""
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        slot = tl.load(slot_ptr + rows, mask=rows < num_rows, other=-1)
        return rows.to(tl.int64), slot, tl.max(slot, axis=0) >= 0

    @triton.jit
    def _shrink_kernel(
        x_ptr, a_ptr, slot_ptr, t_ptr, num_rows, rank, stride_xt,
        IN: tl.constexpr, N_SUB: tl.constexpr, R: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        rows, slot, any_live = _row_slots(slot_ptr, num_rows, BLOCK_T)
        if any_live:
            j = tl.program_id(1)
            live = slot >= 0
            s = tl.where(live, slot, 0).to(tl.int64)  # a safe address for dead rows; their loads are masked
            r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
            ar_ok = live[:, None] & (r < rank)[None, :]
            # Start of A's row (slot, j, r) for each (row, rank) pair: [BLOCK_T, BLOCK_R].
            a_rows = a_ptr + ((s[:, None] * N_SUB + j) * R + r[None, :]) * IN
            acc = tl.zeros([BLOCK_T, BLOCK_R], dtype=tl.float32)
            for k0 in range(0, IN, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                k_ok = k < IN
                xv = tl.load(x_ptr + rows[:, None] * stride_xt + k[None, :],
                             mask=live[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
                av = tl.load(a_rows[:, :, None] + k[None, None, :],
                             mask=ar_ok[:, :, None] & k_ok[None, None, :], other=0.0).to(tl.float32)
                acc += tl.sum(av * xv[:, None, :], axis=2)
            tl.store(t_ptr + (rows[:, None] * N_SUB + j) * rank + r[None, :], acc, mask=ar_ok)

    @triton.jit
    def _expand_kernel(
        y_ptr, b_ptr, t_ptr, slot_ptr, scale_ptr, bounds_ptr, num_rows, rank, stride_yt,
        OUT: tl.constexpr, N_SUB: tl.constexpr, R: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    ):
        rows, slot, any_live = _row_slots(slot_ptr, num_rows, BLOCK_T)
        if any_live:
            live = slot >= 0
            s = tl.where(live, slot, 0).to(tl.int64)
            c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            # Columns outside [bounds[0], bounds[-1]) belong to no sub-module and get nothing, as in the reference.
            c_ok = (c >= tl.load(bounds_ptr)) & (c < tl.load(bounds_ptr + N_SUB))
            sub = tl.zeros([BLOCK_N], dtype=tl.int64)
            for i in tl.static_range(1, N_SUB):
                sub += (c >= tl.load(bounds_ptr + i)).to(tl.int64)
            tc_ok = live[:, None] & c_ok[None, :]
            b_rows = b_ptr + (s[:, None] * OUT + c[None, :]) * R  # [BLOCK_T, BLOCK_N]
            t_rows = t_ptr + (rows[:, None] * N_SUB + sub[None, :]) * rank
            acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
            for r0 in range(0, rank, BLOCK_R):
                r = r0 + tl.arange(0, BLOCK_R)
                mask = tc_ok[:, :, None] & (r < rank)[None, None, :]
                bv = tl.load(b_rows[:, :, None] + r[None, None, :], mask=mask, other=0.0).to(tl.float32)
                tv = tl.load(t_rows[:, :, None] + r[None, None, :], mask=mask, other=0.0)
                acc += tl.sum(bv * tv, axis=2)
            scale = tl.load(scale_ptr + s, mask=live, other=0.0)
            y_addr = y_ptr + rows[:, None] * stride_yt + c[None, :]
            y = tl.load(y_addr, mask=tc_ok, other=0.0).to(tl.float32)
            # One rounding to y's dtype, after the fp32 sum: the same as the reference.
            tl.store(y_addr, (y + acc * scale[:, None]).to(y_ptr.dtype.element_ty), mask=tc_ok)


def _pow2(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(max(n, 1))))


def lora_apply(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slot: torch.Tensor,
               scale: torch.Tensor | Sequence[float], bounds: torch.Tensor | Sequence[int],
               max_rank: int | None = None) -> torch.Tensor:
    """y [T, out] += LoRA(x [T, in]) in place for every row with slot >= 0; returns y. As lora_apply_ref.

    a [S, n_sub, R, in], b [S, out, R], slot [T] (-1 = base model), scale [S], bounds [n_sub + 1] (output
    offsets of the sub-modules). max_rank: the largest true rank in the batch (<= R); ranks past it must be
    zero padding, and are skipped."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    if x.dim() != 2 or y.dim() != 2 or a.dim() != 4 or b.dim() != 3 or slot.dim() != 1:
        raise ValueError("expected y [T, out], x [T, in], a [S, n_sub, R, in], b [S, out, R], slot [T]")
    num_rows, in_features = x.shape
    num_slots, n_sub, full_rank, _ = a.shape
    out_features = y.shape[1]
    if (y.shape[0] != num_rows or slot.shape[0] != num_rows or a.shape[3] != in_features
            or tuple(b.shape) != (num_slots, out_features, full_rank)):
        raise ValueError(f"shape mismatch: y {tuple(y.shape)}, x {tuple(x.shape)}, a {tuple(a.shape)}, "
                         f"b {tuple(b.shape)}, slot {tuple(slot.shape)}")
    if len(bounds) != n_sub + 1:
        raise ValueError(f"{n_sub} sub-modules need {n_sub + 1} bounds, got {len(bounds)}")
    rank = full_rank if max_rank is None else min(int(max_rank), full_rank)
    if num_rows == 0 or rank <= 0 or n_sub == 0:
        return y

    device = y.device
    if x.stride(1) != 1:
        x = x.contiguous()
    # The kernels index a and b densely; the engine's stacked buffers already are, so these are no-op views.
    a = a.contiguous()
    b = b.contiguous()
    slot = slot.to(device=device, dtype=torch.int32).contiguous()
    scale_t = torch.as_tensor(scale, dtype=torch.float32, device=device).contiguous()
    bounds_t = torch.as_tensor(bounds, dtype=torch.int32, device=device).contiguous()
    # y is updated in place; a view with strided columns is worked on densely and copied back.
    target = y if y.stride(1) == 1 else y.contiguous()

    block_t = _pow2(num_rows, 2, 16)
    block_r = _pow2(rank, 2, 16)
    t = torch.empty(num_rows, n_sub, rank, dtype=torch.float32, device=device)
    _shrink_kernel[(triton.cdiv(num_rows, block_t), n_sub, triton.cdiv(rank, block_r))](
        x, a, slot, t, num_rows, rank, x.stride(0),
        IN=in_features, N_SUB=n_sub, R=full_rank,
        BLOCK_T=block_t, BLOCK_R=block_r, BLOCK_K=_pow2(in_features, 16, 32),
    )
    block_n = _pow2(out_features, 16, 32)
    _expand_kernel[(triton.cdiv(num_rows, block_t), triton.cdiv(out_features, block_n))](
        target, b, t, slot, scale_t, bounds_t, num_rows, rank, target.stride(0),
        OUT=out_features, N_SUB=n_sub, R=full_rank,
        BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_R=block_r,
    )
    if target is not y:
        y.copy_(target)
    return y
