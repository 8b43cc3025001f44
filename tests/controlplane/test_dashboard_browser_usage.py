"""The Usage pages in a real browser (Debian's headless Chromium under Playwright) against uvicorn serving the real
ASGI app and engine: API requests made with the tenant's key show up in the summary, its CSV and the request log.
Screenshots land in tests/artifacts/screenshots/ (git-ignored)."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import httpx
import pytest
from browser_support import run_model, scroll_width, shot, sign_in
from cp_support import CHAT_MODEL

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.real_model, pytest.mark.browser]


def _too_long(url: str, account_id: str, secret: str) -> httpx.Response:
    """A prompt beyond the model's context: admitted, refused by sizing, metered as an error (413 / 3006)."""
    return httpx.post(f"{url}/client/v4/accounts/{account_id}/ai/run/{CHAT_MODEL}",
                      headers={"Authorization": f"Bearer {secret}"}, timeout=120,
                      json={"prompt": "word " * 9000, "max_tokens": 4})


def test_api_requests_show_in_the_summary_the_csv_and_the_request_log(live_server_url, browser_tenant, browser):
    account_id = browser_tenant.account.pk
    ok = run_model(live_server_url, account_id, browser_tenant.secret)
    assert ok.status_code == 200
    refused = _too_long(live_server_url, account_id, browser_tenant.secret)
    assert refused.status_code == 413 and refused.json()["errors"][0]["code"] == 3006
    usage = ok.json()["result"]["usage"]

    page = sign_in(browser, live_server_url)
    page.click("nav.pages >> text=Usage")
    page.wait_for_url(f"**/dashboard/{account_id}/usage/")
    assert page.inner_text("#t-requests") == "2" and page.inner_text("#t-errors") == "1"
    assert page.inner_text("#t-input") == str(usage["prompt_tokens"])
    assert page.inner_text("#t-output") == str(usage["completion_tokens"])
    model_row = page.locator(f"#by-model tr[data-model='{CHAT_MODEL}']")
    assert model_row.locator("[data-col=requests]").inner_text() == "2"
    assert model_row.locator("[data-col=errors]").inner_text() == "1"
    key_row = page.locator(f"#by-key tr[data-key='{browser_tenant.key.name}']")
    assert key_row.locator("[data-col=requests]").inner_text() == "2"
    assert browser_tenant.key.prefix in key_row.inner_text()
    assert page.locator("#by-day tbody tr").count() == 1
    bars = page.evaluate("Chart.getChart('daily-chart').data.datasets[0].data")
    assert len(bars) == 30 and bars[-1] == 2 and sum(bars) == 2  # the last 30 days, today's two requests
    shot(page, "usage")

    with page.expect_download() as info:
        page.click("#download-csv")
    download = info.value
    assert download.suggested_filename.startswith(f"hearth-usage-{account_id}-")
    rows = list(csv.DictReader(io.StringIO(Path(download.path()).read_text())))
    assert [(r["model"], r["key_id"], r["requests"], r["errors"], r["input_tokens"], r["output_tokens"])
            for r in rows] == [(CHAT_MODEL, str(browser_tenant.key.pk), "2", "1", str(usage["prompt_tokens"]),
                                str(usage["completion_tokens"]))]
    assert float(rows[0]["neurons"]) > 0

    page.click(".usage-tabs >> text=Request log")
    page.wait_for_url(f"**/dashboard/{account_id}/usage/requests/")
    assert page.locator("#log-table tbody tr").count() == 2
    assert not page.is_visible("#log-loading")  # shown only while a page of the log loads
    page.evaluate("""() => document.body.addEventListener('htmx:beforeSend', () => {
        window.sawLoading = document.getElementById('log-loading').classList.contains('htmx-request'); })""")
    page.select_option("select[name=status]", "error")  # htmx: the log alone is fetched and swapped in
    page.wait_for_url("**/usage/requests/?*status=error*")
    page.wait_for_function("document.body.dataset.logLoads === '1'")  # one swap, settled
    assert page.locator("#log-table tbody tr").count() == 1
    assert page.get_attribute("#log-table tbody tr", "data-status") == "error"
    assert page.evaluate("window.sawLoading") is True
    row = page.locator("#log-table tbody tr").inner_text()
    assert "3006" in row and CHAT_MODEL in row and browser_tenant.key.name in row
    shot(page, "usage-requests")
    page.select_option("select[name=status]", "ok")
    page.wait_for_selector("#log-table tbody tr:only-child[data-status=ok]")
    page.go_back()  # the filter was pushed into history
    page.wait_for_url("**status=error*")

    phone = browser.new_page(viewport={"width": 390, "height": 844})
    phone.context.add_cookies(page.context.cookies())
    for path, name in (("usage/", "usage-phone"), ("usage/requests/", "usage-requests-phone")):
        phone.goto(f"{live_server_url}/dashboard/{account_id}/{path}")
        width = scroll_width(phone)
        assert width <= 390, f"{path} scrolls sideways on a phone ({width}px)"
        shot(phone, name)


def test_the_pages_work_without_javascript_and_bad_filters_say_why(live_server_url, browser_tenant, browser):
    account_id = browser_tenant.account.pk
    assert run_model(live_server_url, account_id, browser_tenant.secret).status_code == 200
    signed = sign_in(browser, live_server_url)
    context = browser.new_context(java_script_enabled=False, viewport={"width": 1280, "height": 900})
    context.add_cookies(signed.context.cookies())
    page = context.new_page()
    page.goto(f"{live_server_url}/dashboard/{account_id}/usage/requests/")
    assert page.locator("#log-table tbody tr").count() == 1 and not page.is_visible("#log-loading")
    page.select_option("select[name=status]", "error")
    page.click("#log-filters button[type=submit]")  # a plain GET form
    page.wait_for_url("**status=error*")
    assert page.inner_text("#log-empty") == "No requests match these filters."
    page.fill("input[name=since]", "2026-03-12T00:00")
    page.fill("input[name=until]", "2026-03-10T00:00")
    page.click("#log-filters button[type=submit]")
    assert page.inner_text("#log-error") == "since must be before until"

    page.goto(f"{live_server_url}/dashboard/{account_id}/usage/?since=2026-03-12&until=2026-03-10")
    assert page.get_by_role("alert").inner_text() == "since (2026-03-12) is after until (2026-03-10)"
    shot(page, "usage-bad-filter")
    page.fill("input[name=since]", "2026-01-01")
    page.fill("input[name=until]", "2099-01-01")
    page.click("#usage-filters button[type=submit]")
    page.wait_for_selector("#t-requests")
    assert page.inner_text("#t-requests") == "1"
    context.close()
