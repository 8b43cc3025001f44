"""`make bench`'s runner: each section lands in the document as soon as it is done, a failing benchmark keeps its
old figures without costing the others, and every section names the CPU precisely enough to tell VMs apart."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import run as bench_run
from benchmarks.machine import cpu_flags, describe

ZEN3 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx avx2 fma bmi2

processor\t: 1
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx avx2 fma bmi2
"""
XEON_AMX = """processor\t: 0
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile amx_int8
"""


def test_the_machine_line_tells_apart_vms_of_one_name() -> None:
    assert describe(ZEN3, cores=2) == "AMD EPYC (family 25 model 1; avx2), 2 cores"
    assert describe(XEON_AMX, cores=2) == (
        "Intel(R) Xeon(R) Processor (family 6 model 143; avx2, avx512f, avx512_bf16, amx_bf16, amx_tile), 2 cores")
    assert cpu_flags(XEON_AMX) == ["avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"]
    # A CPU without AVX2 says so rather than printing an empty list.
    assert describe(ZEN3.replace(" avx2", ""), cores=4) == "AMD EPYC (family 25 model 1; no AVX2), 4 cores"


def test_the_machine_line_of_this_machine_names_its_core_count() -> None:
    import os

    assert describe().endswith(f", {os.cpu_count()} cores")


def test_each_section_lands_at_once_and_a_failure_keeps_its_old_figures(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## Control plane API\n\n<!-- bench:api:start -->\nold api figures\n"
                   "<!-- bench:api:end -->\n\nnotes on the old api run\n")
    seen_before: dict[str, str] = {}

    def run_one(name: str, quick: bool) -> dict:
        seen_before[name] = doc.read_text()
        if name == "api":
            raise RuntimeError("uvicorn did not start")
        return {"result": {}, "markdown": f"| {name} | figures |"}

    failed = bench_run.run_sections(["quant", "api", "cpu_gemm"], quick=False, doc=doc, run_one=run_one)

    assert failed == ["api"]
    text = doc.read_text()
    # The first section was written before the next benchmark started: a crash there would not have lost it.
    assert "| quant | figures |" in seen_before["api"]
    assert "old api figures" in text and "notes on the old api run" in text
    assert "| cpu_gemm | figures |" in text
    assert text.index("## Weight-only int8") < text.index("## CPU GEMM")  # new sections are appended
    assert "python -m benchmarks.run --only quant`" in text
    assert "uvicorn did not start" in capsys.readouterr().err
