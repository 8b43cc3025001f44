"""The LoRA adapters page in a real browser (Debian's headless Chromium under Playwright) against uvicorn serving
the real ASGI app: an owner uploads a real PEFT adapter's two files, watches the progress bar reach 100% and the
adapter appear, ready, without a reload; a refused upload explains itself and keeps the form; a delete asks
first and removes the row, the adapter and its API entry. And a phone-width page."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from browser_support import scroll_width, shot, sign_in
from cp_support import CHAT_MODEL
from test_dashboard_browser_models import in_thread

from controlplane.adapters.models import Adapter
from inference.lora.format import CONFIG_FILE, WEIGHTS_FILE
from inference.models.catalog import BUNDLED_MODELS, model_path

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.real_model, pytest.mark.browser]

# Every value the bar shows, in order, and a flag a reload would wipe.
RECORDER = """() => {
  window.notReloaded = true;
  window.progress = [];
  new MutationObserver(() => window.progress.push(+document.getElementById("ad-bar").getAttribute("aria-valuenow")))
    .observe(document.getElementById("ad-bar"), {attributes: true, attributeFilter: ["aria-valuenow"]});
}"""


@pytest.fixture(scope="module")
def peft_dir(tmp_path_factory) -> Path:
    """Rank 16 on every projection SmolLM2 has: about 20 MB of weights, so the upload takes more than one step."""
    if not BUNDLED_MODELS[CHAT_MODEL].installed:
        pytest.skip(f"{CHAT_MODEL} is not installed: run `make models`")
    from tests.lora_support import make_peft_adapter

    return make_peft_adapter(model_path(CHAT_MODEL), tmp_path_factory.mktemp("browser-lora") / "tone", rank=16,
                             targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                             seed=4)


@pytest.fixture
def tenant(browser_tenant, settings, tmp_path):
    """The signed-in owner's account, with stored adapter files in a folder of the test's own (the live server
    runs in this process, so it sees the setting)."""
    settings.MEDIA_ROOT = str(tmp_path / "media")
    settings.HEARTH_DATA_DIR = tmp_path / "data"
    return browser_tenant


def open_adapters(browser, url: str, account_id: str, **size):
    page = sign_in(browser, url, **size)
    page.click("nav.pages >> text=LoRA adapters")
    page.wait_for_url(f"**/dashboard/{account_id}/adapters/")
    return page


def test_an_owner_uploads_an_adapter_sees_it_listed_and_deletes_it(live_server_url, tenant, peft_dir, browser):
    account_id = tenant.account.pk
    page = open_adapters(browser, live_server_url, account_id)
    assert page.is_visible("#adapters-empty")
    page.select_option("#ad-base-model", CHAT_MODEL)
    page.evaluate(RECORDER)

    # A file that is not safetensors under the right name: refused inline, and the form keeps what was typed.
    page.fill("#ad-name", "tone")
    page.fill("#ad-description", "shorter answers")
    page.set_input_files("#ad-config", str(peft_dir / CONFIG_FILE))
    page.set_input_files("#ad-weights", files=[{"name": WEIGHTS_FILE, "mimeType": "application/octet-stream",
                                                "buffer": b"\x80\x04\x95not a safetensors file"}])
    page.click("#ad-submit")
    page.wait_for_selector("#upload[data-state=error]", timeout=30_000)
    assert "Invalid LoRA adapter" in page.inner_text("#ad-error")
    assert (page.input_value("#ad-name"), page.input_value("#ad-description")) == ("tone", "shorter answers")
    assert page.locator("#adapter-list tr[data-adapter-id]").count() == 0
    assert in_thread(lambda: Adapter.objects.count()) == 0

    # The real weights: the bar follows the upload to 100%, then the new row replaces the empty list in place.
    page.evaluate("window.progress = []")
    page.set_input_files("#ad-weights", str(peft_dir / WEIGHTS_FILE))
    page.click("#ad-submit")
    page.wait_for_selector("#upload[data-state=done]", timeout=60_000)
    progress = page.evaluate("window.progress")
    assert progress[-1] == 100 and progress == sorted(progress), progress
    assert page.get_attribute("#ad-bar", "aria-valuenow") == "100" and page.inner_text("#ad-percent") == "100%"
    assert page.is_hidden("#ad-error") and "Uploaded tone." in page.inner_text("#ad-status")
    assert (page.input_value("#ad-name"), page.input_value("#ad-base-model")) == ("", CHAT_MODEL)  # ready for another
    row = page.locator("#adapter-list tr[data-adapter-id]")
    assert row.count() == 1 and row.get_attribute("data-status") == "ready"
    assert row.locator(".adapter-name").inner_text() == "tone"
    assert row.locator(".c-rank").inner_text() == "16" and row.locator(".c-status").inner_text() == "ready"
    assert "down_proj" in row.locator(".c-targets").inner_text()
    assert page.evaluate("window.notReloaded") is True
    adapter_id = row.get_attribute("data-adapter-id")
    stored = in_thread(lambda: Adapter.objects.get(pk=adapter_id))
    assert (stored.account_id, stored.status, stored.rank) == (account_id, "ready", 16)
    api = f"{live_server_url}/client/v4/accounts/{account_id}/ai/finetunes"
    assert [a["id"] for a in httpx.get(api, headers=tenant.headers).json()["result"]] == [adapter_id]
    shot(page, "adapters")

    phone = browser.new_page(viewport={"width": 390, "height": 844})
    phone.context.add_cookies(page.context.cookies())
    phone.goto(f"{live_server_url}/dashboard/{account_id}/adapters/")
    assert phone.locator("#adapter-list tr[data-adapter-id]").count() == 1
    width = scroll_width(phone)
    assert width <= 390, f"the LoRA adapters page scrolls sideways on a phone ({width}px)"
    shot(phone, "adapters-phone")

    # Delete asks first: dismissed, nothing happens; accepted, the row goes without a reload.
    page.once("dialog", lambda dialog: dialog.dismiss())
    row.locator("button.danger").click()
    assert page.locator("#adapter-list tr[data-adapter-id]").count() == 1
    page.once("dialog", lambda dialog: dialog.accept())
    row.locator("button.danger").click()
    page.wait_for_selector("#adapters-empty", timeout=10_000)
    assert page.locator("#adapter-list tr[data-adapter-id]").count() == 0
    assert "Deleted tone." in page.inner_text("#adapter-message")
    assert page.evaluate("window.notReloaded") is True
    assert in_thread(lambda: Adapter.objects.filter(pk=adapter_id).exists()) is False
    assert httpx.get(f"{api}/{adapter_id}", headers=tenant.headers).status_code == 404
    shot(page, "adapters-deleted")
