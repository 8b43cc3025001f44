"""A decoder layer of a decode step (one token per sequence, and prompt chunks beside them) as one C call
(csrc/decode_layer.c).

The layer's nine kernel calls (norms, products, rotary + KV write, paged attention, SiLU * up) are the ones
the decoder's Python forward makes, made from C in the same order on the same buffers: the results are the
Python path's bit for bit, without the few microseconds of ctypes, torch allocation and interpreter work each
call costs there (about a fifth of a SmolLM2 token once the weights stream at memory speed).

`DecodeStack` holds what stays fixed (the model's shapes, each layer's weights and kernel entry points); each
step `start`s with its token rows and per-layer block tables, then runs `layer(step, i)` for every layer, so
the engine can still act between layers. `matrix` says whether a product can run here at all; a model with any
product that cannot (or a build without the kernels, HEARTH_CPU_KERNELS=off, HEARTH_CPU_DECODE_LAYER=off)
keeps the Python forward. Steps of more than MAX_ROWS sequences run here too where every product of more rows
is also one of these kernels (cpu_gemv's gemm where the layers route products of many rows to it, int8 on its
own kernel at any row count; `many_rows`); otherwise (products of many rows on oneDNN) those steps keep the
Python forward. Steps with LoRA adapters run here too where every adapter present has its products on these
kernels in the activations' dtype (`AdapterTable`): each adapted projection adds its rows' deltas in C. Steps
with prompt chunks (`PromptRows`) run here, adapters included, where the stack was built with `prompts` (the
forward runs this model's prompt attention on the C prompt kernels).
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels import cpu_build, cpu_fused, cpu_gemv, cpu_int8, cpu_norm
from kernels import cpu_paged_attention as cpa

MAX_ROWS = cpu_gemv.MAX_ROWS  # the most rows of the GEMV entry points; more take each product's `many`
GEMV_F32, GEMV_BF16, I8_F32, I8_BF16, I8_PAIRS = range(5)  # decode_layer.c's product kinds
_c = ctypes.c_void_p


class Matrix(ctypes.Structure):
    _fields_ = [("fn", _c), ("kind", ctypes.c_int64), ("packed", _c), ("scale", _c), ("bias", _c),
                ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("many", _c)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", Matrix), ("o", Matrix), ("gate_up", Matrix), ("down", Matrix), ("input_norm", _c),
                ("post_norm", _c), ("cos", _c), ("sin", _c), ("window", ctypes.c_int64), ("gate_up_silu", _c)]


class _Model(ctypes.Structure):
    _fields_ = ([(name, _c) for name in ("norm", "rope", "attention", "silu_mul")]
                + [(name, ctypes.c_int64) for name in ("elem", "hidden", "hq", "hkv", "head_dim", "inter")]
                + [(name, ctypes.c_float) for name in ("eps", "scale", "softcap")]
                + [("norm_offset", ctypes.c_int64), ("threads", ctypes.c_int64), ("gemv_rows", ctypes.c_int64)]
                + [(name, _c) for name in ("causal", "prefill", "lora_gemm", "lora_shrinks")])


class _Prompt(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ("start", "end", "context")] + [("tables", _c),
                                                                                   ("width", ctypes.c_int64)]


MAX_PARTS = 3  # decode_layer.c's most sub-modules of a fused projection (q|k|v)


class Adapter(ctypes.Structure):
    _fields_ = [("shrink", Matrix), ("expand", Matrix * MAX_PARTS), ("column", ctypes.c_int64 * MAX_PARTS),
                ("parts", ctypes.c_int64)]


class _Lora(ctypes.Structure):
    _fields_ = [("table", _c), ("layers", ctypes.c_int64), ("order", _c), ("spans", _c), ("n_spans", ctypes.c_int64),
                ("xs", _c), ("mid", _c), ("delta", _c), ("mid_row", ctypes.c_int64), ("widened_row", ctypes.c_int64),
                ("pieces", _c), ("rank", ctypes.c_int64)]


class _Step(ctypes.Structure):
    _fields_ = ([(name, ctypes.c_int64) for name in ("rows", "width", "block_size")]
                + [(name, _c) for name in ("positions", "slots", "tables", "lens", "k_cache", "v_cache", "pos_cache",
                                           "h", "x", "normed", "qkv", "q", "attn", "gate_up", "act", "widened")]
                + [("has_x", ctypes.c_int64), ("lora", _c), ("decodes", ctypes.c_int64), ("prompts", _c),
                   ("n_prompts", ctypes.c_int64), ("scratch", _c), ("keep", _c), ("kept", ctypes.c_int64),
                   ("last", ctypes.c_int64), ("lora_kept", _c), ("received", _c)])


PROJECTIONS = ("qkv", "o", "gate_up", "down")  # decode_layer.c's order of a layer's products


class AdapterTable:
    """Every adapter slot's packed products per (layer, projection) as decode_layer.c reads them
    ([slots][layers][projections]; an empty entry adds nothing), kept beside inference/lora/slots.py's slots."""

    def __init__(self, slots: int, layers: int, dtype: torch.dtype) -> None:
        self.layers, self.dtype = layers, dtype
        self.entries = (Adapter * (slots * layers * len(PROJECTIONS)))()
        self.ready = [True] * slots  # whether every product of the slot's adapter runs here
        self.widest = 0  # the most columns of any adapter's rank vectors (k * r)
        self.rank = 0  # the highest rank of any adapter
        self.widest_in = self.widest_out = 0  # the widest input and output of any adapted projection
        # What hearth_lora_add and hearth_lora_product read of a model: the activations' size, the GEMV's most rows
        # (threads per call) and the product the adapters ride inside.
        self.model = _Model(elem=torch.finfo(dtype).bits // 8, gemv_rows=MAX_ROWS, lora_gemm=lora_gemm(dtype),
                            lora_shrinks=lora_shrinks(dtype))

    def _index(self, slot: int, layer: int, projection: str) -> int:
        return (slot * self.layers + layer) * len(PROJECTIONS) + PROJECTIONS.index(projection)

    def clear(self, slot: int) -> None:
        for i in range(slot * self.layers * len(PROJECTIONS), (slot + 1) * self.layers * len(PROJECTIONS)):
            self.entries[i] = Adapter()
        self.ready[slot] = True

    def set(self, slot: int, layer: int, projection: str, shrink: tuple,
            expands: list[tuple[int, tuple]]) -> None:
        """One projection's products of the adapter in `slot` (kernels/lora.py's packed layout): the shrink and,
        per sub-module it adapts, its first output column and expand; each product as (kernel weight, bias,
        whether that layer sends more rows to the GEMM), `Linear.kernel_weight` and `Linear.gemm`. A product this
        file cannot run (or not for every row count) leaves the slot to the Python forward."""
        first = matrix(shrink[0], shrink[1], self.dtype, shrink[2])
        parts = [matrix(weight, bias, self.dtype, gemm) for _, (weight, bias, gemm) in expands]
        if not 0 < len(parts) <= MAX_PARTS or any(m is None or not m.many for m in (first, *parts)):
            self.ready[slot] = False
            return
        columns = [column for column, _ in expands]
        self.entries[self._index(slot, layer, projection)] = Adapter(
            first, (Matrix * MAX_PARTS)(*parts), (ctypes.c_int64 * MAX_PARTS)(*columns), len(parts))
        self.widest = max(self.widest, first.n)
        self.rank = max(self.rank, first.n // len(parts))
        self.widest_in = max(self.widest_in, first.k)
        self.widest_out = max(self.widest_out, *(c + m.n for c, m in zip(columns, parts, strict=True)))

    def scratch(self, order: torch.Tensor, spans: torch.Tensor, widest_in: int, widest_out: int,
                widened_row: int) -> tuple[_Lora, tuple]:
        """The step's adapters as decode_layer.c reads them, with scratch for the rows that use one (inputs of
        up to widest_in elements, outputs of up to widest_out), and what the struct points into."""
        order = order.to(torch.int64).contiguous()
        spans = spans.to(torch.int64).contiguous()
        used = order.numel()
        widths = (widest_in, self.widest, widest_out, self.rank)  # gathered rows, rank vectors, deltas, pieces
        scratch = torch.empty(used * sum(widths), dtype=self.dtype)
        pointers, offset = [], scratch.data_ptr()
        for width in widths:
            pointers.append(offset)
            offset += used * width * self.model.elem
        xs, mid, delta, pieces = pointers
        struct = _Lora(ctypes.addressof(self.entries), self.layers, order.data_ptr(), spans.data_ptr(),
                       spans.shape[0], xs, mid, delta, self.widest, widened_row, pieces, self.rank)
        return struct, (order, spans, scratch, self)


@dataclass(frozen=True, slots=True)
class AdapterRows:
    """A step's adapters for the one-call layers: the table, the rows that use an adapter sorted by slot
    (`order`, int64), and (slot, start, end) ranges of it (`spans`, int64 [n, 3])."""

    table: AdapterTable
    order: torch.Tensor
    spans: torch.Tensor


class LoraRows:
    """A step's adapters for the Python forward's projections (prompt chunks, steps off the one-call layers): each
    adapted projection adds its rows' deltas in one C call (decode_layer.c's hearth_lora_add), the products and
    sums the one-call layers make, so lora_apply_packed's bits without its gather, zeroed [rows, out] delta and
    scatter-add, and without a Python call per adapter. Scratch for the step's rows is allocated once."""

    def __init__(self, adapters: AdapterRows) -> None:
        table = self.table = adapters.table
        widened_row = max(table.widest_in, table.widest)  # the GEMV widens x of any adapter product to fp32
        self.widened = torch.empty(adapters.order.numel() * widened_row, dtype=torch.float32)
        self.struct, self._held = table.scratch(adapters.order, adapters.spans, table.widest_in, table.widest_out,
                                                widened_row)
        self._add = _library().hearth_lora_add
        self._product = _library().hearth_lora_product

    def takes(self, x: torch.Tensor, y: torch.Tensor) -> bool:
        """Whether `add` reads x and writes y as they are (contiguous rows of the step in the table's dtype)."""
        return (x.dim() == 2 and y.dim() == 2 and x.shape[0] == y.shape[0] and x.dtype == y.dtype == self.table.dtype
                and x.is_contiguous() and y.is_contiguous() and x.shape[1] <= self.table.widest_in
                and y.shape[1] <= self.table.widest_out)

    def add(self, layer: int, projection: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y [rows, out] += each adapted row's delta from x [rows, in] (in place); see `takes`."""
        self.table.model.threads = torch.get_num_threads()
        self._add(ctypes.byref(self.table.model), ctypes.byref(self.struct), self.widened.data_ptr(), layer,
                  PROJECTIONS.index(projection), x.data_ptr(), x.shape[1], y.data_ptr(), y.shape[1])

    def product(self, layer: int, projection: str, x: torch.Tensor, weight: Matrix, silu: bool = False
                ) -> torch.Tensor | None:
        """x W^T with each adapted row's expands summed inside the product (decode_layer.c's hearth_lora_product;
        with silu, silu(gate) * up of a fused gate|up weight), or None where they cannot ride in it (then the
        caller runs the product and `add`s). x: the step's rows, as `takes` reads them; weight from `matrix`."""
        if not self.table.model.lora_gemm or x.dim() != 2 or x.dtype != self.table.dtype or not x.is_contiguous() \
                or x.shape[1] != weight.k or x.shape[1] > self.table.widest_in:
            return None
        self.table.model.threads = torch.get_num_threads()
        y = torch.empty(x.shape[0], weight.n // 2 if silu else weight.n, dtype=x.dtype)
        done = self._product(ctypes.byref(self.table.model), ctypes.byref(self.struct), self.widened.data_ptr(),
                             layer, PROJECTIONS.index(projection), ctypes.byref(weight), x.data_ptr(), y.data_ptr(),
                             x.shape[0], int(silu))
        return y if done else None


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = cpu_build.load("decode_layer")
    if lib is not None:
        lib.hearth_decode_layer.argtypes = [_c, _c, _c, ctypes.c_int64]
        lib.hearth_decode_layer.restype = None
        lib.hearth_lora_add.argtypes = [_c, _c, _c, *[ctypes.c_int64] * 2, _c, ctypes.c_int64, _c, ctypes.c_int64]
        lib.hearth_lora_add.restype = None
        lib.hearth_lora_product.argtypes = [_c, _c, _c, *[ctypes.c_int64] * 2, _c, _c, _c, *[ctypes.c_int64] * 2]
        lib.hearth_lora_product.restype = ctypes.c_int64
    return lib


def available() -> bool:
    return (os.environ.get("HEARTH_CPU_DECODE_LAYER", "auto") != "off" and _library() is not None
            and cpu_gemv._library() is not None and cpu_norm._library() is not None
            and cpu_fused._library() is not None and cpa.available())


def _address(fn: ctypes._CFuncPtr) -> int:
    return ctypes.cast(fn, _c).value


def _ptr(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


def matrix(weight: cpu_gemv.GemvWeight | cpu_int8.Int8Weight | None, bias: torch.Tensor | None,
           dtype: torch.dtype, gemm: bool = False) -> Matrix | None:
    """The product x W^T (+ bias) for x of `dtype`, as the layer computes it in Python (cpu_gemv.gemv for at most
    MAX_ROWS rows and, where the layer routes more rows to it (`gemm`), cpu_gemv.gemm; cpu_int8.linear for any
    rows), or None where that is not one of these kernels' entry points. The Matrix's `many` is the entry point
    for more rows, or None where the layer sends them elsewhere (oneDNN)."""
    if weight is None or bias is not None and (bias.dtype != dtype or not bias.is_contiguous()):
        return None
    n, k = weight.out_features, weight.in_features
    if isinstance(weight, cpu_gemv.GemvWeight):
        lib = cpu_gemv._library()
        # The packed layout must be the one this build reads (pairs of k where it has the bf16 dot product).
        if lib is None or weight.dtype != dtype or (weight.packed.dim() == 4) != cpu_gemv._pairs(dtype):
            return None
        # gemm's entry points take the GEMV's arguments, so either serves the same kind.
        many_fn = cpu_gemv.gemm_kernel(weight) if gemm else None
        many = _address(many_fn) if many_fn is not None else None
        fn, kind = (lib.hearth_gemv_f32, GEMV_F32) if dtype == torch.float32 else (lib.hearth_gemv_bf16, GEMV_BF16)
        return Matrix(_address(fn), kind, weight.packed.data_ptr(), None, _ptr(bias), n, k, many)
    lib = cpu_int8._library()
    if lib is None or not weight.block or dtype not in cpu_int8.DTYPES:
        return None
    args = (weight.packed.data_ptr(), weight.scale.data_ptr(), _ptr(bias), n, k)
    if dtype == torch.float32:
        fn = None if weight.pairs else lib.hearth_gemv_i8_f32
        kind = I8_F32
    elif weight.pairs:
        fn = lib.hearth_gemv_i8_bf16_pairs if lib.hearth_i8_bf16_pairs() else None
        kind = I8_PAIRS
    else:
        fn, kind = lib.hearth_gemv_i8_bf16, I8_BF16
    # The int8 kernels take any number of rows: the same entry point either way.
    return Matrix(_address(fn), kind, *args, _address(fn)) if fn is not None else None


def lora_gemm(dtype: torch.dtype) -> int | None:
    """The address of gemm.c's product with adapters' expands inside (hearth_gemm_bf16_lora), where bf16 products of
    many rows run on AMX tiles; None elsewhere (and with HEARTH_LORA_FUSED=off), where adapters are added after each
    product (hearth_lora_add)."""
    lib = cpu_gemv._gemm_library()
    if dtype != torch.bfloat16 or lib is None or not cpu_gemv.gemm_amx() \
            or os.environ.get("HEARTH_LORA_FUSED", "auto") == "off":
        return None
    return _address(lib.hearth_gemm_bf16_lora)


def lora_shrinks(dtype: torch.dtype) -> int | None:
    """The address of gemm.c's hearth_gemm_bf16_shrinks (a projection's adapters' shrinks in one call on AMX tiles)
    where `lora_gemm` has one, and HEARTH_LORA_SHRINKS is not off; None elsewhere (one product a span)."""
    if lora_gemm(dtype) is None or os.environ.get("HEARTH_LORA_SHRINKS", "auto") == "off":
        return None
    return _address(cpu_gemv._gemm_library().hearth_gemm_bf16_shrinks)


def silu_entry(weight: cpu_gemv.GemvWeight) -> int | None:
    """The address of cpu_gemv's fused gate/up + SiLU entry point for this weight, or None where it has none."""
    fn = cpu_gemv.gemm_silu_kernel(weight)
    return _address(fn) if fn is not None else None


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """One layer as the stack runs it: its four products (from `matrix`), its two norms' weights, its rotary
    tables [max_pos, head_dim] (rotating every channel), its sliding window, and where the forward computes
    SiLU * up of many rows straight from the gate/up weight, that entry point (`silu_entry`)."""

    qkv: Matrix
    o: Matrix
    gate_up: Matrix
    down: Matrix
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    window: int | None
    gate_up_silu: int | None = None


@dataclass(frozen=True, slots=True)
class PromptRows:
    """A prompt chunk of a step: rows [start, end); either nothing cached before it (context -1) or `context` keys
    cached before it, read through `tables` [L, Hkv, W] (entry t of every kv head holding position t)."""

    start: int
    end: int
    context: int = -1
    tables: torch.Tensor | None = None


@dataclass(slots=True)
class DecodeStep:
    """One step's inputs and buffers. After the last layer, `h` is the residual stream and `x` the last
    sublayer's output, not yet added to it (the final norm adds it); where the step was started with `keep`,
    only their first `len(keep)` rows are meaningful, those rows in keep's order."""

    struct: _Step
    h: torch.Tensor
    x: torch.Tensor
    held: tuple  # what the struct points into (tensors, the adapters' structs), alive until the step is done
    kept: int | None = None  # rows of h and x the caller reads after the last layer (None: all)


class DecodeStack:
    """The fixed part of a decoder's layers for one-call decode layers (see the module's doc)."""

    def __init__(self, *, dtype: torch.dtype, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 intermediate: int, eps: float, norm_offset: bool, scale: float, softcap: float | None,
                 layers: list[LayerSpec], prompts: bool = False) -> None:
        """prompts: whether the forward runs this model's prompt chunks on the C prompt kernels
        (cpu_paged_attention.causal_attention and prefill_attention), so steps with them can run here too."""
        assert dtype in (torch.float32, torch.bfloat16) and available()
        fused, norm, attention = cpu_fused._library(), cpu_norm._library(), cpa._library()
        causal = cpa._causal_library() if prompts else None
        bf16 = dtype == torch.bfloat16
        self.dtype = dtype
        self.model = _Model(
            _address(norm.hearth_add_rms_norm_bf16 if bf16 else norm.hearth_add_rms_norm_f32),
            _address(fused.hearth_rope_write_kv_bf16 if bf16 else fused.hearth_rope_write_kv_f32),
            _address(attention.hearth_paged_decode_bf16 if bf16 else attention.hearth_paged_decode_f32),
            _address(fused.hearth_silu_mul_bf16 if bf16 else fused.hearth_silu_mul_f32),
            2 if bf16 else 4, hidden, num_heads, num_kv_heads, head_dim, intermediate,
            eps, scale, softcap or 0.0, int(norm_offset), torch.get_num_threads(), MAX_ROWS,
            _address(causal.hearth_causal_attention) if causal is not None else None,
            _address(causal.hearth_prefill_attention) if causal is not None else None, lora_gemm(dtype),
            lora_shrinks(dtype))
        self.prompts = causal is not None  # whether steps with prompt chunks run here
        self._tile = causal.hearth_causal_attention_tile() if causal is not None else 0
        self.specs = layers  # the tensors the layer structs point into
        # Steps of more rows run here only if every product of more rows is one of the kernels too.
        self.many_rows = all(m.many for s in layers for m in (s.qkv, s.o, s.gate_up, s.down))
        self.layers = [_Layer(s.qkv, s.o, s.gate_up, s.down, s.input_norm.data_ptr(), s.post_norm.data_ptr(),
                              s.cos.data_ptr(), s.sin.data_ptr(), s.window or 0, s.gate_up_silu) for s in layers]
        self._refs = [ctypes.byref(layer) for layer in self.layers]
        self._model_ref = ctypes.byref(self.model)
        self._widest = max(max(s.qkv.k, s.o.k, s.gate_up.k, s.down.k) for s in layers)
        self._run = _library().hearth_decode_layer

    def start(self, h: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor | None,
              lens: torch.Tensor | None, k_cache: torch.Tensor, v_cache: torch.Tensor,
              pos_cache: torch.Tensor, adapters: AdapterRows | None = None, prompts: Sequence[PromptRows] = (),
              keep: torch.Tensor | None = None, kept_adapters: AdapterRows | None = None,
              received: torch.Tensor | None = None) -> DecodeStep:
        """h [rows, hidden] (updated in place): the decodes' rows (one per sequence) first, then the prompt chunks'
        (`prompts`, where `self.prompts`); at most MAX_ROWS rows unless `many_rows`. positions [rows]; slots
        [L, Hkv, rows]; the decodes' tables [L, decodes, Hkv, W] and lens [L, decodes, Hkv] (None: no decodes);
        the KV pool's caches ([N, block, D] and [N, block]); the step's LoRA adapters, if any row has one; keep:
        the rows (ascending, int64) the last layer's output projection and MLP run on, or None for all, and
        kept_adapters those rows' adapters as rows 0, 1, ... of that layer (LoRABatch.kept; None: none);
        received: None, or fp32 [L, decodes, Hkv, W * block] that every layer's decode attention fills with the
        attention each entry received (`cpu_paged_attention.paged_decode_attention`'s `received`)."""
        m = self.model
        rows = h.shape[0]
        assert (rows <= MAX_ROWS or self.many_rows) and h.dtype == self.dtype and h.is_contiguous() and k_cache.shape[1] <= cpa.MAX_BLOCK
        assert (self.prompts or not prompts) and (keep is not None or kept_adapters is None)
        self.model.threads = torch.get_num_threads()
        positions = positions.to(torch.int64).contiguous()
        slots = slots.to(torch.int64).contiguous()
        if tables is None or lens is None:
            tables, lens = torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int32)
            decodes = width = 0
        else:
            tables = tables.to(torch.int64).contiguous()
            lens = lens.to(torch.int32).contiguous()
            decodes, width = tables.shape[1], tables.shape[-1]
        qkv_width = (m.hq + 2 * m.hkv) * m.head_dim
        # One allocation for every activation buffer of the step, in elements of the model's dtype.
        sizes = (m.hidden, m.hidden, qkv_width, m.hq * m.head_dim, m.hq * m.head_dim, 2 * m.inter, m.inter)
        scratch = torch.empty(rows * sum(sizes), dtype=self.dtype)
        widest = max(self._widest, adapters.table.widest if adapters is not None else 0)
        widened = torch.empty(rows * widest, dtype=torch.float32)
        pointers, offset = [], scratch.data_ptr()
        for size in sizes:
            pointers.append(offset)
            offset += rows * size * m.elem
        x = scratch[: rows * m.hidden].view(rows, m.hidden)
        struct = _Step(rows, width, k_cache.shape[1], positions.data_ptr(), slots.data_ptr(),
                       tables.data_ptr(), lens.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                       pos_cache.data_ptr(), h.data_ptr(), *pointers, widened.data_ptr(), 0, None, decodes)
        held: tuple = (positions, slots, tables, lens, scratch, widened, k_cache, v_cache, pos_cache)
        if received is not None:
            assert received.dtype == torch.float32 and received.is_contiguous() and received.shape == (
                len(self.layers), decodes, m.hkv, width * k_cache.shape[1])
            struct.received = received.data_ptr()
            held += (received,)
        if prompts:
            held += self._prompts(struct, prompts)
        kept = None
        if keep is not None:
            keep = keep.to(torch.int64).contiguous()
            struct.keep, struct.kept, struct.last = keep.data_ptr(), keep.numel(), len(self.layers) - 1
            kept = keep.numel()
            held += (keep,)
        widest_in, widest_out = max(m.hidden, m.hq * m.head_dim, m.inter), max(qkv_width, m.hidden, 2 * m.inter)
        for field, rows_adapters in (("lora", adapters), ("lora_kept", kept_adapters)):
            if rows_adapters is not None:
                lora, lora_held = rows_adapters.table.scratch(rows_adapters.order, rows_adapters.spans, widest_in,
                                                              widest_out, widest)
                setattr(struct, field, ctypes.addressof(lora))
                held += (lora, *lora_held)
        return DecodeStep(struct, h, x, held, kept)

    def _prompts(self, struct: _Step, prompts: Sequence[PromptRows]) -> tuple:
        """The step's prompt chunks into `struct`, with the prompt kernel's work space for the largest of them;
        returns what the struct then points into."""
        m, tile = self.model, self._tile
        chunks = (_Prompt * len(prompts))()
        held: list = [chunks]
        floats = 0
        for i, p in enumerate(prompts):
            tokens, context = p.end - p.start, max(p.context, 0)
            padded = -(-(context + tokens) // tile) * tile
            floats = max(floats, tokens * m.hq * m.head_dim + 2 * m.hkv * m.head_dim * padded)
            if p.context < 0:
                chunks[i] = _Prompt(p.start, p.end, -1, None, 0)
                continue
            assert p.tables is not None
            tables = p.tables.to(torch.int64).contiguous()
            held.append(tables)
            chunks[i] = _Prompt(p.start, p.end, p.context, tables.data_ptr(), tables.shape[-1])
        work = cpa._scratch_floats(floats)  # the prompt kernel's buffer, kept per thread (held: it may be replaced)
        struct.prompts, struct.n_prompts, struct.scratch = ctypes.addressof(chunks), len(prompts), work.data_ptr()
        return (*held, work)

    def layer(self, step: DecodeStep, index: int) -> None:
        self._run(self._model_ref, self._refs[index], ctypes.byref(step.struct), index)
