"""The dashboard's LoRA adapters page through the Django client: the list, uploads through the streaming upload
handler into the adapter services (a ready adapter, or a 4xx with nothing stored), deletes, CSRF, and who may
look and who may change. The adapter is a real PEFT adapter made against SmolLM2 (tests/lora_support.py)."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cp_support import CHAT_MODEL, EMBED_MODEL
from django.contrib.auth import get_user_model
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client

from controlplane.accounts.models import Membership
from controlplane.adapters import services
from controlplane.adapters.models import Adapter, AdapterFile
from inference.lora.format import CONFIG_FILE, WEIGHTS_FILE
from inference.models.catalog import BUNDLED_MODELS, model_path

pytestmark = pytest.mark.django_db

PAGE = "/dashboard/{}/adapters/"
AS_JSON = {"HTTP_ACCEPT": "application/json"}  # what the page's script sends


@dataclass(frozen=True)
class Peft:
    config: bytes
    weights: bytes

    def uploads(self) -> dict[str, SimpleUploadedFile]:
        return {CONFIG_FILE: SimpleUploadedFile(CONFIG_FILE, self.config),
                WEIGHTS_FILE: SimpleUploadedFile(WEIGHTS_FILE, self.weights)}


@pytest.fixture(scope="module")
def peft(tmp_path_factory) -> Peft:
    """A rank-8 adapter on q_proj, v_proj and o_proj, saved by PEFT itself."""
    if not BUNDLED_MODELS[CHAT_MODEL].installed:
        pytest.skip(f"{CHAT_MODEL} is not installed: run `make models`")
    from tests.lora_support import make_peft_adapter

    out = make_peft_adapter(model_path(CHAT_MODEL), tmp_path_factory.mktemp("dash-lora") / "tone", rank=8,
                            targets=("q_proj", "v_proj", "o_proj"), seed=3)
    return Peft((out / CONFIG_FILE).read_bytes(), (out / WEIGHTS_FILE).read_bytes())


@pytest.fixture(autouse=True)
def media(settings, tmp_path) -> Path:
    """Stored adapter files go to a folder of the test's own, so "nothing stored" can be looked at."""
    settings.MEDIA_ROOT = str(tmp_path / "media")
    settings.HEARTH_DATA_DIR = tmp_path / "data"
    return tmp_path / "media"


def stored_files(media: Path) -> list[Path]:
    return sorted(p for p in media.rglob("*") if p.is_file())


def web(tenant=None, name: str = "ada", *, role: str = Membership.Role.OWNER, staff: bool = False) -> Client:
    """A signed-in browser of a user with `role` in tenant's account (or of none)."""
    user = get_user_model().objects.create_user(name, password="pw-" + name, is_staff=staff)
    if tenant is not None:
        Membership.objects.create(account=tenant.account, user=user, role=role)
    client = Client()
    client.force_login(user)
    return client


def upload_form(peft: Peft, name: str = "tone", **changes: Any) -> dict[str, Any]:
    """The form as the page posts it; a change to None leaves that field out."""
    form = {"action": "upload", "name": name, "base_model": CHAT_MODEL, "description": "shorter answers",
            "config": SimpleUploadedFile("adapter_config.json", peft.config),
            "weights": SimpleUploadedFile("adapter_model.safetensors", peft.weights), **changes}
    return {k: v for k, v in form.items() if v is not None}


def adapter_of(tenant, peft: Peft, name: str, *, public: bool = False) -> Adapter:
    adapter = services.upload_adapter(tenant.account, name=name, base_model=CHAT_MODEL, description="",
                                      files=peft.uploads())
    if public:
        services.set_public(adapter.pk, True)
    return adapter


def row_ids(html: str) -> list[str]:
    return re.findall(r'data-adapter-id="([0-9a-f]+)"', html)


def delete_form(adapter_id: str) -> dict[str, str]:
    return {"action": "delete", "adapter_id": adapter_id}


# ------------------------------------------------------------------------------------------------ the page
def test_the_list_shows_the_accounts_and_public_adapters_with_their_facts(tenant, other_tenant, peft):
    owner = web(tenant)
    empty = owner.get(PAGE.format(tenant.account.pk))
    assert empty.status_code == 200 and 'id="adapters-empty"' in empty.content.decode()
    assert 'aria-current="page">LoRA adapters</a>' in empty.content.decode()

    mine = adapter_of(tenant, peft, "tone")
    shared = adapter_of(other_tenant, peft, "house-style", public=True)
    hidden = adapter_of(other_tenant, peft, "globex-only")
    page = owner.get(PAGE.format(tenant.account.pk))
    html = page.content.decode()
    assert row_ids(html) == [shared.pk, mine.pk]  # newest first; another account's private one is not shown
    assert hidden.pk not in html and "globex-only" not in html
    row = html[html.index(f'data-adapter-id="{mine.pk}"'):html.index("</tr>", html.index(mine.pk))]
    assert 'data-label="Rank">8</td>' in row and 'data-label="Alpha">16</td>' in row
    assert 'data-label="Target modules">o_proj, q_proj, v_proj</td>' in row
    assert 'data-status="ready"' in row and "public" not in row
    assert f'value="{mine.pk}"' in row  # its delete form
    public_row = html[html.index(f'data-adapter-id="{shared.pk}"'):html.index(f'data-adapter-id="{mine.pk}"')]
    assert 'class="badge public"' in public_row and "Delete" not in public_row  # not ours to delete
    # Only installed models that serve LoRA can be chosen as the base.
    offered = [m.name for m in page.context["base_models"]]
    assert page.context["form"]["base_model"] == CHAT_MODEL  # the server's default model comes first
    assert CHAT_MODEL in offered and EMBED_MODEL not in offered
    assert offered == sorted(n for n, m in BUNDLED_MODELS.items() if m.supports_lora and m.installed)


# ------------------------------------------------------------------------------------------------ uploads
def test_an_upload_makes_a_ready_adapter_and_answers_with_the_new_list(tenant, peft, media):
    owner = web(tenant)
    answer = owner.post(PAGE.format(tenant.account.pk), upload_form(peft), **AS_JSON)
    assert answer.status_code == 201, answer.content
    body = answer.json()
    adapter = Adapter.objects.get(pk=body["adapter"]["id"])
    assert (adapter.account_id, adapter.name, adapter.base_model) == (tenant.account.pk, "tone", CHAT_MODEL)
    assert (adapter.status, adapter.rank, adapter.alpha, adapter.description) == ("ready", 8, 16, "shorter answers")
    assert body["adapter"]["status"] == "ready" and body["adapter"]["rank"] == 8
    assert row_ids(body["list"]) == [adapter.pk] and 'data-status="ready"' in body["list"]
    digests = {f.file_name: f.sha256 for f in AdapterFile.objects.filter(adapter=adapter)}
    assert digests == {CONFIG_FILE: hashlib.sha256(peft.config).hexdigest(),
                       WEIGHTS_FILE: hashlib.sha256(peft.weights).hexdigest()}
    assert [p.name for p in stored_files(media)] == [CONFIG_FILE, WEIGHTS_FILE]
    listed = Client().get(f"/client/v4/accounts/{tenant.account.pk}/ai/finetunes", **tenant.auth).json()
    assert [a["id"] for a in listed["result"]] == [adapter.pk]  # the API sees what the page made

    # The same name again clashes; without JavaScript the form posts normally and the page comes back.
    clash = owner.post(PAGE.format(tenant.account.pk), upload_form(peft), **AS_JSON)
    assert clash.status_code == 409 and "already exists" in clash.json()["error"]["message"]
    plain = owner.post(PAGE.format(tenant.account.pk), upload_form(peft, name="second"), follow=True)
    assert plain.redirect_chain == [(PAGE.format(tenant.account.pk), 302)]
    assert "Adapter second uploaded." in plain.content.decode()
    assert Adapter.objects.filter(account=tenant.account).count() == 2


NOT_SAFETENSORS = b"\x80\x04\x95" + b"\x00" * 64  # the start of a pickle, as in a pytorch_model.bin


@pytest.mark.parametrize(("changes", "status", "message"), [
    ({"weights": SimpleUploadedFile("adapter_model.bin", NOT_SAFETENSORS)}, 400,
     "adapter_model.safetensors: choose a .safetensors file, not 'adapter_model.bin'"),
    ({"weights": SimpleUploadedFile("adapter_model.safetensors", NOT_SAFETENSORS)}, 400, "Invalid LoRA adapter"),
    ({"weights": None}, 400, "required files missing: adapter_model.safetensors"),
    ({"config": SimpleUploadedFile("adapter_config.json", b'{"peft_type": "LORA", "r": 64}')}, 400, "rank"),
    ({"name": "two words"}, 400, "name: 1 to 100 characters"),
    ({"base_model": EMBED_MODEL}, 400, "does not support LoRA"),
    ({"action": "rename"}, 400, "Unknown action 'rename'"),
], ids=["pickle-file", "pickle-renamed", "no-weights", "rank-too-high", "bad-name", "no-lora-model", "action"])
def test_a_refused_upload_is_a_4xx_with_its_reason_and_stores_nothing(tenant, peft, media, changes, status, message):
    answer = web(tenant).post(PAGE.format(tenant.account.pk), upload_form(peft, **changes), **AS_JSON)
    assert answer.status_code == status, answer.content
    assert message in answer.json()["error"]["message"]
    assert not Adapter.objects.exists() and not AdapterFile.objects.exists() and stored_files(media) == []


def test_without_javascript_a_refusal_shows_inline_and_the_form_keeps_its_values(tenant, peft, media):
    form = upload_form(peft, name="keep-me", description="my <notes>", weights=None)
    answer = web(tenant).post(PAGE.format(tenant.account.pk), form)
    assert answer.status_code == 400
    html = answer.content.decode()
    error = re.search(r'<p class="error" role="alert" id="ad-error">([^<]*)</p>', html)
    assert error and "required files missing" in error.group(1)
    assert 'value="keep-me"' in html and 'value="my &lt;notes&gt;"' in html
    assert not Adapter.objects.exists() and stored_files(media) == []


def test_an_upload_over_the_size_limit_is_413_and_stores_nothing(settings, tenant, peft, media):
    settings.HEARTH_LORA_MAX_BYTES = len(peft.weights) // 2
    answer = web(tenant).post(PAGE.format(tenant.account.pk), upload_form(peft), **AS_JSON)
    assert answer.status_code == 413
    assert f"over the limit of {len(peft.weights) // 2:,} bytes" in answer.json()["error"]["message"]
    assert not Adapter.objects.exists() and stored_files(media) == []


def test_writes_need_the_csrf_token(tenant, peft, media):
    owner = web(tenant)
    owner.handler.enforce_csrf_checks = True
    url = PAGE.format(tenant.account.pk)
    refused = owner.post(url, upload_form(peft), **AS_JSON)
    assert refused.status_code == 403 and not Adapter.objects.exists() and stored_files(media) == []
    token = owner.get(url).cookies["csrftoken"].value
    assert owner.post(url, upload_form(peft), HTTP_X_CSRFTOKEN=token, **AS_JSON).status_code == 201


# ------------------------------------------------------------------------------------------------ deletes
def test_deleting_an_own_adapter_removes_its_row_and_files(tenant, other_tenant, peft, media,
                                                          django_capture_on_commit_callbacks):
    mine, other = adapter_of(tenant, peft, "tone"), adapter_of(tenant, peft, "other")
    shared = adapter_of(other_tenant, peft, "house-style", public=True)
    owner = web(tenant)
    url = PAGE.format(tenant.account.pk)
    with django_capture_on_commit_callbacks(execute=True):  # stored files go once the deletion has committed
        answer = owner.post(url, delete_form(mine.pk), **AS_JSON)
    assert answer.status_code == 200 and answer.json()["deleted"] == mine.pk
    assert row_ids(answer.json()["list"]) == [shared.pk, other.pk]
    assert not Adapter.objects.filter(pk=mine.pk).exists()
    assert not any(mine.pk in str(p) for p in stored_files(media)) and len(stored_files(media)) == 4
    api = Client().get(f"/client/v4/accounts/{tenant.account.pk}/ai/finetunes/{mine.pk}", **tenant.auth)
    assert api.status_code == 404

    # Someone else's public adapter is not ours to delete, and a gone one stays gone.
    for adapter_id in (shared.pk, mine.pk, "not-an-id"):
        refused = owner.post(url, delete_form(adapter_id), **AS_JSON)
        assert refused.status_code == 404 and "No such LoRA adapter" in refused.json()["error"]["message"]
    assert Adapter.objects.filter(pk=shared.pk).exists()
    plain = owner.post(url, delete_form(other.pk), follow=True)
    assert plain.redirect_chain == [(url, 302)] and "Adapter deleted." in plain.content.decode()
    assert row_ids(plain.content.decode()) == [shared.pk]


# ------------------------------------------------------------------------------------------------ access
def test_members_look_owners_and_operators_change_strangers_get_404(tenant, other_tenant, peft, media):
    url = PAGE.format(tenant.account.pk)
    kept = adapter_of(tenant, peft, "tone")
    assert Client().get(url).status_code == 302  # to the sign-in page

    stranger = web(other_tenant, "eve")
    for answer in (stranger.get(url), stranger.post(url, upload_form(peft, name="x"), **AS_JSON),
                   stranger.post(url, delete_form(kept.pk), **AS_JSON)):
        assert answer.status_code == 404

    member = web(tenant, "bob", role=Membership.Role.MEMBER)
    looked = member.get(url)
    assert looked.status_code == 200 and row_ids(looked.content.decode()) == [kept.pk]
    assert 'id="upload-form"' not in looked.content.decode() and "Delete" not in looked.content.decode()
    upload = member.post(url, upload_form(peft, name="mine"), **AS_JSON)
    delete = member.post(url, delete_form(kept.pk), **AS_JSON)
    for answer in (upload, delete):
        assert answer.status_code == 403 and "Only the account's owners" in answer.json()["error"]["message"]
    plain = member.post(url, delete_form(kept.pk))
    assert plain.status_code == 403 and "Only the account&#x27;s owners" in plain.content.decode()
    assert list(Adapter.objects.values_list("name", flat=True)) == ["tone"]
    assert len(stored_files(media)) == 2

    operator = web(name="ops", staff=True)  # no membership: operators act on every account
    assert 'id="upload-form"' in operator.get(url).content.decode()
    made = operator.post(url, upload_form(peft, name="from-ops"), **AS_JSON)
    assert made.status_code == 201
    assert Adapter.objects.get(pk=made.json()["adapter"]["id"]).account_id == tenant.account.pk
    assert operator.post(url, delete_form(kept.pk), **AS_JSON).status_code == 200
    assert list(Adapter.objects.values_list("name", flat=True)) == ["from-ops"]
