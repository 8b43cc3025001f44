"""Adapter slots: a fixed number of adapters resident next to the model, loaded on demand, evicted LRU.

A request names its adapter with a `LoRARequest` (a name that identifies the exact weights, and the directory
holding them). When the request is added, the adapter is read from disk and checked against the model once
(`prepare`; a bad adapter fails that request alone, before it is queued) and kept on the host. When the
scheduler admits the sequence it `acquire`s a slot: the adapter's weights are copied into the stacked tensors
(see kernels/lora.py for the layout) unless they are there already, and the slot is pinned until the
sequence finishes or is preempted. A slot pinned by nobody may be reused, least recently released first; while
every slot is pinned by other adapters, the sequence waits.

On CUDA the adapters sit in stacked, rank-padded tensors that the Triton kernels index per row; on CPU each is
kept packed (see kernels/lora.py), where the number of small ops is what costs. Either way the storage of a
(layer, projection) is made the first time some adapter adapts it, so adapters of q and v pay for q and v only.
"""

from __future__ import annotations

import functools
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from inference import memory
from inference.config import default_dtype
from inference.errors import InvalidRequestError
from inference.lora.format import (
    FUSED,
    MODULES,
    AdapterError,
    AdapterSpec,
    BaseDims,
    inspect_adapter_dir,
    load_pairs,
)
from inference.models.layers import Linear, LinearLayer
from kernels import cpu_decode_layer, cpu_fused, cpu_gemv
from kernels import lora as lora_ref


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """An adapter to serve a request with. `name` must change whenever the weights do (it keys the prefix
    cache and the slots): the control plane uses the adapter id and its checksum."""

    name: str
    path: str | Path

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or len(self.name) > 256:
            raise InvalidRequestError("lora name must be a non-empty string of at most 256 characters")
        if not str(self.path):
            raise InvalidRequestError("lora path must name the adapter's directory")


@dataclass(slots=True)
class HostAdapter:
    """A checked adapter's weights on the host, grouped the way our fused projections are."""

    name: str
    spec: AdapterSpec
    # (layer, fused) -> (sub-module index, A [r, in], B [out_j, r]) for every sub-module it adapts
    weights: dict[tuple[int, str], list[tuple[int, torch.Tensor, torch.Tensor]]]
    load_seconds: float


@dataclass(slots=True)
class LoRAStats:
    disk_loads: int = 0  # adapters read and checked from disk
    slot_loads: int = 0  # copies into a slot
    disk_seconds: float = 0.0
    slot_seconds: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {"disk_loads": self.disk_loads, "slot_loads": self.slot_loads,
                "disk_load_ms_avg": 1000 * self.disk_seconds / self.disk_loads if self.disk_loads else 0.0,
                "slot_load_ms_avg": 1000 * self.slot_seconds / self.slot_loads if self.slot_loads else 0.0}


@dataclass(slots=True)
class _Slot:
    name: str | None = None
    pins: int = 0
    rank: int = 0
    scale: float = 0.0
    targets: dict[tuple[int, str], tuple[int, ...]] = field(default_factory=dict)


class LoRASlots:
    def __init__(self, base: BaseDims, num_layers: int, max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, host_cache: int | None = None,
                 stacked: bool = False) -> None:
        self.base, self.num_layers = base, num_layers
        self.stacked = stacked  # the Triton kernels' layout; packed per adapter otherwise
        self.packed: dict[tuple[int, str], list[lora_ref.Products | None]] = {}
        self.max_loras, self.max_rank = max_loras, max_rank
        self.dtype, self.device = dtype, device
        self.host_cache = host_cache or 4 * max_loras
        self.slots = [_Slot() for _ in range(max_loras)]
        self.a: dict[tuple[int, str], torch.Tensor] = {}  # [S, n_sub, R, in]
        self.b: dict[tuple[int, str], torch.Tensor] = {}  # [S, out, R]
        self.bounds = {fused: base.fused_bounds(fused) for fused in FUSED}
        self._hosts: OrderedDict[str, HostAdapter] = OrderedDict()
        self._idle: OrderedDict[int, None] = OrderedDict((i, None) for i in range(max_loras))  # LRU order
        self.stats = LoRAStats()
        self._matrices: dict[int, tuple[Linear, cpu_decode_layer.Matrix]] = {}  # id(layer) -> (layer, its product)
        self._arenas: list[memory.Arena | None] = [None] * max_loras  # each slot's packed products (CPU)
        self._scale = torch.zeros(max_loras, dtype=torch.float32, device=device)
        # The packed adapters' products run in fp32, where they are small and a CPU without native bf16 runs
        # bf16 ones several times slower; in bf16 where the model is bf16 on a CPU that multiplies it natively,
        # since what they cost there is reading them: eight rank-32 adapters on every projection are 0.6x the
        # base's bytes in fp32 (kernels/lora.py).
        self.packed_dtype = (torch.bfloat16 if device.type == "cpu" and dtype == torch.bfloat16
                             and default_dtype("cpu") == torch.bfloat16 else torch.float32)
        # Decode steps on the one-call layers (kernels/cpu_decode_layer) read the same products from this table.
        self.table = (cpu_decode_layer.AdapterTable(max_loras, num_layers, dtype)
                      if device.type == "cpu" and not stacked and self.packed_dtype == dtype
                      and cpu_decode_layer.available() else None)

    # ----------------------------------------------------------------- host side
    def prepare(self, lora: LoRARequest) -> HostAdapter:
        """The adapter's checked weights on the host, read from disk unless recently used.
        Raises InvalidRequestError naming what is wrong with it."""
        host = self._hosts.get(lora.name)
        if host is not None:
            self._hosts.move_to_end(lora.name)
            return host
        start = time.perf_counter()
        try:
            spec = inspect_adapter_dir(lora.path, self.base, self.max_rank)
            pairs = load_pairs(lora.path, spec)
        except AdapterError as exc:
            raise InvalidRequestError(f"LoRA adapter {lora.name!r}: {exc}") from None
        except OSError as exc:
            raise InvalidRequestError(f"LoRA adapter {lora.name!r} could not be read: {exc}") from None
        weights: dict[tuple[int, str], list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
        for (layer, module), (a, b) in sorted(pairs.items()):
            fused, sub = MODULES[module]
            weights.setdefault((layer, fused), []).append((sub, a.to(self.dtype), b.to(self.dtype)))
        host = HostAdapter(lora.name, spec, weights, time.perf_counter() - start)
        self.stats.disk_loads += 1
        self.stats.disk_seconds += host.load_seconds
        self._hosts[lora.name] = host
        while len(self._hosts) > self.host_cache:
            self._hosts.popitem(last=False)  # sequences still hold theirs; only the cache forgets it
        return host

    # ----------------------------------------------------------------- slots
    def acquire(self, host: HostAdapter) -> int | None:
        """Pin a slot holding this adapter (loading it into the least recently used free slot when it is not
        resident); None when every slot is pinned by other adapters."""
        for index, slot in enumerate(self.slots):
            if slot.name == host.name:
                self._pin(index)
                return index
        if not self._idle:
            return None
        index = next(iter(self._idle))
        self._load(index, host)
        self._pin(index)
        return index

    def can_acquire(self, name: str) -> bool:
        return bool(self._idle) or any(slot.name == name for slot in self.slots)

    def release(self, index: int) -> None:
        slot = self.slots[index]
        if slot.pins <= 0:
            raise RuntimeError(f"LoRA slot {index} released more often than acquired")
        slot.pins -= 1
        if slot.pins == 0:
            self._idle[index] = None  # most recently released last: evicted last

    def _pin(self, index: int) -> None:
        self.slots[index].pins += 1
        self._idle.pop(index, None)

    def _load(self, index: int, host: HostAdapter) -> None:
        start = time.perf_counter()
        for key in self.a:  # whatever the slot held before must add nothing now
            self.a[key][index].zero_()
            self.b[key][index].zero_()
        for packed in self.packed.values():
            packed[index] = None
        if self.table is not None:
            self.table.clear(index)
        rank = host.spec.rank
        targets: dict[tuple[int, str], tuple[int, ...]] = {}
        # In the order a step runs them: layer by layer, a layer's projections in decode_layer.c's order.
        keys = sorted(host.weights, key=lambda key: (key[0], cpu_decode_layer.PROJECTIONS.index(key[1])))
        packs = {key: lora_ref.pack(host.weights[key], self.bounds[key[1]], host.spec.scaling, self.packed_dtype)
                 for key in keys} if not self.stacked else {}
        zeros = self._arena(index, packs.values())
        for key in keys:
            subs = host.weights[key]
            bounds = self.bounds[key[1]]
            targets[key] = tuple(sorted(sub for sub, _, _ in subs))
            if not self.stacked:
                packed = self.packed.setdefault(key, [None] * self.max_loras)
                # On the CPU layers the base runs on (kernels/lora.py says why), in packed_dtype.
                weights = packs[key]
                if self.device.type == "cpu":
                    shrink = Linear(weights.a, zeros=zeros)
                    expands = [(column, Linear(b, zeros=zeros)) for column, b in weights.parts]
                    packed[index] = (shrink, expands)
                    if self.table is not None:
                        self.table.set(index, key[0], key[1], (*shrink.kernel_weight(), shrink.gemm),
                                       [(column, (*e.kernel_weight(), e.gemm)) for column, e in expands])
                else:
                    packed[index] = lora_ref.matmuls(weights.to(self.device))
                continue
            a, b = self._stack(key)
            for sub, a_w, b_w in subs:
                a[index, sub, :rank].copy_(a_w, non_blocking=True)
                b[index, bounds[sub]:bounds[sub + 1], :rank].copy_(b_w, non_blocking=True)
        self.slots[index] = _Slot(name=host.name, pins=self.slots[index].pins, rank=rank,
                                  scale=host.spec.scaling, targets=targets)
        self._scale[index] = host.spec.scaling
        self.stats.slot_loads += 1
        self.stats.slot_seconds += time.perf_counter() - start

    def _arena(self, index: int, packs: Iterable[lora_ref.Packed]) -> cpu_gemv.Zeros:
        """Where slot `index`'s packed products go on CPU: one region for the whole adapter, its matrices one after
        another in the order a step reads them (`_load` packs them in that order). A decode step reads every
        adapter present, thousands of matrices of a few KB to a few hundred KB each; apart, each begins a
        stream of its own on 4 KiB pages (they are smaller than a huge page), and the kernels' fetches ahead run
        past its end into unrelated memory. Together, on huge pages, those fetches bring in the next matrix
        while the last one's products run (docs/benchmarks.md, the LoRA notes). The slot keeps its region for
        the next adapter loaded into it where that one fits: faulting a fresh region's pages in made a load
        ~40 ms slower on an AMX Xeon VM; the slot's old products are gone by then (`_load` clears them first)."""
        if self.device.type != "cpu" or not cpu_gemv.supports(torch.empty(0, 2, dtype=self.packed_dtype)):
            return memory.zeros
        nbytes = sum(memory.Arena.size(cpu_gemv.packed_nbytes(*w.shape, w.dtype))
                     for packed in packs for w in (packed.a, *(b for _, b in packed.parts)))
        arena = self._arenas[index]
        if arena is None or arena.capacity < nbytes:
            arena = self._arenas[index] = memory.Arena(nbytes)
        else:
            arena.reset()
        return arena.zeros

    def _stack(self, key: tuple[int, str]) -> tuple[torch.Tensor, torch.Tensor]:
        if key not in self.a:
            fused = key[1]
            subs = FUSED[fused]
            fan_in = self.base.shapes[subs[0]][0]
            out = self.bounds[fused][-1]
            self.a[key] = torch.zeros(self.max_loras, len(subs), self.max_rank, fan_in,
                                      dtype=self.dtype, device=self.device)
            self.b[key] = torch.zeros(self.max_loras, out, self.max_rank, dtype=self.dtype, device=self.device)
        return self.a[key], self.b[key]

    def matrix(self, linear: Linear) -> cpu_decode_layer.Matrix:
        """A base layer's product as the C kernels take it (made once per layer; the layer is kept with it)."""
        made = self._matrices.get(id(linear))
        if made is None:
            weight, bias = linear.kernel_weight()
            matrix = cpu_decode_layer.matrix(weight, bias, self.dtype, linear.gemm) or cpu_decode_layer.Matrix()
            made = self._matrices[id(linear)] = (linear, matrix)
        return made[1]

    @property
    def resident(self) -> list[str]:
        return [slot.name for slot in self.slots if slot.name is not None]

    def metrics(self) -> dict[str, Any]:
        """The slots' `EngineMetrics` fields."""
        return {"lora_slots": self.max_loras, "lora_resident": self.resident,
                "lora_disk_loads_total": self.stats.disk_loads, "lora_slot_loads_total": self.stats.slot_loads,
                "lora_disk_load_ms_avg": self.stats.as_dict()["disk_load_ms_avg"]}

    # ----------------------------------------------------------------- per step
    def batch(self, row_slots: np.ndarray) -> LoRABatch | None:
        """The step's view: which rows use which slot. None when no row uses an adapter."""
        used = np.flatnonzero(row_slots >= 0)
        if used.size == 0:
            return None
        present = sorted({int(s) for s in row_slots[used]})
        if self.stacked:
            slot = torch.from_numpy(row_slots.astype(np.int64)).to(self.device)
            return LoRABatch(self, present, max(self.slots[s].rank for s in present), row_slots, slot=slot)
        order = used[np.argsort(row_slots[used], kind="stable")]  # each adapter's rows together
        sorted_slots = row_slots[order]
        spans = []
        for s in present:
            start, end = np.searchsorted(sorted_slots, [s, s + 1])
            spans.append((s, int(start), int(end)))
        return LoRABatch(self, present, max(self.slots[s].rank for s in present), row_slots,
                         order=torch.from_numpy(order).to(self.device), spans=spans)

    def one_call(self, batch: LoRABatch) -> cpu_decode_layer.AdapterRows | None:
        """The step's adapters as the one-call decode layers take them, or None where some adapter present must
        run in the Python forward."""
        if self.table is None or batch.order is None or batch.spans is None \
                or not all(self.table.ready[s] for s in batch.present):
            return None
        return cpu_decode_layer.AdapterRows(self.table, batch.order, torch.tensor(batch.spans, dtype=torch.int64))


class LoRABatch:
    """Adds each row's adapter to a projection's output, for the rows of one step."""

    def __init__(self, slots: LoRASlots, present: list[int], max_rank: int, row_slots: np.ndarray, *,
                 slot: torch.Tensor | None = None, order: torch.Tensor | None = None,
                 spans: list[tuple[int, int, int]] | None = None) -> None:
        self.slots, self.present, self.max_rank = slots, present, max_rank
        self.row_slots = row_slots  # each row's slot, -1 for none (host)
        self._kept: tuple[torch.Tensor, LoRABatch | None] | None = None
        self.slot = slot  # stacked: each row's slot, -1 for none
        self.order, self.spans = order, spans  # packed: rows sorted by slot, and each slot's range of them

    def kept(self, keep: torch.Tensor) -> LoRABatch | None:
        """The same adapters for the rows `keep` lists, in its order (a pass's last layer runs its output
        projection and MLP on the rows it samples alone); None where none of them uses an adapter."""
        if self._kept is None or self._kept[0] is not keep:
            self._kept = (keep, self.slots.batch(self.row_slots[keep.cpu().numpy()]))
        return self._kept[1]

    @functools.cached_property
    def cpu_rows(self) -> cpu_decode_layer.LoraRows | None:
        """Where every adapter present runs on the CPU kernels: the step's rows for their one C call a projection
        (made at the first adapted projection, its scratch kept for the step)."""
        adapters = self.slots.one_call(self)
        return cpu_decode_layer.LoraRows(adapters) if adapters is not None else None

    def touches(self, layer: int, fused: str) -> bool:
        """Whether any adapter of this step changes that projection of that layer."""
        return any((layer, fused) in self.slots.slots[s].targets for s in self.present)

    def product(self, layer: int, fused: str, x: torch.Tensor, linear: LinearLayer, silu: bool = False
                ) -> torch.Tensor:
        """linear(x) with each row's adapter added (with silu, silu(gate) * up of an adapted gate|up, which the
        caller runs apart otherwise): inside the product where the CPU kernels can carry the adapters there
        (cpu_decode_layer.LoraRows.product), else the product, then `apply`."""
        if self.touches(layer, fused) and isinstance(linear, Linear) and linear.gemm:
            rows = self.cpu_rows
            if rows is not None:
                y = rows.product(layer, fused, x, self.slots.matrix(linear), silu)
                if y is not None:
                    return y
        y = self.apply(layer, fused, x, linear(x))
        return cpu_fused.silu_mul(y) if silu else y

    def apply(self, layer: int, fused: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        key = (layer, fused)
        slots = self.slots
        if not self.touches(layer, fused):
            return y
        if self.slot is not None:
            from kernels import triton_lora

            return triton_lora.lora_apply(y, x, slots.a[key], slots.b[key], self.slot, slots._scale,
                                          slots.bounds[fused], max_rank=self.max_rank)
        assert self.order is not None and self.spans is not None
        rows = self.cpu_rows
        if rows is not None and rows.takes(x, y):
            rows.add(layer, fused, x, y)
            return y
        return lora_ref.lora_apply_packed(y, x, slots.packed[key], self.order, self.spans, slots.packed_dtype)
