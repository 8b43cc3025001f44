"""The dashboard in a real browser: Debian's headless Chromium driven by Playwright, against uvicorn serving the
real ASGI app and engine. Screenshots of each page land in tests/artifacts/screenshots/ (git-ignored)."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import httpx
import pytest
from cp_support import CHAT_MODEL, make_tenant
from django.contrib.auth import get_user_model

from controlplane.accounts.models import Membership
from controlplane.catalog.services import seed
from inference.models.catalog import BUNDLED_MODELS

CHROMIUM = os.environ.get("HEARTH_CHROMIUM", "/usr/bin/chromium")
SHOTS = Path(__file__).resolve().parents[1] / "artifacts" / "screenshots"
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.real_model, pytest.mark.browser]


@pytest.fixture
def browser():
    if not shutil.which(CHROMIUM):
        pytest.skip(f"Chromium is not installed at {CHROMIUM} (Debian package `chromium`; .ci/run installs it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--no-first-run"])
        yield chromium
        chromium.close()


def shot(page, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


@pytest.fixture
def tenant(live_server_url):
    """Rows made before the browser starts: Playwright's sync API runs an event loop in this thread, and Django
    refuses database calls from a thread with a running loop."""
    seed(BUNDLED_MODELS.values(), log=lambda line: None)
    tenant = make_tenant("browser")
    user = get_user_model().objects.create_user("grace", password="pw-grace")
    Membership.objects.create(account=tenant.account, user=user, role=Membership.Role.OWNER)
    return tenant


def sign_in(browser, url: str):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(f"{url}/dashboard/login/")
    page.fill("input[name=username]", "grace")
    page.fill("input[name=password]", "pw-grace")
    page.click("button[type=submit]")
    page.wait_for_url("**/dashboard/*/")
    return page


def run_model(url: str, account_id: str, secret: str) -> httpx.Response:
    return httpx.post(f"{url}/client/v4/accounts/{account_id}/ai/run/{CHAT_MODEL}",
                      headers={"Authorization": f"Bearer {secret}"}, timeout=120,
                      json={"prompt": "Say hello.", "max_tokens": 4, "temperature": 0})


def test_sign_in_and_watch_an_api_request_reach_the_live_chart(live_server_url, tenant, browser):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(f"{live_server_url}/dashboard/")
    assert "/dashboard/login/" in page.url
    page.fill("input[name=username]", "grace")
    page.fill("input[name=password]", "wrong")
    page.click("button[type=submit]")
    assert page.get_by_role("alert").inner_text().startswith("That username and password do not match")
    shot(page, "login-error")
    page.fill("input[name=password]", "pw-grace")
    page.click("button[type=submit]")
    page.wait_for_url(f"**/dashboard/{tenant.account.pk}/")
    page.wait_for_selector("#live-state[data-state=live]", timeout=10_000)
    assert page.inner_text("#t-requests") == "0" and page.is_visible("#chart-empty")
    shot(page, "overview-empty")

    response = run_model(live_server_url, tenant.account.pk, tenant.secret)
    assert response.status_code == 200
    answered = time.monotonic()
    page.wait_for_selector("body[data-requests-today='1']", timeout=2_000)  # the promise: within 2 s
    waited = time.monotonic() - answered
    assert page.inner_text("#t-requests") == "1" and not page.is_visible("#chart-empty")
    bars = page.evaluate("Chart.getChart('usage-chart').data.datasets[0].data")
    assert bars[-1] == 1 or bars[-2] == 1  # this minute (or the last, across a minute boundary)
    assert waited < 2
    shot(page, "overview-live")

    phone = browser.new_page(viewport={"width": 390, "height": 844})
    phone.context.add_cookies(page.context.cookies())
    phone.goto(f"{live_server_url}/dashboard/{tenant.account.pk}/")
    width = phone.evaluate("document.documentElement.scrollWidth")
    assert width <= 390, f"the overview scrolls sideways on a phone ({width}px)"
    shot(phone, "overview-phone")

    page.click("text=Sign out")
    page.wait_for_url("**/dashboard/login/")


def test_create_a_key_use_it_then_revoke_it_and_the_api_refuses_it(live_server_url, tenant, browser):
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
    assert run_model(live_server_url, tenant.account.pk, secret).status_code == 200

    page.click("text=API keys")  # the secret was shown once
    assert secret not in page.content()
    page.on("dialog", lambda dialog: dialog.accept())
    page.click("tr[data-key=from-the-browser] button.danger")
    page.wait_for_selector("tr[data-key=from-the-browser] td.status:has-text('revoked')")
    assert page.locator("tr[data-key=from-the-browser]").count() == 1
    shot(page, "keys-revoked")
    refused = run_model(live_server_url, tenant.account.pk, secret)
    assert refused.status_code == 401 and "revoked" in refused.json()["errors"][0]["message"]
