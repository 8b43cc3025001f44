"""The dashboard's pages, its figures (from the rollups) and its live socket, through the real ASGI app."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta

import pytest
from asgiref.sync import sync_to_async
from asgiref.testing import ApplicationCommunicator
from cp_support import CHAT_MODEL, redis_url
from django.contrib.auth import get_user_model
from django.test import Client, override_settings
from django.utils import timezone

from controlplane.accounts.models import Membership
from controlplane.catalog.models import AiModel
from controlplane.catalog.services import set_price
from controlplane.dashboard import stats
from controlplane.usage.models import Status
from controlplane.usage.services import UsageRecord, record

NOW = datetime(2026, 5, 4, 12, 30, 20, tzinfo=UTC)


@pytest.fixture
def priced(catalog) -> None:
    """A price in effect since 2020, so usage at the fixed NOW has one."""
    set_price(AiModel.objects.get(name=CHAT_MODEL), input_neurons=1000, cached_input_neurons=250,
              output_neurons=4000, effective_at=datetime(2020, 1, 1, tzinfo=UTC))


def usage(tenant, *, at=NOW, inp=100, cached=0, out=20, status=Status.OK, proposed=0, accepted=0):
    return record(UsageRecord(account_id=tenant.account.pk, key_id=str(tenant.key.pk), model=CHAT_MODEL,
                              route="native", status=status, input_tokens=inp, cached_input_tokens=cached,
                              output_tokens=out, latency_ms=40.0, ttft_ms=10.0, spec_proposed=proposed,
                              spec_accepted=accepted, created_at=at))


def member(tenant, name="ada", *, staff=False):
    user = get_user_model().objects.create_user(name, password="pw-" + name, is_staff=staff)
    if not staff:
        Membership.objects.create(account=tenant.account, user=user, role=Membership.Role.MEMBER)
    return user


# ------------------------------------------------------------------------------------------------ figures
@pytest.mark.django_db
def test_overview_figures_come_from_the_rollups(priced, tenant, other_tenant):
    usage(tenant)
    usage(tenant, at=NOW - timedelta(seconds=15), inp=50, cached=25, proposed=10, accepted=7)
    usage(tenant, at=NOW - timedelta(minutes=5), status=Status.ERROR)
    usage(tenant, at=NOW - timedelta(hours=2))  # today, but outside the hour on the chart
    usage(tenant, at=NOW - timedelta(days=1))  # yesterday: nowhere
    usage(other_tenant)  # another account: nowhere
    s = stats.overview(tenant.account, NOW)
    assert len(s["series"]["labels"]) == 60 and s["series"]["labels"][-1] == "12:30"
    assert s["series"]["requests"][-1] == 2 and s["series"]["requests"][-6] == 1
    assert s["series"]["errors"][-6] == 1 and sum(s["series"]["requests"]) == 3
    assert s["series"]["tokens"][-1] == 120 + 70
    assert s["now"] == {"requests_per_min": 2, "tokens_per_min": 190}
    today = s["today"]
    assert (today["requests"], today["errors"]) == (4, 1)
    assert today["error_rate"] == 0.25 and today["mean_latency_ms"] == 40.0 and today["mean_ttft_ms"] == 10.0
    assert today["prefix_cache_hit_rate"] == 25 / 250  # a failed request bills (and counts) no tokens
    assert today["spec_acceptance"] == 0.7
    assert today["free_neurons"] == tenant.account.free_neurons_per_day and today["neurons"] > 0
    step = 2 ** 0.5  # the histogram's bucket width: every request took 40 ms, its first token came at 10 ms
    assert 40 / step <= today["p50_latency_ms"] <= today["p95_latency_ms"] <= 40 * step
    assert 10 / step <= today["p50_ttft_ms"] <= today["p95_ttft_ms"] <= 10 * step
    latency = s["series"]["p95_latency_ms"]
    assert 40 / step <= latency[-1] <= 40 * step and latency[-2] is None  # a minute without requests has none


@pytest.mark.real_model
@pytest.mark.django_db
def test_the_overview_shows_each_loaded_engines_kv_cache(backend, tenant):
    from controlplane.serving.dispatch import set_backend

    previous = set_backend(None)
    try:
        assert stats.engines() == []  # no backend yet: nothing is loaded just to be looked at
    finally:
        set_backend(previous)
    web = Client()
    answer = web.post(tenant.run_url + CHAT_MODEL, {"prompt": "Hi", "max_tokens": 2},
                      content_type="application/json", **tenant.auth)
    assert answer.status_code == 200
    engines = {e["model"]: e for e in stats.overview(tenant.account, timezone.now())["engines"]}
    engine = engines[CHAT_MODEL]
    assert engine["kv_blocks_total"] > 0 and 0 <= engine["kv_blocks_free"] <= engine["kv_blocks_total"]
    assert engine["kv_usage"] == pytest.approx(1 - engine["kv_blocks_free"] / engine["kv_blocks_total"], abs=1e-6)
    web.force_login(member(tenant))
    page = web.get(f"/dashboard/{tenant.account.pk}/")
    assert f"<td>{CHAT_MODEL}</td>".encode() in page.content


@pytest.mark.django_db
def test_an_account_with_no_usage_has_an_empty_hour_and_no_rates(tenant):
    s = stats.overview(tenant.account, NOW)
    assert s["series"]["requests"] == [0] * 60 and s["today"]["requests"] == 0
    assert s["today"]["error_rate"] is None and s["today"]["spec_acceptance"] is None


# -------------------------------------------------------------------------------------------------- pages
@pytest.mark.django_db
def test_pages_need_a_sign_in_and_show_only_the_users_accounts(tenant, other_tenant):
    web = Client()
    assert web.get("/dashboard/").url.startswith("/dashboard/login/")
    assert web.get(f"/dashboard/{tenant.account.pk}/").status_code == 302
    page = web.post("/dashboard/login/", {"username": "ada", "password": "nope"})
    assert page.status_code == 200 and b"do not match" in page.content
    member(tenant)
    assert web.post("/dashboard/login/", {"username": "ada", "password": "pw-ada"}).status_code == 302
    assert web.get("/dashboard/").url == f"/dashboard/{tenant.account.pk}/"
    usage(tenant, at=timezone.now())
    page = web.get(f"/dashboard/{tenant.account.pk}/")
    assert page.status_code == 200 and b"Overview" in page.content
    assert page.context["snapshot"]["today"]["requests"] == 1
    assert b"account-switcher" not in page.content  # one account: nothing to switch
    assert web.get(f"/dashboard/{other_tenant.account.pk}/").status_code == 404


@pytest.mark.django_db
def test_operators_switch_between_every_account(tenant, other_tenant):
    web = Client()
    web.force_login(member(tenant, "op", staff=True))
    page = web.get(f"/dashboard/{other_tenant.account.pk}/")
    assert page.status_code == 200 and b"account-switcher" in page.content
    assert tenant.account.name.encode() in page.content and other_tenant.account.name.encode() in page.content
    keys = web.get(f"/dashboard/{other_tenant.account.pk}/keys/")  # switching keeps the page
    assert f'<option value="/dashboard/{tenant.account.pk}/keys/"'.encode() in keys.content


@pytest.mark.django_db
def test_a_user_without_an_account_is_told_so(db):
    web = Client()
    web.force_login(get_user_model().objects.create_user("lonely", password="x"))
    assert b"not a member of any account" in web.get("/dashboard/").content


# ------------------------------------------------------------------------------------------------- socket
class Socket(ApplicationCommunicator):
    """A WebSocket client speaking ASGI to the app (channels.testing needs daphne, which we do not ship)."""

    def __init__(self, app, path: str, headers: list[tuple[bytes, bytes]]) -> None:
        super().__init__(app, {"type": "websocket", "path": path, "raw_path": path.encode(), "query_string": b"",
                               "headers": headers, "subprotocols": [], "client": ("127.0.0.1", 1),
                               "server": ("127.0.0.1", 8000)})

    async def connect(self, timeout: float) -> tuple[bool, int | None]:
        await self.send_input({"type": "websocket.connect"})
        reply = await self.receive_output(timeout)
        return (True, None) if reply["type"] == "websocket.accept" else (False, reply.get("code"))

    async def receive_json_from(self, timeout: float) -> dict:
        reply = await self.receive_output(timeout)
        assert reply["type"] == "websocket.send", reply
        return json.loads(reply["text"])

    async def disconnect(self) -> None:
        await self.send_input({"type": "websocket.disconnect", "code": 1000})
        await self.wait(1)


async def _connect(account_id: str, cookie: str | None, origin: str = "http://127.0.0.1:8000"):
    from controlplane.asgi import application

    headers = [(b"origin", origin.encode()), (b"host", b"127.0.0.1:8000")]
    if cookie:
        headers.append((b"cookie", f"sessionid={cookie}".encode()))
    socket = Socket(application, f"/ws/dashboard/{account_id}/overview", headers)
    connected, code = await socket.connect(timeout=10)
    return socket, connected, code


def _session(user) -> str:
    web = Client()
    web.force_login(user)
    return web.cookies["sessionid"].value


async def _live_update_arrives(tenant, cookie: str) -> None:
    socket, connected, _ = await _connect(tenant.account.pk, cookie)
    assert connected
    first = await socket.receive_json_from(timeout=10)
    assert first["type"] == "overview" and first["data"]["today"]["requests"] == 0
    started = asyncio.get_running_loop().time()
    await sync_to_async(usage)(tenant, at=timezone.now())
    while True:  # a snapshot with the new request, well within the 2 s the dashboard promises
        update = await socket.receive_json_from(timeout=2)
        if update["data"]["today"]["requests"] == 1:
            break
    assert asyncio.get_running_loop().time() - started < 2
    await socket.disconnect()


@pytest.mark.django_db(transaction=True)
def test_the_socket_pushes_a_new_snapshot_when_usage_lands(tenant):
    asyncio.run(_live_update_arrives(tenant, _session(member(tenant))))


@pytest.mark.django_db(transaction=True)
def test_a_notice_from_a_worker_thread_wakes_the_socket_at_once(tenant):
    """A batch worker's thread has no event loop of its own: its notice must be handed to the server's loop, not
    sent on a private loop that the in-memory layer's waiting consumer never hears from (the loop here has no
    periodic wake-up that would hide it)."""
    import threading

    from controlplane.dashboard import live

    cookie = _session(member(tenant))

    async def go() -> None:
        socket, connected, _ = await _connect(tenant.account.pk, cookie)
        assert connected
        await socket.receive_json_from(timeout=10)
        loop = asyncio.get_running_loop()
        started = loop.time()
        threading.Thread(target=live.notify, args=(tenant.account.pk,)).start()
        await socket.receive_json_from(timeout=2)  # the re-read BURST_S after the notice
        assert loop.time() - started < 1.0
        await socket.disconnect()

    asyncio.run(go())


@pytest.mark.django_db(transaction=True)
def test_an_open_socket_refreshes_without_usage_for_the_engine_gauges(tenant, monkeypatch):
    from controlplane.dashboard import consumers

    monkeypatch.setattr(consumers, "TICK_S", 0.2)
    cookie = _session(member(tenant))

    async def go() -> None:
        socket, connected, _ = await _connect(tenant.account.pk, cookie)
        assert connected
        first = await socket.receive_json_from(timeout=10)
        second = await socket.receive_json_from(timeout=10)  # ticks every 0.2 s; a busy machine may lag
        assert second["data"]["generated_at"] > first["data"]["generated_at"] and "engines" in second["data"]
        await socket.disconnect()

    asyncio.run(go())


@pytest.mark.django_db(transaction=True)
def test_the_socket_refuses_strangers_and_other_sites(tenant, other_tenant):
    cookie = _session(member(tenant))

    async def go() -> None:
        _, connected, _ = await _connect(tenant.account.pk, None)
        assert not connected  # nobody signed in
        _, connected, code = await _connect(other_tenant.account.pk, cookie)
        assert not connected and code == 4403  # not a member
        _, connected, _ = await _connect(tenant.account.pk, cookie, origin="https://evil.example")
        assert not connected  # a page of another site

    asyncio.run(go())


@pytest.mark.django_db(transaction=True)
def test_live_updates_cross_processes_on_the_redis_channel_layer(tenant):
    from conftest import redis_up

    if not redis_up():
        pytest.skip("Redis is not reachable on 127.0.0.1:6379")
    layers = {"default": {"BACKEND": "channels_redis.core.RedisChannelLayer",
                          "CONFIG": {"hosts": [redis_url(0)], "prefix": "hearth-test-dashboard"}}}
    from channels.layers import channel_layers

    with override_settings(CHANNEL_LAYERS=layers):
        channel_layers.backends.clear()
        try:
            asyncio.run(_live_update_arrives(tenant, _session(member(tenant))))
        finally:
            channel_layers.backends.clear()


# -------------------------------------------------------------------------------------------------- keys
@pytest.mark.django_db
def test_owners_create_and_revoke_keys_and_the_secret_is_shown_once(tenant):
    from controlplane.accounts.models import ApiKey
    from controlplane.accounts.services import authenticate_key
    from controlplane.api.errors import ApiError

    owner = member(tenant, "owner")
    Membership.objects.filter(user=owner).update(role=Membership.Role.OWNER)
    web = Client()
    web.force_login(owner)
    url = f"/dashboard/{tenant.account.pk}/keys/"
    page = web.post(url, {"action": "create", "name": "my-app", "permission": "run", "expires_days": "30"})
    assert page.status_code == 200
    secret = page.context["created"]["secret"]
    assert secret.encode() in page.content and authenticate_key(secret).account_id == tenant.account.pk
    assert secret.encode() not in web.get(url).content  # once
    key = ApiKey.objects.get(name="my-app")
    assert key.created_by == owner and 29 < (key.expires_at - timezone.now()).days + 1 <= 30
    bad = web.post(url, {"action": "create", "name": "x", "expires_days": "soon"})
    assert bad.status_code == 400 and b"number of days" in bad.content
    for days in ("-1", "0", "1e20", "nan"):
        bad = web.post(url, {"action": "create", "name": "x", "expires_days": days})
        assert bad.status_code == 400 and b"number of days between" in bad.content, days
    bad = web.post(url, {"action": "create", "name": "x" * 101})
    assert bad.status_code == 400 and b"at most 100 characters" in bad.content
    bad = web.post(url, {"action": "create", "name": "x", "permission": "root"})
    assert bad.status_code == 400 and b"permission must be one of" in bad.content
    assert web.post(url, {"action": "revoke", "key_id": str(key.pk)}).status_code == 302
    with pytest.raises(ApiError, match="revoked"):
        authenticate_key(secret)
    assert b"revoked" in web.get(url).content
    assert web.post(url, {"action": "revoke", "key_id": "not-a-key"}).status_code == 404


@pytest.mark.django_db
def test_members_see_keys_but_cannot_change_them(tenant, other_tenant):
    web = Client()
    web.force_login(member(tenant))
    url = f"/dashboard/{tenant.account.pk}/keys/"
    page = web.get(url)
    assert page.status_code == 200 and tenant.key.prefix.encode() in page.content and b"Create a key" not in page.content
    assert web.post(url, {"action": "revoke", "key_id": str(tenant.key.pk)}).status_code == 403
    tenant.key.refresh_from_db()
    assert tenant.key.revoked_at is None
    assert web.get(f"/dashboard/{other_tenant.account.pk}/keys/").status_code == 404
