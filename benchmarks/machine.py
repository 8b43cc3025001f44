"""Which CPU a figure was measured on, read from /proc/cpuinfo.

VMs of one name differ in what decides our figures: "AMD EPYC" has been a Zen 3 with AVX2 only (fp32 is the
engine's default dtype there), a Zen 4 and a Zen 5 with AVX-512 BF16 (bf16), and one Xeon model came with and
without AMX tiles. So every figure names the family, the model and the flags that pick the engine's kernels, not
only the name the VM reports.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

# The flags that choose a kernel or the default dtype (kernels/cpu_build.py, inference/config.py).
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _first_processor(text: str) -> dict[str, str]:
    """The fields of the first processor block (every block of one machine lists the same CPU)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_flags(text: str | None = None) -> list[str]:
    """The kernel-choosing flags this CPU has, in KERNEL_FLAGS order; the architecture's name without cpuinfo."""
    fields = _first_processor(_cpuinfo() if text is None else text)
    if "flags" not in fields:
        return [platform.machine()]
    have = set(fields["flags"].split())
    return [flag for flag in KERNEL_FLAGS if flag in have]


def cpu_label(text: str | None = None) -> str:
    """E.g. "AMD EPYC (family 25 model 1; avx2)"."""
    fields = _first_processor(_cpuinfo() if text is None else text)
    name = fields.get("model name") or platform.processor() or platform.machine()
    detail = []
    if "cpu family" in fields and "model" in fields:
        detail.append(f"family {fields['cpu family']} model {fields['model']}")
    if "flags" in fields:
        detail.append(", ".join(cpu_flags(text)) or "no AVX2")
    return f"{name} ({'; '.join(detail)})" if detail else name


def describe(text: str | None = None, cores: int | None = None) -> str:
    """E.g. "AMD EPYC (family 25 model 1; avx2), 2 cores": what every section's first line names."""
    return f"{cpu_label(text)}, {cores if cores is not None else os.cpu_count()} cores"
