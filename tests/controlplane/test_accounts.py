"""Accounts, API keys (hash-only storage, scopes, expiry, revocation, last use), management commands, REST."""

from __future__ import annotations

import hashlib
import io
from datetime import timedelta

import pytest
from cp_support import CHAT_MODEL, make_tenant
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.test import Client
from django.utils import timezone

from controlplane.accounts.models import Account, ApiKey, Membership
from controlplane.accounts.services import authenticate_key, issue_key
from controlplane.api.errors import ApiError

pytestmark = pytest.mark.django_db


def test_key_is_stored_only_as_a_hash_with_a_public_prefix(tenant):
    row = ApiKey.objects.get(pk=tenant.key.pk)
    assert tenant.secret.startswith("hth_" + row.prefix)
    assert row.secret_hash == hashlib.sha256(tenant.secret.encode()).hexdigest()
    stored = " ".join(str(getattr(row, f.attname)) for f in ApiKey._meta.fields)
    assert tenant.secret not in stored
    assert authenticate_key(tenant.secret).account_id == tenant.account.pk


def test_create_api_key_command_creates_account_and_prints_key_last(catalog):
    out = io.StringIO()
    call_command("create_api_key", "--account", "initech", "--name", "ci", "--models", CHAT_MODEL, stdout=out)
    lines = out.getvalue().strip().splitlines()
    account = Account.objects.get(name="initech")
    assert any(account.pk in line for line in lines)
    ctx = authenticate_key(lines[-1])
    assert (ctx.account_id, ctx.key_name, ctx.allowed_models) == (account.pk, "ci", (CHAT_MODEL,))
    # Second key for the same account: no new account.
    out2 = io.StringIO()
    call_command("create_api_key", "--account", "initech", stdout=out2)
    assert Account.objects.filter(name="initech").count() == 1
    assert authenticate_key(out2.getvalue().strip().splitlines()[-1]).account_id == account.pk


def test_bootstrap_demo_is_idempotent_and_prints_secrets_once(catalog, monkeypatch):
    monkeypatch.delenv("HEARTH_ADMIN_PASSWORD", raising=False)
    first = io.StringIO()
    call_command("bootstrap_demo", stdout=first)
    text = first.getvalue()
    password = next(line.split(": ", 1)[1] for line in text.splitlines() if line.startswith("Admin password"))
    key = text.strip().splitlines()[-1]
    admin = get_user_model().objects.get(username="admin")
    assert admin.is_superuser and admin.check_password(password)
    assert authenticate_key(key).account_name == "demo"

    second = io.StringIO()
    call_command("bootstrap_demo", stdout=second)
    again = second.getvalue()
    assert password not in again and key not in again and "hth_" not in again.replace(key[:16], "")
    assert "create_api_key --account demo" in again
    assert ApiKey.objects.filter(account__name="demo").count() == 1

    monkeypatch.setenv("HEARTH_ADMIN_PASSWORD", "a-chosen-password-1")
    call_command("bootstrap_demo", stdout=io.StringIO())
    admin.refresh_from_db()
    assert admin.check_password("a-chosen-password-1")


def run(client: Client, tenant, model: str = CHAT_MODEL, account_id: str | None = None, **headers):
    return client.post(f"/client/v4/accounts/{account_id or tenant.account.pk}/ai/run/{model}",
                       data={"prompt": "hi", "max_tokens": 1}, content_type="application/json", **headers)


@pytest.mark.parametrize("header, message", [
    (None, "Missing API key"),
    ("Basic abc", "Malformed Authorization"),
    ("Bearer hth_short", "Invalid API key"),
    ("Bearer hth_" + "a" * 52, "Invalid API key"),
])
def test_bad_credentials_are_401_in_both_styles(client, tenant, header, message):
    extra = {"HTTP_AUTHORIZATION": header} if header else {}
    native = run(client, tenant, **extra)
    assert native.status_code == 401
    assert native.json()["success"] is False and native.json()["errors"][0]["code"] == 10000
    assert message in native.json()["errors"][0]["message"]
    oa = client.get("/v1/models", **extra)
    assert oa.status_code == 401 and oa.json()["error"]["code"] == "invalid_api_key"


def test_wrong_secret_with_a_real_prefix_is_refused(client, tenant):
    forged = tenant.secret[:-4] + ("aaaa" if not tenant.secret.endswith("aaaa") else "bbbb")
    assert run(client, tenant, HTTP_AUTHORIZATION=f"Bearer {forged}").status_code == 401


def test_expired_and_revoked_keys_are_refused_even_after_being_cached(client, tenant):
    assert client.get("/v1/models", **tenant.auth).status_code == 200  # now cached
    ApiKey.objects.filter(pk=tenant.key.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    key = ApiKey.objects.get(pk=tenant.key.pk)
    key.save()  # a save (admin, service) drops the cached context
    response = client.get("/v1/models", **tenant.auth)
    assert response.status_code == 401 and "expired" in response.json()["error"]["message"]

    fresh = make_tenant("fresh")
    assert client.get("/v1/models", **fresh.auth).status_code == 200
    outsider = make_tenant("outsider", permission=ApiKey.Permission.ADMIN)
    revoke = client.delete(f"/client/v4/accounts/{fresh.account.pk}/tokens/{fresh.key.pk}", **outsider.auth)
    assert revoke.status_code == 403  # another account's key: not ours to revoke
    revoke = client.delete(f"/client/v4/accounts/{fresh.account.pk}/tokens/{fresh.key.pk}", **fresh.auth)
    assert revoke.status_code == 403  # a run key cannot manage keys
    owner_key, owner_secret = issue_key(fresh.account, permission=ApiKey.Permission.ADMIN)
    revoke = client.delete(f"/client/v4/accounts/{fresh.account.pk}/tokens/{fresh.key.pk}",
                           HTTP_AUTHORIZATION=f"Bearer {owner_secret}")
    assert revoke.status_code == 200 and revoke.json()["result"]["status"] == "revoked"
    response = client.get("/v1/models", **fresh.auth)
    assert response.status_code == 401 and "revoked" in response.json()["error"]["message"]


def test_another_accounts_id_in_the_path_is_403_everywhere(client, tenant, other_tenant):
    other = other_tenant.account.pk
    for response in (
        run(client, tenant, account_id=other, **tenant.auth),
        client.get(f"/client/v4/accounts/{other}/ai/usage", **tenant.auth),
        client.get(f"/client/v4/accounts/{other}/tokens", **tenant.auth),
        client.get(f"/client/v4/accounts/{other}/ai/models/search", **tenant.auth),
        client.get(f"/client/v4/accounts/{other}/ai/v1/models", **tenant.auth),
        client.get("/client/v4/accounts/" + "0" * 32 + "/ai/usage", **tenant.auth),
    ):
        assert response.status_code == 403, response.content
    # Another account's key id under one's own account is simply not there.
    missing = client.get(f"/client/v4/accounts/{tenant.account.pk}/tokens/{other_tenant.key.pk}", **tenant.auth)
    assert missing.status_code == 404 and missing.json()["errors"][0]["code"] == 7003


def test_accounts_listing_shows_only_the_keys_account(client, tenant, other_tenant):
    body = client.get("/client/v4/accounts", **tenant.auth).json()
    assert body["success"] and [a["id"] for a in body["result"]] == [tenant.account.pk]
    assert body["result"][0]["name"] == "acme"


def test_scopes_limit_models_and_read_only_keys_cannot_run(client, catalog):
    scoped = make_tenant("scoped", allowed_models=["@hearth/gemma-3-270m"])
    response = run(client, scoped, **scoped.auth)
    assert response.status_code == 403 and "may not use" in response.json()["errors"][0]["message"]
    listed = [m["id"] for m in client.get("/v1/models", **scoped.auth).json()["data"]]
    assert listed == (["@hearth/gemma-3-270m"] if catalog["@hearth/gemma-3-270m"].installed else [])

    reader = make_tenant("reader", permission=ApiKey.Permission.READ)
    response = run(client, reader, **reader.auth)
    assert response.status_code == 403 and "read-only" in response.json()["errors"][0]["message"]
    assert client.get(f"/client/v4/accounts/{reader.account.pk}/ai/usage", **reader.auth).status_code == 200


def test_keys_rest_create_list_revoke(client, tenant):
    url = f"/client/v4/accounts/{tenant.account.pk}/tokens"
    created = client.post(url, data={"name": "ci", "permission": "run", "models": [CHAT_MODEL],
                                     "requests_per_minute": 5}, content_type="application/json", **tenant.auth)
    assert created.status_code == 201
    value = created.json()["result"]["value"]
    assert authenticate_key(value).requests_per_minute == 5
    listing = client.get(url, **tenant.auth).json()["result"]
    assert {k["name"] for k in listing} == {"default", "ci"}
    assert all("value" not in k for k in listing)
    bad = client.post(url, data={"permission": "root"}, content_type="application/json", **tenant.auth)
    assert bad.status_code == 400 and bad.json()["errors"][0]["code"] == 5006
    past = client.post(url, data={"expires_on": "2001-01-01T00:00:00Z"}, content_type="application/json",
                       **tenant.auth)
    assert past.status_code == 400


def test_last_used_is_recorded(client, tenant):
    assert ApiKey.objects.get(pk=tenant.key.pk).last_used_at is None
    client.get("/v1/models", **tenant.auth)
    assert ApiKey.objects.get(pk=tenant.key.pk).last_used_at is not None


def test_session_members_see_their_account_and_owners_manage_keys(tenant, other_tenant):
    user = get_user_model().objects.create_user("alice", password="pw-for-alice-1")
    Membership.objects.create(account=tenant.account, user=user, role=Membership.Role.MEMBER)
    browser = Client(enforce_csrf_checks=True)
    browser.force_login(user)
    assert [a["id"] for a in browser.get("/client/v4/accounts").json()["result"]] == [tenant.account.pk]
    assert browser.get(f"/client/v4/accounts/{tenant.account.pk}/tokens").status_code == 200
    assert browser.get(f"/client/v4/accounts/{other_tenant.account.pk}/tokens").status_code == 403
    # Writes with a session need the CSRF token, and owner rights.
    url = f"/client/v4/accounts/{tenant.account.pk}/tokens"
    assert browser.post(url, data={}, content_type="application/json").status_code == 403
    Membership.objects.filter(user=user).update(role=Membership.Role.OWNER)
    browser.get("/admin/login/")  # sets the CSRF cookie
    token = browser.cookies["csrftoken"].value
    created = browser.post(url, data={"name": "from-dashboard"}, content_type="application/json",
                           HTTP_X_CSRFTOKEN=token)
    assert created.status_code == 201, created.content
    staff = get_user_model().objects.create_user("op", password="pw-for-op-1", is_staff=True)
    browser.force_login(staff)
    ids = {a["id"] for a in browser.get("/client/v4/accounts").json()["result"]}
    assert {tenant.account.pk, other_tenant.account.pk} <= ids


def test_issue_key_rejects_a_past_expiry(tenant):
    with pytest.raises(ApiError):
        issue_key(tenant.account, expires_at=timezone.now() - timedelta(days=1))
