"""PEFT LoRA adapters on disk: read and check one against a base model without trusting any of it.

An adapter is two files: `adapter_config.json` and `adapter_model.safetensors`. Nothing is ever unpickled:
the weights are read only as safetensors, whose header is parsed here by hand (bounded, checked against the
file's size) before a single tensor is loaded. `inspect_adapter` is what the control plane runs on an upload
and what the engine runs again before it loads one; every refusal says exactly what is wrong.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
REQUIRED_FILES = (CONFIG_FILE, WEIGHTS_FILE)
MAX_RANK = 32
MAX_HEADER_BYTES = 16 * 1024 * 1024

# The projections an adapter may adapt: which fused matrix of ours each belongs to, and its place in it.
MODULES: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0),
}
FUSED: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_ITEM_BYTES = {"F32": 4, "F16": 2, "BF16": 2}
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (PEFT may add the adapter's name before .weight)
_TENSOR = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])"
                     r"(?:\.[A-Za-z0-9_]+)?\.weight$")
LORA_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gemma3")


class AdapterError(ValueError):
    """An adapter that cannot be used. kind: missing_files, unsupported_model or invalid."""

    def __init__(self, message: str, kind: str = "invalid") -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True, slots=True)
class BaseDims:
    """What an adapter must fit: the base model's architecture, layer count and each projection's shape."""

    model_type: str
    num_layers: int
    shapes: Mapping[str, tuple[int, int]]  # module -> (in_features, out_features)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> BaseDims:
        config = config.get("text_config") or config
        hidden, inter = int(config["hidden_size"]), int(config["intermediate_size"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        q, kv = heads * head_dim, kv_heads * head_dim
        shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
                  "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
        return cls(str(config.get("model_type", "")), int(config["num_hidden_layers"]), shapes)

    @classmethod
    def from_model_dir(cls, path: str | Path) -> BaseDims:
        return cls.from_config(json.loads((Path(path) / "config.json").read_text()))

    def fused_bounds(self, fused: str) -> tuple[int, ...]:
        """Output offsets of the sub-modules of one fused projection: (0, q, q+k, q+k+v) for qkv."""
        bounds = [0]
        for module in FUSED[fused]:
            bounds.append(bounds[-1] + self.shapes[module][1])
        return tuple(bounds)


@dataclass(frozen=True, slots=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """A checked adapter: what it adapts and how strongly."""

    rank: int
    alpha: float
    scaling: float  # alpha / rank, or alpha / sqrt(rank) with rsLoRA
    target_modules: tuple[str, ...]  # sorted
    layers: tuple[int, ...]  # the layers it has weights for
    dtype: str  # of its tensors
    num_tensors: int
    base_model: str = ""  # as its config names it (informational)
    pairs: frozenset[tuple[int, str]] = field(default_factory=frozenset)  # (layer, module) with both A and B

    def as_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "alpha": self.alpha, "target_modules": list(self.target_modules),
                "layers": len(self.layers), "dtype": self.dtype, "tensors": self.num_tensors}


def read_safetensors_header(path: str | Path) -> dict[str, TensorInfo]:
    """The tensors a safetensors file declares, after checking that the header is sane and every tensor's
    bytes lie inside the file without overlapping another's."""
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise AdapterError(f"{WEIGHTS_FILE} is not a safetensors file (shorter than its 8-byte header length)")
        (length,) = struct.unpack("<Q", head)
        if length < 2 or length > MAX_HEADER_BYTES or 8 + length > size:
            raise AdapterError(f"{WEIGHTS_FILE} is not a safetensors file (header length {length} does not fit "
                               f"a file of {size} bytes)")
        raw = f.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{WEIGHTS_FILE} is not a safetensors file (its header is not JSON: {exc})") from None
    if not isinstance(header, dict):
        raise AdapterError(f"{WEIGHTS_FILE} is not a safetensors file (its header is not an object)")
    header.pop("__metadata__", None)
    data_size = size - 8 - length
    spans: list[tuple[int, int, str]] = []
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if not isinstance(entry, dict):
            raise AdapterError(f"tensor {name!r}: malformed header entry")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in DTYPES:
            raise AdapterError(f"tensor {name!r} has dtype {dtype!r}; allowed: {', '.join(DTYPES)}")
        if (not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape)
                or not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) for o in offsets)):
            raise AdapterError(f"tensor {name!r}: malformed shape or data offsets")
        start, end = offsets
        numel = 1
        for d in shape:
            numel *= d
        if not 0 <= start <= end <= data_size or end - start != numel * _ITEM_BYTES[dtype]:
            raise AdapterError(f"tensor {name!r}: its data offsets {offsets} do not match its shape {shape} "
                               f"and dtype {dtype} inside {data_size} bytes of data")
        spans.append((start, end, name))
        tensors[name] = TensorInfo(dtype, tuple(shape))
    spans.sort()
    for (_, end, first), (start, _, second) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise AdapterError(f"tensors {first!r} and {second!r} overlap in {WEIGHTS_FILE}")
    return tensors


def parse_config(raw: bytes | str) -> dict[str, Any]:
    try:
        config = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{CONFIG_FILE} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{CONFIG_FILE} must be a JSON object")
    return config


def _targets(config: Mapping[str, Any]) -> tuple[str, ...]:
    targets = config.get("target_modules")
    if isinstance(targets, str):  # PEFT reads a string as a regular expression over module names
        try:
            pattern = re.compile(targets)
        except re.error as exc:
            raise AdapterError(f"target_modules is not a valid regular expression: {exc}") from None
        names = [f"model.layers.0.{_PARENT[m]}.{m}" for m in MODULES]
        found = tuple(m for m, name in zip(MODULES, names, strict=True)
                      if pattern.fullmatch(name) or pattern.fullmatch(m))
        if not found:
            raise AdapterError(f"target_modules {targets!r} matches none of {', '.join(MODULES)}")
        return tuple(sorted(found))
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise AdapterError("target_modules must be a non-empty list of module names")
    unknown = sorted(t for t in set(targets) if t.rsplit(".", 1)[-1] not in MODULES)
    if unknown:
        raise AdapterError(f"target modules {unknown} are not supported; an adapter may target "
                           f"{', '.join(MODULES)}")
    return tuple(sorted({t.rsplit(".", 1)[-1] for t in targets}))


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(config: Mapping[str, Any], key: str, default: float) -> float:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise AdapterError(f"{key} must be a positive number, got {value!r}")
    return float(value)


# Variants that change what the adapter computes; we serve plain LoRA (optionally rsLoRA) exactly or not at all.
_MUST_BE_EMPTY = ("use_dora", "fan_in_fan_out", "lora_bias", "use_qalora", "use_bdlora", "rank_pattern",
                  "alpha_pattern", "modules_to_save", "layer_replication", "trainable_token_indices",
                  "target_parameters", "alora_invocation_tokens", "arrow_config", "kasa_config")


def check_config(config: Mapping[str, Any], max_rank: int = MAX_RANK) -> tuple[int, float, float, tuple[str, ...]]:
    """rank, alpha, scaling and target modules of a PEFT LoRA config; refuses what we cannot serve exactly."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterError(f"peft_type is {peft_type!r}; only LORA adapters are supported")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"r (the rank) must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"rank {rank} is over the limit of {max_rank}")
    alpha = _number(config, "lora_alpha", 8)
    if config.get("bias", "none") not in ("none", None):
        raise AdapterError(f"bias={config['bias']!r} is not supported (only 'none')")
    for key in _MUST_BE_EMPTY:
        if config.get(key):
            raise AdapterError(f"{key}={config[key]!r} is not supported (only plain LoRA is served)")
    layers = config.get("layers_to_transform")
    if layers is not None and not (_whole(layers) or (isinstance(layers, list) and all(map(_whole, layers)))):
        raise AdapterError(f"layers_to_transform must be a layer index or a list of them, got {layers!r}")
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool | None):
        raise AdapterError(f"use_rslora must be true or false, got {rslora!r}")
    scaling = alpha / (rank ** 0.5) if rslora else alpha / rank
    return rank, alpha, scaling, _targets(config)


def inspect_adapter(config: Mapping[str, Any] | bytes | str, weights_path: str | Path, base: BaseDims,
                    max_rank: int = MAX_RANK) -> AdapterSpec:
    """Check an adapter against a base model before anything of it is used; AdapterError says what is wrong."""
    if base.model_type not in LORA_ARCHITECTURES:
        raise AdapterError(f"the base model's architecture {base.model_type!r} does not support LoRA",
                           kind="unsupported_model")
    if not isinstance(config, Mapping):
        config = parse_config(config)
    rank, alpha, scaling, targets = check_config(config, max_rank)
    tensors = read_safetensors_header(weights_path)
    if not tensors:
        raise AdapterError(f"{WEIGHTS_FILE} holds no tensors")
    layers_allowed = config.get("layers_to_transform")
    if isinstance(layers_allowed, int):
        layers_allowed = [layers_allowed]
    halves: dict[tuple[int, str], set[str]] = {}
    dtypes = set()
    for name, info in tensors.items():
        match = _TENSOR.match(name)
        if match is None:
            raise AdapterError(f"tensor {name!r} is not a LoRA weight of a decoder layer projection")
        layer, parent, module, half = int(match[1]), match[2], match[3], match[4]
        if module not in MODULES or _PARENT[module] != parent:
            raise AdapterError(f"tensor {name!r} adapts {parent}.{module}, which the base model does not have")
        if module not in targets:
            raise AdapterError(f"tensor {name!r} adapts {module}, which is not in target_modules")
        if not 0 <= layer < base.num_layers:
            raise AdapterError(f"tensor {name!r} is for layer {layer}; the base model has {base.num_layers} layers")
        if layers_allowed is not None and layer not in layers_allowed:
            raise AdapterError(f"tensor {name!r} is for layer {layer}, outside layers_to_transform")
        fan_in, fan_out = base.shapes[module]
        want = (rank, fan_in) if half == "A" else (fan_out, rank)
        if info.shape != want:
            raise AdapterError(f"tensor {name!r} has shape {list(info.shape)}; the base model's {module} with "
                               f"rank {rank} needs {list(want)}")
        key = (layer, module)
        if half in halves.setdefault(key, set()):
            raise AdapterError(f"layer {layer} {module} has two lora_{half} tensors")
        halves[key].add(half)
        dtypes.add(info.dtype)
    lonely = sorted(f"layer {k[0]} {k[1]}" for k, v in halves.items() if len(v) != 2)
    if lonely:
        raise AdapterError(f"{', '.join(lonely[:5])}: lora_A and lora_B must come in pairs")
    return AdapterSpec(rank=rank, alpha=alpha, scaling=scaling, target_modules=targets,
                       layers=tuple(sorted({k[0] for k in halves})), dtype="/".join(sorted(dtypes)),
                       num_tensors=len(tensors), base_model=str(config.get("base_model_name_or_path") or ""),
                       pairs=frozenset(halves))


def inspect_adapter_dir(path: str | Path, base: BaseDims, max_rank: int = MAX_RANK) -> AdapterSpec:
    path = Path(path)
    missing = [name for name in REQUIRED_FILES if not (path / name).is_file()]
    if missing:
        raise AdapterError(f"required files missing: {', '.join(missing)}", kind="missing_files")
    return inspect_adapter((path / CONFIG_FILE).read_bytes(), path / WEIGHTS_FILE, base, max_rank)


def load_pairs(path: str | Path, spec: AdapterSpec) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, module) -> (A [r, in], B [out, r]) from a checked adapter, read as safetensors only."""
    from safetensors.torch import load_file

    tensors = load_file(str(Path(path) / WEIGHTS_FILE), device="cpu")
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _TENSOR.match(name)
        if match is None:  # checked by inspect_adapter; a file changed underneath is refused
            raise AdapterError(f"tensor {name!r} is not a LoRA weight")
        pairs.setdefault((int(match[1]), match[3]), {})[match[4]] = tensor
    if set(pairs) != set(spec.pairs):
        raise AdapterError("the adapter's weights changed after it was checked")
    return {key: (halves["A"], halves["B"]) for key, halves in pairs.items()}
