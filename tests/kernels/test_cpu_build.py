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
    # An undeclared function is only a warning to C, and a library that cannot load: an error here.
    command = [COMPILER, *cpu_build.flags(), "-O0", "-Werror=implicit-function-declaration",
               str(cpu_build.SOURCES / f"{name}.c"), "-o",
               str(tmp_path / f"{name}.so"), "-lm"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{name}.c does not compile with {' '.join(cpu_build.flags())}:\n{result.stderr}"
