"""Large CPU buffers on transparent huge pages: the weights decode streams and the KV pool it reads.

A decode step on CPU reads every weight, and with many sequences about as many bytes again of KV blocks
scattered over the pool. With 4 KiB pages that is a TLB miss every 4 KiB, and the hardware prefetchers stop at
each page boundary; on 2 MiB pages neither happens (measured: docs/benchmarks.md, "CPU kernels"). Linux gives
huge pages to anonymous memory that asks for them (`madvise(MADV_HUGEPAGE)`, honoured when
/sys/kernel/mm/transparent_hugepage/enabled is `always` or `madvise`), so such buffers are mapped here, asked
for huge pages before the first touch, and handed to torch with `torch.frombuffer`, which keeps the mapping
alive as long as any tensor views it. Elsewhere (other devices, small buffers, no madvise, or
HEARTH_HUGEPAGES=off) these are plain torch allocations.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os

import torch

HUGE_PAGE = 2 << 20
MIN_BYTES = HUGE_PAGE  # smaller buffers gain nothing


def enabled() -> bool:
    return os.environ.get("HEARTH_HUGEPAGES", "auto") != "off" and hasattr(mmap, "MADV_HUGEPAGE")


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A zero-filled tensor; on huge pages when it is a large CPU buffer (see the module's docstring)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes < MIN_BYTES or not enabled():
        return torch.zeros(shape, dtype=dtype, device=device)
    # Whole huge pages, and one spare so that the tensor can start on a 2 MiB boundary (mmap only promises 4 KiB
    # alignment). The kernel backs with huge pages only the 2 MiB ranges that lie wholly inside the mapping: with
    # nbytes + one spare, a buffer's last partial huge page stayed on 4 KiB pages unless the buffer happened to start
    # near the mapping's start (SmolLM2's LM head, 0.6 MiB past its last whole huge page, about seven times in ten).
    region = mmap.mmap(-1, -(-nbytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE,
                       flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # a kernel without THP: still a valid, zeroed buffer
        region.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(region, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start: start + nbytes].view(dtype).view(shape)


class Arena:
    """Zeroed buffers carved one after another from one region (on huge pages where `zeros` puts it), in the
    order they are asked for: weights that are read in turn then lie in turn in memory, so the kernels' fetches
    ahead, which run past the end of one matrix, bring in the next one (a LoRA adapter's many small matrices:
    inference/lora/slots.py). A request past the end gets a buffer of its own. `reset` carves from the start again
    (a LoRA slot's region, reused for the next adapter loaded into it)."""

    ALIGN = 64  # a cache line: each buffer starts on one, as torch's own allocations do

    def __init__(self, nbytes: int) -> None:
        self._raw = zeros((max(1, nbytes),), torch.uint8)
        self._at = 0
        self._used = False  # whether buffers carved before a reset may hold data

    @property
    def capacity(self) -> int:
        return self._raw.numel()

    def reset(self) -> None:
        """Carve from the start again (what was carved before must no longer be used); buffers come zeroed."""
        self._at, self._used = 0, True

    @staticmethod
    def size(nbytes: int) -> int:
        """The room a buffer of nbytes takes in an arena."""
        return -(-nbytes // Arena.ALIGN) * Arena.ALIGN

    def room(self) -> int:
        """The bytes still free to carve."""
        return self._raw.numel() - self._at

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if self._at + nbytes > self._raw.numel():
            return torch.zeros(shape, dtype=dtype)
        view = self._raw[self._at: self._at + nbytes]
        self._at += self.size(nbytes)
        if self._used:
            view.zero_()
        return view.view(dtype).view(shape)


class Pool:
    """Zeroed buffers on huge pages, carved one after another from shared regions in the order they are asked for
    (a model's packed weights: the order a decode step reads them); one larger than a region gets its own.

    `zeros` leaves buffers under a huge page plain, and a model's weights are mostly matrices of a few hundred KiB
    to a few MiB that decode streams one product at a time: SmolLM2-135M's q|k|v, o and down (0.6-1.7 MiB in
    bf16) were on the heap's 4 KiB pages. On a Zen 4 VM its 120 products a token streamed 1.15-1.27x faster with
    every matrix on huge pages (a C loop over the same shapes), and the engine's bf16 single stream gained 1.03x, in
    one process alternating with the old placement (docs/benchmarks.md, CPU peers). A region's untouched tail is
    never faulted in: it costs address space, not memory (at most the rest of the huge page the last buffer ends
    in)."""

    REGION = 32 << 20

    def __init__(self) -> None:
        self._arena: Arena | None = None

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if nbytes > self.REGION or not enabled():
            return zeros(shape, dtype)
        if self._arena is None or self._arena.room() < nbytes:
            self._arena = Arena(self.REGION)
        return self._arena.zeros(shape, dtype)
