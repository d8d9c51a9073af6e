"""The web page at / in a real headless Chromium (Debian's chromium + chromium-driver, Selenium):
a chat answer streams in, the speculation switch reflects the server, the charts draw, and a
screenshot is saved (test-output/web_page.png and the test's tmp dir)."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import httpx
import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
OUTPUT = Path(__file__).resolve().parents[2] / "test-output"


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if not (CHROMIUM and DRIVER):
        if os.environ.get("CI"):
            pytest.fail("CI must have Debian's chromium and chromium-driver (.ci/run installs them)")
        pytest.skip("chromium / chromedriver not installed (apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    # Headless, and nothing that would reach beyond this machine (its network is closed).
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-quic", "--window-size=1400,900"):
        opts.add_argument(flag)
    # Chromium keeps its singleton socket in a directory under $TMPDIR that outlives it; give it
    # one of pytest's own temporary directories (rotated) instead of /tmp.
    env = dict(os.environ, TMPDIR=str(tmp_path_factory.mktemp("chromium")))
    driver = webdriver.Chrome(service=Service(DRIVER, env=env), options=opts)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def _wait(cond, timeout: float, what: str):  # noqa: ANN001, ANN202
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_chat_streams_and_charts_draw(smol_server, browser, tmp_path):
    from selenium.webdriver.common.by import By

    base = smol_server.base_url
    assert "specserve" in httpx.get(base + "/").text
    stats = httpx.get(base + "/stats").json()
    assert {"requests", "series", "speculation", "engine"} <= set(stats)
    browser.get(base + "/")
    assert browser.find_element(By.ID, "model-name").text == "smollm2"
    _wait(lambda: browser.execute_script("return document.body.dataset.refreshed"), 20, "the first /stats refresh")
    # The switch mirrors the server (n-gram speculation on).
    assert browser.find_element(By.ID, "spec-switch").is_selected()
    box = browser.find_element(By.ID, "prompt")
    box.send_keys("Write a Python function that reverses a string.")
    browser.find_element(By.ID, "send").click()
    # Tokens arrive while the request is still streaming, then it finishes with its stats line.
    msg = _wait(lambda: browser.find_elements(By.CSS_SELECTOR, ".msg.assistant"), 10, "the assistant message")[-1]
    _wait(lambda: msg.get_attribute("data-state") == "done" or "Error" in msg.text, 120, "the answer to finish")
    assert msg.get_attribute("data-state") == "done", msg.text
    text = msg.text
    assert "tokens" in text and "first token" in text and len(text) > 40, text
    # The finished request reaches /stats and the latency charts draw it.
    for chart in ("c-ttft", "c-tpot", "c-tps", "c-kv"):
        _wait(lambda c=chart: int(browser.find_element(By.ID, c).get_attribute("data-points") or 0) > 0, 20,
              f"chart {chart} to draw")
    assert browser.find_element(By.ID, "v-ttft").text.endswith("ms")
    assert "precision" in browser.find_element(By.ID, "engine").text
    OUTPUT.mkdir(exist_ok=True)
    for path in (tmp_path / "web_page.png", OUTPUT / "web_page.png"):
        assert browser.save_screenshot(str(path))
        assert path.stat().st_size > 10_000
