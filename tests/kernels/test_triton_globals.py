"""Compiled Triton (3.6 on the lent H100) refuses a kernel that reads a plain module global, such as a float
constant; the interpreter that runs the kernel tests on CPU reads it happily. So every jitted function of
kernels/triton_* is checked here for the globals it names: each must be a constexpr, another jitted function, a
module or part of triton.language."""

from __future__ import annotations

import importlib
import types

import pytest

triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402
from triton.runtime.jit import KernelInterface  # noqa: E402

MODULES = ["kernels.triton_paged_attention", "kernels.triton_kv_compress", "kernels.triton_lora"]


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _allowed(value: object) -> bool:
    return (isinstance(value, (tl.constexpr, KernelInterface, types.ModuleType))
            or getattr(value, "__module__", "").startswith("triton"))


@pytest.mark.parametrize("module_name", MODULES)
def test_jitted_functions_read_only_constexpr_globals(module_name: str) -> None:
    module = importlib.import_module(module_name)
    # JITFunction compiled, InterpretedFunction under TRITON_INTERPRET=1 (set by other kernel tests on CPU)
    kernels = [v for v in vars(module).values() if isinstance(v, KernelInterface)]
    assert kernels, f"{module_name} defines no jitted function"
    for kernel in kernels:
        fn = kernel.fn
        bad = {name: type(fn.__globals__[name]).__name__ for name in _code_names(fn.__code__)
               if name in fn.__globals__ and not _allowed(fn.__globals__[name])}
        assert not bad, f"{module_name}.{fn.__name__} reads non-constexpr globals {bad}"


def test_the_check_catches_a_plain_float_global() -> None:
    namespace: dict = {"tl": tl, "LIMIT": 1.5}
    exec("def kernel(x):\n    return tl.full([4], LIMIT, tl.float32)\n", namespace)
    fn = namespace["kernel"]
    assert not _allowed(fn.__globals__["LIMIT"]) and "LIMIT" in _code_names(fn.__code__)
