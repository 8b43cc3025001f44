"""What the host of a lent GPU machine is like, in a few seconds: first step of `benchmarks/gpu.sh`.

On the H200 of 2026-11-27 transformers.generate decoded SmolLM2-135M at 10.7 tok/s (about 93 ms a token for a
model whose kernels take well under a millisecond), and CPU-kernel tests that pass on 2-core AVX-512 and AMX VMs
ran past their time limits there on 16 threads. Both point at the host, not the card. This prints what decides
that: the CPUs the process may use and its cgroup's CPU quota, the speed of a plain Python loop, a CUDA launch and a
synchronisation, and the CPU GEMM (the native build: AVX-512 and AMX where the CPU has them) at 1, 2, 4, 8 and 16
threads, each in a child process with its own time limit, so that a count that hangs is named rather than eating
the call.

    python -m benchmarks.host_probe            # the whole probe
    python -m benchmarks.host_probe --gemm 16  # one child: the GEMM at 16 threads (what the probe runs)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path


def _cgroup_quota() -> str:
    """cgroup v2's cpu.max ("max 100000": no quota; "200000 100000": two CPUs' worth), or v1's pair."""
    v2 = Path("/sys/fs/cgroup/cpu.max")
    if v2.exists():
        return v2.read_text().strip()
    v1 = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us")
    if all(p.exists() for p in v1):
        return " ".join(p.read_text().strip() for p in v1) + " (v1)"
    return "unknown"


def _throttling() -> str:
    """cgroup v2's count of periods in which the group ran out of quota, and for how long it waited."""
    stat = Path("/sys/fs/cgroup/cpu.stat")
    if not stat.exists():
        return "unknown"
    fields = dict(line.split() for line in stat.read_text().splitlines() if line.count(" ") == 1)
    return f"nr_throttled {fields.get('nr_throttled', '?')}, throttled_usec {fields.get('throttled_usec', '?')}"


def _python_loop_ns() -> float:
    n = 2_000_000
    t0 = time.perf_counter()
    total = 0
    for i in range(n):
        total += i
    return (time.perf_counter() - t0) / n * 1e9


def _cuda_latencies_us() -> tuple[float, float] | None:
    """Mean time to launch one tiny kernel (1,000 in a row, then one wait) and to launch-and-wait one."""
    import torch

    if not torch.cuda.is_available():
        return None
    x = torch.zeros(16, device="cuda")
    for _ in range(100):
        x.add_(1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(1000):
        x.add_(1)
    torch.cuda.synchronize()
    launch = (time.perf_counter() - t0) / 1000 * 1e6
    t0 = time.perf_counter()
    for _ in range(200):
        x.add_(1)
        torch.cuda.synchronize()
    return launch, (time.perf_counter() - t0) / 200 * 1e6


def gemm_child(threads: int) -> None:
    """One fp32 product of 5 rows and one of 64 on a SmolLM2-sized weight through the CPU GEMM, checked against
    torch, timed: the path of the tests that ran out of time on the lent H200's host."""
    import torch

    from kernels import cpu_build, cpu_gemv

    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(1536, 576, generator=gen)
    packed = cpu_gemv.pack(w)
    extra = [f.removeprefix("-m") for f in cpu_build.flags() if f.startswith(("-mavx512", "-mamx"))]
    line = [f"threads {threads:2d}", "build: avx2 " + " ".join(extra)]
    for rows in (5, 64):
        x = torch.randn(rows, 576, generator=gen)
        got = cpu_gemv.gemm(x, packed)
        torch.testing.assert_close(got, x @ w.t(), rtol=1e-4, atol=1e-3)
        t0 = time.perf_counter()
        for _ in range(20):
            cpu_gemv.gemm(x, packed)
        line.append(f"{rows} rows {(time.perf_counter() - t0) / 20 * 1e3:.3f} ms")
    print(", ".join(line), flush=True)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--gemm":
        gemm_child(int(sys.argv[2]))
        return
    usable = len(os.sched_getaffinity(0))
    print(f"cgroup throttling at the start: {_throttling()}")
    print(f"cpus: os.cpu_count {os.cpu_count()}, usable by this process {usable}, cgroup cpu.max {_cgroup_quota()}")
    print(f"python loop: {_python_loop_ns():.1f} ns an iteration (a 2020s server core: about 30-60)")
    cuda = _cuda_latencies_us()
    if cuda is not None:
        print(f"cuda: {cuda[0]:.1f} us a launch, {cuda[1]:.1f} us a launch and wait (a bare H100 host: about 5 and 15)")
    for threads in (1, 2, 4, 8, 16):
        if threads > max(usable, 2):
            break
        try:
            done = subprocess.run([sys.executable, "-m", "benchmarks.host_probe", "--gemm", str(threads)],
                                  capture_output=True, text=True, timeout=20)
            print(done.stdout.strip() or f"threads {threads:2d}: exit {done.returncode} {done.stderr[-300:]}")
        except subprocess.TimeoutExpired:
            print(f"threads {threads:2d}: no answer in 20 s (a hang or a host this slow)", flush=True)
    print(f"cgroup throttling so far: {_throttling()}")


if __name__ == "__main__":
    main()
