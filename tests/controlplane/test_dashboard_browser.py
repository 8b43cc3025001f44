"""The dashboard in a real browser: Debian's headless Chromium driven by Playwright, against uvicorn serving the
real ASGI app and engine. Screenshots of each page land in tests/artifacts/screenshots/ (git-ignored)."""

from __future__ import annotations

import time

import pytest
from browser_support import PASSWORD, USER, run_model, scroll_width, shot, sign_in
from cp_support import CHAT_MODEL

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.real_model, pytest.mark.browser]


def test_sign_in_and_watch_an_api_request_reach_the_live_chart(live_server_url, browser_tenant, browser):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(f"{live_server_url}/dashboard/")
    assert "/dashboard/login/" in page.url
    page.fill("input[name=username]", USER)
    page.fill("input[name=password]", "wrong")
    page.click("button[type=submit]")
    assert page.get_by_role("alert").inner_text().startswith("That username and password do not match")
    shot(page, "login-error")
    page.fill("input[name=password]", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url(f"**/dashboard/{browser_tenant.account.pk}/")
    page.wait_for_selector("#live-state[data-state=live]", timeout=10_000)
    assert page.inner_text("#t-requests") == "0" and page.is_visible("#chart-empty")
    shot(page, "overview-empty")

    response = run_model(live_server_url, browser_tenant.account.pk, browser_tenant.secret)
    assert response.status_code == 200
    answered = time.monotonic()
    page.wait_for_selector("body[data-requests-today='1']", timeout=2_000)  # the promise: within 2 s
    waited = time.monotonic() - answered
    assert page.inner_text("#t-requests") == "1" and not page.is_visible("#chart-empty")
    bars = page.evaluate("Chart.getChart('usage-chart').data.datasets[0].data")
    assert bars[-1] == 1 or bars[-2] == 1  # this minute (or the last, across a minute boundary)
    assert waited < 2
    assert page.inner_text("#t-latency").endswith("s") and page.inner_text("#t-ttft").endswith("s")  # ms or s
    assert page.locator("#engines td", has_text=CHAT_MODEL).count() == 1 and not page.is_visible("#engines-empty")
    shot(page, "overview-live")

    phone = browser.new_page(viewport={"width": 390, "height": 844})
    phone.context.add_cookies(page.context.cookies())
    phone.goto(f"{live_server_url}/dashboard/{browser_tenant.account.pk}/")
    width = scroll_width(phone)
    assert width <= 390, f"the overview scrolls sideways on a phone ({width}px)"
    shot(phone, "overview-phone")

    page.click("text=Sign out")
    page.wait_for_url("**/dashboard/login/")


def test_create_a_key_use_it_then_revoke_it_and_the_api_refuses_it(live_server_url, browser_tenant, browser):
    page = sign_in(browser, live_server_url)
    page.click("text=API keys")
    page.fill("input[name=name]", "from-the-browser")
    page.fill("input[name=expires_days]", "7")
    page.click("text=Create key")
    secret = page.inner_text("#new-secret").strip()
    assert secret.startswith("hth_")
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    page.click("button[data-copy=new-secret]")
    assert page.evaluate("navigator.clipboard.readText()") == secret
    shot(page, "keys-created")
    assert run_model(live_server_url, browser_tenant.account.pk, secret).status_code == 200

    page.click("text=API keys")  # the secret was shown once
    assert secret not in page.content()
    page.on("dialog", lambda dialog: dialog.accept())
    page.click("tr[data-key=from-the-browser] button.danger")
    page.wait_for_selector("tr[data-key=from-the-browser] td.status:has-text('revoked')")
    assert page.locator("tr[data-key=from-the-browser]").count() == 1
    shot(page, "keys-revoked")
    refused = run_model(live_server_url, browser_tenant.account.pk, secret)
    assert refused.status_code == 401 and "revoked" in refused.json()["errors"][0]["message"]
