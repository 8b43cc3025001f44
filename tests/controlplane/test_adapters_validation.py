"""Every refusal of a LoRA upload: its status, code and message, and that nothing usable is left behind (no
rows, no stored files) after it."""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import test_adapters as shared
import torch
from cp_support import CHAT_MODEL, EMBED_MODEL
from django.core.files.uploadedfile import SimpleUploadedFile
from safetensors.torch import load, save
from test_adapters import Built, create, error, finetunes_url, stored_files, upload, upload_both

from controlplane.adapters import upload as upload_module
from controlplane.adapters.models import Adapter, AdapterFile
from inference.lora.format import CONFIG_FILE, WEIGHTS_FILE

# The shared fixtures: the PEFT adapters (built once per session) and a storage folder per test (autouse).
built, storage = shared.built, shared.storage
pytestmark = pytest.mark.django_db


def torch_pickle(built: Built) -> bytes:
    """The weights as torch.save writes them (a pickle inside a zip): what a .bin adapter is."""
    buffer = io.BytesIO()
    torch.save(load(built.weights), buffer)
    return buffer.getvalue()


def reshaped(built: Built) -> bytes:
    """The same tensor names, shaped for a model with another hidden size (64 instead of 576)."""
    tensors = load(built.weights)
    return save({name: torch.zeros(8, 64) if "lora_A" in name else torch.zeros(64, 8) for name in tensors})


def int8(built: Built) -> bytes:
    return save({name: t.to(torch.int8) for name, t in load(built.weights).items()})


def config_with(built: Built, **changes: Any) -> bytes:
    return json.dumps({**json.loads(built.config), **changes}).encode()


def assert_pending_with(adapter_id: str, storage, kinds: list[str]) -> None:
    adapter = Adapter.objects.get(pk=adapter_id)
    assert adapter.status == "pending" and adapter.rank is None
    assert sorted(adapter.files.values_list("kind", flat=True)) == kinds
    names = {"config": CONFIG_FILE, "weights": WEIGHTS_FILE}
    assert stored_files(storage) == [f"adapters/{adapter.account_id}/{adapter_id}/{names[k]}" for k in kinds]


# ------------------------------------------------------------------------------------------------ weights
WEIGHTS_REFUSALS = [
    # (what, file_name, content builder, message fragment)
    ("a .bin (pickle) file", "adapter_model.bin", torch_pickle, "only adapter_model.safetensors is accepted"),
    ("a .pt file", "adapter_model.pt", torch_pickle, "only adapter_model.safetensors is accepted"),
    ("pickle bytes named .safetensors", WEIGHTS_FILE, torch_pickle, "is not a safetensors file"),
    ("plain pickle named .safetensors", WEIGHTS_FILE, lambda b: pickle.dumps({"x": 1}), "is not a safetensors file"),
    ("shapes of another model", WEIGHTS_FILE, reshaped, "needs [8, 576]"),
    ("int8 tensors", WEIGHTS_FILE, int8, "dtype 'I8'; allowed: F32, F16, BF16"),
]


@pytest.mark.parametrize(("what", "file_name", "content", "fragment"), WEIGHTS_REFUSALS,
                         ids=[r[0] for r in WEIGHTS_REFUSALS])
def test_bad_weights_are_refused_and_not_kept(client, tenant, built, storage, what, file_name, content, fragment):
    adapter_id = create(client, tenant).json()["result"]["id"]
    assert upload(client, tenant, adapter_id, CONFIG_FILE, built.config).status_code == 200
    status, code, message = error(upload(client, tenant, adapter_id, file_name, content(built)))
    assert (status, code) == (400, 5006) and fragment in message, message
    assert_pending_with(adapter_id, storage, ["config"])


@pytest.mark.parametrize(("what", "file_name", "content", "fragment"), WEIGHTS_REFUSALS,
                         ids=[r[0] for r in WEIGHTS_REFUSALS])
def test_bad_weights_in_a_single_upload_create_nothing(client, tenant, built, storage, what, file_name, content,
                                                       fragment):
    response = upload_both(client, tenant, built, **{CONFIG_FILE: built.config, file_name: content(built)})
    status, code, message = error(response)  # a wrong name is refused before the missing weights are noticed
    assert (status, code) == (400, 5006) and fragment in message, message
    assert not Adapter.objects.exists() and stored_files(storage) == []


def test_bad_weights_arriving_first_are_refused_too(client, tenant, built, storage):
    adapter_id = create(client, tenant).json()["result"]["id"]
    status, code, message = error(upload(client, tenant, adapter_id, WEIGHTS_FILE, int8(built)))
    assert (status, code) == (400, 5006) and "dtype 'I8'" in message
    # Well-formed weights that fit no config: caught once the config completes the pair; the config is not kept.
    assert upload(client, tenant, adapter_id, WEIGHTS_FILE, reshaped(built)).status_code == 200
    status, code, message = error(upload(client, tenant, adapter_id, CONFIG_FILE, built.config))
    assert (status, code) == (400, 5006) and "needs [8, 576]" in message
    assert_pending_with(adapter_id, storage, ["weights"])


# ------------------------------------------------------------------------------------------------ config
CONFIG_REFUSALS = [
    ("not JSON", lambda b: b"{'r': 8,", "adapter_config.json is not valid JSON"),
    ("a JSON list", lambda b: b"[1, 2]", "must be a JSON object"),
    ("rank 64", lambda b: config_with(b, r=64), "rank 64 is over the limit of 32"),
    ("an unknown target module", lambda b: config_with(b, target_modules=["foo_proj"]), "['foo_proj'] are not"),
    ("DoRA", lambda b: config_with(b, use_dora=True), "use_dora=True is not supported"),
    ("another PEFT method", lambda b: config_with(b, peft_type="IA3"), "only LORA adapters"),
    ("use_rslora as a string", lambda b: config_with(b, use_rslora="false"), "use_rslora must be true or false"),
]


def test_a_malformed_layers_to_transform_is_refused(client, tenant, built):
    response = upload_both(client, tenant, built, **{CONFIG_FILE: config_with(built, layers_to_transform="0,1"),
                                                     WEIGHTS_FILE: built.weights})
    assert response.status_code == 400, response.status_code
    assert error(response)[1] == 5006 and not Adapter.objects.exists()
    assert "layers_to_transform must be a layer index" in error(response)[2]


@pytest.mark.parametrize(("what", "content", "fragment"), CONFIG_REFUSALS, ids=[r[0] for r in CONFIG_REFUSALS])
def test_bad_configs_are_refused_and_not_kept(client, tenant, built, storage, what, content, fragment):
    adapter_id = create(client, tenant).json()["result"]["id"]
    status, code, message = error(upload(client, tenant, adapter_id, CONFIG_FILE, content(built)))
    assert (status, code) == (400, 5006) and fragment in message, message
    assert_pending_with(adapter_id, storage, [])


def test_a_real_rank_64_adapter_is_refused(client, tenant, built, storage):
    response = upload_both(client, tenant, built, **{CONFIG_FILE: built.rank64_config,
                                                     WEIGHTS_FILE: built.rank64_weights})
    status, code, message = error(response)
    assert (status, code) == (400, 5006) and "rank 64 is over the limit of 32" in message
    assert not Adapter.objects.exists() and stored_files(storage) == []


def test_weights_that_do_not_match_the_config_rank_are_refused(client, tenant, built, storage):
    response = upload_both(client, tenant, built, **{CONFIG_FILE: config_with(built, r=16),
                                                     WEIGHTS_FILE: built.weights})
    status, code, message = error(response)
    assert (status, code) == (400, 5006) and "with rank 16 needs" in message
    assert not Adapter.objects.exists()


# ------------------------------------------------------------------------------------------------ names, files
@pytest.mark.parametrize("file_name", ["notes.txt", "../../etc/passwd", "adapters/x/adapter_config.json",
                                       "Adapter_Config.json", ""])
def test_only_the_two_file_names_are_accepted(client, tenant, built, storage, tmp_path, file_name):
    adapter_id = create(client, tenant).json()["result"]["id"]
    response = upload(client, tenant, adapter_id, file_name, built.config, part_name="upload.json")
    status, code, message = error(response)
    assert (status, code) == (400, 5006) and "an adapter is two files" in message
    assert_pending_with(adapter_id, storage, [])
    assert not (tmp_path / "etc").exists()


def test_client_paths_never_become_storage_paths(client, tenant, built, storage, tmp_path):
    # Django keeps only the last path component of a part's filename; the stored name is ours regardless.
    response = client.post(finetunes_url(tenant), data={
        "name": "tone", "model": CHAT_MODEL,
        "file": [SimpleUploadedFile(f"../../{CONFIG_FILE}", built.config),
                 SimpleUploadedFile(f"..\\..\\{WEIGHTS_FILE}", built.weights)]}, **tenant.auth)
    assert response.status_code == 200, response.content
    adapter_id = response.json()["result"]["id"]
    assert stored_files(storage) == [f"adapters/{tenant.account.pk}/{adapter_id}/{CONFIG_FILE}",
                                     f"adapters/{tenant.account.pk}/{adapter_id}/{WEIGHTS_FILE}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["media"]
    # A traversal filename that names neither file is refused.
    other = create(client, tenant, name="other").json()["result"]["id"]
    status, code, _ = error(upload(client, tenant, other, None, built.config, part_name="../../etc/passwd"))
    assert (status, code) == (400, 5006)
    assert AdapterFile.objects.filter(adapter_id=other).count() == 0


def test_a_single_upload_without_both_files_is_3039(client, tenant, built, storage):
    for files in ({CONFIG_FILE: built.config}, {WEIGHTS_FILE: built.weights}):
        status, code, message = error(upload_both(client, tenant, built, **files))
        missing = WEIGHTS_FILE if CONFIG_FILE in files else CONFIG_FILE
        assert (status, code) == (400, 3039) and f"required files missing: {missing}" in message
    response = client.post(finetunes_url(tenant), data={"name": "tone", "model": CHAT_MODEL,
                                                        "x": SimpleUploadedFile("x", b"")}, **tenant.auth)
    assert error(response)[:2] == (400, 5006)
    no_files = client.post(finetunes_url(tenant), data={"name": "tone", "model": CHAT_MODEL}, **tenant.auth)
    assert error(no_files)[:2] == (400, 3039)
    assert not Adapter.objects.exists() and stored_files(storage) == []


def test_one_file_per_asset_upload(client, tenant, built):
    adapter_id = create(client, tenant).json()["result"]["id"]
    response = client.post(finetunes_url(tenant, f"/{adapter_id}/finetune-assets"), data={
        "file_name": CONFIG_FILE, "file": [SimpleUploadedFile("a", built.config), SimpleUploadedFile("b", b"{}")]},
        **tenant.auth)
    status, code, message = error(response)
    assert (status, code) == (400, 5006) and "one file per request" in message
    as_json = client.post(finetunes_url(tenant, f"/{adapter_id}/finetune-assets"), data={"file_name": CONFIG_FILE},
                          content_type="application/json", **tenant.auth)
    assert error(as_json)[:2] == (400, 5006)


# ------------------------------------------------------------------------------------------------ models, size
def test_the_base_model_must_support_lora(client, tenant, built, storage):
    status, code, message = error(create(client, tenant, model=EMBED_MODEL))
    assert (status, code) == (400, 5005) and "does not support LoRA" in message
    status, code, _ = error(create(client, tenant, model="@x/none"))
    assert (status, code) == (400, 5007)
    response = client.post(finetunes_url(tenant), data={
        "name": "tone", "model": EMBED_MODEL, CONFIG_FILE: SimpleUploadedFile(CONFIG_FILE, built.config),
        WEIGHTS_FILE: SimpleUploadedFile(WEIGHTS_FILE, built.weights)}, **tenant.auth)
    assert error(response)[:2] == (400, 5005)
    assert not Adapter.objects.exists() and stored_files(storage) == []


def test_uploads_over_the_size_limit_are_cut_off(client, tenant, built, storage, settings):
    settings.HEARTH_LORA_MAX_BYTES = len(built.config) + len(built.weights) - 1
    adapter_id = create(client, tenant).json()["result"]["id"]
    assert upload(client, tenant, adapter_id, CONFIG_FILE, built.config).status_code == 200
    status, code, message = error(upload(client, tenant, adapter_id, WEIGHTS_FILE, built.weights))
    assert (status, code) == (413, 3006) and f"{settings.HEARTH_LORA_MAX_BYTES:,} bytes" in message
    assert_pending_with(adapter_id, storage, ["config"])

    status, code, _ = error(upload_both(client, tenant, built, name="single"))
    assert (status, code) == (413, 3006)
    assert list(Adapter.objects.values_list("name", flat=True)) == ["tone"]

    # A body whose declared length cannot fit is refused before it is read.
    settings.HEARTH_LORA_MAX_BYTES = 1000
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    assert error(upload(client, tenant, adapter_id, WEIGHTS_FILE, built.weights))[:2] == (413, 3006)
    assert_pending_with(adapter_id, storage, ["config"])


def test_the_upload_handler_stops_streaming_at_the_limit(rf, settings):
    """What the view relies on: parsing stops at the limit (no partial file is handed over), files under it are
    temporary files on disk, never held in memory."""
    settings.HEARTH_LORA_MAX_BYTES = 10_000
    request = rf.post("/x", data={"small": SimpleUploadedFile("a", b"x" * 4_000),
                                  "large": SimpleUploadedFile("b", b"y" * 8_000), "after": "field"})
    handler = upload_module.install(request)
    files = request.FILES
    assert handler.exceeded and list(files) == ["small"] and "after" not in request.POST
    assert Path(files["small"].temporary_file_path()).read_bytes() == b"x" * 4_000

    fits = rf.post("/x", data={"a": SimpleUploadedFile("a", b"x" * 4_000), "b": SimpleUploadedFile("b", b"y" * 6_000)})
    handler = upload_module.install(fits)
    assert not handler.exceeded and sorted(fits.FILES) == ["a", "b"]
    assert fits.FILES["b"].size == 6_000 and hasattr(fits.FILES["b"], "temporary_file_path")
