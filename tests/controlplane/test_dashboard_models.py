"""The dashboard's Models page: who sees and edits what, operator price and default edits reaching the API and
the engine at once, and the playground streaming from the real engine with its usage metered like the API's."""

from __future__ import annotations

import json
import re
from datetime import UTC, timedelta
from decimal import Decimal

import httpx
import pytest
from cp_support import CHAT_MODEL, EMBED_MODEL, make_tenant
from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import timezone

from controlplane.accounts.models import Account, Membership
from controlplane.catalog.models import AiModel, Price
from controlplane.catalog.services import get_model, invalidate, seed
from controlplane.usage.models import Status, UsageEvent
from inference.models.catalog import BUNDLED_MODELS

GROUNDED = ("Repeat exactly, word for word: The quick brown fox jumps over the lazy dog, then the lazy dog "
            "sleeps under the old oak tree by the river.")
LONG = " ".join(f"Item {n}: the {['red', 'blue', 'green'][n % 3]} box holds {n * 7} marbles." for n in range(60))


def user(name: str, tenant=None, *, role: str = Membership.Role.MEMBER, staff: bool = False):
    person = get_user_model().objects.create_user(name, password="pw-" + name, is_staff=staff)
    if tenant is not None:
        Membership.objects.create(account=tenant.account, user=person, role=role)
    return person


def signed_in(person, **client_options) -> Client:
    web = Client(**client_options)
    web.force_login(person)
    return web


def page_url(tenant) -> str:
    return f"/dashboard/{tenant.account.pk}/models/"


def listing(tenant) -> dict[str, dict]:
    return {m["id"]: m for m in Client().get("/v1/models", **{
        "HTTP_AUTHORIZATION": f"Bearer {tenant.secret}"}).json()["data"]}


def price_form(model: AiModel, **values: str) -> dict[str, str]:
    return {"action": "price", "model_id": str(model.pk), "input": "2000", "cached": "500", "output": "9000",
            "usd_per_1k": "0.02", "discount": "", "effective_at": "", "note": "", **values}


def defaults_form(model: AiModel, **values: str) -> dict[str, str]:
    return {"action": "defaults", "model_id": str(model.pk), "speculation": "ngram", "k": "6", "kv_mode": "off",
            "kv_value": "", **values}


# ------------------------------------------------------------------------------------------------ the page
@pytest.mark.django_db
def test_members_see_the_catalog_with_prices_and_defaults_but_no_forms(tenant, other_tenant):
    AiModel.objects.filter(name="@hearth/gemma-3-270m").update(deprecated_on=timezone.now().date())
    AiModel.objects.filter(name="@hearth/qwen2.5-coder-1.5b-instruct").update(installed=False)
    invalidate()  # update() sends no signal
    web = signed_in(user("ada", tenant))
    page = web.get(page_url(tenant))
    assert page.status_code == 200
    html = page.content.decode()
    rows = {row.entry.name: row for row in page.context["rows"]}
    assert set(rows) == {name for name, m in BUNDLED_MODELS.items()}  # every active model, installed or not
    chat = rows[CHAT_MODEL]
    assert (chat.price.input, chat.price.cached, chat.price.output) == ("1,500", "375", "6,000")
    assert chat.usd_per_m == ("0.0165", "0.004125", "0.066")  # at the default $0.011 per 1,000 neurons
    assert [line.state for line in chat.history] == ["current"]
    assert f'<tr data-model="{CHAT_MODEL}">' in html and "$0.0165" in html
    assert "ngram, k = 8" in html and chat.kv_label == "off"
    assert rows[EMBED_MODEL].generates is False
    assert rows["@hearth/gemma-3-270m"].state.startswith("deprecated since ")
    assert rows["@hearth/qwen2.5-coder-1.5b-instruct"].state == "not installed"
    offered = [m.name for m in page.context["playground_models"]]  # installed text generation only
    assert CHAT_MODEL in offered and EMBED_MODEL not in offered and "@hearth/qwen2.5-coder-1.5b-instruct" not in offered
    assert "Save price" not in html and "Save defaults" not in html
    assert web.get(f"/dashboard/{other_tenant.account.pk}/models/").status_code == 404
    assert Client().get(page_url(tenant)).url.startswith("/dashboard/login/")


@pytest.mark.django_db
def test_an_empty_catalog_says_so(db):
    tenant = make_tenant("bare")  # no seed_catalog: nothing to list or run
    page = signed_in(user("owner", tenant, role=Membership.Role.OWNER)).get(page_url(tenant))
    assert page.status_code == 200 and page.context["rows"] == []
    assert b'id="catalog-empty"' in page.content and b'id="playground-empty"' in page.content


@pytest.mark.django_db
def test_non_operators_get_403_and_nothing_changes(tenant):
    model = AiModel.objects.get(name=CHAT_MODEL)
    owner = signed_in(user("owner", tenant, role=Membership.Role.OWNER))
    before = (Price.objects.count(), model.engine_settings)
    for form in (price_form(model), defaults_form(model, speculation="off")):
        answer = owner.post(page_url(tenant), form)
        assert answer.status_code == 403 and b"Only operators can change prices" in answer.content
    model.refresh_from_db()
    assert (Price.objects.count(), model.engine_settings) == before


# ---------------------------------------------------------------------------------------- operator prices
@pytest.mark.django_db
def test_an_operator_prices_a_model_now_and_the_api_and_metering_use_it_at_once(tenant):
    model = AiModel.objects.get(name=CHAT_MODEL)
    old = get_model(CHAT_MODEL).price_at(timezone.now().timestamp())
    web = signed_in(user("op", staff=True))
    answer = web.post(page_url(tenant), price_form(model, discount="25", note="spring pricing"))
    assert answer.status_code == 302 and answer.url.endswith(f"#model-{model.pk}")
    newest = Price.objects.filter(model=model).order_by("-effective_at").first()
    assert newest.pk != old.price_id and Price.objects.filter(model=model).count() == 2
    assert (newest.neurons_per_m_input, newest.neurons_per_m_output) == (Decimal(2000), Decimal(9000))
    assert newest.batch_discount_percent == 25 and newest.note == "spring pricing"
    assert abs((newest.effective_at - timezone.now()).total_seconds()) < 5

    pricing = listing(tenant)[CHAT_MODEL]["pricing"]
    assert pricing["neurons_per_m_input_tokens"] == 2000 and pricing["usd_per_1k_neurons"] == 0.02
    assert pricing["batch_discount_percent"] == 25
    assert get_model(CHAT_MODEL).price_at(timezone.now().timestamp()).price_id == newest.pk  # metering's lookup

    page = web.get(page_url(tenant))
    assert b"New price for " + CHAT_MODEL.encode() + b" in effect now." in page.content
    row = next(r for r in page.context["rows"] if r.entry.name == CHAT_MODEL)
    assert [line.state for line in row.history] == ["current", "past"]
    assert row.price.input == "2,000" and row.usd_per_m[0] == "0.04"


@pytest.mark.django_db
def test_a_future_price_is_scheduled_and_the_current_one_stays(tenant):
    model = AiModel.objects.get(name=CHAT_MODEL)
    web = signed_in(user("op", staff=True))
    later = (timezone.now() + timedelta(days=3)).astimezone(UTC).replace(second=0, microsecond=0, tzinfo=None)
    answer = web.post(page_url(tenant), price_form(model, effective_at=later.strftime("%Y-%m-%dT%H:%M")))
    assert answer.status_code == 302
    assert Price.objects.get(model=model, effective_at=later.replace(tzinfo=UTC)).neurons_per_m_input == 2000
    assert listing(tenant)[CHAT_MODEL]["pricing"]["neurons_per_m_input_tokens"] == 1500  # not yet
    row = next(r for r in web.get(page_url(tenant)).context["rows"] if r.entry.name == CHAT_MODEL)
    assert [line.state for line in row.history] == ["scheduled", "current"]
    assert get_model(CHAT_MODEL).price_at((later + timedelta(minutes=1)).replace(tzinfo=UTC).timestamp()) \
        .neurons_per_m_input == 2000


@pytest.mark.parametrize(("values", "message"), [
    ({"input": "-1"}, "Input: must not be negative"),
    ({"output": "abc"}, "'abc' is not a number"),
    ({"cached": "NaN"}, "is not a number"),
    ({"input": "Infinity"}, "is not a number"),
    ({"input": ""}, "Input: enter a number"),
    ({"input": "1" * 20}, "Input:"),
    ({"discount": "101"}, "Batch discount: must be at most 100"),
    ({"discount": "-5"}, "Batch discount: must not be negative"),
    ({"usd_per_1k": "-0.1"}, "must not be negative"),
    ({"effective_at": "2020-01-01T00:00"}, "Effective from: must be now or in the future"),
    ({"effective_at": "next tuesday"}, "is not a date and time"),
    ({"model_id": "999999"}, "That model is not in the catalog"),
    ({"model_id": "x"}, "That model is not in the catalog"),
    ({"action": "delete"}, "Unknown action"),
])
@pytest.mark.django_db
def test_bad_price_input_is_400_inline_and_changes_nothing(tenant, values, message):
    model = AiModel.objects.get(name=CHAT_MODEL)
    web = signed_in(user("op", staff=True))
    before = list(Price.objects.values_list("pk", "neurons_per_m_input"))
    answer = web.post(page_url(tenant), price_form(model, **values))
    assert answer.status_code == 400
    assert message.encode() in answer.content.replace(b"&#x27;", b"'"), answer.content.decode()[:2000]
    assert b'role="alert"' in answer.content
    assert list(Price.objects.values_list("pk", "neurons_per_m_input")) == before
    if values.get("model_id", "").isdigit() or "model_id" not in values:
        assert listing(tenant)[CHAT_MODEL]["pricing"]["neurons_per_m_input_tokens"] == 1500


# -------------------------------------------------------------------------------------- operator defaults
@pytest.mark.django_db
def test_an_operator_edits_defaults_and_the_listing_shows_them(tenant):
    model = AiModel.objects.get(name=CHAT_MODEL)
    model.engine_settings = {**model.engine_settings, "max_num_seqs": 8}
    model.save()
    web = signed_in(user("op", staff=True))
    answer = web.post(page_url(tenant), defaults_form(model, speculation="ngram", k="3", kv_mode="rate",
                                                      kv_value="4"))
    assert answer.status_code == 302
    model.refresh_from_db()
    assert model.engine_settings == {"speculation": "ngram", "num_speculative_tokens": 3, "max_num_seqs": 8,
                                     "kv_compression_rate": 4.0}  # other settings are kept
    assert listing(tenant)[CHAT_MODEL]["speculation"] == {"mode": "ngram", "k": 3, "draft_model": None}
    assert get_model(CHAT_MODEL).kv_compression == {"rate": 4.0}

    assert web.post(page_url(tenant), defaults_form(model, speculation="off", kv_mode="max_cache_tokens",
                                                    kv_value="512")).status_code == 302
    model.refresh_from_db()
    assert model.engine_settings["speculation"] == "off" and "kv_compression_rate" not in model.engine_settings
    assert get_model(CHAT_MODEL).kv_compression == {"max_cache_tokens": 512}
    page = web.get(page_url(tenant))
    row = next(r for r in page.context["rows"] if r.entry.name == CHAT_MODEL)
    assert row.kv_label == "≤ 512 entries per head" and b"Defaults for " in page.content


@pytest.mark.parametrize(("values", "message"), [
    ({"speculation": "fast"}, "Speculation: must be one of off, ngram, draft"),
    ({"k": "0"}, "k: must be a whole number from 1 to 16"),
    ({"k": "17"}, "k: must be a whole number from 1 to 16"),
    ({"k": "four"}, "is not a whole number"),
    ({"speculation": "draft"}, "draft needs a draft model"),
    ({"kv_mode": "rate", "kv_value": "0.5"}, "kv_compression rate must be a number in [1, 1024]"),
    ({"kv_mode": "rate", "kv_value": "lots"}, "is not a number"),
    ({"kv_mode": "max_cache_tokens", "kv_value": "0"}, "max_cache_tokens must be a positive integer"),
    ({"kv_mode": "max_cache_tokens", "kv_value": ""}, "enter a rate"),
    ({"kv_mode": "zip"}, "unknown choice"),
])
@pytest.mark.django_db
def test_bad_defaults_are_400_inline_and_change_nothing(tenant, values, message):
    model = AiModel.objects.get(name=CHAT_MODEL)
    before = dict(model.engine_settings)
    answer = signed_in(user("op", staff=True)).post(page_url(tenant), defaults_form(model, **values))
    assert answer.status_code == 400
    assert message.encode() in answer.content.replace(b"&#x27;", b"'"), answer.content.decode()[:2000]
    model.refresh_from_db()
    assert model.engine_settings == before
    assert listing(tenant)[CHAT_MODEL]["speculation"] == {"mode": "ngram", "k": 8, "draft_model": None}


@pytest.mark.real_model
@pytest.mark.django_db
def test_default_edits_apply_to_the_next_request_without_a_restart(backend, tenant):
    """The session engine was loaded with speculation off and no compression default; only the catalog's
    current defaults, passed with each request, can turn them on, and off again."""
    model = AiModel.objects.get(name=CHAT_MODEL)
    web = signed_in(user("op", staff=True))
    api = Client()

    def ask(prompt: str, max_tokens: int) -> UsageEvent:
        answer = api.post(tenant.run_url + CHAT_MODEL, {"prompt": prompt, "max_tokens": max_tokens,
                                                        "temperature": 0}, content_type="application/json",
                          **tenant.auth)
        assert answer.status_code == 200, answer.content
        return UsageEvent.objects.order_by("-created_at").first()

    def set_defaults(**values: str) -> None:
        assert web.post(page_url(tenant), defaults_form(model, **values)).status_code == 302

    set_defaults(speculation="off")
    first = ask(GROUNDED, 24)
    engine = backend._engines[CHAT_MODEL]
    assert first.spec_proposed == 0
    set_defaults(speculation="ngram", k="6")
    second = ask(GROUNDED, 24)
    assert second.spec_proposed > 0 and second.output_tokens == first.output_tokens
    set_defaults(speculation="off")
    assert ask(GROUNDED, 24).spec_proposed == 0

    compressions = engine.metrics().kv_compressions_total
    set_defaults(speculation="off", kv_mode="rate", kv_value="4")
    ask(LONG, 4)
    assert engine.metrics().kv_compressions_total > compressions
    compressions = engine.metrics().kv_compressions_total
    set_defaults(speculation="off", kv_mode="off")
    ask(LONG, 4)
    assert engine.metrics().kv_compressions_total == compressions
    assert backend._engines[CHAT_MODEL] is engine  # the same engine throughout: no restart


# ------------------------------------------------------------------------------- playground: refusals
def play(web: Client, tenant, body: dict | str) -> object:
    return web.post(f"/dashboard/{tenant.account.pk}/models/playground/",
                    data=body if isinstance(body, str) else json.dumps(body), content_type="application/json")


CHAT = {"model": CHAT_MODEL, "message": "Say hi.", "max_tokens": 4, "temperature": 0}


@pytest.mark.django_db
def test_the_playground_refuses_without_csrf_sign_in_or_ownership(tenant, other_tenant):
    owner = user("owner", tenant, role=Membership.Role.OWNER)
    strict = signed_in(owner, enforce_csrf_checks=True)
    refused = play(strict, tenant, CHAT)
    assert refused.status_code == 403 and b"CSRF" in refused.content
    anonymous = play(Client(), tenant, CHAT)
    assert anonymous.status_code == 401 and "sign in again" in anonymous.json()["error"]["message"]
    member = play(signed_in(user("ada", tenant)), tenant, CHAT)
    assert member.status_code == 403 and "owners" in member.json()["error"]["message"]
    assert play(signed_in(owner), other_tenant, CHAT).status_code == 404
    assert signed_in(owner).get(f"/dashboard/{tenant.account.pk}/models/playground/").status_code == 405
    page = signed_in(user("ada2", tenant)).get(page_url(tenant))
    assert b'id="playground-owners-only"' in page.content and b'id="playground-form"' not in page.content
    assert not UsageEvent.objects.exists()


@pytest.mark.parametrize(("body", "status", "message"), [
    ({**CHAT, "model": "@hearth/nope"}, 400, "No such model '@hearth/nope'"),
    ({**CHAT, "model": ""}, 400, "Choose a model"),
    ({**CHAT, "model": EMBED_MODEL}, 400, "is a text-embeddings model"),
    ({**CHAT, "max_tokens": 0}, 400, "max_tokens must be in [1,"),
    ({**CHAT, "max_tokens": "lots"}, 400, "max_tokens: Input should be a valid integer"),
    ({**CHAT, "max_tokens": 2.5}, 400, "max_tokens"),
    ({**CHAT, "temperature": 9}, 400, "temperature must be in [0, 5]"),
    ({**CHAT, "message": "   "}, 400, "Write a message to send"),
    ({**CHAT, "message": "x" * 32_001}, 400, "message"),
    ("{oops", 400, "Malformed JSON body"),
    ("[1, 2]", 400, "must be a JSON object"),
    ({**CHAT, "json_schema": "{nope"}, 400, "json_schema is not valid JSON"),
    ({**CHAT, "tools": "{}"}, 400, "tools: a JSON list of functions"),
    ({**CHAT, "tools": '[{"name": "bad name!"}]'}, 400, "tools"),
    ({**CHAT, "json_schema": "{}", "tools": "[]"}, 400, "not both"),
])
@pytest.mark.django_db
def test_bad_playground_input_is_a_clear_4xx_and_not_metered(tenant, body, status, message):
    web = signed_in(user("owner", tenant, role=Membership.Role.OWNER))
    answer = play(web, tenant, body)
    assert answer.status_code == status and message in answer.json()["error"]["message"], answer.content
    assert not UsageEvent.objects.exists()


@pytest.mark.django_db
def test_the_playground_stops_at_the_free_allocation(tenant):
    Account.objects.filter(pk=tenant.account.pk).update(daily_free_neurons=0)
    answer = play(signed_in(user("owner", tenant, role=Membership.Role.OWNER)), tenant, CHAT)
    assert answer.status_code == 429 and "daily free allocation" in answer.json()["error"]["message"]
    assert "Retry-After" in answer.headers and not UsageEvent.objects.exists()


# ------------------------------------------------------------------------- playground: the real engine
@pytest.fixture
def live_owner(live_server_url, transactional_db):
    """An owner's signed-in HTTP session against uvicorn, holding the CSRF token the page hands out."""
    seed(BUNDLED_MODELS.values(), log=lambda line: None)
    tenant = make_tenant("playground")
    owner = user("owner", tenant, role=Membership.Role.OWNER)
    session = httpx.Client(base_url=live_server_url, timeout=120,
                           cookies={"sessionid": signed_in(owner).cookies["sessionid"].value})
    page = session.get(f"/dashboard/{tenant.account.pk}/models/")
    assert page.status_code == 200
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text).group(1)
    yield session, tenant, token
    session.close()


def wait_for_event(timeout: float = 10.0, count: int = 1) -> UsageEvent:
    """The first usage event, once `count` have been written (the server writes them after the response)."""
    import time

    deadline = time.monotonic() + timeout
    while UsageEvent.objects.count() < count and time.monotonic() < deadline:
        time.sleep(0.05)
    event = UsageEvent.objects.order_by("created_at").first()
    assert event is not None and UsageEvent.objects.count() >= count, "the usage events were not written"
    return event


def stream(session: httpx.Client, tenant, token: str, body: dict, *, leave_after_first_token: bool = False):
    events = []
    with session.stream("POST", f"/dashboard/{tenant.account.pk}/models/playground/", json=body,
                        headers={"X-CSRFToken": token}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"] == "text/event-stream"
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if leave_after_first_token and events[-1]["type"] == "token":
                    break
    return events


@pytest.mark.real_model
@pytest.mark.django_db(transaction=True)
def test_the_playground_streams_real_tokens_and_meters_them_like_the_api(live_owner):
    session, tenant, token = live_owner
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]
    events = stream(session, tenant, token, {"model": CHAT_MODEL, "system": "You are terse.",
                                             "message": "Name three colours.", "max_tokens": 12, "temperature": 0})
    assert events[0]["type"] == "start" and events[-1]["type"] == "done"
    tokens = [e["text"] for e in events if e["type"] == "token"]
    assert len(tokens) >= 2 and "".join(tokens).strip()  # token by token, not one blob
    done = events[-1]
    event = wait_for_event()
    assert (event.route, event.api_key_id, event.account_id, event.status, event.stream) == (
        "playground", None, tenant.account.pk, Status.OK, True)
    usage = done["usage"]
    assert (event.input_tokens, event.cached_input_tokens, event.output_tokens) == (
        usage["input_tokens"], usage["cached_input_tokens"], usage["output_tokens"])
    assert event.output_tokens >= len(tokens) and done["ttft_ms"] <= done["latency_ms"]
    price = event.price
    assert price is not None and price.pk == get_model(CHAT_MODEL).price_at(event.created_at.timestamp()).price_id
    neurons = ((event.input_tokens - event.cached_input_tokens) * price.neurons_per_m_input
               + event.cached_input_tokens * price.neurons_per_m_cached_input
               + event.output_tokens * price.neurons_per_m_output) / 1_000_000
    assert event.neurons == neurons.quantize(event.neurons) == Decimal(done["neurons"]) > 0
    assert event.cost_usd == (neurons * price.usd_per_1k_neurons / 1000).quantize(event.cost_usd)
    assert Decimal(done["cost_usd"]) == event.cost_usd

    # The same request through the API (greedy) gives the same words: it is the API's path, with a session.
    api = httpx.post(f"{session.base_url}/v1/chat/completions", headers=tenant.headers, timeout=120, json={
        "model": CHAT_MODEL, "messages": messages, "max_tokens": 12, "temperature": 0})
    assert api.json()["choices"][0]["message"]["content"] == "".join(tokens)
    assert api.json()["usage"]["completion_tokens"] == event.output_tokens  # metered alike
    # The API request's own event is written after its response; the test's teardown must not race it.
    wait_for_event(count=2)


@pytest.mark.real_model
@pytest.mark.django_db(transaction=True)
def test_the_playground_sends_a_schema_or_tools_and_shows_the_parsed_result(live_owner):
    session, tenant, token = live_owner
    schema = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]},
                                               "why": {"type": "string", "maxLength": 30}},
              "required": ["colour", "why"]}
    events = stream(session, tenant, token, {"model": CHAT_MODEL, "message": "Pick a colour.", "max_tokens": 60,
                                             "temperature": 0, "json_schema": json.dumps(schema)})
    done = events[-1]
    assert done["type"] == "done" and done["finish_reason"] == "stop"
    assert set(done["parsed"]["json"]) == {"colour", "why"} and done["parsed"]["json"]["colour"] in schema[
        "properties"]["colour"]["enum"]
    tools = [{"name": "get_weather", "description": "Weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}]
    events = stream(session, tenant, token, {"model": CHAT_MODEL, "message": "Weather in Oslo?", "max_tokens": 60,
                                             "temperature": 0, "tools": json.dumps(tools)})
    parsed = events[-1]["parsed"]
    assert set(parsed) == {"content", "tool_calls"}
    for call in parsed["tool_calls"]:  # auto: words or a call, and any call is valid
        assert call["name"] == "get_weather" and isinstance(call["arguments"]["city"], str)
    wait_for_event(count=2)


@pytest.mark.real_model
@pytest.mark.django_db(transaction=True)
def test_leaving_the_playground_mid_stream_aborts_and_records_it(live_owner):
    session, tenant, token = live_owner
    events = stream(session, tenant, token, {"model": CHAT_MODEL, "message": "Write a long story about a "
                    "lighthouse.", "max_tokens": 200, "temperature": 0}, leave_after_first_token=True)
    assert events[-1]["type"] == "token"
    event = wait_for_event()
    assert event.status == Status.ABORTED and event.route == "playground" and event.api_key_id is None
    streamed = sum(1 for e in events if e["type"] == "token")
    assert event.output_tokens >= streamed  # what reached the client is metered...
    assert event.output_tokens < 200  # ...and the engine stopped before its budget ran out


@pytest.mark.once  # the prompt format of a base model: nothing the database decides
@pytest.mark.real_model
@pytest.mark.django_db(transaction=True)
def test_a_plain_prompt_model_gets_the_system_text_before_the_message(live_owner):
    session, tenant, token = live_owner
    plain = "@hearth/gemma-3-270m"
    if not BUNDLED_MODELS[plain].installed:
        pytest.skip("Gemma 3 270M is not installed")
    assert not get_model(plain).has_chat_template
    events = stream(session, tenant, token, {"model": plain, "system": "A list of fruit:", "message": "apple,",
                                             "max_tokens": 3, "temperature": 0})
    assert events[-1]["type"] == "done" and events[-1]["usage"]["output_tokens"] >= 1
    event = wait_for_event()
    assert event.model == plain and event.input_tokens == events[-1]["usage"]["input_tokens"] > 3

