"""LoRA adapters in the control plane: the Workers AI finetunes routes, the services the engine and the
dashboard use, storage and scoping. Refusals of bad uploads are in test_adapters_validation.py.

Adapters are real PEFT adapters built against SmolLM2's converted checkpoint (tests/lora_support.py), once per
session; every test gets its own storage folder and data dir.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cp_support import CHAT_MODEL, Tenant, make_tenant
from django.core.files.storage import default_storage
from django.core.files.uploadedfile import SimpleUploadedFile

from controlplane.accounts.models import ApiKey
from controlplane.adapters import services
from controlplane.adapters.models import Adapter, AdapterFile
from controlplane.api.errors import ApiError
from inference.lora.format import CONFIG_FILE, WEIGHTS_FILE
from inference.models.catalog import BUNDLED_MODELS, model_path

pytestmark = pytest.mark.django_db


@dataclass(frozen=True)
class Built:
    config: bytes
    weights: bytes
    rank64_config: bytes
    rank64_weights: bytes


_built: list[Built] = []  # test_adapters_validation uses this fixture too: build once per session, not per module


@pytest.fixture(scope="session")
def built(tmp_path_factory) -> Built:
    """A rank-8 adapter on q_proj and v_proj, and a rank-64 one (over the limit of 32), made with PEFT."""
    if not BUNDLED_MODELS[CHAT_MODEL].installed:
        pytest.skip(f"{CHAT_MODEL} is not installed: run `make models`")
    if not _built:
        from tests.lora_support import make_peft_adapter

        root = tmp_path_factory.mktemp("peft")
        good = make_peft_adapter(model_path(CHAT_MODEL), root / "good", rank=8, targets=("q_proj", "v_proj"),
                                 seed=1)
        big = make_peft_adapter(model_path(CHAT_MODEL), root / "big", rank=64, targets=("q_proj",), seed=2)
        _built.append(Built((good / CONFIG_FILE).read_bytes(), (good / WEIGHTS_FILE).read_bytes(),
                            (big / CONFIG_FILE).read_bytes(), (big / WEIGHTS_FILE).read_bytes()))
    return _built[0]


@pytest.fixture(autouse=True)
def storage(settings, tmp_path) -> Path:
    """A storage folder and data dir of the test's own."""
    settings.MEDIA_ROOT = str(tmp_path / "media")
    settings.HEARTH_DATA_DIR = tmp_path / "data"
    return tmp_path / "media"


def finetunes_url(tenant: Tenant, suffix: str = "") -> str:
    return f"/client/v4/accounts/{tenant.account.pk}/ai/finetunes{suffix}"


def create(client, tenant: Tenant, name: str = "tone", model: str = CHAT_MODEL, **extra: Any):
    return client.post(finetunes_url(tenant), data={"name": name, "model": model, **extra},
                       content_type="application/json", **tenant.auth)


def upload(client, tenant: Tenant, ref: str, file_name: str | None, content: bytes, part_name: str | None = None):
    data: dict[str, Any] = {"file": SimpleUploadedFile(part_name or file_name or "upload", content)}
    if file_name is not None:
        data["file_name"] = file_name
    return client.post(finetunes_url(tenant, f"/{ref}/finetune-assets"), data=data, **tenant.auth)


def upload_both(client, tenant: Tenant, built: Built, name: str = "tone", **files: bytes):
    """The single multipart upload, both files as fields named after them (or the given ones instead)."""
    parts = files or {CONFIG_FILE: built.config, WEIGHTS_FILE: built.weights}
    data: dict[str, Any] = {"name": name, "model": CHAT_MODEL, "description": "shorter answers"}
    data.update({field: SimpleUploadedFile(field, content) for field, content in parts.items()})
    return client.post(finetunes_url(tenant), data=data, **tenant.auth)


def make_ready(client, tenant: Tenant, built: Built, name: str = "tone") -> dict[str, Any]:
    response = upload_both(client, tenant, built, name)
    assert response.status_code == 200, response.content
    return response.json()["result"]


def error(response) -> tuple[int, int, str]:
    body = response.json()
    assert body["success"] is False and body["result"] is None
    return response.status_code, body["errors"][0]["code"], body["errors"][0]["message"]


def stored_files(root: Path) -> list[str]:
    """Every file under the storage folder, relative to it."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) if root.exists() else []


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ------------------------------------------------------------------------------------------------ happy paths
def test_the_chat_model_supports_lora(catalog):
    assert catalog[CHAT_MODEL].supports_lora is True and catalog[CHAT_MODEL].installed


def test_two_step_upload_makes_a_ready_adapter_that_can_be_listed_used_and_deleted(
        client, tenant, built, storage, django_capture_on_commit_callbacks):
    created = create(client, tenant, description="shorter answers")
    assert created.status_code == 200, created.content
    adapter = created.json()["result"]
    assert (adapter["name"], adapter["model"], adapter["status"], adapter["files"]) == (
        "tone", CHAT_MODEL, "pending", [])
    assert len(adapter["id"]) == 32 and adapter["created_at"] and adapter["modified_at"]

    half = upload(client, tenant, adapter["id"], CONFIG_FILE, built.config).json()["result"]
    assert half["status"] == "pending" and [f["file_name"] for f in half["files"]] == [CONFIG_FILE]
    with pytest.raises(ApiError) as refused:
        services.find_adapter(tenant.account.pk, "tone")
    assert refused.value.code == 3039 and WEIGHTS_FILE in refused.value.message

    done = upload(client, tenant, adapter["id"], WEIGHTS_FILE, built.weights)
    assert done.status_code == 200, done.content
    ready = done.json()["result"]
    assert (ready["status"], ready["rank"], ready["alpha"], ready["target_modules"]) == (
        "ready", 8, 16.0, ["q_proj", "v_proj"])
    assert ready["size_bytes"] == len(built.config) + len(built.weights)
    assert ready["files"] == [{"file_name": CONFIG_FILE, "size_bytes": len(built.config), "sha256": sha(built.config)},
                              {"file_name": WEIGHTS_FILE, "size_bytes": len(built.weights),
                               "sha256": sha(built.weights)}]
    row = Adapter.objects.get(pk=adapter["id"])
    assert (row.num_layers, row.dtype, row.scaling) == (30, "F32", 2.0)

    prefix = f"adapters/{tenant.account.pk}/{adapter['id']}"
    assert stored_files(storage) == [f"{prefix}/{CONFIG_FILE}", f"{prefix}/{WEIGHTS_FILE}"]
    assert (storage / prefix / WEIGHTS_FILE).read_bytes() == built.weights

    listing = client.get(finetunes_url(tenant), **tenant.auth).json()
    assert [a["id"] for a in listing["result"]] == [adapter["id"]] and listing["result_info"]["count"] == 1
    assert client.get(finetunes_url(tenant, f"/{adapter['id']}"), **tenant.auth).json()["result"] == ready
    assert client.get(finetunes_url(tenant, "/tone"), **tenant.auth).json()["result"]["id"] == adapter["id"]

    # What the serving side gets: the adapter by name, its folder holding exactly the two files, its cache key.
    found = services.find_adapter(tenant.account.pk, "tone", CHAT_MODEL)
    folder = services.adapter_dir(found)
    assert sorted(p.name for p in folder.iterdir()) == [CONFIG_FILE, WEIGHTS_FILE]
    assert (folder / CONFIG_FILE).read_bytes() == built.config
    assert services.adapter_key(found) == f"{adapter['id']}:{sha(built.weights)[:16]}"

    with django_capture_on_commit_callbacks(execute=True):
        deleted = client.delete(finetunes_url(tenant, f"/{adapter['id']}"), **tenant.auth)
    assert deleted.status_code == 200 and deleted.json()["result"] == {"id": adapter["id"], "deleted": True}
    assert not Adapter.objects.exists() and not AdapterFile.objects.exists()
    assert stored_files(storage) == [] and not (storage / prefix).exists()
    assert error(client.get(finetunes_url(tenant, f"/{adapter['id']}"), **tenant.auth))[:2] == (404, 7003)


def test_the_weights_may_come_first(client, tenant, built):
    adapter_id = create(client, tenant).json()["result"]["id"]
    first = upload(client, tenant, adapter_id, WEIGHTS_FILE, built.weights).json()["result"]
    assert first["status"] == "pending"
    second = upload(client, tenant, adapter_id, CONFIG_FILE, built.config).json()["result"]
    assert (second["status"], second["rank"]) == ("ready", 8)


def test_file_name_defaults_to_the_parts_filename(client, tenant, built):
    adapter_id = create(client, tenant).json()["result"]["id"]
    assert upload(client, tenant, adapter_id, None, built.config, part_name=CONFIG_FILE).status_code == 200
    assert Adapter.objects.get(pk=adapter_id).files.get().file_name == CONFIG_FILE


def test_single_multipart_upload_with_fields_named_after_the_files(client, tenant, built, storage):
    result = make_ready(client, tenant, built)
    assert (result["status"], result["description"], len(result["files"])) == ("ready", "shorter answers", 2)
    assert len(stored_files(storage)) == 2


def test_single_multipart_upload_with_two_file_parts(client, tenant, built):
    response = client.post(finetunes_url(tenant), data={
        "name": "tone", "model": CHAT_MODEL,
        "file": [SimpleUploadedFile(CONFIG_FILE, built.config), SimpleUploadedFile(WEIGHTS_FILE, built.weights)]},
        **tenant.auth)
    assert response.status_code == 200, response.content
    assert response.json()["result"]["status"] == "ready"


def test_the_same_file_cannot_be_uploaded_twice(client, tenant, built, storage):
    adapter = make_ready(client, tenant, built)
    again = upload(client, tenant, adapter["id"], WEIGHTS_FILE, built.config)
    status, code, message = error(again)
    assert (status, code) == (409, 5006) and "cannot be replaced" in message
    prefix = storage / "adapters" / tenant.account.pk / adapter["id"]
    assert (prefix / WEIGHTS_FILE).read_bytes() == built.weights and len(stored_files(storage)) == 2

    # Also for a file that is stored while the adapter is still pending.
    pending = create(client, tenant, name="half").json()["result"]["id"]
    assert upload(client, tenant, pending, CONFIG_FILE, built.config).status_code == 200
    assert error(upload(client, tenant, pending, CONFIG_FILE, built.config))[:2] == (409, 5006)


def test_names_are_unique_per_account(client, tenant, other_tenant):
    assert create(client, tenant).status_code == 200
    status, code, message = error(create(client, tenant))
    assert (status, code) == (409, 5006) and "'tone' already exists" in message
    assert create(client, other_tenant).status_code == 200  # another account's namespace


def test_an_account_keeps_at_most_the_configured_number(client, tenant, other_tenant, settings):
    settings.HEARTH_LORA_MAX_PER_ACCOUNT = 2
    assert create(client, tenant, name="a").status_code == 200
    assert create(client, tenant, name="b").status_code == 200
    status, code, message = error(create(client, tenant, name="c"))
    assert (status, code) == (409, 5006) and "the most it may keep (2)" in message
    assert Adapter.objects.filter(account=tenant.account).count() == 2
    assert create(client, other_tenant, name="c").status_code == 200


@pytest.mark.parametrize("name", ["", "-dash", "a b", "x" * 101, "../up", "ünï"])
def test_bad_names_are_refused(client, tenant, name):
    status, code, message = error(create(client, tenant, name=name))
    assert (status, code) == (400, 5006) and "name" in message
    assert not Adapter.objects.exists()


def test_api_keys_cannot_publish(client, tenant, other_tenant):
    adapter = create(client, tenant, public=True).json()["result"]
    assert adapter["public"] is False
    assert client.get(finetunes_url(other_tenant), **other_tenant.auth).json()["result"] == []


# ------------------------------------------------------------------------------------------------ scoping
def test_another_account_cannot_see_use_change_or_delete(client, tenant, other_tenant, built):
    adapter = make_ready(client, tenant, built)
    assert client.get(finetunes_url(other_tenant), **other_tenant.auth).json()["result"] == []
    for ref in (adapter["id"], "tone"):
        assert error(client.get(finetunes_url(other_tenant, f"/{ref}"), **other_tenant.auth))[:2] == (404, 7003)
        assert error(client.delete(finetunes_url(other_tenant, f"/{ref}"), **other_tenant.auth))[:2] == (404, 7003)
        with pytest.raises(ApiError) as refused:
            services.find_adapter(other_tenant.account.pk, ref)
        assert (refused.value.status, refused.value.code, refused.value.param) == (400, 5007, "lora")
    assert error(upload(client, other_tenant, adapter["id"], CONFIG_FILE, built.config))[:2] == (404, 7003)
    # Its own key on the other account's path is refused outright.
    assert error(client.get(finetunes_url(tenant), **other_tenant.auth))[:2] == (403, 10001)
    assert Adapter.objects.get(pk=adapter["id"]).files.count() == 2


def test_a_published_adapter_is_visible_to_all_but_deletable_only_by_its_owner(
        client, tenant, other_tenant, built, django_capture_on_commit_callbacks):
    adapter = make_ready(client, tenant, built)
    services.set_public(adapter["id"], True)
    mine = create(client, other_tenant, name="mine").json()["result"]
    listing = client.get(finetunes_url(other_tenant), **other_tenant.auth).json()["result"]
    assert [a["id"] for a in listing] == [mine["id"], adapter["id"]]  # newest first
    public = client.get(finetunes_url(other_tenant, "/public"), **other_tenant.auth).json()["result"]
    assert [a["id"] for a in public] == [adapter["id"]] and public[0]["public"] is True
    seen = client.get(finetunes_url(other_tenant, "/tone"), **other_tenant.auth).json()["result"]
    assert seen["id"] == adapter["id"]
    assert services.find_adapter(other_tenant.account.pk, "tone", CHAT_MODEL).pk == adapter["id"]

    assert error(client.delete(finetunes_url(other_tenant, f"/{adapter['id']}"), **other_tenant.auth))[:2] == (
        404, 7003)
    assert error(upload(client, other_tenant, adapter["id"], CONFIG_FILE, built.config))[:2] == (404, 7003)
    with pytest.raises(ApiError):
        services.delete_adapter(other_tenant.account.pk, adapter["id"])
    assert Adapter.objects.filter(pk=adapter["id"]).exists()

    # An account's own adapter of the same name comes first.
    create(client, other_tenant, name="tone")
    with pytest.raises(ApiError) as refused:
        services.find_adapter(other_tenant.account.pk, "tone")
    assert refused.value.code == 3039  # its own, which has no files yet


def test_a_read_key_lists_but_cannot_create_upload_or_delete(client, tenant, built):
    reader = make_tenant("reader", permission=ApiKey.Permission.READ)
    runner = make_tenant("runner", permission=ApiKey.Permission.RUN)
    for who in (reader, runner):
        status, code, message = error(create(client, who))
        assert (status, code) == (403, 10001) and "'admin' permission" in message
        assert client.get(finetunes_url(who), **who.auth).status_code == 200
    adapter = services.create_adapter(reader.account, name="tone", base_model=CHAT_MODEL)
    assert error(upload(client, reader, adapter.pk, CONFIG_FILE, built.config))[:2] == (403, 10001)
    assert error(client.delete(finetunes_url(reader, f"/{adapter.pk}"), **reader.auth))[:2] == (403, 10001)
    assert error(upload_both(client, reader, built))[:2] == (403, 10001)
    assert Adapter.objects.filter(account=reader.account).count() == 1
    assert error(client.get(finetunes_url(tenant)))[:2] == (401, 10000)
    # A key limited to other models cannot make adapters for this one.
    scoped = make_tenant("scoped", permission=ApiKey.Permission.ADMIN, allowed_models=["@hearth/gemma-3-270m"])
    status, code, message = error(create(client, scoped))
    assert (status, code) == (403, 10001) and CHAT_MODEL in message


def test_signed_in_members_read_and_owners_manage(client, tenant, built, django_user_model):
    from controlplane.accounts.models import Membership

    owner = django_user_model.objects.create_user("owner", password="pw-123456789")
    member = django_user_model.objects.create_user("member", password="pw-123456789")
    Membership.objects.create(account=tenant.account, user=owner, role=Membership.Role.OWNER)
    Membership.objects.create(account=tenant.account, user=member, role=Membership.Role.MEMBER)
    client.force_login(owner)
    response = client.post(finetunes_url(tenant), data={
        "name": "tone", "model": CHAT_MODEL, CONFIG_FILE: SimpleUploadedFile(CONFIG_FILE, built.config),
        WEIGHTS_FILE: SimpleUploadedFile(WEIGHTS_FILE, built.weights)})
    assert response.status_code == 200 and response.json()["result"]["status"] == "ready"
    client.force_login(member)
    assert [a["name"] for a in client.get(finetunes_url(tenant)).json()["result"]] == ["tone"]
    assert error(client.delete(finetunes_url(tenant, "/tone")))[:2] == (403, 10001)
    assert Adapter.objects.count() == 1


def test_find_adapter_checks_the_base_model(client, tenant, built):
    make_ready(client, tenant, built)
    with pytest.raises(ApiError) as refused:
        services.find_adapter(tenant.account.pk, "tone", "@hearth/gemma-3-270m")
    assert refused.value.status == 400 and f"is for {CHAT_MODEL}" in refused.value.message
    with pytest.raises(ApiError) as unknown:
        services.find_adapter(tenant.account.pk, "nope", CHAT_MODEL)
    assert unknown.value.code == 5007 and "No LoRA adapter 'nope'" in unknown.value.message


# ------------------------------------------------------------------------------------------------ storage
def test_adapter_dir_copies_from_a_storage_without_local_paths(settings, tenant, built):
    """A storage without local paths (S3-like; Django's in-memory one here): the engine gets a checked copy in
    the data dir, made once."""
    settings.STORAGES = {**settings.STORAGES,
                         "default": {"BACKEND": "django.core.files.storage.InMemoryStorage"}}
    adapter = services.create_adapter(tenant.account, name="tone", base_model=CHAT_MODEL)
    services.add_asset(adapter, CONFIG_FILE, SimpleUploadedFile("x", built.config))
    adapter = services.add_asset(adapter, WEIGHTS_FILE, SimpleUploadedFile("y", built.weights))
    assert adapter.status == "ready"
    folder = services.adapter_dir(adapter)
    assert folder == Path(settings.HEARTH_DATA_DIR) / "adapter-cache" / adapter.pk
    assert (folder / WEIGHTS_FILE).read_bytes() == built.weights and len(list(folder.iterdir())) == 2
    assert services.adapter_dir(adapter) == folder

    # A stored file that no longer matches its checksum is refused, not served.
    import shutil

    shutil.rmtree(folder)
    name = adapter.files.get(kind="weights").storage_name
    default_storage.delete(name)
    default_storage.save(name, SimpleUploadedFile("y", built.weights[:-4] + b"\0\0\0\0"))
    with pytest.raises(ApiError) as damaged:
        services.adapter_dir(adapter)
    assert damaged.value.code == 3039 and "damaged" in damaged.value.message
    assert not folder.exists()


def test_adapter_dir_reports_files_missing_from_storage(client, tenant, built, storage):
    adapter = make_ready(client, tenant, built)
    (storage / "adapters" / tenant.account.pk / adapter["id"] / WEIGHTS_FILE).unlink()
    with pytest.raises(ApiError) as missing:
        services.adapter_dir(services.find_adapter(tenant.account.pk, adapter["id"]))
    assert missing.value.code == 3039 and WEIGHTS_FILE in missing.value.message


# ------------------------------------------------------------------------------------------------ admin, docs
def test_operators_publish_in_the_admin(client, tenant, other_tenant, built, django_user_model,
                                        django_capture_on_commit_callbacks, storage):
    adapter = make_ready(client, tenant, built)
    operator = django_user_model.objects.create_superuser("op", password="pw-123456789")
    client.force_login(operator)
    url = f"/admin/adapters/adapter/{adapter['id']}/change/"
    assert client.get(url).status_code == 200
    files = list(AdapterFile.objects.filter(adapter_id=adapter["id"]))
    form = {"public": "on", "files-TOTAL_FORMS": "2", "files-INITIAL_FORMS": "2", "files-MIN_NUM_FORMS": "0",
            "files-MAX_NUM_FORMS": "1000", "_save": "Save"}
    for i, f in enumerate(files):
        form.update({f"files-{i}-id": str(f.pk), f"files-{i}-adapter": adapter["id"]})
    assert client.post(url, form).status_code == 302
    client.logout()
    seen = client.get(finetunes_url(other_tenant), **other_tenant.auth).json()["result"]
    assert [a["id"] for a in seen] == [adapter["id"]]
    # Only `public` is editable there: the rest stays what validation found.
    assert Adapter.objects.get(pk=adapter["id"]).rank == 8

    client.force_login(operator)
    with django_capture_on_commit_callbacks(execute=True):
        assert client.post(f"/admin/adapters/adapter/{adapter['id']}/delete/", {"post": "yes"}).status_code == 302
    assert not Adapter.objects.exists() and stored_files(storage) == []


def test_the_routes_are_documented(client):
    paths = client.get("/api/schema/").json()["paths"]
    base = "/client/v4/accounts/{account_id}/ai/finetunes"
    assert {"get", "post"} <= set(paths[base]) and {"get", "delete"} <= set(paths[base + "/{finetune_id}"])
    body = paths[base]["post"]["requestBody"]["content"]
    assert {"application/json", "multipart/form-data"} <= set(body)
    assert "post" in paths[base + "/{finetune_id}/finetune-assets"]


def test_the_json_envelope_on_a_malformed_create(client, tenant):
    response = client.post(finetunes_url(tenant), data="{nope", content_type="application/json", **tenant.auth)
    assert error(response)[:2] == (400, 3003)
    status, code, message = error(client.post(finetunes_url(tenant), data=json.dumps({"name": "x"}),
                                              content_type="application/json", **tenant.auth))
    assert (status, code) == (400, 5006) and "model" in message


def test_an_upload_declared_too_large_is_refused_before_its_body_is_read(settings):
    """The ASGI router answers 413 from the Content-Length alone: Django would spool the whole body first."""
    import asyncio

    from controlplane.asgi import UPLOAD_SLACK, http_router

    settings.HEARTH_LORA_MAX_BYTES = 1000
    sent: list[dict] = []

    async def receive() -> dict:
        raise AssertionError("the body must not be read")

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/client/v4/accounts/acct/ai/finetunes",
             "headers": [(b"content-length", str(1000 + UPLOAD_SLACK + 1).encode())]}
    asyncio.run(http_router(scope, receive, send))
    assert sent[0]["status"] == 413
    body = json.loads(sent[1]["body"])
    assert body["success"] is False and body["errors"][0]["code"] == 3006
