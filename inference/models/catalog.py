"""The bundled model catalog and where converted checkpoints live in the data dir.

Nothing here loads weights: it only names models and finds their directories, so the control plane can
import it cheaply to seed its catalog.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from inference.errors import ModelNotFoundError

Task = Literal["text-generation", "text-embeddings"]
Architecture = Literal["llama", "qwen2", "gemma3", "bert"]

_TASKS: frozenset[str] = frozenset({"text-generation", "text-embeddings"})
_ARCHITECTURES: frozenset[str] = frozenset({"llama", "qwen2", "gemma3", "bert"})

# Written last by the installer; a model dir without it is not (completely) installed.
MARKER_FILE = "hearth.json"
INSTALL_HINT = "run `make models` (or `python -m inference.models.install`)"
EXTRA_INSTALL_HINT = "it is an optional extra: run `make models-extra` (or `python -m inference.models.install --extras`)"


def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent.parent


def data_dir() -> Path:
    """Root of Hearth's mutable data: HEARTH_DATA_DIR, else `<repo root>/.data`."""
    env = os.environ.get("HEARTH_DATA_DIR")
    return Path(env).expanduser() if env else repo_root() / ".data"


def models_dir() -> Path:
    return data_dir() / "models"


class InstallError(RuntimeError):
    """A bundled model cannot be installed (package missing, corrupt download, failed conversion)."""


@dataclass(frozen=True)
class BundledModel:
    name: str
    slug: str
    task: Task
    description: str
    architecture: Architecture
    context_window: int  # max tokens per sequence (prompt + output; for embeddings the truncation length)
    has_chat_template: bool
    supports_lora: bool
    # Free-form facts the catalog shows (Workers-AI style "properties"): source, license, dims ...
    properties: MappingProxyType[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    # Optional extras are known to the catalog but installed only on request (`make models-extra`,
    # `install --extras`): `make run` and the default test suite never need them.
    extra: bool = False

    def __post_init__(self) -> None:
        if not self.name.startswith("@hearth/"):
            raise ValueError(f"bundled model names start with @hearth/: {self.name!r}")
        if not self.slug or "/" in self.slug or self.slug.startswith("."):
            raise ValueError(f"bad slug {self.slug!r}")
        if self.task not in _TASKS:
            raise ValueError(f"unknown task {self.task!r}")
        if self.architecture not in _ARCHITECTURES:
            raise ValueError(f"unknown architecture {self.architecture!r}")
        if self.context_window <= 0:
            raise ValueError("context_window must be positive")
        if self.task == "text-embeddings" and (self.has_chat_template or self.supports_lora):
            raise ValueError("embedding models have neither a chat template nor LoRA support")
        if not isinstance(self.extra, bool):
            raise ValueError("extra must be true or false")
        if not isinstance(self.properties, MappingProxyType):
            object.__setattr__(self, "properties", MappingProxyType(dict(self.properties)))

    @property
    def path(self) -> Path:
        return model_path(self.name)

    @property
    def installed(self) -> bool:
        return (self.path / MARKER_FILE).is_file()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready copy (properties as a plain dict), e.g. for seeding the control plane's catalog."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["properties"] = dict(self.properties)
        return data


def _model(**kwargs: Any) -> BundledModel:
    kwargs["properties"] = MappingProxyType(kwargs.get("properties", {}))
    return BundledModel(**kwargs)


# Context windows are the max_position_embeddings of the converted configs (checked in the tests).
_MODELS: tuple[BundledModel, ...] = (
    _model(
        name="@hearth/smollm2-135m-instruct",
        slug="smollm2-135m-instruct",
        task="text-generation",
        description="SmolLM2 135M Instruct (Hugging Face): a tiny, fast chat model with a ChatML template.",
        architecture="llama",
        context_window=8192,
        has_chat_template=True,
        supports_lora=True,
        properties={
            "source": "HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to fp32)",
            "license": "apache-2.0",
            "parameters": "135M",
        },
    ),
    _model(
        name="@hearth/qwen2.5-coder-0.5b-instruct",
        slug="qwen2.5-coder-0.5b-instruct",
        task="text-generation",
        description="Qwen2.5-Coder 0.5B Instruct (Alibaba): a small code-specialised chat model.",
        architecture="qwen2",
        context_window=32768,
        has_chat_template=True,
        supports_lora=True,
        properties={
            "source": "Qwen/Qwen2.5-Coder-0.5B-Instruct (GGUF, dequantized to fp32)",
            "license": "apache-2.0",
            "parameters": "0.5B",
        },
    ),
    _model(
        name="@hearth/qwen2.5-coder-1.5b-instruct",
        slug="qwen2.5-coder-1.5b-instruct",
        task="text-generation",
        description="Qwen2.5-Coder 1.5B Instruct (Alibaba): a code-specialised chat model; shares its "
        "tokenizer with the 0.5B, which can draft for it in speculative decoding.",
        architecture="qwen2",
        context_window=32768,
        has_chat_template=True,
        supports_lora=True,
        properties={
            "source": "Qwen/Qwen2.5-Coder-1.5B-Instruct (GGUF, dequantized to fp32)",
            "license": "apache-2.0",
            "parameters": "1.5B",
        },
        extra=True,
    ),
    _model(
        name="@hearth/gemma-3-270m",
        slug="gemma-3-270m",
        task="text-generation",
        description="Gemma 3 270M (Google), pretrained base model: raw text completion, no chat template.",
        architecture="gemma3",
        context_window=32768,
        has_chat_template=False,
        supports_lora=True,
        properties={
            "source": "google/gemma-3-270m (Q4_K_M GGUF, dequantized to fp32)",
            "license": "gemma",
            "parameters": "270M",
        },
    ),
    _model(
        name="@hearth/all-minilm-l6-v2",
        slug="all-minilm-l6-v2",
        task="text-embeddings",
        description="all-MiniLM-L6-v2 (sentence-transformers): 384-dimensional sentence embeddings.",
        architecture="bert",
        context_window=256,
        has_chat_template=False,
        supports_lora=False,
        properties={
            "source": "sentence-transformers/all-MiniLM-L6-v2",
            "license": "apache-2.0",
            "dimensions": 384,
            "max_input_tokens": 256,
            "pooling": "mean",
            "normalized": True,
        },
    ),
)

# Every model the catalog knows, optional extras included; DEFAULT_MODELS are those `make models` installs.
BUNDLED_MODELS: dict[str, BundledModel] = {m.name: m for m in _MODELS}
DEFAULT_MODELS: dict[str, BundledModel] = {m.name: m for m in _MODELS if not m.extra}
EXTRA_MODELS: dict[str, BundledModel] = {m.name: m for m in _MODELS if m.extra}
DEFAULT_MODEL = "@hearth/smollm2-135m-instruct"
DEFAULT_EMBEDDING_MODEL = "@hearth/all-minilm-l6-v2"


def get_bundled(name: str) -> BundledModel:
    try:
        return BUNDLED_MODELS[name]
    except KeyError:
        known = ", ".join(sorted(BUNDLED_MODELS))
        raise ModelNotFoundError(f"unknown bundled model {name!r} (bundled: {known})") from None


def model_path(name: str) -> Path:
    """Where the converted checkpoint of a bundled model lives (whether or not it is installed)."""
    return models_dir() / get_bundled(name).slug


def read_marker(path: Path) -> dict[str, Any] | None:
    """The installer's hearth.json of a model dir, or None when absent or unreadable."""
    try:
        data = json.loads((path / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def resolve_model(name_or_path: str | os.PathLike[str]) -> Path:
    """A bundled model name -> its installed checkpoint dir; else an existing local HF checkpoint dir."""
    text = os.fspath(name_or_path)
    if text in BUNDLED_MODELS:
        path = model_path(text)
        if not (path / MARKER_FILE).is_file():
            hint = EXTRA_INSTALL_HINT if BUNDLED_MODELS[text].extra else INSTALL_HINT
            raise ModelNotFoundError(f"bundled model {text!r} is not installed in {path.parent}: {hint}")
        return path
    if text.startswith("@"):
        known = ", ".join(sorted(BUNDLED_MODELS))
        raise ModelNotFoundError(f"unknown model {text!r} (bundled: {known})")
    path = Path(text).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path.resolve()
    if path.is_dir():
        raise ModelNotFoundError(
            f"{text!r} is a directory but not a Hugging Face checkpoint (no config.json)"
        )
    raise ModelNotFoundError(f"no bundled model named {text!r} and no checkpoint directory at that path")


def installed_models() -> list[BundledModel]:
    """Bundled models whose conversion finished, in catalog order (extras only when installed)."""
    return [m for m in _MODELS if m.installed]
