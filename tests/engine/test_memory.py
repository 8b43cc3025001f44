"""Huge-page buffers (inference/memory.py): zeroed, aligned, alive as long as a view is, plain where they gain
nothing; and the layers that use them compute what they did."""

from __future__ import annotations

import gc
import itertools
from pathlib import Path

import pytest
import torch

from inference import LLM, EngineConfig, memory
from inference.kv_cache import KVLayout, KVPool
from inference.models.layers import Linear


def test_a_large_buffer_is_zeroed_aligned_to_a_huge_page_and_outlives_its_mapping_handle() -> None:
    t = memory.zeros((3 << 20,), torch.float32)
    assert t.shape == (3 << 20,) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % memory.HUGE_PAGE == 0
    assert int(t.count_nonzero()) == 0
    # mapped in whole huge pages: the last, partial one of an odd size lies wholly inside the mapping, which the
    # kernel needs to back it with a huge page too
    odd = memory.zeros(((5 << 19) + 100,), torch.uint8)
    mapped = odd.untyped_storage().nbytes() - (odd.data_ptr() - odd.untyped_storage().data_ptr())
    assert odd.data_ptr() % memory.HUGE_PAGE == 0 and mapped >= 2 * memory.HUGE_PAGE
    view = t[5:9]
    del t
    gc.collect()
    view.copy_(torch.arange(4.0))  # the mapping is still there: the view keeps it alive
    assert view.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_small_buffers_other_devices_and_the_switch_give_plain_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    small = memory.zeros((16, 16), torch.bfloat16)
    assert small.dtype == torch.bfloat16 and int(small.count_nonzero()) == 0
    monkeypatch.setenv("HEARTH_HUGEPAGES", "off")
    assert not memory.enabled()
    big = memory.zeros((1 << 20, 4), torch.int32)
    assert big.shape == (1 << 20, 4) and int(big.count_nonzero()) == 0


def test_weights_packed_onto_huge_pages_hold_their_source_and_layers_on_them_compute_the_same() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(1537, 576, generator=gen)  # 3.5 MB: on huge pages; the last block of outputs is partial
    layer = Linear(w)
    if layer.gemv_weight is not None:
        assert layer.gemv_weight.packed.data_ptr() % memory.HUGE_PAGE == 0
        assert torch.equal(layer.gemv_weight.unpacked(), w)
    for rows in (1, 2, 5):
        x = torch.randn(rows, 576, generator=gen)
        torch.testing.assert_close(layer(x), x @ w.t(), rtol=1e-5, atol=1e-4)
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)
    pool = KVPool(layout, 1024, torch.device("cpu"))
    assert pool.k.shape == (1024, 16, 64) and int(pool.k.count_nonzero()) == 0 and int(pool.pos.count_nonzero()) == 0


def test_an_arena_lays_buffers_one_after_another_zeroed_and_aligned_and_carves_again_after_a_reset() -> None:
    sizes = [((3, 5), torch.bfloat16), ((7,), torch.float32), ((2, 2, 2), torch.float32), ((1,), torch.int64)]
    room = sum(memory.Arena.size(torch.empty(shape, dtype=dtype).nbytes) for shape, dtype in sizes)
    arena = memory.Arena(room)
    made = [arena.zeros(shape, dtype) for shape, dtype in sizes]
    for (shape, dtype), t in zip(sizes, made, strict=True):
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and int(t.count_nonzero()) == 0
        assert t.data_ptr() % memory.Arena.ALIGN == 0
    for before, after in itertools.pairwise(made):  # in the order asked for, each right after the last
        assert after.data_ptr() == before.data_ptr() + memory.Arena.size(before.nbytes)
    made[0].fill_(1.0)
    assert all(int(t.count_nonzero()) == 0 for t in made[1:])  # none overlaps another
    extra = arena.zeros((4,), torch.float32)  # no room left: a buffer of its own, still zeroed
    assert int(extra.count_nonzero()) == 0
    assert not made[0].data_ptr() <= extra.data_ptr() < made[-1].data_ptr() + made[-1].nbytes
    first = made[0].data_ptr()
    arena.reset()  # carved again from the start, zeroed although the old buffers were written
    again = arena.zeros((3, 5), torch.bfloat16)
    assert again.data_ptr() == first and int(again.count_nonzero()) == 0
    big = memory.Arena(3 << 20)  # large: on huge pages like memory.zeros, and alive while a view is
    view = big.zeros((4,), torch.float32)
    assert view.data_ptr() % memory.HUGE_PAGE == 0
    del big
    gc.collect()
    view.copy_(torch.arange(4.0))
    assert view.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_pool_carves_buffers_in_turn_on_huge_pages_and_gives_one_larger_than_a_region_its_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory.Pool, "REGION", memory.HUGE_PAGE)  # one huge page a region: the third opens a new one
    pool = memory.Pool()
    third = memory.HUGE_PAGE // 3
    small = [pool.zeros((third // 4,), torch.float32) for _ in range(3)]
    assert all(int(t.count_nonzero()) == 0 and t.dtype == torch.float32 for t in small)
    assert small[0].data_ptr() % memory.HUGE_PAGE == 0  # a region starts on a huge page
    assert small[1].data_ptr() == small[0].data_ptr() + memory.Arena.size(small[0].nbytes)  # in the order asked for
    assert small[2].data_ptr() % memory.HUGE_PAGE == 0 and small[2].data_ptr() != small[0].data_ptr()  # no room left
    small[0].fill_(1.0)
    assert int(small[1].count_nonzero()) == 0
    large = pool.zeros((memory.HUGE_PAGE,), torch.bfloat16)  # larger than a region: a region of its own
    assert large.data_ptr() % memory.HUGE_PAGE == 0 and int(large.count_nonzero()) == 0
    after = pool.zeros((8,), torch.float32)  # carving goes on in the open region
    assert after.data_ptr() == small[2].data_ptr() + memory.Arena.size(small[2].nbytes)
    monkeypatch.setenv("HEARTH_HUGEPAGES", "off")
    plain = memory.Pool().zeros((4, 4), torch.float32)
    assert plain.shape == (4, 4) and int(plain.count_nonzero()) == 0


def test_a_decoder_lays_its_packed_matrices_one_after_another_in_the_order_decode_reads_them(
        tiny_llama: Path) -> None:
    llm = LLM(tiny_llama, EngineConfig(device="cpu", dtype="float32", kv_cache_memory="16MiB"))
    weights = [getattr(layer, name).gemv_weight for layer in llm.engine.model.layers
               for name in ("qkv", "o", "gate_up", "down")]
    if any(w is None for w in weights):
        pytest.skip("this machine's CPU kernels do not pack these weights")
    packed = [w.packed for w in weights]
    assert packed[0].data_ptr() % memory.HUGE_PAGE == 0
    for before, after in itertools.pairwise(packed):
        assert after.data_ptr() == before.data_ptr() + memory.Arena.size(before.nbytes)
