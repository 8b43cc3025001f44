"""The Triton kernels against their torch references: time, bandwidth achieved and the card's share.

    python -m benchmarks.kernels [--quick] [--interpret]    (in `make bench` as `--only kernels`)

It needs torch and Triton only (no Django, no weights), so it runs on a bare GPU machine. Without CUDA it
reports that it did not run. `--interpret` runs the same cases at toy sizes on CPU under TRITON_INTERPRET=1:
that checks the harness and the kernels' results, while its timings mean nothing.

Every case first checks the kernel against its reference on the same fresh random inputs (the reference in fp32
on upcast inputs; the cache move exactly), then times both (CUDA events, medians). Bandwidth counts the fewest
bytes the operation must move: each cached entry a head holds read once, queries read and outputs written once.
The card's figure is a device-to-device copy measured in the same run (bytes read plus bytes written).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

QWEN = {"num_q_heads": 14, "num_kv_heads": 2, "head_dim": 64}  # Qwen2.5-Coder-0.5B, one layer
BLOCK_SIZE = 16  # the engine's default


@dataclass(frozen=True, slots=True)
class Pool:
    """One layer's paged cache with per-(sequence, kv-head) lengths, blocks placed at random."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor
    tables: torch.Tensor
    lens: torch.Tensor
    q_positions: torch.Tensor

    @property
    def entries(self) -> int:
        return int(self.lens.sum())


def make_pool(lens: torch.Tensor, context: int, dtype: torch.dtype, device: str, seed: int) -> Pool:
    """lens [B, Hkv]: the entries each head holds out of `context` positions (the last one is always kept).

    A head holding fewer than `context` entries keeps a sorted random subset of the positions, as eviction
    leaves it."""
    gen = torch.Generator().manual_seed(seed)
    batch, hkv = lens.shape
    width = -(-int(lens.max()) // BLOCK_SIZE)
    num_blocks = batch * hkv * width + 7
    tables = torch.randperm(num_blocks, generator=gen)[: batch * hkv * width].view(batch, hkv, width)
    head_dim = QWEN["head_dim"]
    pos = torch.full((num_blocks * BLOCK_SIZE,), -1, dtype=torch.int32)
    for b in range(batch):
        for h in range(hkv):
            n = int(lens[b, h])
            if n >= context:
                kept = torch.arange(context)
            else:
                kept = torch.sort(torch.randperm(context - 1, generator=gen)[: n - 1]).values
                kept = torch.cat([kept, torch.tensor([context - 1])])
            idx = torch.arange(n)
            pos[tables[b, h, idx // BLOCK_SIZE] * BLOCK_SIZE + idx % BLOCK_SIZE] = kept.int()
    groups = QWEN["num_q_heads"] // QWEN["num_kv_heads"]
    q = torch.randn(batch, hkv * groups, head_dim, generator=gen)
    k = torch.randn(num_blocks, BLOCK_SIZE, head_dim, generator=gen)
    v = torch.randn(num_blocks, BLOCK_SIZE, head_dim, generator=gen)
    q_positions = torch.full((batch,), context - 1, dtype=torch.int32)
    return Pool(q.to(dtype).to(device), k.to(dtype).to(device), v.to(dtype).to(device),
                pos.view(num_blocks, BLOCK_SIZE).to(device), tables.to(device), lens.to(device), q_positions.to(device))


def compressed_lens(batch: int, hkv: int, context: int, rate: float, seed: int) -> torch.Tensor:
    """Per-head lengths averaging context / rate but spread over a decade, as variable budgets are."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.exp(torch.empty(batch, hkv).uniform_(-1.15, 1.15, generator=gen))
    lens = (raw / raw.mean() * context / rate).round().long()
    return lens.clamp(1, context)


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("nan")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def _time_ms(fn: Callable[[], object], device: str, quick: bool) -> float:
    if device == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25 if quick else 100, rep=100 if quick else 500,
                                             return_mode="median"))
    fn()
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def copy_bandwidth(device: str, quick: bool) -> float:
    """GB/s of a large device-to-device copy, bytes read plus bytes written."""
    numel = (1 << 26 if quick else 1 << 28) if device == "cuda" else 1 << 20
    src = torch.randn(numel, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), device, quick)
    return 2 * src.numel() * src.element_size() / ms / 1e6


def _cases(device: str, quick: bool) -> list[tuple[str, Pool]]:
    """Full caches over the batch and context sizes a server sees (32-256 sequences, 1k-8k tokens), and caches
    compressed 8x on average with per-head lengths spread over a decade, as variable eviction leaves them."""
    hkv = QWEN["num_kv_heads"]
    if device != "cuda":  # the interpreter: toy sizes, the same shapes of problem
        full_shapes, compressed_shapes = [(2, 80)], [(2, 80)]
    elif quick:
        full_shapes, compressed_shapes = [(16, 2048)], [(16, 2048)]
    else:
        full_shapes = [(32, 1024), (64, 4096), (256, 2048), (32, 8192)]
        compressed_shapes = [(64, 4096), (256, 2048)]
    cases = [(f"{b} seqs x {n} tokens, full", make_pool(torch.full((b, hkv), n), n, torch.bfloat16, device, 1))
             for b, n in full_shapes]
    cases += [(f"{b} seqs x {n} tokens, 8x variable",
               make_pool(compressed_lens(b, hkv, n, 8, 2), n, torch.bfloat16, device, 3))
              for b, n in compressed_shapes]
    return cases


def _decode_row(name: str, pool: Pool, device: str, quick: bool) -> dict:
    from kernels import paged_attention as pa
    from kernels import triton_paged_attention as tpa

    scale = QWEN["head_dim"] ** -0.5

    def kernel() -> torch.Tensor:
        return tpa.paged_decode_attention(pool.q, pool.k, pool.v, pool.pos, pool.tables, pool.lens,
                                          pool.q_positions, scale)

    def reference(dtype: torch.dtype | None = None) -> torch.Tensor:
        cast = (lambda t: t.to(dtype)) if dtype else (lambda t: t)
        mask = pa.decode_mask(pool.pos, pool.tables, pool.lens, pool.q_positions)
        return pa.paged_decode_attention_ref(cast(pool.q), cast(pool.k), cast(pool.v), pool.tables, mask, scale)

    error = _relative_error(kernel(), reference(torch.float32))
    elem = pool.k.element_size()
    nbytes = pool.entries * (2 * QWEN["head_dim"] * elem + 4) + 2 * pool.q.numel() * elem
    return _row("paged decode attention", name, nbytes, error, kernel, reference, device, quick)


def _extend_row(name: str, pool: Pool, device: str, quick: bool) -> dict:
    """A prompt chunk of one sequence over its cached entries (chunked prefill, a prefix hit)."""
    from kernels import paged_attention as pa
    from kernels import triton_paged_attention as tpa

    scale = QWEN["head_dim"] ** -0.5
    chunk = 8 if device != "cuda" else 128
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(chunk, QWEN["num_q_heads"], QWEN["head_dim"], generator=gen).to(pool.q.dtype).to(device)
    last = int(pool.q_positions[0])
    q_positions = torch.arange(last - chunk + 1, last + 1, dtype=torch.int32, device=device)
    table, lens = pool.tables[0], pool.lens[0]

    def kernel() -> torch.Tensor:
        return tpa.paged_prefill_attention(q, pool.k, pool.v, pool.pos, table, lens, q_positions, scale)

    def reference(dtype: torch.dtype | None = None) -> torch.Tensor:
        cast = (lambda t: t.to(dtype)) if dtype else (lambda t: t)
        return pa.paged_prefill_attention_ref(cast(q), cast(pool.k), cast(pool.v), pool.pos, table, lens,
                                              q_positions, scale)

    error = _relative_error(kernel(), reference(torch.float32))
    elem = pool.k.element_size()
    nbytes = int(lens.sum()) * (2 * QWEN["head_dim"] * elem + 4) + 2 * q.numel() * elem
    return _row("paged extend attention", f"{chunk} queries, one seq of {name}", nbytes, error,
                kernel, reference, device, quick)


def _received_row(name: str, pool: Pool, device: str, quick: bool) -> dict:
    from kernels import kv_compress as kc
    from kernels import paged_attention as pa
    from kernels import triton_kv_compress as tkc

    scale = QWEN["head_dim"] ** -0.5

    def kernel() -> torch.Tensor:
        return tkc.decode_received_attention(pool.q, pool.k, pool.pos, pool.tables, pool.lens, pool.q_positions,
                                             scale)

    def reference(dtype: torch.dtype | None = None) -> torch.Tensor:
        cast = (lambda t: t.to(dtype)) if dtype else (lambda t: t)
        mask = pa.decode_mask(pool.pos, pool.tables, pool.lens, pool.q_positions)
        return kc.decode_received_attention_ref(cast(pool.q), cast(pool.k), pool.tables, mask, scale)

    error = _relative_error(kernel(), reference(torch.float32))
    elem = pool.k.element_size()
    nbytes = pool.entries * (QWEN["head_dim"] * elem + 4 + 4) + pool.q.numel() * elem
    return _row("received attention (eviction metric)", name, nbytes, error, kernel, reference, device, quick)


def _slots(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return table[index // BLOCK_SIZE] * BLOCK_SIZE + index % BLOCK_SIZE


def _move_row(pool: Pool, device: str, quick: bool) -> dict:
    """Compaction after an 8x eviction: every head keeps a random eighth of its entries, moved to its front."""
    from kernels import kv_compress as kc
    from kernels import triton_kv_compress as tkc

    gen = torch.Generator().manual_seed(5)
    src_parts, dst_parts = [], []
    tables, lens = pool.tables.cpu(), pool.lens.cpu()
    for b in range(tables.shape[0]):
        for h in range(tables.shape[1]):
            n = int(lens[b, h])
            kept = torch.sort(torch.randperm(n, generator=gen)[: max(1, n // 8)]).values
            src_parts.append(_slots(tables[b, h], kept))
            dst_parts.append(_slots(tables[b, h], torch.arange(kept.numel())))
    src, dst = torch.cat(src_parts).to(device), torch.cat(dst_parts).to(device)
    caches = (pool.k.clone(), pool.v.clone(), pool.pos.clone())
    mine = tuple(c.clone() for c in caches)
    tkc.move_entries(*mine, src, dst)
    kc.move_entries_ref(*caches, src, dst)
    exact = all(torch.equal(a, b) for a, b in zip(mine, caches, strict=True))
    elem = pool.k.element_size()
    nbytes = 2 * src.numel() * (2 * QWEN["head_dim"] * elem + 4) + 2 * src.numel() * 8

    def kernel() -> None:
        tkc.move_entries(*mine, src, dst)

    def reference(dtype: torch.dtype | None = None) -> None:
        kc.move_entries_ref(*caches, src, dst)

    return _row("cache move (compaction)", f"{src.numel():,} entries of {len(src_parts)} heads", nbytes,
                0.0 if exact else float("nan"), kernel, reference, device, quick)


def _row(kernel_name: str, case: str, nbytes: int, error: float, kernel: Callable[[], object],
         reference: Callable[..., object], device: str, quick: bool) -> dict:
    kernel_ms = _time_ms(kernel, device, quick)
    reference_ms = _time_ms(reference, device, quick)
    return {"kernel": kernel_name, "case": case, "bytes": nbytes, "rel_error": error, "kernel_ms": kernel_ms,
            "reference_ms": reference_ms, "kernel_gbps": nbytes / kernel_ms / 1e6,
            "reference_gbps": nbytes / reference_ms / 1e6}


def run(quick: bool = False, interpret: bool = False) -> dict:
    if torch.cuda.is_available():
        device = "cuda"
    elif interpret:
        device = "cpu"
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is first imported
    else:
        return {"skipped": "no CUDA device on this machine, so the kernels were not timed (on one, "
                           "`bash benchmarks/gpu.sh` runs the kernel tests and this benchmark with torch and Triton "
                           "alone)"}
    try:
        import triton  # noqa: F401
    except ImportError:
        return {"skipped": "Triton is not installed"}
    card = copy_bandwidth(device, quick)
    rows = []
    cases = _cases(device, quick)
    for name, pool in cases:
        rows.append(_decode_row(name, pool, device, quick))
        rows.append(_received_row(name, pool, device, quick))
    for name, pool in cases:
        rows.append(_extend_row(name, pool, device, quick))
    rows.append(_move_row(cases[0][1], device, quick))
    for row in rows:
        row["card_share"] = row["kernel_gbps"] / card
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU, TRITON_INTERPRET=1 (timings meaningless)"
    return {"device": name, "copy_gbps": card, "rows": rows}


def markdown(result: dict) -> str:
    if "skipped" in result:
        return f"Not run: {result['skipped']}."
    lines = [
        f"Device: {result['device']}. Device-to-device copy: {result['copy_gbps']:,.0f} GB/s (read + written). "
        "Shapes of Qwen2.5-Coder-0.5B, one layer (14 query heads over 2 kv-heads, head dim 64), bf16, blocks of "
        f"{BLOCK_SIZE}. Bytes: the fewest the operation must move.",
        "",
        "| kernel | case | rel. error vs fp32 reference | Triton (ms) | torch reference (ms) | speedup | "
        "Triton GB/s | share of copy bandwidth |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["rows"]:
        error = "exact" if r["kernel"].startswith("cache move") and r["rel_error"] == 0 else f"{r['rel_error']:.1e}"
        lines.append(f"| {r['kernel']} | {r['case']} | {error} | {r['kernel_ms']:.3f} | {r['reference_ms']:.3f} | "
                     f"{r['reference_ms'] / r['kernel_ms']:.2f}x | {r['kernel_gbps']:,.0f} | "
                     f"{r['card_share']:.0%} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--interpret", action="store_true", help="toy sizes on CPU under TRITON_INTERPRET=1")
    args = parser.parse_args()
    print(markdown(run(quick=args.quick, interpret=args.interpret)))


if __name__ == "__main__":
    main()
