"""Small building blocks of the decoder forward pass: norms, rotary embeddings, activations."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig

from inference import memory
from kernels import cpu_argmax, cpu_gemv, cpu_int8


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, offset: bool) -> torch.Tensor:
    """RMSNorm in fp32. Llama casts back before scaling; Gemma scales by (1 + w) in fp32, then casts.

    Both orders are kept exactly so that bf16 outputs track transformers' as closely as fp32 ones do.
    """
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (xf * (1.0 + weight.float())).to(x.dtype)
    return weight * xf.to(x.dtype)


_PACKABLE: dict[torch.dtype, bool] = {}


def _onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN can pack weights of this dtype here. Its bf16 path needs AVX-512 (or AVX-NE-CONVERT);
    on a CPU without them packing raises, and the generic path is the only one."""
    if dtype not in _PACKABLE:
        ok = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        if ok:
            try:
                probe = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), None)
                torch.ops.mkldnn._linear_pointwise(torch.zeros(1, 8, dtype=dtype), probe, None, "none", [], "")
            except RuntimeError:
                ok = False
        _PACKABLE[dtype] = ok
    return _PACKABLE[dtype]


class Linear:
    """y = x W^T + b, on the fastest path this machine has for the shape.

    Decode is a stream of matrix-vector products whose cost is reading the weights; prefill and large batches
    are compute-bound. On CPU, fp32 and bf16 weights are packed once for kernels/cpu_gemv, whose GEMV streams
    one or two rows faster than oneDNN (docs/benchmarks.md). Where its gemm takes the weight (fp32; bf16 with
    AVX-512 BF16), products of three rows or more run on that copy too and there is no other. Elsewhere those
    go to a oneDNN-packed copy (ahead of BLAS: docs/benchmarks.md), which costs the weight's size again in
    memory; HEARTH_CPU_GEMV=off keeps only oneDNN's.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 zeros: cpu_gemv.Zeros = memory.zeros) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias.contiguous() if bias is not None else None
        self.nbytes = weight.numel() * weight.element_size() + (bias.numel() * bias.element_size() if bias is not None else 0)
        weight = weight.contiguous()
        gemv = cpu_gemv.supports(weight) and (bias is None or bias.dtype == weight.dtype)
        self.gemv_weight: cpu_gemv.GemvWeight | None = None
        if gemv:
            # The blocks gemv streams every decode step live on huge pages (inference/memory.py), or where
            # `zeros` puts them (a LoRA slot's arena).
            self.gemv_weight = cpu_gemv.pack(weight, zeros)
        # Products of more rows on those blocks too where kernels/cpu_gemv's gemm takes them (it keeps level with
        # or ahead of oneDNN); then every product runs on them, and oneDNN's copy would only cost the weights'
        # size again.
        self.gemm = self.gemv_weight is not None and cpu_gemv.gemm_supports(self.gemv_weight)
        self.packed = not self.gemm and weight.device.type == "cpu" \
            and weight.dtype in (torch.float32, torch.bfloat16) and _onednn_packs(weight.dtype)
        self.weight: torch.Tensor | None = None
        if not self.gemm:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None) if self.packed else weight

    def kernel_weight(self) -> tuple[cpu_gemv.GemvWeight | None, torch.Tensor | None]:
        """What products of one or two rows run on (kernels/cpu_gemv), and the bias."""
        return self.gemv_weight, self.bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemm:
            assert self.gemv_weight is not None
            rows = x.reshape(-1, self.in_features)
            product = cpu_gemv.gemv if rows.shape[0] <= cpu_gemv.MAX_ROWS else cpu_gemv.gemm
            return product(rows, self.gemv_weight, self.bias).view(*x.shape[:-1], self.out_features)
        if self.gemv_weight is not None and x.dim() == 2 and x.shape[0] <= cpu_gemv.MAX_ROWS:
            return cpu_gemv.gemv(x, self.gemv_weight, self.bias)
        assert self.weight is not None
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def fp32(self, x: torch.Tensor) -> torch.Tensor:
        """self(x).float(): on the GEMM in bf16, in the same pass (cpu_gemv.gemm_fp32)."""
        if self.gemm and self.gemv_weight is not None and x.dim() == 2 and x.shape[0] > cpu_gemv.MAX_ROWS:
            return cpu_gemv.gemm_fp32(x, self.gemv_weight, self.bias)
        return self(x).float()

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """argmax(self.fp32(x), dim=-1) as int64 [rows]: on the GEMV (one or two rows) or the GEMM, without
        storing the products (a greedy step's tokens from the LM head: cpu_gemv.gemv_argmax, gemm_argmax)."""
        if self.gemv_weight is not None and x.dim() == 2:
            if x.shape[0] <= cpu_gemv.MAX_ROWS:
                return cpu_gemv.gemv_argmax(x, self.gemv_weight, self.bias)
            if self.gemm:
                return cpu_gemv.gemm_argmax(x, self.gemv_weight, self.bias)
        return cpu_argmax.argmax(self(x))  # = argmax(self(x).float()): bf16 values widen exactly


class Int8Linear:
    """y = x (scale * Q)^T + b with weight-only int8 Q, one fp32 scale per output row (kernels/cpu_int8).

    A quarter of fp32's weight bytes for decode to stream, at a quality cost the catalog's operator opts into
    (`quantization: "int8"`; docs/benchmarks.md measures it). Activations, sums and the bias keep the model's
    dtype; Q lives on huge pages like the other weights decode streams."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 zeros: cpu_gemv.Zeros = memory.zeros) -> None:
        self.out_features, self.in_features = weight.shape
        # The packed blocks decode streams every step live on huge pages (inference/memory.py).
        self.weight = cpu_int8.Int8Weight.from_float(weight, zeros=zeros)
        self.bias = bias.contiguous() if bias is not None else None
        self.nbytes = self.weight.nbytes + (bias.numel() * bias.element_size() if bias is not None else 0)

    def kernel_weight(self) -> tuple[cpu_int8.Int8Weight, torch.Tensor | None]:
        """What products run on (kernels/cpu_int8), and the bias."""
        return self.weight, self.bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_int8.linear(x, self.weight, self.bias)

    def fp32(self, x: torch.Tensor) -> torch.Tensor:
        return self(x).float()

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_argmax.argmax(self(x))  # = argmax(self.fp32(x)): bf16 values widen exactly


LinearLayer = Linear | Int8Linear


def linear(weight: torch.Tensor, bias: torch.Tensor | None = None, quantization: str = "none",
           zeros: cpu_gemv.Zeros = memory.zeros) -> LinearLayer:
    """The layer for this weight under the model's quantization setting; its packed blocks in buffers from
    `zeros` (a model's memory.Pool)."""
    return Int8Linear(weight, bias, zeros) if quantization == "int8" else Linear(weight, bias, zeros)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": gelu_tanh, "gelu_tanh": gelu_tanh,
               "gelu": F.gelu, "gelu_new": gelu_tanh}


def rope_params(config: PretrainedConfig, layer_type: str | None) -> dict:
    """The rope settings for one layer type; configs nest them per layer type when the types differ (Gemma 3)."""
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    if "rope_theta" not in params:
        params = {**params, "rope_theta": getattr(config, "rope_theta", 10000.0)}
    return params


def rope_inverse_frequencies(
    config: PretrainedConfig, head_dim: int, layer_type: str | None
) -> tuple[torch.Tensor, float]:
    params = rope_params(config, layer_type)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        base = float(params["rope_theta"])
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    # Scaled variants (linear, llama3, yarn, ...) follow transformers' own definitions: the reference in tests.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    init = ROPE_INIT_FUNCTIONS[rope_type]
    try:
        inv_freq, scaling = init(config, "cpu", layer_type=layer_type)
    except TypeError:
        inv_freq, scaling = init(config, "cpu")
    return inv_freq.float(), float(scaling)


class RotaryTable:
    """cos/sin for every position up to max_positions, built once; looked up by position each step."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float, max_positions: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        positions = torch.arange(max_positions, dtype=torch.float)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * scaling).to(dtype=dtype, device=device)
        self.sin = (emb.sin() * scaling).to(dtype=dtype, device=device)
        self.rotary_dim = emb.shape[-1]

    def rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for these positions, shaped [T, 1, D] to broadcast over heads."""
        return self.cos.index_select(0, positions).unsqueeze(1), self.sin.index_select(0, positions).unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] rotated in its first rotary_dim channels (rotate-half convention)."""
        if self.rotary_dim == x.shape[-1]:
            return x * cos + _rotate_half(x) * sin
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim:]
        return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def default_attention_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
