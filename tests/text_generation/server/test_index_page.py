"""The web page in a real headless browser (Debian's chromium + chromedriver, driven by Selenium;
nothing is downloaded): type a prompt, press Generate, watch the text arrive token by token,
toggle the log-probs, save a screenshot. Skips (saying why) where no browser is installed:
``apt-get install -y chromium chromium-driver``."""

from __future__ import annotations

import shutil
import time

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")

pytestmark = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="no headless browser: apt-get install -y chromium chromium-driver")


@pytest.fixture()
def browser():
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1000,800"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def test_prompt_generate_streamed_text(harness, browser, tmp_path):
    from selenium.webdriver.common.by import By

    harness.step_delay = 0.03  # slow enough to watch the tokens arrive one by one
    with harness.serving() as url:
        browser.get(url + "/")
        browser.find_element(By.ID, "prompt").send_keys("Once upon a time")
        tokens = browser.find_element(By.ID, "max_tokens")
        tokens.clear()
        tokens.send_keys("24")
        browser.find_element(By.ID, "generate").click()
        counts, deadline = set(), time.monotonic() + 60
        while time.monotonic() < deadline:
            counts.add(len(browser.find_elements(By.CSS_SELECTOR, "#output .tok")))
            if "finished" in browser.find_element(By.ID, "status").text:
                break
            time.sleep(0.02)
        status = browser.find_element(By.ID, "status").text
        assert status.startswith("finished"), status
        output = browser.find_element(By.ID, "output").text
        assert output.startswith("Once upon a time") and len(output) > len("Once upon a time")
        assert len(counts - {0}) >= 3, f"text did not arrive in steps: {sorted(counts)}"
        first = browser.find_elements(By.CSS_SELECTOR, "#output .tok")[0]
        assert first.get_attribute("title").startswith("log-prob ")
        browser.find_element(By.ID, "show_lp").click()
        assert "show-lp" in browser.find_element(By.ID, "output").get_attribute("class")
        shot = tmp_path / "text_generation_page.png"
        assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 1000
