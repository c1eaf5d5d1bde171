"""The built book in a real browser: headless Chromium (Debian's `chromium` and `chromium-driver`).

Run alone with `python -m pytest -m browser -s` (the screenshots' paths are printed). Skipped, with the
reason, where Chromium or its driver is not installed; `.ci/run` installs both where it can.
"""

import base64
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

CHROMIUM = Path("/usr/bin/chromium")
DRIVER = Path("/usr/bin/chromedriver")
if not CHROMIUM.is_file():
    pytest.skip(f"headless Chromium is not installed ({CHROMIUM}); apt-get install -y chromium chromium-driver",
                allow_module_level=True)
if not DRIVER.is_file():
    pytest.skip(f"chromedriver is not installed ({DRIVER}); apt-get install -y chromium-driver",
                allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[dev]')")
from selenium.webdriver.common.by import By  # noqa: E402 - only once selenium is known to be there

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars"]
DESKTOP, PHONE = (1280, 900), (390, 844)


@pytest.fixture(scope="module")
def site(built) -> Path:
    return built.out  # the book's tests' own build (conftest)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    os.environ.setdefault("SE_OFFLINE", "true")  # Selenium Manager must never fetch a driver or a browser
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in FLAGS + [f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}",
                         f"--window-size={DESKTOP[0]},{DESKTOP[1]}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=str(DRIVER)))
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("screenshots")


def viewport(driver, width: int, height: int) -> None:
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": width < 600})


def screenshot(driver, path: Path, full_page: bool = True) -> Path:
    """The whole page (not only the window), as a person scrolling it would see it."""
    width = driver.execute_script("return document.documentElement.clientWidth")
    height = driver.execute_script("return document.documentElement.scrollHeight") if full_page else \
        driver.execute_script("return window.innerHeight")
    shot = driver.execute_cdp_cmd("Page.captureScreenshot", {
        "format": "png", "captureBeyondViewport": full_page,
        "clip": {"x": 0, "y": 0, "width": width, "height": height, "scale": 1}})
    path.write_bytes(base64.b64decode(shot["data"]))
    return path


def report(capsys, *paths: Path) -> None:
    with capsys.disabled():
        for path in paths:
            print(f"\n  screenshot: {path}")


def test_index_lists_the_tracks(browser, site, shots, capsys):
    viewport(browser, *DESKTOP)
    browser.get((site / "index.html").as_uri())
    assert "KV Lab" in browser.title
    tracks = browser.find_elements(By.CSS_SELECTOR, "section.track h2")
    assert [t.text.split(" · ")[0] for t in tracks][:2] == ["Track M", "Track P"]
    modules = browser.find_elements(By.CSS_SELECTOR, "li.module")
    assert modules and all(m.find_element(By.CSS_SELECTOR, ".pill").text for m in modules)
    report(capsys, screenshot(browser, shots / "index.png"))


def test_m02_hints_are_folded_and_open_on_click(browser, site, shots, capsys):
    viewport(browser, *DESKTOP)
    browser.get((site / "m02_thinker_attention.html").as_uri())
    hints = browser.find_elements(By.CSS_SELECTOR, "details.hint")
    assert len(hints) == 3
    for hint in hints:
        assert hint.get_attribute("open") is None
        assert not hint.find_element(By.CSS_SELECTOR, ".hint-body").is_displayed()
    page = screenshot(browser, shots / "m02.png")
    first = hints[0]
    summary = first.find_element(By.TAG_NAME, "summary")
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", summary)
    summary.click()
    assert first.get_attribute("open") is not None
    body = first.find_element(By.CSS_SELECTOR, ".hint-body")
    assert body.is_displayed() and body.size["height"] > 100
    assert all(h.get_attribute("open") is None for h in hints[1:])
    opened = shots / "m02-hint-l1-open.png"
    opened.write_bytes(first.screenshot_as_png)
    report(capsys, page, opened)


def test_m02_math_is_rendered(browser, site):
    viewport(browser, *DESKTOP)
    browser.get((site / "m02_thinker_attention.html").as_uri())
    formulas = browser.find_elements(By.TAG_NAME, "math")
    assert len(formulas) >= 3
    display = browser.find_element(By.CSS_SELECTOR, ".math-display math")
    assert display.size["width"] > 200 and display.size["height"] > 30  # laid out as MathML, not as raw text
    assert "$" not in browser.find_element(By.ID, "computation").text


def test_m02_fits_a_phone(browser, site, shots, capsys):
    viewport(browser, *PHONE)
    browser.get((site / "m02_thinker_attention.html").as_uri())
    overflow = browser.execute_script("return document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 0, f"the page is {overflow}px wider than a phone; wide blocks must scroll inside themselves"
    report(capsys, screenshot(browser, shots / "m02-phone.png", full_page=False))
    viewport(browser, *DESKTOP)


def test_m02_prints_with_its_hints_open(browser, site):
    browser.get((site / "m02_thinker_attention.html").as_uri())
    browser.execute_cdp_cmd("Emulation.setEmulatedMedia", {"media": "print"})
    try:
        # Selenium's is_displayed() treats a closed <details> as hidden whatever the CSS says; ask the page.
        shown = browser.execute_script(
            "return [...document.querySelectorAll('details.hint .hint-body')].map(b => b.checkVisibility())")
        assert shown == [True, True, True], "print must show every hint (a printed page cannot be clicked)"
        assert not browser.find_element(By.CSS_SELECTOR, "nav.toc").is_displayed()
        pdf = browser.execute_cdp_cmd("Page.printToPDF", {"printBackground": True})
        assert base64.b64decode(pdf["data"]).startswith(b"%PDF")
    finally:
        browser.execute_cdp_cmd("Emulation.setEmulatedMedia", {"media": ""})


def test_chinese_page_and_switch(browser, site, shots, capsys):
    viewport(browser, *DESKTOP)
    browser.get((site / "m02_thinker_attention.html").as_uri())
    browser.find_element(By.CSS_SELECTOR, "a.lang-switch").click()
    assert browser.current_url.endswith("/zh/m02_thinker_attention.html")
    assert browser.find_element(By.TAG_NAME, "html").get_attribute("lang") == "zh-Hans"
    assert browser.find_element(By.CSS_SELECTOR, "#hints h2").text == "三级提示"
    report(capsys, screenshot(browser, shots / "m02-zh.png", full_page=False))


def test_chinese_page_of_a_track_p_module(browser, site, shots, capsys):
    """A Track P page in Chinese: its computed toy and its code render with real CJK glyphs around them."""
    viewport(browser, *DESKTOP)
    browser.get((site / "zh" / "p04_paged_decode.html").as_uri())
    assert browser.find_element(By.TAG_NAME, "html").get_attribute("lang") == "zh-Hans"
    assert browser.find_element(By.CSS_SELECTOR, "#hints h2").text == "三级提示"
    toy = browser.find_element(By.CSS_SELECTOR, "#toy")
    assert toy.find_elements(By.TAG_NAME, "table"), "the computed toy shows no table"
    report(capsys, screenshot(browser, shots / "p04-zh.png", full_page=False))
