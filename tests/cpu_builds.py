"""Runs a test on both CPU kernel builds: the code this machine's CPU builds (AVX-512 where it has it) and the
AVX2 baseline (HEARTH_CPU_AVX512=off), so both paths stay checked wherever the suite runs. Import `isa` into a
test module or conftest to use it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kernels import cpu_argmax, cpu_build, cpu_decode_layer, cpu_fused, cpu_gemv, cpu_int8, cpu_norm
from kernels import cpu_paged_attention as cpa


def forget_libraries() -> None:
    """Drop every loaded kernel library, so the next use builds (or loads) the one the environment asks for."""
    for cached in (cpu_build.load, cpu_gemv._library, cpu_gemv._gemm_library, cpa._library, cpa._causal_library, cpu_norm._library, cpu_fused._library,
                   cpu_int8._library, cpu_decode_layer._library, cpu_argmax._library):
        cached.cache_clear()


@pytest.fixture(params=["native", "avx2"])
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "avx2":
        monkeypatch.setenv("HEARTH_CPU_AVX512", "off")
    forget_libraries()
    yield request.param
    monkeypatch.undo()
    forget_libraries()
