"""Builds and loads the C kernels of kernels/csrc for the CPU (AVX2 + FMA, OpenMP).

Each source is compiled once per machine with the system C compiler into a cache directory, under a name
keyed by the source's hash and flags, and loaded with ctypes: no torch headers, nothing to ship. `make models`
builds them all at once (`python -m kernels.cpu_build`, a compiler per library); anything missing then is built
at its first use (seconds on AVX2, about half a minute for gemm.c with AVX-512 BF16 and AMX). Without a C
compiler or those CPU features, or with HEARTH_CPU_KERNELS=off, `load` returns None and callers keep their torch
path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch  # noqa: F401  (loaded first: its OpenMP runtime is the one the kernels link against)

SOURCES = Path(__file__).resolve().parent / "csrc"
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")
# Where the CPU has them, kernels may also use 16-lane loops (`#ifdef __AVX512F__`), AVX-512 BF16 dot
# products (`#ifdef __AVX512BF16__`) and AMX tiles (`#ifdef __AMX_BF16__`).
AVX512_FLAGS = ("-mavx512f", "-mavx512bw")
BF16_FLAGS = ("-mavx512bf16",)
AMX_FLAGS = ("-mamx-tile", "-mamx-bf16")
PREFETCH_L2 = "-DHEARTH_PREFETCH_L2"  # see `defines`


def cpu_has(*flags: str) -> bool:
    """Whether /proc/cpuinfo lists every one of these CPU flags."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((row for row in f if row.startswith("flags")), "")
    except OSError:
        return False
    have = set(line.split(":", 1)[-1].split())
    return all(flag in have for flag in flags)


def flags() -> tuple[str, ...]:
    """This machine's compiler flags: the AVX2 baseline, plus AVX-512 (and its BF16 dot products, and AMX tiles)
    where the CPU has them. HEARTH_CPU_AVX512=off keeps the baseline (the AVX2 paths, on any machine: tests and
    comparisons); HEARTH_CPU_AMX=off leaves the tiles out."""
    if os.environ.get("HEARTH_CPU_AVX512", "auto") == "off" or not cpu_has("avx512f", "avx512bw"):
        return FLAGS
    if not cpu_has("avx512_bf16"):
        return FLAGS + AVX512_FLAGS
    amx = os.environ.get("HEARTH_CPU_AMX", "auto") != "off" and cpu_has("amx_tile", "amx_bf16")
    return FLAGS + AVX512_FLAGS + BF16_FLAGS + (AMX_FLAGS if amx else ())


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id (GenuineIntel, AuthenticAMD, ...), or "" where it says none."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((row for row in f if row.startswith("vendor_id")), "")
    except OSError:
        return ""
    return line.split(":", 1)[-1].strip()


def defines() -> tuple[str, ...]:
    """Tuning that depends on the CPU's maker rather than its instruction sets, as -D flags every library is built
    with. HEARTH_PREFETCH_L2: the one- and two-row products ask for their weights 8 KiB ahead into L2 (gemv.c).
    On the Intel Xeons it measured 1.04-1.09x (fp32) and ~1.3x (AVX-512 BF16 pairs) the products' rate; on a Zen 4
    EPYC, slower (docs/benchmarks.md, CPU peers). HEARTH_CPU_PREFETCH=on or off overrides the vendor's choice (auto), for comparisons."""
    choice = os.environ.get("HEARTH_CPU_PREFETCH", "auto")
    prefetch = choice == "on" or (choice == "auto" and cpu_vendor() == "GenuineIntel")
    return (PREFETCH_L2,) if prefetch else ()


def cache_dir() -> Path:
    root = os.environ.get("HEARTH_DATA_DIR")
    return Path(root) / "kernels" if root else Path.home() / ".cache" / "hearth" / "kernels"


def _compile(compiler: str, source: Path, target: Path, build_flags: tuple[str, ...]) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: processes starting together never load a half-written library.
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
        partial = Path(tmp.name)
    try:
        subprocess.run([compiler, *build_flags, str(source), "-o", str(partial), "-lm"], check=True,
                       capture_output=True, timeout=300)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def build(name: str, build_flags: tuple[str, ...] | None = None) -> Path | None:
    """kernels/csrc/<name>.c compiled with these flags (this machine's by default) into the cache, unless it is
    there already: the library's path, or None where it cannot be built here."""
    if os.environ.get("HEARTH_CPU_KERNELS", "auto") == "off" or not cpu_has("avx2", "fma"):
        return None
    compiler = _compiler()
    if compiler is None:
        return None
    build_flags = (flags() if build_flags is None else build_flags) + defines()
    source = SOURCES / f"{name}.c"
    # Keyed by the source, the headers and the flags: a change to any of them builds anew.
    headers = b"".join(h.read_bytes() for h in sorted(SOURCES.glob("*.h")))
    digest = hashlib.sha256(source.read_bytes() + headers + " ".join(build_flags).encode()).hexdigest()[:16]
    target = cache_dir() / f"{name}-{digest}.so"
    try:
        if not target.exists():
            _compile(compiler, source, target, build_flags)
    except (OSError, subprocess.SubprocessError):
        return None
    return target


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """kernels/csrc/<name>.c as a loaded library, or None where it cannot be built here."""
    target = build(name)
    if target is None:
        return None
    try:
        # torch is loaded, so its libgomp.so.1 is in the process: the library's OpenMP calls resolve to that
        # runtime and both share one thread pool instead of two pools fighting over the cores.
        return ctypes.CDLL(str(target))
    except OSError:
        return None


def prebuild() -> tuple[list[str], list[str]]:
    """Every kernel built now for this machine, and for the AVX2 baseline where that differs (HEARTH_CPU_AVX512=off
    asks for it), one compiler per library, all at once: (built, failed) names. `make models` runs it, so an engine's
    first start loads the libraries instead of compiling them. Why: with AVX-512 BF16 and AMX, gemm.c's register
    tiles for every row count and dtype take the compiler about half a minute, and the first engine start (or the
    first test to use it) waited that long; on the lent H200 tests ran out of their time limit in that wait."""
    names = sorted(path.stem for path in SOURCES.glob("*.c"))
    flag_sets = list(dict.fromkeys([flags(), FLAGS]))
    jobs = [(name, build_flags) for build_flags in flag_sets for name in names]
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        done = list(pool.map(lambda job: build(*job) is not None, jobs))
    labels = [f"{name} ({'avx2' if f == FLAGS else 'native'})" for name, f in jobs]
    return ([label for label, ok in zip(labels, done, strict=True) if ok],
            [label for label, ok in zip(labels, done, strict=True) if not ok])


def main() -> int:
    started = time.monotonic()
    built, failed = prebuild()
    extra = " ".join(f.removeprefix("-m") for f in flags() if f not in FLAGS) or "the AVX2 baseline"
    print(f"CPU kernels: {len(built)} libraries ready in {cache_dir()} ({extra}; {time.monotonic() - started:.1f} s)"
          + (f"; could not build {', '.join(failed)}: the engine uses torch there" if failed else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
