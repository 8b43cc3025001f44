"""The Triton multi-adapter LoRA kernels, and the engine's packed CPU path, against kernels.lora.lora_apply_ref.

Inputs are fresh each run (the seed comes from os.urandom and is printed on failure). On CPU the kernels run
under TRITON_INTERPRET=1, set before Triton is imported; on CUDA they run compiled.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton_lora = pytest.importorskip("kernels.triton_lora")
if not triton_lora.available():
    pytest.skip("Triton is not installed", allow_module_level=True)

from kernels.lora import lora_apply_packed, lora_apply_ref, matmuls, pack  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
QKV = (0, 48, 72, 96)  # q wider than k and v, as with grouped-query attention


@dataclass
class Case:
    seed: int
    y: torch.Tensor
    x: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    slot: torch.Tensor
    scale: torch.Tensor
    bounds: tuple[int, ...]
    ranks: list[int]
    targets: list[list[int]]

    def msg(self, text: str) -> str:
        return f"{text}\nseed={self.seed}"


def make_case(rows: int, in_features: int, bounds: tuple[int, ...], full_rank: int, ranks: list[int],
              targets: list[list[int]] | None = None, slots: list[int] | None = None,
              dtype: torch.dtype = torch.float32, device: str = DEVICE) -> Case:
    """Adapters padded to full_rank with zeros, and zero A and B for the sub-modules an adapter leaves alone.

    slots: every row's slot; by default random over the adapters and -1, with each of them present."""
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator().manual_seed(seed)
    n_sub, out_features, num_slots = len(bounds) - 1, bounds[-1], len(ranks)
    targets = targets if targets is not None else [list(range(n_sub))] * num_slots
    a = torch.zeros(num_slots, n_sub, full_rank, in_features)
    b = torch.zeros(num_slots, out_features, full_rank)
    for s, (r, subs) in enumerate(zip(ranks, targets, strict=True)):
        for j in subs:
            a[s, j, :r] = torch.randn(r, in_features, generator=gen) / in_features ** 0.5
            b[s, bounds[j]:bounds[j + 1], :r] = torch.randn(bounds[j + 1] - bounds[j], r, generator=gen)
    if slots is None:
        choices = list(range(-1, num_slots))
        slots = choices + torch.randint(-1, num_slots, (rows - len(choices),), generator=gen).tolist()
        slots = [slots[i] for i in torch.randperm(rows, generator=gen).tolist()]
    x = torch.randn(rows, in_features, generator=gen)
    y = torch.randn(rows, out_features, generator=gen)
    scale = torch.rand(num_slots, generator=gen) * 2 + 0.25
    tensors = [t.to(dtype).to(device) for t in (y, x, a, b)]
    return Case(seed, *tensors, torch.tensor(slots, dtype=torch.int64, device=device), scale.to(device), bounds,
                list(ranks), [list(t) for t in targets])


def reference(case: Case) -> torch.Tensor:
    return lora_apply_ref(case.y, case.x, case.a, case.b, case.slot, case.scale, case.bounds)


def run_kernel(case: Case, max_rank: int | None = None) -> torch.Tensor:
    y = case.y.clone()
    out = triton_lora.lora_apply(y, case.x, case.a, case.b, case.slot, case.scale, case.bounds, max_rank)
    assert out is y  # in place
    return y


@pytest.mark.parametrize(("rows", "in_features", "bounds", "full_rank", "ranks", "targets"), [
    (24, 64, QKV, 16, [16, 4, 8, 1], [[0, 1, 2], [0, 2], [1], [0, 1, 2]]),  # qkv; untargeted sub-modules
    (17, 40, (0, 40, 80), 8, [8, 3, 5], None),  # gate|up; odd row count, in not a power of two
    (9, 24, (0, 37), 4, [4, 2], None),  # one sub-module (o or down), out not a power of two
])
def test_kernel_matches_reference_with_mixed_slots(rows, in_features, bounds, full_rank, ranks, targets) -> None:
    case = make_case(rows, in_features, bounds, full_rank, ranks, targets)
    got = run_kernel(case)
    torch.testing.assert_close(got, reference(case), atol=1e-4, rtol=1e-5, msg=case.msg)
    assert not torch.equal(got, case.y)  # the adapters did add something
    # Base-model rows and the columns of sub-modules an adapter does not target are left exactly as they were.
    for row, s in enumerate(case.slot.tolist()):
        untouched = [j for j in range(len(bounds) - 1) if s < 0 or j not in case.targets[s]]
        for j in untouched:
            lo, hi = bounds[j], bounds[j + 1]
            assert torch.equal(got[row, lo:hi], case.y[row, lo:hi]), case.msg(f"row {row} slot {s} sub {j}")


def test_max_rank_below_padding_gives_the_same_result() -> None:
    case = make_case(20, 48, QKV, 16, [5, 3, 5, 2])
    ref = reference(case)
    trimmed = run_kernel(case, max_rank=5)  # 5: not a multiple of the kernel's rank tile
    torch.testing.assert_close(trimmed, ref, atol=1e-4, rtol=1e-5, msg=case.msg)
    torch.testing.assert_close(trimmed, run_kernel(case), atol=1e-5, rtol=1e-6, msg=case.msg)
    # A max_rank below a true rank drops that rank's contribution: the argument is really honoured.
    assert not torch.allclose(run_kernel(case, max_rank=2), ref, atol=1e-3)


def test_ranks_wider_than_one_rank_tile() -> None:
    """Rank 24 spans two of the kernels' 16-wide rank tiles, the second one partial."""
    case = make_case(8, 32, (0, 24, 40), 24, [24, 17, 9])
    ref = reference(case)
    torch.testing.assert_close(run_kernel(case), ref, atol=1e-4, rtol=1e-5, msg=case.msg)
    torch.testing.assert_close(run_kernel(case, max_rank=24), ref, atol=1e-4, rtol=1e-5, msg=case.msg)


def test_all_rows_without_adapter_leave_y_unchanged() -> None:
    case = make_case(12, 32, QKV, 8, [8, 8], slots=[-1] * 12)
    assert torch.equal(run_kernel(case), case.y)
    assert torch.equal(run_kernel(case, max_rank=0), case.y)


def test_one_slot_for_every_row() -> None:
    case = make_case(16, 64, QKV, 8, [2, 8, 4], slots=[1] * 16)
    torch.testing.assert_close(run_kernel(case), reference(case), atol=1e-4, rtol=1e-5, msg=case.msg)


def test_strided_inputs_are_read_and_written_in_place() -> None:
    """x a column slice of a wider buffer (rows not contiguous) and y a transposed view (columns strided)."""
    case = make_case(10, 32, (0, 24, 40), 4, [4, 2])
    wide = torch.randn(10, 50, device=DEVICE)
    wide[:, 7:39] = case.x
    y_storage = case.y.t().contiguous()
    y = y_storage.t()
    out = triton_lora.lora_apply(y, wide[:, 7:39], case.a, case.b, case.slot, case.scale, case.bounds)
    assert out is y
    torch.testing.assert_close(y_storage.t(), reference(case), atol=1e-4, rtol=1e-5, msg=case.msg)


@pytest.mark.parametrize("products", ["torch", "engine", "engine-bf16"])
@pytest.mark.parametrize(("ranks", "targets"), [
    ([16, 4, 8, 1], [[0, 1, 2], [0, 2], [1], [0, 1, 2]]),
    ([6, 6, 6, 6], None),
    ([1, 2, 16, 3], [[1], [2], [0, 1, 2], [0]]),
])
def test_packed_cpu_path_matches_reference(ranks, targets, products) -> None:
    """The packed path with torch's matmuls, and with the engine's CPU layers as the products (its GEMV for one
    or two rows of an adapter, its GEMM for more; k down to one rank); in bf16 as a bf16 model runs it where the
    CPU multiplies bf16 natively (inputs, adapters and the rank vector rounded to bf16)."""
    from inference.models.layers import Linear

    dtype = torch.bfloat16 if products == "engine-bf16" else torch.float32
    case = make_case(24, 64, QKV, 16, ranks, targets, device="cpu", dtype=dtype)
    bounds = case.bounds
    matrices = [pack([(j, case.a[s, j, :r], case.b[s, bounds[j]:bounds[j + 1], :r]) for j in subs], bounds,
                     float(case.scale[s]), dtype)
                for s, (r, subs) in enumerate(zip(case.ranks, case.targets, strict=True))]
    packed = [matmuls(m) if products == "torch" else (Linear(m.a), [(c, Linear(b)) for c, b in m.parts])
              for m in matrices]
    for m, subs in zip(matrices, case.targets, strict=True):  # each sub-module's B alone, never a zero block
        assert [c for c, _ in m.parts] == [bounds[j] for j in subs]
        assert [b.shape[0] for _, b in m.parts] == [bounds[j + 1] - bounds[j] for j in subs]
    used = torch.nonzero(case.slot >= 0).flatten()
    order = used[torch.argsort(case.slot[used], stable=True)]
    spans, start = [], 0
    for s in sorted(set(case.slot.tolist()) - {-1}):
        count = int((case.slot == s).sum())
        spans.append((s, start, start + count))
        start += count
    # In bf16 each of up to 16 rank terms (|delta| ~ 9 here) is rounded at 2^-8: atol ~ 1% of a delta, while a
    # missing adapter is off by the whole delta.
    tolerance = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.15, rtol=2e-2)
    got = lora_apply_packed(case.y.clone(), case.x, packed, order, spans, dtype)
    assert got.dtype == dtype
    torch.testing.assert_close(got, reference(case), **tolerance, msg=case.msg)
    # A slot that does not adapt this projection (None) leaves its rows alone.
    silent = lora_apply_packed(case.y.clone(), case.x, [None, *packed[1:]], order, spans, dtype)
    rows0 = case.slot == 0
    assert torch.equal(silent[rows0], case.y[rows0])
    torch.testing.assert_close(silent[~rows0], reference(case)[~rows0], **tolerance, msg=case.msg)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_accumulate_in_fp32(dtype) -> None:
    case = make_case(20, 64, QKV, 8, [8, 5, 3], [[0, 1, 2], [0, 2], [1]], dtype=dtype)
    got = run_kernel(case)
    assert got.dtype == dtype
    # The reference sees the same rounded inputs in fp32; the kernel adds one rounding of y to dtype (under the
    # interpreter, bf16 truncates: up to one ulp, 2**-7 relative).
    ref = lora_apply_ref(case.y.float(), case.x.float(), case.a.float(), case.b.float(), case.slot, case.scale,
                         case.bounds)
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol, msg=case.msg)


def test_bad_shapes_are_rejected() -> None:
    case = make_case(6, 16, (0, 16, 24), 4, [4])
    with pytest.raises(ValueError):
        triton_lora.lora_apply(case.y, case.x[:, :8], case.a, case.b, case.slot, case.scale, case.bounds)
    with pytest.raises(ValueError):
        triton_lora.lora_apply(case.y, case.x, case.a, case.b, case.slot[:3], case.scale, case.bounds)
    with pytest.raises(ValueError):
        triton_lora.lora_apply(case.y, case.x, case.a, case.b, case.slot, case.scale, (0, 24))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernel_at_model_shapes(dtype) -> None:
    ranks = [32, 8, 16, 4, 32, 1, 8, 16]
    targets = [[0, 1, 2], [0, 2], [1], [0, 1, 2], [0], [0, 1, 2], [2], [0, 1]]
    case = make_case(256, 576, (0, 576, 768, 960), 32, ranks, targets, dtype=dtype, device="cuda")
    ref = lora_apply_ref(case.y.float(), case.x.float(), case.a.float(), case.b.float(), case.slot, case.scale,
                         case.bounds)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(run_kernel(case).float(), ref, atol=tol, rtol=tol, msg=case.msg)
    torch.testing.assert_close(run_kernel(case, max_rank=32).float(), ref, atol=tol, rtol=tol, msg=case.msg)
