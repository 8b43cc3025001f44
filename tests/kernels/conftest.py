"""Each CPU kernel test runs twice: on the code this machine's CPU builds (AVX-512 where it has it) and on the
AVX2 baseline (HEARTH_CPU_AVX512=off), so both paths stay checked wherever the suite runs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kernels import cpu_build, cpu_fused, cpu_gemv, cpu_int8, cpu_norm
from kernels import cpu_paged_attention as cpa


def _forget_libraries() -> None:
    for cached in (cpu_build.load, cpu_gemv._library, cpa._library, cpu_norm._library, cpu_fused._library,
                   cpu_int8._library):
        cached.cache_clear()


@pytest.fixture(params=["native", "avx2"])
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "avx2":
        monkeypatch.setenv("HEARTH_CPU_AVX512", "off")
    _forget_libraries()
    yield request.param
    monkeypatch.undo()
    _forget_libraries()
