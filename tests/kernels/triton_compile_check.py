"""Every Triton kernel compiled for a Hopper GPU (sm_90, the lent H100/H200) on a CPU-only machine.

The kernel tests run here under TRITON_INTERPRET=1, which executes the Python and never compiles: a kernel the
compiler refuses (the first CUDA run found one reading a plain float global) passes them all. Triton's NVIDIA
backend ships its own ptxas, so the real compiler runs without a GPU. Each wrapper is called with small CPU
tensors while its kernels are replaced by a recorder; the recorded launches, with the exact arguments and
constexprs the wrapper chose, are then compiled to PTX and cubin for sm_90.

Run as `python -m tests.kernels.triton_compile_check` in a process without TRITON_INTERPRET (the kernel tests set it
for their own process, and then the kernels are interpreted functions that cannot be compiled);
tests/kernels/test_triton_compile.py does that.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from kernels import triton_kv_compress, triton_lora, triton_paged_attention

HOPPER = GPUTarget("cuda", 90, 32)
POINTER = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.int32: "*i32",
           torch.int64: "*i64", torch.int8: "*i8", torch.uint8: "*u8"}


class _Recorder:
    """Stands in for a jitted kernel: `kernel[grid](*args, **kwargs)` records the call instead of launching."""

    def __init__(self, kernel: JITFunction) -> None:
        self.kernel = kernel
        self.calls: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid: object) -> Callable[..., None]:
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def compile_for_hopper(kernel: JITFunction, args: tuple, kwargs: dict) -> object:
    signature, constexprs = {}, {}
    values = dict(zip([p.name for p in kernel.params], args, strict=False)) | kwargs
    for param in kernel.params:
        value = values[param.name]
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = POINTER[value.dtype]
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        else:
            assert isinstance(value, int), (param.name, value)
            signature[param.name] = "i32" if -2**31 <= value < 2**31 else "i64"
    return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs), target=HOPPER)


def launches(module: object, names: list[str], call: Callable[[], object]) -> list:
    """The launches `call` makes of the named kernels of `module`, recorded instead of run."""
    recorders = {name: _Recorder(getattr(module, name)) for name in names}
    try:
        for name, recorder in recorders.items():
            setattr(module, name, recorder)
        call()
    finally:
        for name, recorder in recorders.items():
            setattr(module, name, recorder.kernel)
    found = [(r.kernel, args, kwargs) for r in recorders.values() for args, kwargs in r.calls]
    assert {k.fn.__name__ for k, _, _ in found} == set(names), "every kernel was launched"
    return found


def _pool(dtype: torch.dtype, batch: int = 3, hkv: int = 2, groups: int = 7, head_dim: int = 64,
          block_size: int = 16, width: int = 40):
    blocks = batch * hkv * width
    q = torch.randn(batch, hkv * groups, head_dim).to(dtype)
    k = torch.randn(blocks, block_size, head_dim).to(dtype)
    v = torch.randn(blocks, block_size, head_dim).to(dtype)
    pos = torch.arange(blocks * block_size, dtype=torch.int32).view(blocks, block_size)
    tables = torch.randperm(blocks, dtype=torch.int32).view(batch, hkv, width)
    lens = torch.full((batch, hkv), width * block_size, dtype=torch.int32)
    q_pos = torch.full((batch,), width * block_size, dtype=torch.int32)
    return q, k, v, pos, tables, lens, q_pos


def cases() -> dict[str, list]:
    """Each case's recorded launches: the engine's decode (Qwen's 7-head groups, long heads split), one program
    per head, exact fp32 products with a window and soft-capping; the compression kernels; LoRA."""
    out: dict[str, list] = {}
    for name, dtype, splits, window, softcap in [("decode bf16 split", torch.bfloat16, None, None, None),
                                                ("decode bf16 whole", torch.bfloat16, 1, None, None),
                                                ("decode fp32 window softcap", torch.float32, 3, 512, 30.0)]:
        q, k, v, pos, tables, lens, q_pos = _pool(dtype)
        names = ["_decode_kernel"] + (["_merge_kernel"] if splits != 1 else [])
        out[name] = launches(triton_paged_attention, names, lambda q=q, k=k, v=v, pos=pos, tables=tables, lens=lens,
                             q_pos=q_pos, splits=splits, window=window, softcap=softcap:
                             triton_paged_attention.paged_decode_attention(q, k, v, pos, tables, lens, q_pos, 0.125,
                                                                           window, softcap, num_splits=splits))
    q, k, v, pos, tables, lens, q_pos = _pool(torch.bfloat16)
    out["received"] = launches(triton_kv_compress, ["_received_stats_kernel", "_received_write_kernel"],
                               lambda: triton_kv_compress.decode_received_attention(q, k, pos, tables, lens, q_pos,
                                                                                    0.125))
    src, dst = torch.arange(40, 80), torch.arange(0, 40)
    out["move"] = launches(triton_kv_compress, ["_gather_kernel", "_scatter_kernel"],
                           lambda: triton_kv_compress.move_entries(k, v, pos, src, dst))
    rows, inp, features, slots, n_sub, rank = 24, 576, 1728, 4, 3, 16
    y, x = torch.randn(rows, features).to(torch.bfloat16), torch.randn(rows, inp).to(torch.bfloat16)
    a = torch.randn(slots, n_sub, rank, inp).to(torch.bfloat16)
    b = torch.randn(slots, features, rank).to(torch.bfloat16)
    slot = torch.randint(-1, slots, (rows,), dtype=torch.int32)
    out["lora"] = launches(triton_lora, ["_shrink_kernel", "_expand_kernel"],
                           lambda: triton_lora.lora_apply(y, x, a, b, slot, [1.0] * slots, [0, 576, 1152, 1728]))
    return out


def plain_float_global_is_refused() -> bool:
    """The failure the first CUDA run met, reproduced: a plain float where the kernels read NEG_INF."""
    q, k, v, pos, tables, lens, q_pos = _pool(torch.bfloat16)
    saved = triton_paged_attention.NEG_INF
    triton_paged_attention.NEG_INF = float("-inf")
    try:
        (kernel, args, kwargs), = launches(triton_paged_attention, ["_decode_kernel"],
                                           lambda: triton_paged_attention.paged_decode_attention(
                                               q, k, v, pos, tables, lens, q_pos, 0.125, num_splits=1))
        compile_for_hopper(kernel, args, kwargs)
    except Exception as exc:  # noqa: BLE001 (the compiler's own error type differs between versions)
        return "NEG_INF" in str(exc)
    finally:
        triton_paged_attention.NEG_INF = saved
    return False


def main() -> int:
    # Triton's on-disk cache keys a kernel by its source, not by the globals it reads: a cached compile would hide
    # a change that breaks it.
    os.environ["TRITON_ALWAYS_COMPILE"] = "1"
    failures = 0
    for name, found in cases().items():
        for kernel, args, kwargs in found:
            try:
                binary = compile_for_hopper(kernel, args, kwargs)
                print(f"ok {name}: {kernel.fn.__name__} ({len(binary.asm['cubin'])} bytes of sm_90 code)")
            except Exception as exc:  # noqa: BLE001
                failures += 1
                print(f"FAILED {name}: {kernel.fn.__name__}: {exc}")
    refused = plain_float_global_is_refused()
    print(f"{'ok' if refused else 'FAILED'} a plain float global is refused")
    return 1 if failures or not refused else 0


if __name__ == "__main__":
    raise SystemExit(main())
