"""The Batches page in a real browser (Debian's headless Chromium under Playwright) against uvicorn serving the
real ASGI app, with the real engine and the embedded Celery worker consuming this session's Redis queue in the
same process, as `make run` does. Batches are submitted through the API with the tenant's key while the page is
open. Screenshots land in tests/artifacts/screenshots/ (git-ignored)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from browser_support import scroll_width, shot, sign_in
from cp_support import CHAT_MODEL
from django.db import connection

from controlplane.batches import services

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.real_model, pytest.mark.browser,
              pytest.mark.redis]

# Every mutation of the list, recorded in the page: proof that rows moved in place, without a reload (which
# would also wipe this recorder).
RECORDER = """() => {
  window.seen = [];
  const record = () => document.querySelectorAll("#batch-list tr[data-batch-id]").forEach((r) =>
    window.seen.push({id: r.dataset.batchId, percent: +r.dataset.percent, status: r.dataset.status,
                      completed: +r.querySelector(".n-completed").textContent}));
  new MutationObserver(record).observe(document.getElementById("batch-list"),
                                       {subtree: true, childList: true, attributes: true, characterData: true});
}"""


@pytest.fixture
def tenant(browser_tenant, batch_worker):
    return browser_tenant


def open_batches(browser, url: str, account_id: str, **size):
    page = sign_in(browser, url, **size)
    page.click("nav.pages >> text=Batches")
    page.wait_for_url(f"**/dashboard/{account_id}/batches/")
    page.wait_for_selector("#live-state[data-state=live]", timeout=10_000)
    return page


def submit_openai_batch(url: str, tenant, lines: list[str]) -> str:
    data = "".join(line + "\n" for line in lines).encode()
    upload = httpx.post(f"{url}/v1/files", headers=tenant.headers, data={"purpose": "batch"},
                        files={"file": ("stories.jsonl", data, "application/jsonl")}, timeout=30)
    assert upload.status_code == 200, upload.text
    batch = httpx.post(f"{url}/v1/batches", headers=tenant.headers, timeout=30, json={
        "input_file_id": upload.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"})
    assert batch.status_code == 200, batch.text
    return batch.json()["id"]


def chat_line(custom_id: str, max_tokens: int) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": CHAT_MODEL, "max_tokens": max_tokens, "temperature": 0,
                                "messages": [{"role": "user", "content": f"Tell story number {custom_id}."}]}})


def submit_native_batch(url: str, tenant, count: int, max_tokens: int) -> str:
    queued = httpx.post(f"{url}/client/v4/accounts/{tenant.account.pk}/ai/run/{CHAT_MODEL}?queueRequest=true",
                        headers=tenant.headers, timeout=30, json={"requests": [
                            {"prompt": f"Write a long story about ship {i}.", "max_tokens": max_tokens,
                             "temperature": 0, "external_reference": f"ship-{i}"} for i in range(count)]})
    assert queued.status_code == 200, queued.text
    return queued.json()["result"]["request_id"]


def download(page, selector: str) -> tuple[str, bytes]:
    with page.expect_download() as info:
        page.click(selector)
    return info.value.suggested_filename, Path(info.value.path()).read_bytes()


def test_a_batch_submitted_through_the_api_moves_to_100_percent_live_and_its_results_download(
        live_server_url, tenant, browser, settings):
    # Runs of 2: the items of one run go in together and are mostly stored together, and ten alike items in runs
    # of 8 can finish in one or two steps, too fast for the page to see the bar part-way (it did once in three).
    settings.HEARTH_BATCH_RUN_ITEMS = 2
    account = tenant.account.pk
    page = open_batches(browser, live_server_url, account)
    assert page.is_visible("text=No batches yet")
    shot(page, "batches")
    page.evaluate(RECORDER)

    batch_id = submit_openai_batch(live_server_url, tenant, [chat_line(f"s{i}", 24) for i in range(10)]
                                   + ["this line is not JSON"])
    row = f"tr[data-batch-id='{batch_id}']"
    page.wait_for_selector(row, timeout=10_000)  # a batch the page had not seen: the list is read again
    assert not page.is_visible("text=No batches yet")
    # Some requests answered, some not yet: the bar is on its way.
    page.wait_for_function(f"""() => {{ const r = document.querySelector("{row}");
        return +r.querySelector(".n-completed").textContent > 0 && +r.dataset.percent < 100; }}""", timeout=120_000)
    shot(page, "batches-progress")
    page.wait_for_selector(f"{row}[data-status=completed][data-percent='100']", timeout=180_000)
    page.wait_for_selector(f"{row} a[data-kind=output]", timeout=10_000)  # links come with the finished row
    assert page.inner_text(f"{row} .badge") == "Completed"
    assert page.get_attribute(f"{row} .bar", "aria-valuenow") == "100"
    assert page.inner_text(f"{row} .c-progress").split("\n") == ["100% · 11 of 11", "10 done, 1 failed, 0 cancelled"]
    shot(page, "batches-done")

    seen = [s for s in page.evaluate("window.seen") if s["id"] == batch_id]  # still there: no reload
    percents = [s["percent"] for s in seen]
    assert percents == sorted(percents) and percents[-1] == 100
    assert any(0 < s["completed"] < 10 for s in seen)  # it was seen part-way, not only before and after
    assert {s["status"] for s in seen} >= {"in_progress", "completed"}

    name, content = download(page, f"{row} a[data-kind=output]")
    assert name == f"{batch_id}_output.jsonl"
    answers = [json.loads(line) for line in content.splitlines()]
    assert sorted(a["custom_id"] for a in answers) == sorted(f"s{i}" for i in range(10))
    assert all(a["response"]["status_code"] == 200 and a["response"]["body"]["choices"][0]["message"]["content"]
               for a in answers)
    api = httpx.get(f"{live_server_url}/v1/batches/{batch_id}", headers=tenant.headers, timeout=30).json()
    served = httpx.get(f"{live_server_url}/v1/files/{api['output_file_id']}/content", headers=tenant.headers,
                       timeout=30)
    assert content == served.content  # the same file the Files API serves
    name, content = download(page, f"{row} a[data-kind=errors]")
    errors = [json.loads(line) for line in content.splitlines()]
    assert len(errors) == 1 and errors[0]["error"]["code"] == "invalid_json"


def test_cancel_a_running_batch_from_the_page_and_read_the_phone_layout(live_server_url, tenant, browser):
    account = tenant.account.pk
    batch_id = submit_native_batch(live_server_url, tenant, 40, 64)
    page = open_batches(browser, live_server_url, account)
    row = f"tr[data-batch-id='{batch_id}']"
    assert page.get_attribute(row, "data-status") == "in_progress"
    page.evaluate(RECORDER)
    page.on("dialog", lambda dialog: dialog.accept())
    page.click(f"{row} button.danger")
    page.wait_for_selector("#batch-message .notice", timeout=10_000)
    assert batch_id in page.inner_text("#batch-message .notice")
    page.wait_for_selector(f"{row}[data-status=cancelled]", timeout=120_000)
    assert page.locator(f"{row} button.danger").count() == 0  # nothing left to cancel
    cancelled = int(page.inner_text(f"{row} .n-cancelled"))
    completed = int(page.inner_text(f"{row} .n-completed"))
    assert cancelled > 0 and completed + cancelled + int(page.inner_text(f"{row} .n-failed")) == 40
    assert page.get_attribute(f"{row} .bar", "aria-valuenow") == "100"
    assert page.evaluate("window.seen.length") > 0  # the row changed in place
    shot(page, "batches-cancelled")

    name, content = download(page, f"{row} a[data-kind=results]")
    assert name == f"{batch_id}.json"
    result = json.loads(content)["result"]
    assert result["status"] == "cancelled" and len(result["responses"]) == 40
    assert sum(r["success"] for r in result["responses"]) == completed

    phone = browser.new_page(viewport={"width": 390, "height": 844})
    phone.context.add_cookies(page.context.cookies())
    phone.goto(f"{live_server_url}/dashboard/{account}/batches/")
    phone.wait_for_selector("#live-state[data-state=live]", timeout=10_000)
    width = scroll_width(phone)
    assert width <= 390, f"the Batches page scrolls sideways on a phone ({width}px)"
    shot(phone, "batches-phone")


def test_cancelling_a_batch_that_finished_unseen_says_why_inline(live_server_url, tenant, browser, settings):
    settings.HEARTH_BATCH_WINDOW = 0  # the server (this process) holds the items back until the page is open
    batch_id = submit_native_batch(live_server_url, tenant, 1, 2)
    page = sign_in(browser, live_server_url)
    page.route_web_socket("**/ws/dashboard/**", lambda socket: None)  # a socket that hears nothing: no updates
    page.goto(f"{live_server_url}/dashboard/{tenant.account.pk}/batches/")
    row = f"tr[data-batch-id='{batch_id}']"
    assert page.get_attribute(row, "data-status") == "in_progress"

    settings.HEARTH_BATCH_WINDOW = 80
    worker = threading.Thread(target=lambda: (services.dispatch(batch_id), connection.close()))
    worker.start()  # Django refuses database calls from this thread while Playwright's loop runs in it
    worker.join(30)
    deadline = time.monotonic() + 60
    poll_url = f"{live_server_url}/client/v4/accounts/{tenant.account.pk}/ai/run/{CHAT_MODEL}"
    while httpx.post(poll_url, headers=tenant.headers, json={"request_id": batch_id},
                     timeout=30).json()["result"]["status"] != "completed":
        assert time.monotonic() < deadline, "the batch did not finish"
        time.sleep(0.1)
    assert page.get_attribute(row, "data-status") == "in_progress"  # the page has not heard

    page.on("dialog", lambda dialog: dialog.accept())
    page.click(f"{row} button.danger")
    alert = page.wait_for_selector("#batch-message [role=alert]", timeout=10_000)
    assert alert.inner_text() == f"Cannot cancel a batch that is completed ({batch_id})."
    page.wait_for_selector(f"{row}[data-status=completed] a[data-kind=results]")  # the list came with it
    assert page.locator(f"{row} button.danger").count() == 0
    shot(page, "batches-cancel-refused")
