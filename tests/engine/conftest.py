"""Fixtures for engine tests: tiny randomly initialised models of each architecture, and real ones."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from inference import AsyncEngine
from inference.errors import ModelNotFoundError
from inference.models.catalog import BUNDLED_MODELS, model_path, resolve_model

SMOLLM = "@hearth/smollm2-135m-instruct"
QWEN = "@hearth/qwen2.5-coder-0.5b-instruct"
GEMMA = "@hearth/gemma-3-270m"

# Small enough to build in a second, big enough to have GQA, several layers, biases and sliding windows.
TINY_CONFIGS: dict[str, dict] = {
    "llama": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=10000.0),
    "qwen2": dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=1000000.0),
    "gemma3_text": dict(model_type="gemma3_text", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=1, head_dim=32, max_position_embeddings=1024,
                        rms_norm_eps=1e-6, sliding_window=24, query_pre_attn_scalar=32,
                        layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                     "sliding_attention"],
                        tie_word_embeddings=True),
}


def _tokenizer_source() -> Path:
    path = model_path(SMOLLM)
    if not (path / "tokenizer.json").exists():
        pytest.skip("the bundled models are not installed: run `make models`")
    return path


def build_tiny_model(arch: str, directory: Path, seed: int = 0) -> Path:
    tokenizer = AutoTokenizer.from_pretrained(_tokenizer_source())
    settings = dict(TINY_CONFIGS[arch])
    model_type = settings.pop("model_type")
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                  **settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random init is tiny; widen it so logits spread and argmax is unambiguous
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
            elif "norm" in str(p.shape) or p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session", params=list(TINY_CONFIGS))
def tiny_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(request.param, tmp_path_factory.mktemp(f"tiny-{request.param}"))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama-shared"))


def installed(name: str) -> Path:
    """The converted model's directory, or skip (with the installer's own message) when it is missing."""
    try:
        return resolve_model(name)
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture
def empty_data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HEARTH_DATA_DIR", str(tmp_path / "data"))
    return tmp_path / "data"


def require_installed(name: str) -> Path:
    if name not in BUNDLED_MODELS or not (model_path(name) / "config.json").exists():
        pytest.skip(f"{name} is not installed: run `make models`")
    return model_path(name)


def hold_steps(engine: AsyncEngine) -> tuple[threading.Event, threading.Event]:
    """Make the engine's next step wait: (in_step: set once the loop thread is inside it, release: lets it go)."""
    in_step, release = threading.Event(), threading.Event()
    real_step = engine.engine.step

    def held_step():
        in_step.set()
        release.wait(10)
        return real_step()

    engine.engine.step = held_step  # type: ignore[method-assign]
    return in_step, release


def counting_rows(product, rows: dict[str, int], name: str):
    """product (a layer's projection), adding the rows of every call to rows[name]."""
    def run(x: torch.Tensor) -> torch.Tensor:
        rows[name] += x.shape[0]
        return product(x)
    return run


def counting_layer_rows(model, path: str, rows: dict[str, int]) -> None:
    """Counts the rows the first and the last layer's output projections run on (rows["first"], rows["last"]),
    in the Python forward (path "python": the one-call layers switched off) or in the one-call layers' steps."""
    stack = model.decode_stack
    if path == "python" or stack is None:
        model.decode_stack = None
        model.layers[0].o = counting_rows(model.layers[0].o, rows, "first")
        model.layers[-1].o = counting_rows(model.layers[-1].o, rows, "last")
        return
    start = stack.start

    def counting(h: torch.Tensor, *args, **kwargs):
        step = start(h, *args, **kwargs)
        rows["first"] += h.shape[0]
        rows["last"] += h.shape[0] if step.kept is None else step.kept
        return step
    stack.start = counting
