"""The Models page in a real browser (Debian's headless Chromium under Playwright) against uvicorn serving the
real ASGI app and engine: an owner runs the playground, an operator changes a price, and a phone-width page."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from typing import Any

import httpx
import pytest
from browser_support import scroll_width, shot, sign_in
from cp_support import CHAT_MODEL
from django.contrib.auth import get_user_model
from django.db import connection

from controlplane.accounts.models import Account
from controlplane.catalog.models import AiModel
from controlplane.usage.models import Status, UsageEvent

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.real_model, pytest.mark.browser]

OPERATOR, OPERATOR_PASSWORD = "ops", "pw-ops"


def in_thread(query: Callable[[], Any]) -> Any:
    """Run a query off this thread: Playwright's sync API runs an event loop here, and Django refuses database
    calls from a thread with a running loop."""
    def run() -> Any:
        try:
            return query()
        finally:
            connection.close()

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(run).result()


def events_when(count: int, account_id: str, timeout: float = 10.0) -> list[UsageEvent]:
    """The account's playground events once there are `count` (only its own: a write another test left running
    must not pass for one of them)."""
    deadline = time.monotonic() + timeout
    while True:
        events = in_thread(lambda: list(UsageEvent.objects.filter(account_id=account_id, route="playground")
                                        .order_by("created_at")))
        if len(events) >= count or time.monotonic() > deadline:
            return events
        time.sleep(0.1)


def plain(value: Decimal) -> str:
    return format(value.normalize(), "f") if value else "0"


@pytest.fixture
def operator(browser_tenant):
    """A staff user (no membership: operators see every account), made before the browser starts."""
    get_user_model().objects.create_user(OPERATOR, password=OPERATOR_PASSWORD, is_staff=True)
    return browser_tenant


@pytest.fixture
def broke_tenant(browser_tenant):
    Account.objects.filter(pk=browser_tenant.account.pk).update(daily_free_neurons=0)
    return browser_tenant


def models_page(browser, url: str, account_id: str, *, width: int = 1280):
    page = sign_in(browser, url, width=width)
    page.click("nav.pages >> text=Models")
    page.wait_for_url(f"**/dashboard/{account_id}/models/")
    return page


def test_an_owner_streams_a_reply_sees_its_usage_and_cost_and_can_stop_one(live_server_url, browser_tenant,
                                                                             browser):
    page = models_page(browser, live_server_url, browser_tenant.account.pk)
    assert page.locator(f'#catalog tr[data-model="{CHAT_MODEL}"]').count() == 1
    assert page.locator("form.price-form").count() == 0  # owners are not operators
    assert page.input_value("#pg-model") == CHAT_MODEL
    assert page.evaluate("(t => t.scrollWidth <= t.parentElement.clientWidth)(document.getElementById('catalog'))"), \
        "the catalog needs a sideways scroll on a laptop screen"
    shot(page, "models")

    # Count the reply's updates as they land: a streamed reply grows in several steps, not in one.
    page.evaluate("""() => { window.replyUpdates = 0; new MutationObserver(() => window.replyUpdates++)
        .observe(document.getElementById('pg-reply'), {childList: true, characterData: true, subtree: true}); }""")
    page.fill("#pg-system", "You are terse.")
    page.fill("#pg-message", "Name three colours.")
    page.fill("#pg-max-tokens", "16")
    page.fill("#pg-temperature", "0")
    page.click("#pg-run")
    page.wait_for_selector("#playground[data-state=done]", timeout=60_000)
    reply = page.inner_text("#pg-reply")
    assert reply.strip() and page.evaluate("window.replyUpdates") >= 3
    [event] = events_when(1, browser_tenant.account.pk)
    assert (event.route, event.api_key_id, event.status) == ("playground", None, Status.OK)
    assert page.inner_text("#pg-input-tokens") == str(event.input_tokens)
    assert page.inner_text("#pg-output-tokens") == str(event.output_tokens)
    assert page.inner_text("#pg-cached-tokens") == str(event.cached_input_tokens)
    assert page.inner_text("#pg-neurons") == plain(event.neurons)
    assert page.inner_text("#pg-cost") == "$" + plain(event.cost_usd) and event.cost_usd > 0
    assert page.inner_text("#pg-latency").endswith("s") and page.inner_text("#pg-ttft").endswith("s")
    assert page.is_disabled("#pg-stop") and not page.is_disabled("#pg-run")
    shot(page, "models-playground")

    page.fill("#pg-message", "Write a long story about a lighthouse keeper and the sea.")
    page.fill("#pg-max-tokens", "400")
    page.click("#pg-run")
    page.wait_for_selector("#playground[data-state=streaming]", timeout=60_000)
    page.click("#pg-stop")
    page.wait_for_selector("#playground[data-state=stopped]", timeout=5_000)
    assert "Stopped" in page.inner_text("#pg-status") and not page.is_disabled("#pg-run")
    events = events_when(2, browser_tenant.account.pk)
    stopped = events[1]
    assert stopped.status == Status.ABORTED and 1 <= stopped.output_tokens < 400, (
        stopped.status, stopped.output_tokens, stopped.latency_ms, stopped.request_id)
    shot(page, "models-playground-stopped")


def test_an_operator_edits_a_price_and_sees_it_in_the_table(live_server_url, operator, browser):
    model_pk = in_thread(lambda: AiModel.objects.get(name=CHAT_MODEL).pk)
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(f"{live_server_url}/dashboard/login/")
    page.fill("input[name=username]", OPERATOR)
    page.fill("input[name=password]", OPERATOR_PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url("**/dashboard/*/")
    page.goto(f"{live_server_url}/dashboard/{operator.account.pk}/models/")
    card = page.locator(f"#model-{model_pk}")
    card.locator("summary").click()
    form = card.locator("form.price-form")
    form.locator("input[name=input]").fill("-3")
    form.locator("button[type=submit]").click()
    page.wait_for_selector(f"#model-{model_pk}[open] .error")  # 400, inline, next to the form
    assert "must not be negative" in card.locator(".error").inner_text()
    assert page.inner_text(f'#catalog tr[data-model="{CHAT_MODEL}"] td .price-input') == "1,500"

    form = card.locator("form.price-form")
    form.locator("input[name=input]").fill("2500")
    form.locator("input[name=note]").fill("set from the browser")
    form.locator("button[type=submit]").click()
    page.wait_for_selector(".notice")
    assert page.inner_text(f'#catalog tr[data-model="{CHAT_MODEL}"] td .price-input') == "2,500"
    card = page.locator(f"#model-{model_pk}")
    card.locator("summary").click()
    assert card.locator("tr.current td.note").inner_text() == "set from the browser"
    assert card.locator("tr.past").count() == 1
    listed = httpx.get(f"{live_server_url}/v1/models", headers=operator.headers).json()["data"]
    assert next(m for m in listed if m["id"] == CHAT_MODEL)["pricing"]["neurons_per_m_input_tokens"] == 2500
    shot(page, "models-price-edited")

    phone = browser.new_page(viewport={"width": 390, "height": 844})
    phone.context.add_cookies(page.context.cookies())
    phone.goto(f"{live_server_url}/dashboard/{operator.account.pk}/models/#model-{model_pk}")
    phone.locator(f"#model-{model_pk} summary").click()  # the widest state: history and both forms open
    width = scroll_width(phone)
    assert width <= 390, f"the operator's Models page scrolls sideways on a phone ({width}px)"
    shot(phone, "models-operator-phone")


def test_a_phone_shows_the_page_without_sideways_scroll_and_refusals_clearly(live_server_url, broke_tenant,
                                                                             browser):
    page = models_page(browser, live_server_url, broke_tenant.account.pk, width=390)
    width = scroll_width(page)
    assert width <= 390, f"the Models page scrolls sideways on a phone ({width}px)"
    page.fill("#pg-message", "Hello?")
    page.click("#pg-run")
    page.wait_for_selector("#playground[data-state=error]", timeout=10_000)
    assert "daily free allocation" in page.inner_text("#pg-error")
    assert scroll_width(page) <= 390
    shot(page, "models-phone")
    assert in_thread(lambda: UsageEvent.objects.count()) == 0
