"""A step's LoRA deltas in one C call per projection (kernels/cpu_decode_layer.LoraRows, what the Python forward's
prompt chunks use) against lora_apply_packed, the torch path it replaces: the same products on the same rows, so
the same bits, on fresh random adapters of mixed ranks and targets, fp32 and bf16, both CPU builds, with adapters'
rows of one or two (the GEMV) and of many (the GEMM), with as many adapters as threads and with fewer."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from inference.models.layers import Linear
from kernels import cpu_decode_layer, cpu_gemv
from kernels import lora as lora_ref
from tests.cpu_builds import isa

pytestmark = pytest.mark.skipif(not cpu_decode_layer.available(), reason="the CPU kernels cannot be built here")
__all__ = ["isa"]  # the fixture, imported: both CPU builds

HIDDEN, INTER = 64, 96
# Each fused projection: its input width and its sub-modules' output bounds (q 64, k 32, v 32; gate, up).
SHAPES = {"qkv": (HIDDEN, [0, 64, 96, 128]), "o": (HIDDEN, [0, HIDDEN]), "gate_up": (HIDDEN, [0, INTER, 2 * INTER]),
          "down": (INTER, [0, HIDDEN])}
LAYERS = 2


def _adapters(gen: torch.Generator, dtype: torch.dtype, slots: int) -> tuple[cpu_decode_layer.AdapterTable, dict]:
    """Random packed adapters in every slot (ranks 2-16, each adapting a random subset of the sub-modules), in the
    table the C call reads and as the products (shrink, then each sub-module's expand) lora_apply_packed takes."""
    table = cpu_decode_layer.AdapterTable(slots, LAYERS, dtype)
    products: dict[tuple[int, str], list] = {}
    for slot in range(slots):
        rank = int(torch.randint(1, 9, (), generator=gen)) * 2
        for layer in range(LAYERS):
            for projection, (fan_in, bounds) in SHAPES.items():
                weights = products.setdefault((layer, projection), [None] * slots)
                chosen = [j for j in range(len(bounds) - 1) if torch.rand((), generator=gen) < 0.7]
                if not chosen:
                    continue  # this adapter leaves the projection alone
                subs = [(j, torch.randn(rank, fan_in, generator=gen) / fan_in ** 0.5,
                         torch.randn(bounds[j + 1] - bounds[j], rank, generator=gen)) for j in chosen]
                packed = lora_ref.pack(subs, bounds, 0.5 + float(torch.rand((), generator=gen)), dtype)
                shrink = Linear(packed.a)
                expands = [(column, Linear(b)) for column, b in packed.parts]
                weights[slot] = (shrink, expands)
                table.set(slot, layer, projection, (*shrink.kernel_weight(), shrink.gemm),
                          [(column, (*e.kernel_weight(), e.gemm)) for column, e in expands])
    return table, products


def _rows(row_slots: np.ndarray) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """The step's adapted rows sorted by slot and each slot's range of them, as LoRASlots.batch makes them."""
    used = np.flatnonzero(row_slots >= 0)
    order = used[np.argsort(row_slots[used], kind="stable")]
    ordered = row_slots[order]
    spans = []
    for s in sorted({int(s) for s in row_slots[used]}):
        start, end = np.searchsorted(ordered, [s, s + 1])
        spans.append((s, int(start), int(end)))
    return torch.from_numpy(order), spans


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_call_adds_what_lora_apply_packed_adds_bit_for_bit(isa: str, dtype: torch.dtype) -> None:
    seed = int(torch.randint(0, 2**31 - 1, ()))
    gen = torch.Generator().manual_seed(seed)
    slots = 5
    table, products = _adapters(gen, dtype, slots)
    if not all(table.ready):
        # bf16 products of many rows are oneDNN's on a build without AVX-512 BF16: the torch path keeps them.
        assert dtype == torch.bfloat16 and not cpu_gemv.gemm_supports(cpu_gemv.pack(torch.zeros(32, 32, dtype=dtype)))
        pytest.skip("this build's bf16 products of many rows are not the C kernels' (oneDNN's)")
    threads = torch.get_num_threads()
    # Every slot, some with one or two rows (the GEMV) and some with many (the GEMM), and rows of the base model;
    # then a single adapter (fewer adapters than threads: its products take every thread).
    steps = [np.concatenate([np.full(1, 0), np.full(2, 1), np.full(37, 2), np.full(150, 3), np.full(9, 4),
                             np.full(40, -1)]), np.concatenate([np.full(200, 3), np.full(30, -1)])]
    for row_slots in steps:
        row_slots = row_slots[torch.randperm(len(row_slots), generator=gen).numpy()]
        order, spans = _rows(row_slots)
        rows = cpu_decode_layer.LoraRows(cpu_decode_layer.AdapterRows(table, order, torch.tensor(spans)))
        for (layer, projection), weights in products.items():
            fan_in, bounds = SHAPES[projection]
            x = torch.randn(len(row_slots), fan_in, generator=gen).to(dtype)
            y = torch.randn(len(row_slots), bounds[-1], generator=gen).to(dtype)
            want = lora_ref.lora_apply_packed(y.clone(), x, weights, order, spans, dtype)
            got = y.clone()
            assert rows.takes(x, got)
            rows.add(layer, projection, x, got)
            assert torch.equal(got, want), (seed, threads, layer, projection, len(spans))
            base = torch.from_numpy(row_slots < 0)
            assert torch.equal(got[base], y[base])  # rows of the base model are left alone
            adapted = [s for s, _, _ in spans if weights[s] is not None]
            if adapted:
                changed = torch.from_numpy(np.isin(row_slots, adapted))
                assert not torch.equal(got[changed], y[changed]), seed


def test_rows_it_cannot_read_as_they_are_are_not_taken() -> None:
    gen = torch.Generator().manual_seed(3)
    table, _ = _adapters(gen, torch.float32, 2)
    order, spans = _rows(np.array([0, 1, 1, -1]))
    rows = cpu_decode_layer.LoraRows(cpu_decode_layer.AdapterRows(table, order, torch.tensor(spans)))
    x, y = torch.randn(4, HIDDEN), torch.randn(4, 2 * INTER)
    assert rows.takes(x, y)
    assert not rows.takes(x.t().contiguous().t(), y)  # not contiguous
    assert not rows.takes(x.bfloat16(), y.bfloat16())  # another dtype than the table's
    assert not rows.takes(x[:3], y)  # not the step's rows


def test_adapters_inside_the_products_on_amx_tiles_add_what_the_definition_adds() -> None:
    """hearth_lora_product (the expands summed in the base product's tiles, each output rounded once): against the
    definition in fp32 (x W^T + each part's rank vectors times its B^T), rows of the base model bit for bit the
    plain product's; gate|up straight into silu(gate) * up; rows mixing adapters inside a 16-row group, groups all
    of one adapter (read where the shrinks wrote them), a last partial group and chunks of 96 rows; and a rank off
    the tiles' 32 is left to the caller."""
    if cpu_decode_layer.lora_gemm(torch.bfloat16) is None:
        pytest.skip("bf16 products of many rows are not on AMX tiles here (a CPU, build or process without them)")
    seed = int(torch.randint(0, 2**31 - 1, ()))
    gen = torch.Generator().manual_seed(seed)
    dtype, slots = torch.bfloat16, 4
    table = cpu_decode_layer.AdapterTable(slots, 1, dtype)
    packs: dict[tuple[int, str], lora_ref.Packed] = {}
    held = []
    for slot in range(slots):
        rank = (32, 64, 32, 32)[slot]
        for projection, (fan_in, bounds) in SHAPES.items():
            chosen = [j for j in range(len(bounds) - 1) if slot == 0 or torch.rand((), generator=gen) < 0.7]
            if not chosen:
                continue
            subs = [(j, torch.randn(rank, fan_in, generator=gen) / fan_in ** 0.5,
                     torch.randn(bounds[j + 1] - bounds[j], rank, generator=gen) / rank ** 0.5) for j in chosen]
            packed = packs[(slot, projection)] = lora_ref.pack(subs, bounds, 0.5 + float(torch.rand((), generator=gen)),
                                                               dtype)
            shrink, expands = Linear(packed.a), [(column, Linear(b)) for column, b in packed.parts]
            held.append((shrink, expands))  # the table points into their weights
            table.set(slot, 0, projection, (*shrink.kernel_weight(), shrink.gemm),
                      [(column, (*e.kernel_weight(), e.gemm)) for column, e in expands])
    assert all(table.ready)
    for m, runs in ((3, False), (21, False), (130, False), (200, True)):
        if runs:  # a prompt step's rows: runs of one adapter, whole 16-row groups of one among groups mixing them
            lengths = torch.randint(1, 65, (m,), generator=gen).cumsum(0)
            starts = torch.cat([torch.zeros(1, dtype=torch.long), lengths[lengths < m]])
            which = torch.randint(-1, slots, (len(starts),), generator=gen)
            row_slots = which[torch.searchsorted(starts, torch.arange(m), right=True) - 1].numpy()
            row_slots[32:64] = 0  # at least two whole groups of slot 0, which adapts every projection
        else:
            row_slots = torch.randint(-1, slots, (m,), generator=gen).numpy()  # adapters mixed within 16-row groups
        order, spans = _rows(row_slots)
        rows = cpu_decode_layer.LoraRows(cpu_decode_layer.AdapterRows(table, order, torch.tensor(spans)))
        for projection, (fan_in, bounds) in SHAPES.items():
            w = (torch.randn(bounds[-1], fan_in, generator=gen) / fan_in ** 0.5).to(dtype)
            bias = (torch.randn(bounds[-1], generator=gen) / 10).to(dtype) if projection == "qkv" else None
            base = Linear(w, bias)
            x = torch.randn(m, fan_in, generator=gen).to(dtype)
            want = x.float() @ w.float().t() + (bias.float() if bias is not None else 0.0)
            for row, slot in enumerate(row_slots):
                packed = packs.get((int(slot), projection))
                if slot < 0 or packed is None:
                    continue
                vectors = (x[row].float() @ packed.a.float().t()).to(dtype).float()  # the shrink's rounded outputs
                rank = vectors.numel() // len(packed.parts)
                for i, (column, b) in enumerate(packed.parts):
                    want[row, column:column + b.shape[0]] += b.float() @ vectors[i * rank:(i + 1) * rank]
            matrix = cpu_decode_layer.matrix(*base.kernel_weight(), dtype, base.gemm)
            got = rows.product(0, projection, x, matrix)
            assert got is not None, (seed, m, projection)
            plain = torch.from_numpy(np.array([s < 0 or (int(s), projection) not in packs for s in row_slots]))
            assert torch.equal(got[plain], base(x)[plain]), (seed, m, projection)  # no adapter: the same bits
            where = f"seed {seed}, {m} rows, {projection}"
            torch.testing.assert_close(got.float(), want, rtol=2 ** -7, atol=2e-2,
                                       msg=lambda text, where=where: f"{where}: {text}")
            if projection == "gate_up":
                act = rows.product(0, projection, x, matrix, silu=True)
                assert act is not None and act.shape == (m, INTER)
                gate, up = want.to(dtype).float().chunk(2, dim=-1)
                torch.testing.assert_close(act.float(), torch.nn.functional.silu(gate) * up, rtol=2 ** -6, atol=2e-2,
                                           msg=lambda text, where=where: f"{where}, silu: {text}")
                assert torch.equal(act[plain], cpu_gemv.gemm_silu(x, *base.kernel_weight())[plain])
    odd = cpu_decode_layer.AdapterTable(1, 1, dtype)  # rank 16: the tiles take 32 ranks a multiply
    a, b = Linear(torch.randn(16, HIDDEN, dtype=dtype)), Linear(torch.randn(HIDDEN, 16, dtype=dtype))
    odd.set(0, 0, "o", (*a.kernel_weight(), True), [(0, (*b.kernel_weight(), True))])
    order, spans = _rows(np.zeros(8, dtype=np.int64))
    rows = cpu_decode_layer.LoraRows(cpu_decode_layer.AdapterRows(odd, order, torch.tensor(spans)))
    base = Linear(torch.randn(HIDDEN, HIDDEN, dtype=dtype))
    assert rows.product(0, "o", torch.randn(8, HIDDEN, dtype=dtype),
                        cpu_decode_layer.matrix(*base.kernel_weight(), dtype, base.gemm)) is None


class _Job(ctypes.Structure):  # csrc/lora_side.h's lora_job
    _fields_ = [("x", ctypes.c_void_p), ("packed", ctypes.c_void_p), ("y", ctypes.c_void_p), ("m", ctypes.c_int64),
                ("n", ctypes.c_int64)]


@pytest.mark.parametrize("threads", [1, 2])
def test_the_shrinks_in_one_call_give_each_products_bits(threads: int) -> None:
    """hearth_gemm_bf16_shrinks (a projection's adapters' shrinks in one parallel region on AMX tiles, each thread
    fetching its next item's weights, whichever job they belong to) against each job's own hearth_gemm_bf16: the
    same bits, on fresh random jobs of a few rows (a decode step's spans), of rows past a tile's 16 and a chunk's 96,
    and of outputs in part of a block, with rows around each output left as they were."""
    if cpu_decode_layer.lora_shrinks(torch.bfloat16) is None:
        pytest.skip("bf16 products of many rows are not on AMX tiles here (a CPU, build or process without them)")
    lib = cpu_gemv._gemm_library()
    seed = int(torch.randint(0, 2**31 - 1, ()))
    gen = torch.Generator().manual_seed(seed)
    for k in (64, 576):
        shapes = [(4, 96), (1, 32), (4, 64), (17, 40), (3, 96), (130, 64), (33, 32), (4, 96)]
        held, jobs, want = [], [], []
        for m, n in shapes:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            w = cpu_gemv.pack((torch.randn(n, k, generator=gen) / k ** 0.5).to(torch.bfloat16))
            y = torch.full((m + 2, n), 7.0, dtype=torch.bfloat16)  # a row either side that must stay as it is
            one = torch.empty(m, n, dtype=torch.bfloat16)
            lib.hearth_gemm_bf16(x.data_ptr(), w.packed.data_ptr(), None, one.data_ptr(), m, n, k, 1, None)
            held += [x, w, y]
            jobs.append(_Job(x.data_ptr(), w.packed.data_ptr(), y[1:].data_ptr(), m, n))
            want.append(one)
        array = (_Job * len(jobs))(*jobs)
        assert lib.hearth_gemm_bf16_shrinks(ctypes.addressof(array), len(jobs), k, threads) == 1
        for (m, n), y, one in zip(shapes, held[2::3], want, strict=True):
            assert torch.equal(y[1:m + 1], one), (seed, k, m, n)
            assert torch.all(y[0] == 7.0) and torch.all(y[m + 1] == 7.0), (seed, k, m, n)
    assert lib.hearth_gemm_bf16_shrinks(ctypes.addressof(array), len(jobs), 48, threads) == 0  # k off the tiles


def test_the_shrinks_in_one_call_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HEARTH_LORA_SHRINKS", "off")
    assert cpu_decode_layer.lora_shrinks(torch.bfloat16) is None
    assert cpu_decode_layer.lora_shrinks(torch.float32) is None
