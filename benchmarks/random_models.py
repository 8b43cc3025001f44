"""Installed models with random weights, for a machine the real weights cannot reach.

    python -m benchmarks.random_models pack DIR [MODEL ...]    # here: each model's files but its weights
    python -m benchmarks.random_models unpack DIR DATA_DIR     # there: a data dir of random-weight models

A lent GPU machine fetches nothing and only 64 MiB of the working tree travel to it, so the converted checkpoints
(hundreds of MB each) cannot go. `pack` copies what is small (config.json, the tokenizer files, the install
marker) and writes `layout.json`: every tensor's name, dtype and shape, read from the safetensors header without
loading the weights. `unpack` writes `DATA_DIR/models/<slug>/` with those files and a model.safetensors of random
values in exactly that layout, so the engine and transformers load it as they load the real model (point
HEARTH_DATA_DIR at DATA_DIR). Speed does not depend on the values; the output text is noise.
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
from collections.abc import Sequence
from pathlib import Path

import torch

from inference.models.catalog import DEFAULT_MODELS, get_bundled, model_path

WEIGHTS = "model.safetensors"
LAYOUT = "layout.json"
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def read_layout(checkpoint: Path) -> dict[str, list]:
    """{tensor name: [safetensors dtype, shape]} from the file's JSON header (the first 8 bytes give its size)."""
    with open(checkpoint, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return {name: [meta["dtype"], meta["shape"]] for name, meta in header.items() if name != "__metadata__"}


def pack_checkpoint(src: Path, target: Path) -> Path:
    """Copy a checkpoint dir but its weights, and write their layout beside the copy."""
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(src, target, ignore=shutil.ignore_patterns("*.safetensors"))
    (target / LAYOUT).write_text(json.dumps(read_layout(src / WEIGHTS)))
    return target


def pack(dest: Path, names: Sequence[str]) -> list[Path]:
    out = []
    for name in names:
        src = model_path(name)
        if not (src / WEIGHTS).is_file():
            raise SystemExit(f"{name} is not installed at {src}: run `make models` first")
        out.append(pack_checkpoint(src, dest / get_bundled(name).slug))
    return out


def random_tensor(name: str, dtype: str, shape: list[int], gen: torch.Generator) -> torch.Tensor:
    """Values of the size trained weights have, so activations stay finite through every layer in bf16: norm
    scales near 1, everything else N(0, 0.02) (the usual initialisation)."""
    if name.endswith("norm.weight"):
        values = 1.0 + 0.05 * torch.randn(shape, generator=gen)
    else:
        values = 0.02 * torch.randn(shape, generator=gen)
    return values.to(_DTYPES[dtype])


def unpack(src: Path, data: Path, seed: int = 0) -> Path:
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    for skeleton in sorted(p for p in src.iterdir() if (p / LAYOUT).is_file()):
        target = data / "models" / skeleton.name
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(skeleton, target, ignore=shutil.ignore_patterns(LAYOUT))
        layout = json.loads((skeleton / LAYOUT).read_text())
        tensors = {name: random_tensor(name, dtype, shape, gen) for name, (dtype, shape) in layout.items()}
        save_file(tensors, str(target / WEIGHTS), metadata={"format": "pt"})
    return data


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack")
    p.add_argument("dir", type=Path)
    p.add_argument("models", nargs="*", default=list(DEFAULT_MODELS))
    u = sub.add_parser("unpack")
    u.add_argument("dir", type=Path)
    u.add_argument("data_dir", type=Path)
    args = parser.parse_args(argv)
    if args.command == "pack":
        args.dir.mkdir(parents=True, exist_ok=True)
        for path in pack(args.dir, args.models):
            print(f"packed {path}")
    else:
        print(f"HEARTH_DATA_DIR={unpack(args.dir, args.data_dir)}")


if __name__ == "__main__":
    main()
