"""The class report in a real browser: headless Chromium, as the book's browser test starts it.

Run alone with `python -m pytest checks/selftests/test_class_report_browser.py -s` (the screenshots' paths
are printed). Skipped, with the reason, where Chromium or its driver is not installed.
"""

from pathlib import Path

import pytest

from book.class_report import write_class_report
from checks.selftests.test_class_report import STATUS, synthetic_class

pytestmark = pytest.mark.browser

# Chromium, its driver and selenium as the book's browser test finds them (this module is skipped with it,
# saying why, where they are missing), and the same browser fixture
from checks.selftests.test_book_browser import (  # noqa: E402, F401 - `browser` is a fixture
    DESKTOP, PHONE, By, browser, report, screenshot, viewport)

PAGES = {"en": "class.html", "zh": "class.zh.html"}
PLOTS = 4  # two modules, each with a histogram of its scores and a chart of its checks' pass rates


@pytest.fixture(scope="module")
def graded(tmp_path_factory) -> Path:
    folder = synthetic_class(tmp_path_factory.mktemp("class") / "graded")
    write_class_report(folder)
    return folder


@pytest.mark.parametrize("lang", PAGES)
def test_class_report_renders_its_plots_and_tables(browser, graded, lang, tmp_path_factory, capsys):
    viewport(browser, *DESKTOP)
    browser.get((graded / PAGES[lang]).as_uri())
    assert browser.find_element(By.TAG_NAME, "html").get_attribute("lang") == ("zh-Hans" if lang == "zh" else "en")
    styled = browser.execute_script("return getComputedStyle(document.querySelector('.topbar')).position")
    assert styled == "sticky", "class.css did not load"
    plots = browser.find_elements(By.CSS_SELECTOR, "figure.plot svg")
    assert len(plots) == PLOTS
    for plot in plots:
        assert plot.size["width"] > 200 and plot.size["height"] > 80, plot.get_attribute("aria-label")
        assert plot.find_elements(By.CSS_SELECTOR, "text"), "a plot with no labels"
    overflow = browser.execute_script("return document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 0, f"the page is {overflow}px wider than the window"
    assert len(browser.find_elements(By.CSS_SELECTOR, "table.scores tbody tr")) == len(STATUS)
    assert len(browser.find_elements(By.CSS_SELECTOR, "table.not-graded tbody tr")) == 2
    assert len(browser.find_elements(By.CSS_SELECTOR, "table.duplicates tbody tr")) == 1
    ranked = browser.find_elements(By.CSS_SELECTOR, "#module-m01 table.mistakes-ranked tbody tr")
    assert [r.get_attribute("data-mistake") for r in ranked] == ["no-fp32-upcast", "eps-outside-sqrt"]
    fold = ranked[0].find_element(By.CSS_SELECTOR, "details.students")
    assert not fold.find_element(By.CSS_SELECTOR, ".ids").is_displayed()
    summary = fold.find_element(By.TAG_NAME, "summary")
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", summary)
    summary.click()
    assert fold.find_element(By.CSS_SELECTOR, ".ids").text.split() == ["bob", "carol", "dave"]
    browser.execute_script("window.scrollTo(0, 0)")
    shot = screenshot(browser, tmp_path_factory.mktemp("screenshots") / f"class-{lang}.png")
    report(capsys, shot)


@pytest.mark.parametrize("lang", PAGES)
def test_class_report_fits_a_phone(browser, graded, lang):
    viewport(browser, *PHONE)
    try:
        browser.get((graded / PAGES[lang]).as_uri())
        overflow = browser.execute_script("return document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 0, f"the page is {overflow}px wider than a phone; plots shrink, tables scroll inside"
        widths = [p.size["width"] for p in browser.find_elements(By.CSS_SELECTOR, "figure.plot svg")]
        assert widths and all(0 < w <= PHONE[0] for w in widths)
    finally:
        viewport(browser, *DESKTOP)
