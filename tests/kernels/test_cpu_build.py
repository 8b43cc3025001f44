"""Every C kernel source compiles on both CPU builds. A kernel that fails to build is not an error at run time
(the engine keeps its torch path), so without this a broken source would only show as lost speed."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from kernels import cpu_build

SOURCES = sorted(p.stem for p in cpu_build.SOURCES.glob("*.c"))
COMPILER = shutil.which("cc") or shutil.which("gcc")

pytestmark = [pytest.mark.skipif(COMPILER is None or not cpu_build.cpu_has("avx2", "fma"),
                                 reason="needs a C compiler and a CPU with AVX2 and FMA"),
              pytest.mark.usefixtures("isa")]  # native and AVX2 builds: tests/kernels/conftest.py


@pytest.mark.parametrize("name", SOURCES)
def test_every_kernel_source_compiles(name: str, tmp_path: Path) -> None:
    assert COMPILER is not None
    # The build's flags with -O0 after them: the same checks of the source, a fraction of the time.
    # An undeclared function is only a warning to C, and a library that cannot load: an error here. With every
    # vendor's tuning defined, so that code compiles on any machine.
    command = [COMPILER, *cpu_build.flags(), cpu_build.PREFETCH_L2, "-O0", "-Werror=implicit-function-declaration",
               str(cpu_build.SOURCES / f"{name}.c"), "-o",
               str(tmp_path / f"{name}.so"), "-lm"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{name}.c does not compile with {' '.join(cpu_build.flags())}:\n{result.stderr}"


def test_prebuild_builds_every_source_once_and_loads_need_no_compiler(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """`python -m kernels.cpu_build` (make models): every source for this machine's build and the AVX2 baseline,
    so a later load only opens the file; a changed header builds anew."""
    sources = tmp_path / "csrc"
    sources.mkdir()
    (sources / "one.c").write_text('#include "shared.h"\nint one(void) { return ANSWER - 1; }\n')
    (sources / "two.c").write_text('#include "shared.h"\nint two(void) { return ANSWER; }\n')
    (sources / "shared.h").write_text("#define ANSWER 2\n")
    monkeypatch.setattr(cpu_build, "SOURCES", sources)
    monkeypatch.setenv("HEARTH_DATA_DIR", str(tmp_path / "data"))
    cpu_build.load.cache_clear()
    try:
        built, failed = cpu_build.prebuild()
        builds = len({cpu_build.flags(), cpu_build.FLAGS})
        assert failed == [] and len(built) == 2 * builds
        libraries = sorted(cpu_build.cache_dir().glob("*.so"))
        assert len(libraries) == 2 * builds

        def no_compiler(*args: object) -> None:
            raise AssertionError("a prebuilt library was compiled again")

        compile_for_real = cpu_build._compile
        monkeypatch.setattr(cpu_build, "_compile", no_compiler)
        assert cpu_build.prebuild() == (built, [])
        lib = cpu_build.load("two")
        assert lib is not None and lib.two() == 2
        monkeypatch.setattr(cpu_build, "_compile", compile_for_real)
        (sources / "shared.h").write_text("#define ANSWER 3\n")
        assert cpu_build.build("one") not in libraries
    finally:
        cpu_build.load.cache_clear()


def test_the_l2_prefetch_is_built_in_on_intel_cpus_unless_the_operator_says_otherwise(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HEARTH_CPU_PREFETCH", raising=False)
    monkeypatch.setattr(cpu_build, "cpu_vendor", lambda: "GenuineIntel")
    assert cpu_build.defines() == (cpu_build.PREFETCH_L2,)
    monkeypatch.setenv("HEARTH_CPU_PREFETCH", "off")
    assert cpu_build.defines() == ()
    monkeypatch.setattr(cpu_build, "cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.setenv("HEARTH_CPU_PREFETCH", "auto")
    assert cpu_build.defines() == ()
    monkeypatch.setenv("HEARTH_CPU_PREFETCH", "on")
    assert cpu_build.defines() == (cpu_build.PREFETCH_L2,)
