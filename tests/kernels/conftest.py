"""Each CPU kernel test that asks for `isa` runs on both builds (tests/cpu_builds)."""

from tests.cpu_builds import isa

__all__ = ["isa"]
