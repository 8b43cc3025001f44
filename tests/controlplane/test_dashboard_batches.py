"""The dashboard's Batches page: the list, cancel and downloads through the Django client, and its live socket
through the real ASGI app (in-memory channel layer, and channels_redis on the real Redis). Batches are made and
advanced by the batch services themselves (create, prepare, claim, finish), as the API and the worker do."""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from asgiref.testing import ApplicationCommunicator
from cp_support import CHAT_MODEL, redis_url
from django.contrib.auth import get_user_model
from django.test import Client, override_settings
from django.utils import timezone

from controlplane.accounts.models import Membership
from controlplane.accounts.services import authenticate_key
from controlplane.batches import file_services, item_services, maintenance, services
from controlplane.batches.models import Batch, Item

PAGE = "/dashboard/{}/batches/"


def member(tenant, name: str = "ada", *, role: str = Membership.Role.MEMBER, staff: bool = False):
    user = get_user_model().objects.create_user(name, password="pw-" + name, is_staff=staff)
    if not staff:
        Membership.objects.create(account=tenant.account, user=user, role=role)
    return user


def signed_in(user, **options) -> Client:
    web = Client(**options)
    web.force_login(user)
    return web


def native_batch(tenant, count: int) -> Batch:
    return services.create_native_batch(authenticate_key(tenant.secret), CHAT_MODEL, [
        (f"r{i}", {"prompt": f"Say hi ({i}).", "max_tokens": 2}) for i in range(count)])


def chat_line(custom_id: str) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                "max_tokens": 2}})


def openai_batch(tenant, lines: list[str]) -> Batch:
    """Uploaded, created and read into items, as the API and the prepare task do."""
    ctx = authenticate_key(tenant.secret)
    upload = file_services.create_file(ctx, purpose="batch", filename="in.jsonl", content="\n".join(lines).encode())
    batch = services.create_openai_batch(ctx, input_file_id=upload.pk, endpoint="/v1/chat/completions",
                                         completion_window="24h")
    services.prepare(batch.pk)
    return Batch.objects.get(pk=batch.pk)


def run_items(batch: Batch, count: int | None = None, *, fail: tuple[int, ...] = ()) -> Batch:
    """Claim and finish the batch's next queued items as a worker does: answers for most, errors for `fail`."""
    queued = Item.objects.filter(batch=batch, status=Item.Status.QUEUED).order_by("index")
    for item in list(queued)[:count]:
        taken = item_services.claim(item.pk)
        assert taken.claim is not None
        if item.index in fail:
            outcome = item_services.Outcome(Item.Status.FAILED, error={
                "status": 400, "openai_status": 400, "code": 5006, "openai_code": "context_length_exceeded",
                "message": "The prompt does not fit", "param": None})
        else:
            outcome = item_services.Outcome(Item.Status.SUCCEEDED, response={"response": f"answer {item.index}"})
        assert item_services.finish(taken.claim, outcome)
    return Batch.objects.get(pk=batch.pk)


def rows(page) -> list[str]:
    return [row.batch.pk for row in page.context["rows"]]


# --------------------------------------------------------------------------------------------------- list
@pytest.mark.django_db
def test_the_list_shows_the_accounts_batches_newest_first_with_their_progress(tenant, other_tenant):
    done = run_items(native_batch(tenant, 2), fail=(1,))
    half = run_items(native_batch(tenant, 4), 2)
    queued = openai_batch(tenant, [chat_line("a"), "not json", chat_line("b")])
    foreign = native_batch(other_tenant, 1)
    page = signed_in(member(tenant)).get(PAGE.format(tenant.account.pk))
    assert page.status_code == 200
    assert rows(page) == [queued.pk, half.pk, done.pk] and foreign.pk.encode() not in page.content
    by_id = {row.batch.pk: row for row in page.context["rows"]}
    assert (done.status, by_id[done.pk].percent, by_id[done.pk].downloads) == ("completed", 100, (("results",
                                                                                                   "Results"),))
    assert by_id[done.pk].widths == {"completed": "50.00%", "failed": "50.00%", "cancelled": "0.00%"}
    assert (by_id[half.pk].percent, by_id[half.pk].cancellable, by_id[half.pk].downloads) == (50, True, ())
    # The malformed line failed alone at validation: a third of the batch is finished before anything ran.
    assert (queued.status, queued.total_count, queued.failed_count, by_id[queued.pk].percent) == (
        "in_progress", 3, 1, 33)
    html = page.content.decode()
    assert f'data-batch-id="{half.pk}" data-status="in_progress" data-total="4" data-finished="2"' in html
    assert 'aria-valuenow="50"' in html and 'style="width: 50.00%"' in html
    assert html.count(">Cancel</button>") == 2  # the finished batch has none
    assert f"/dashboard/{tenant.account.pk}/batches/{done.pk}/download/results/" in html
    assert f'data-socket="/ws/dashboard/{tenant.account.pk}/batches"' in html


@pytest.mark.django_db
def test_an_account_without_batches_is_told_how_to_make_one(tenant):
    page = signed_in(member(tenant)).get(PAGE.format(tenant.account.pk))
    assert page.status_code == 200 and b"No batches yet" in page.content and b"queueRequest=true" in page.content


@pytest.mark.django_db
def test_pages_of_25_with_an_older_link_and_bad_cursors_are_a_clear_400(tenant, other_tenant):
    made = [native_batch(tenant, 1) for _ in range(27)]
    newest_first = [b.pk for b in sorted(made, key=lambda b: (b.created_at, b.pk), reverse=True)]
    web = signed_in(member(tenant))
    url = PAGE.format(tenant.account.pk)
    first = web.get(url)
    assert rows(first) == newest_first[:25] and first.context["older"] == newest_first[24]
    assert f'?after={newest_first[24]}" rel="next">Older'.encode() in first.content
    second = web.get(url, {"after": newest_first[24]})
    assert rows(second) == newest_first[25:] and second.context["older"] is None
    assert b"Newest" in second.content and b"Older" not in second.content
    assert b'data-first-page="0"' in second.content  # live events add no rows to an older page
    past_the_end = web.get(url, {"after": newest_first[-1]})
    assert rows(past_the_end) == [] and b"No older batches" in past_the_end.content
    for cursor in ("batch_nope", native_batch(other_tenant, 1).pk):  # unknown, and another account's
        bad = web.get(url, {"after": cursor})
        assert bad.status_code == 400 and b'role="alert"' in bad.content and b"showing the newest" in bad.content
        assert rows(bad) == newest_first[:25]


@pytest.mark.django_db
def test_only_members_and_operators_see_an_accounts_batches(tenant, other_tenant):
    batch = native_batch(tenant, 1)
    url = PAGE.format(tenant.account.pk)
    anonymous = Client()
    assert anonymous.get(url).url.startswith("/dashboard/login/")
    assert anonymous.post(f"{url}{batch.pk}/cancel/").url.startswith("/dashboard/login/")
    stranger = signed_in(member(other_tenant, "eve"))
    assert stranger.get(url).status_code == 404
    assert stranger.post(f"{url}{batch.pk}/cancel/").status_code == 404
    assert stranger.get(f"{url}{batch.pk}/download/results/").status_code == 404
    assert Batch.objects.get(pk=batch.pk).status == "in_progress"
    operator = signed_in(member(other_tenant, "op", staff=True))
    page = operator.get(url)
    assert page.status_code == 200 and rows(page) == [batch.pk]


# ------------------------------------------------------------------------------------------------- cancel
@pytest.mark.django_db
def test_members_owners_and_operators_cancel_and_finished_batches_say_why_not(tenant, other_tenant):
    url = PAGE.format(tenant.account.pk)
    web = signed_in(member(tenant))
    running = run_items(native_batch(tenant, 3), 1)
    answer = web.post(f"{url}{running.pk}/cancel/")
    assert answer.status_code == 302 and answer.url == url
    running.refresh_from_db()
    # The two requests that had not started are cancelled; the answer already made stays.
    assert (running.status, running.completed_count, running.cancelled_count) == ("cancelled", 1, 2)
    after = web.get(url)
    assert f"{running.pk} is cancelled".encode() in after.content and b'role="status"' in after.content
    assert after.context["rows"][0].downloads == (("results", "Results"),)

    again = web.post(f"{url}{running.pk}/cancel/", HTTP_HX_REQUEST="true")  # already cancelled: nothing to do
    assert again.status_code == 200
    finished = run_items(native_batch(tenant, 1))
    refused = web.post(f"{url}{finished.pk}/cancel/")
    assert refused.status_code == 409 and b"Cannot cancel a batch that is completed" in refused.content
    assert b'role="alert"' in refused.content and Batch.objects.get(pk=finished.pk).status == "completed"
    for unknown in ("batch_nope", native_batch(other_tenant, 1).pk):
        missing = web.post(f"{url}{unknown}/cancel/")
        assert missing.status_code == 404 and f"No such batch: {unknown}".encode() in missing.content
    assert web.get(f"{url}{finished.pk}/cancel/").status_code == 405

    owner = signed_in(member(tenant, "olga", role=Membership.Role.OWNER))
    operator = signed_in(member(other_tenant, "op", staff=True))
    for who in (owner, operator):
        batch = native_batch(tenant, 1)
        assert who.post(f"{url}{batch.pk}/cancel/").status_code == 302
        assert Batch.objects.get(pk=batch.pk).status == "cancelled"


@pytest.mark.django_db
def test_cancel_from_the_page_answers_htmx_with_the_list_and_keeps_the_older_page(tenant):
    url = PAGE.format(tenant.account.pk)
    web = signed_in(member(tenant))
    batches = [native_batch(tenant, 1) for _ in range(27)]
    oldest = min(batches, key=lambda b: (b.created_at, b.pk))
    cursor = web.get(url).context["older"]
    answer = web.post(f"{url}{oldest.pk}/cancel/", {"after": cursor}, HTTP_HX_REQUEST="true")
    assert answer.status_code == 200 and "HX-Request" in answer["Vary"]
    html = answer.content.decode()
    assert "<html" not in html and 'id="batch-message" hx-swap-oob="true"' in html
    assert f"{oldest.pk} is cancelled" in html and f'data-batch-id="{oldest.pk}" data-status="cancelled"' in html
    assert rows(answer)[-1] == oldest.pk and len(rows(answer)) == 2  # still the older page
    plain = web.post(f"{url}{native_batch(tenant, 1).pk}/cancel/", {"after": cursor})
    assert plain.status_code == 302 and plain.url == f"{url}?after={cursor}"
    finished = run_items(native_batch(tenant, 1))
    refused = web.post(f"{url}{finished.pk}/cancel/", HTTP_HX_REQUEST="true")
    assert refused.status_code == 409 and "<html" not in refused.content.decode()
    assert b'hx-swap-oob="true"><p class="error" role="alert">Cannot cancel a batch that is completed' in refused.content


@pytest.mark.django_db
def test_cancel_needs_the_csrf_token(tenant):
    url = PAGE.format(tenant.account.pk)
    batch = native_batch(tenant, 1)
    web = signed_in(member(tenant), enforce_csrf_checks=True)
    assert web.post(f"{url}{batch.pk}/cancel/").status_code == 403
    assert Batch.objects.get(pk=batch.pk).status == "in_progress"
    token = web.get(url).context["csrf_token"]
    assert web.post(f"{url}{batch.pk}/cancel/", {"csrfmiddlewaretoken": str(token)}).status_code == 302
    assert Batch.objects.get(pk=batch.pk).status == "cancelled"


# ----------------------------------------------------------------------------------------------- download
@pytest.mark.django_db
def test_openai_output_and_error_files_download_as_the_files_api_serves_them(tenant, other_tenant):
    url = PAGE.format(tenant.account.pk)
    web = signed_in(member(tenant))
    batch = openai_batch(tenant, [chat_line("a"), "not json", chat_line("b")])
    early = web.get(f"{url}{batch.pk}/download/output/")
    assert early.status_code == 409 and b"once it has finished" in early.content
    batch = run_items(batch)
    assert batch.status == "completed" and (batch.completed_count, batch.failed_count) == (2, 1)
    output = web.get(f"{url}{batch.pk}/download/output/")
    assert output.status_code == 200 and output["Content-Type"] == "application/jsonl"
    assert output["Content-Disposition"] == f'attachment; filename="{batch.pk}_output.jsonl"'
    lines = [json.loads(x) for x in output.content.splitlines()]
    assert [(x["custom_id"], x["response"]["body"]) for x in lines] == [
        ("a", {"response": "answer 0"}), ("b", {"response": "answer 2"})]
    _, stored = file_services.file_content(tenant.account.pk, batch.output_file_id)
    assert output.content == stored
    failed = [json.loads(x) for x in web.get(f"{url}{batch.pk}/download/errors/").content.splitlines()]
    assert len(failed) == 1 and failed[0]["error"]["code"] == "invalid_json"
    assert web.get(f"{url}{batch.pk}/download/results/").status_code == 404  # that is the native kind
    assert web.get(f"{url}{batch.pk}/download/anything/").status_code == 404
    page = web.get(url)
    assert page.context["rows"][0].downloads == (("output", "Output"), ("errors", "Errors"))
    assert signed_in(member(other_tenant, "eve")).get(f"{url}{batch.pk}/download/output/").status_code == 404
    clean = run_items(openai_batch(tenant, [chat_line("c")]))
    missing = web.get(f"{url}{clean.pk}/download/errors/")
    assert missing.status_code == 404 and b"has no errors file" in missing.content


@pytest.mark.django_db
def test_native_results_download_is_what_the_poll_returns(tenant, catalog):
    url = PAGE.format(tenant.account.pk)
    web = signed_in(member(tenant))
    batch = native_batch(tenant, 3)
    assert web.get(f"{url}{batch.pk}/download/results/").status_code == 409
    batch = run_items(batch, fail=(1,))
    download = web.get(f"{url}{batch.pk}/download/results/")
    assert download.status_code == 200 and download["Content-Type"] == "application/json"
    assert download["Content-Disposition"] == f'attachment; filename="{batch.pk}.json"'
    poll = Client().post(tenant.run_url + CHAT_MODEL, {"request_id": batch.pk}, content_type="application/json",
                         **tenant.auth)
    assert poll.status_code == 200 and json.loads(download.content) == poll.json()
    result = poll.json()["result"]
    assert [r["success"] for r in result["responses"]] == [True, False, True]
    assert web.get(f"{url}{batch.pk}/download/output/").status_code == 404  # an OpenAI kind
    assert web.get(f"{url}batch_nope/download/results/").status_code == 404
    # Past the retention period the results are gone, on the page as on the API.
    Batch.objects.filter(pk=batch.pk).update(finished_at=timezone.now() - timedelta(days=365))
    maintenance.cleanup()
    gone = web.get(f"{url}{batch.pk}/download/results/")
    assert gone.status_code == 404 and b"removed after the retention period" in gone.content
    assert web.get(url).context["rows"][0].downloads == ()


# ------------------------------------------------------------------------------------------------- socket
class Socket(ApplicationCommunicator):
    """A WebSocket client speaking ASGI to the app (channels.testing needs daphne, which we do not ship)."""

    def __init__(self, path: str, headers: list[tuple[bytes, bytes]]) -> None:
        from controlplane.asgi import application

        super().__init__(application, {"type": "websocket", "path": path, "raw_path": path.encode(),
                                       "query_string": b"", "headers": headers, "subprotocols": [],
                                       "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)})

    async def open(self) -> tuple[bool, int | None]:
        await self.send_input({"type": "websocket.connect"})
        reply = await self.receive_output(10)
        return (True, None) if reply["type"] == "websocket.accept" else (False, reply.get("code"))

    async def next_json(self, timeout: float) -> dict:
        reply = await self.receive_output(timeout)
        assert reply["type"] == "websocket.send", reply
        return json.loads(reply["text"])

    async def close(self) -> None:
        await self.send_input({"type": "websocket.disconnect", "code": 1000})
        await self.wait(1)


async def open_socket(account_id: str, user=None, origin: str = "http://127.0.0.1:8000"):
    headers = [(b"origin", origin.encode()), (b"host", b"127.0.0.1:8000")]
    if user is not None:
        cookie = await sync_to_async(lambda: signed_in(user).cookies["sessionid"].value)()
        headers.append((b"cookie", f"sessionid={cookie}".encode()))
    socket = Socket(f"/ws/dashboard/{account_id}/batches", headers)
    return socket, *(await socket.open())


@pytest.mark.django_db(transaction=True)
def test_the_socket_refuses_strangers_other_accounts_and_other_sites(tenant, other_tenant):
    ada, operator = member(tenant), member(other_tenant, "op", staff=True)

    async def go() -> None:
        _, connected, _ = await open_socket(tenant.account.pk)
        assert not connected  # nobody signed in
        _, connected, code = await open_socket(other_tenant.account.pk, ada)
        assert not connected and code == 4403  # not a member
        _, connected, _ = await open_socket(tenant.account.pk, ada, origin="https://evil.example")
        assert not connected  # a page of another site
        socket, connected, _ = await open_socket(tenant.account.pk, operator)
        assert connected  # operators watch every account
        await socket.close()

    asyncio.run(go())


async def _progress_of_its_account_only(tenant, other_tenant, user) -> None:
    mine = await sync_to_async(native_batch)(tenant, 2)
    theirs = await sync_to_async(native_batch)(other_tenant, 1)
    socket, connected, _ = await open_socket(tenant.account.pk, user)
    assert connected
    await sync_to_async(run_items)(theirs)  # finished first: its events would arrive before ours
    await sync_to_async(run_items)(mine, 1)
    await sync_to_async(services.cancel_batch)(tenant.account.pk, mine.pk)
    received = []
    while not received or received[-1]["status"] != "cancelled":
        received.append(await socket.next_json(timeout=5))
    assert {e["batch_id"] for e in received} == {mine.pk}
    assert all(e["type"] == "batch.progress" and e["api"] == "native" for e in received)
    statuses = [e["status"] for e in received]
    assert statuses[-3:] == ["cancelling", "finalizing", "cancelled"]  # every status change is sent
    assert {k: received[-1][k] for k in ("total", "completed", "failed", "cancelled")} == {
        "total": 2, "completed": 1, "failed": 0, "cancelled": 1}
    assert await socket.receive_nothing(timeout=0.5)
    await socket.close()


@pytest.mark.django_db(transaction=True)
def test_the_socket_forwards_the_progress_of_its_own_accounts_batches(tenant, other_tenant, settings):
    settings.HEARTH_BATCH_WINDOW = 0  # nothing goes to a broker: the test is the worker
    asyncio.run(_progress_of_its_account_only(tenant, other_tenant, member(tenant)))


@pytest.mark.django_db(transaction=True)
@pytest.mark.redis
def test_the_socket_forwards_progress_across_processes_on_the_redis_channel_layer(tenant, other_tenant, settings):
    from channels.layers import channel_layers
    from conftest import redis_up

    if not redis_up():
        pytest.skip("Redis is not reachable on 127.0.0.1:6379")
    settings.HEARTH_BATCH_WINDOW = 0
    layers = {"default": {"BACKEND": "channels_redis.core.RedisChannelLayer",
                          "CONFIG": {"hosts": [redis_url(1)], "prefix": "hearth-test-batches"}}}
    user = member(tenant)
    with override_settings(CHANNEL_LAYERS=layers):
        channel_layers.backends.clear()
        try:
            asyncio.run(_progress_of_its_account_only(tenant, other_tenant, user))
        finally:
            channel_layers.backends.clear()
