"""Shared pieces of the browser tests: Debian's headless Chromium driven by Playwright's sync API, a signed-in
page, screenshots into tests/artifacts/screenshots/ (git-ignored). The fixtures that use these live in
conftest.py (`browser`, `browser_tenant`)."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
from cp_support import CHAT_MODEL

CHROMIUM = os.environ.get("HEARTH_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run"]
SHOTS = Path(__file__).resolve().parents[1] / "artifacts" / "screenshots"
USER, PASSWORD = "grace", "pw-grace"


def shot(page, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def sign_in(browser, url: str, *, width: int = 1280, height: int = 900):
    page = browser.new_page(viewport={"width": width, "height": height})
    page.goto(f"{url}/dashboard/login/")
    page.fill("input[name=username]", USER)
    page.fill("input[name=password]", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url("**/dashboard/*/")
    return page


def run_model(url: str, account_id: str, secret: str) -> httpx.Response:
    return httpx.post(f"{url}/client/v4/accounts/{account_id}/ai/run/{CHAT_MODEL}",
                      headers={"Authorization": f"Bearer {secret}"}, timeout=120,
                      json={"prompt": "Say hello.", "max_tokens": 4, "temperature": 0})


def scroll_width(page) -> int:
    """The page's layout width: more than the viewport means it scrolls sideways."""
    return page.evaluate("document.documentElement.scrollWidth")
