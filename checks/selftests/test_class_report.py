"""The class report (book/class_report.py) on a made-up class: five students, written as grade-class leaves them.

alice passes all of m01; bob, carol and dave make m01's `no-fp32-upcast` (bob on two checks: he counts once)
and bob also `eps-outside-sqrt`; carol's and dave's m01 sources are identical; dave's worker crashed on a
check; erin handed in the stubs (empty). p01 is graded too, with a check whose cases are partly skipped.
"""

import hashlib
import json
import re
from pathlib import Path

import pytest

from book import pages
from book.build import render_sections
from book.class_report import write_class_report
from checks.harness.loader import ROOT

M01, P01 = "m01_rmsnorm", "p01_block_manager"
M01_CHECKS = {  # function -> (title, points): a subset of m01's checks, as checks.json names them
    "test_toy_rows": ("rms_norm gives the hand-computed toy rows", 2),
    "test_fp16_large_values": ("fp16 rows with |x| in the hundreds (their squares overflow fp16) match HF", 2),
    "test_tiny_rows_where_eps_matters": ("rows whose mean square is close to eps match HF (eps sits inside the "
                                         "square root)", 2),
    "test_eps_is_used": ("the eps argument is used, not a hard-coded constant", 2),
}
P01_CHECKS = {
    "test_toy_scenario": ("the toy scenario, step by step", 4),
    "test_slot_of": ("slot_of maps a token to block * block_size + offset", 2),
}
FAILED = {  # student -> {(module, function): mistake ids}; every other check passes (erin's code never ran)
    "alice": {(P01, "test_slot_of"): []},
    "bob": {(M01, "test_fp16_large_values"): ["no-fp32-upcast"],
            (M01, "test_tiny_rows_where_eps_matters"): ["eps-outside-sqrt", "no-fp32-upcast"]},
    "carol": {(M01, "test_fp16_large_values"): ["no-fp32-upcast"], (P01, "test_toy_scenario"): []},
    "dave": {(M01, "test_fp16_large_values"): ["no-fp32-upcast"], (M01, "test_eps_is_used"): []},
}
STATUS = {"alice": ("graded", ""), "bob": ("graded", ""), "carol": ("graded", ""),
          "dave": ("crashed", "test_eps_is_used: the worker died (SIGSEGV) while running it"),
          "erin": ("empty", "no module file differs from the shipped stub")}
SHARED = hashlib.sha256(b"carol's and dave's m01").hexdigest()


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def rows(student: str) -> list[dict]:
    found = []
    for module, checks in ((M01, M01_CHECKS), (P01, P01_CHECKS)):
        for function, (title, points) in checks.items():
            mistakes = FAILED[student].get((module, function))
            cases = ["fp32-a", "fp16-b"]
            for n, case in enumerate(cases):
                failed = mistakes is not None and n == 0
                status = "failed" if failed else "passed"
                if function == "test_slot_of" and n == 1:
                    status = "skipped"  # a skipped case does not count against the check
                found.append({"module": module, "check": title, "case": case, "impl": "submission",
                              "status": status, "reason": "max error 3.1e+00 > tolerance 1e-2" if failed else "",
                              "mistakes": list(mistakes or []) if failed else [], "function": function,
                              "points": points})
    return found


def score(student: str, module: str, checks: dict) -> float:
    return float(sum(points for function, (_, points) in checks.items()
                     if (module, function) not in FAILED.get(student, {})))


def synthetic_class(folder: Path) -> Path:
    """The class above as `grade-class --out folder` leaves it (before its report)."""
    for student, (status, reason) in STATUS.items():
        home = folder / student
        home.mkdir(parents=True)
        ran = status != "empty"
        scores = {M01: score(student, M01, M01_CHECKS), P01: score(student, P01, P01_CHECKS)} if ran else \
            {M01: 0.0, P01: 0.0}
        sources = {} if not ran else {f"{M01}.py": SHARED if student in ("carol", "dave") else digest(student),
                                      f"{P01}.py": digest(student + "p01")}
        graded = {"student": student, "hash": digest(student + "folder"), "status": status, "reason": reason,
                  "seconds": 12.3, "modules": [M01, P01], "scores": scores, "max": {M01: 8, P01: 6},
                  "total": sum(scores.values()), "max_total": 14, "sources": sources}
        (home / "graded.json").write_text(json.dumps(graded))
        if ran:
            (home / "checks.json").write_text(json.dumps({"seed": 2026, "complete": True, "passed": False,
                                                          "results": rows(student)}))
    return folder


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    folder = synthetic_class(tmp_path_factory.mktemp("class") / "graded")
    written = write_class_report(folder)
    return {"folder": folder, "written": written, "en": written[0].read_text(), "zh": written[1].read_text()}


def section(html: str, anchor: str) -> str:
    start = html.index(f'id="{anchor}"')
    return html[start: html.index("</section>", start)]


def cells(html: str, table: str) -> list[list[str]]:
    """The text of every body row's cells of the first `<table class="{table}">`."""
    body = html[html.index(f'<table class="{table}"'):]
    body = body[body.index("<tbody>"): body.index("</tbody>")]
    return [[re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", row, re.DOTALL)]
            for row in re.findall(r"<tr[^>]*>(.*?)</tr>", body, re.DOTALL)]


def test_writes_both_pages_and_their_stylesheet(report):
    folder = report["folder"]
    assert report["written"] == [folder / "class.html", folder / "class.zh.html"]
    assert all(path.is_file() for path in report["written"])
    css = (folder / "class.css").read_text()
    assert ".topbar" in css and "figure.plot" in css  # the book's stylesheet and the report's rules, one file
    assert 'href="class.css"' in report["en"] and 'href="class.css"' in report["zh"]


def test_header_counts_students_statuses_and_totals(report):
    html = report["en"]
    assert re.search(r'id="student-count">5<', html)
    chips = dict(re.findall(r'data-status="([^"]+)">[^<]*<b>(\d+)</b>', html))
    assert chips == {"graded": "3", "crashed": "1", "empty": "1"}
    # totals of those whose code ran: alice 12, bob 10, carol 8, dave 10 (of 14)
    assert re.search(r'id="mean-total">10 ', html) and re.search(r'id="median-total">10 ', html)
    modules = cells(html, "modules")  # module, mean, median, of, full marks, mistakes named
    assert [row[0].split(" · ")[0] for row in modules] == ["M01", "P01"]
    assert [row[1:] for row in modules] == [["5.5", "5", "8", "1", "2"], ["4.5", "5", "6", "2", "0"]]


def test_pass_rate_per_check_counts_a_student_once_and_ignores_skipped_cases(report):
    table = {row[1]: row[2] for row in cells(section(report["en"], "module-m01"), "pass-rates")}
    assert table == {"test_toy_rows": "4/4", "test_fp16_large_values": "1/4",
                     "test_tiny_rows_where_eps_matters": "3/4", "test_eps_is_used": "3/4"}
    p01 = {row[1]: row[2] for row in cells(section(report["en"], "module-p01"), "pass-rates")}
    assert p01 == {"test_toy_scenario": "3/4", "test_slot_of": "3/4"}


def test_mistakes_ranked_by_students_with_their_ids_folded(report):
    m01 = section(report["en"], "module-m01")
    assert re.findall(r'data-mistake="([^"]+)"', m01) == ["no-fp32-upcast", "eps-outside-sqrt"]
    first, second = cells(m01, "mistakes-ranked")
    assert first[0] == "1" and first[2] == "3" and second[2] == "1"
    assert "squares computed in the input dtype" in first[1]  # the catalogue's title
    fold = re.search(r'data-mistake="no-fp32-upcast".*?(<details class="students">.*?</details>)', m01, re.DOTALL)
    assert fold and re.findall(r"<code>(\w+)</code>", fold.group(1)) == ["bob", "carol", "dave"]
    assert "3 students" in fold.group(1)
    assert "data-mistake" not in section(report["en"], "module-p01")  # p01's failures named no mistake


def test_mistakes_link_to_their_pitfalls_in_both_languages(report, tmp_path):
    assert 'href="book/m01_rmsnorm.html#pitfall-no-fp32-upcast"' in report["en"]
    assert 'href="book/zh/m01_rmsnorm.html#pitfall-no-fp32-upcast"' in report["zh"]
    assert 'href="book/m01_rmsnorm.html"' in report["en"] and 'href="book/zh/index.html"' in report["zh"]
    for lang in pages.LANGUAGES:  # the anchors the links point to are the ones the built book gives
        anchors = render_sections(pages.load(ROOT, M01, lang))["Pitfalls"]["anchors"]
        assert {"no-fp32-upcast", "eps-outside-sqrt"} <= set(anchors), lang
    unlinked = write_class_report(synthetic_class(tmp_path / "graded"), book=None)[0].read_text()
    assert "pitfall-" not in unlinked and "book/" not in unlinked and "no-fp32-upcast" in unlinked


def test_identical_sources_are_flagged_as_a_hint(report):
    flagged = section(report["en"], "duplicates")
    assert cells(flagged, "duplicates") == [["m01_rmsnorm.py", "carol dave", SHARED[:12]]]
    prose = re.sub(r"<[^>]+>", "", flagged).lower()
    assert "hint" in prose and "before drawing any conclusion" in prose
    assert not re.search(r"cheat|plagiar|copied", prose)  # a hint for a person, never a verdict
    assert "只是提示" in section(report["zh"], "duplicates")


def test_students_not_graded_normally_are_listed_with_their_reason(report):
    table = cells(section(report["en"], "not-graded"), "not-graded")
    assert table == [["dave", "crashed", STATUS["dave"][1]], ["erin", "empty", STATUS["erin"][1]]]


def test_every_students_scores(report):
    table = cells(section(report["en"], "scores"), "scores")
    assert [row[0] for row in table] == ["alice", "bob", "carol", "dave", "erin"]
    assert {row[0]: row[2:] for row in table} == {
        "alice": ["8", "4", "12"], "bob": ["4", "6", "10"], "carol": ["6", "2", "8"],
        "dave": ["4", "6", "10"], "erin": ["0", "0", "0"]}


def test_plots_are_inlined_svg_with_ids_unique_on_the_page(report):
    html = report["en"]
    assert html.count("<svg ") == 4  # per module: the scores' histogram and the checks' pass rates
    assert "<?xml" not in html and "<metadata>" not in html and "dc:date" not in html.lower()
    ids = re.findall(r'\bid="([^"]+)"', html)
    assert len(ids) == len(set(ids)), sorted({i for i in ids if ids.count(i) > 1})
    for target in re.findall(r'(?:href="#|url\(#)([^")]+)', html):
        assert target in ids, target


def test_same_inputs_give_the_same_bytes(report, tmp_path):
    again = write_class_report(synthetic_class(tmp_path / "graded"))
    assert [p.read_bytes() for p in again] == [p.read_bytes() for p in report["written"]]
    assert (again[0].parent / "class.css").read_bytes() == (report["folder"] / "class.css").read_bytes()


def test_chinese_page_is_written_in_chinese(report):
    en, zh = report["en"], report["zh"]
    assert '<html lang="zh-Hans">' in zh and 'href="class.html"' in zh and 'href="class.zh.html"' in en
    cjk = re.compile(r"[\u4e00-\u9fff]")
    headings = re.findall(r"<(h1|h2|h3|th|summary|dt|p)\b[^>]*>(.*?)</\1>", zh, re.DOTALL)
    for tag, inner in headings:
        words = re.sub(r"<code>.*?</code>|<svg.*?</svg>|<[^>]+>", "", inner, flags=re.DOTALL).strip()
        words = re.sub(r"\b[A-Z]\d\d\b|KV Lab|[\d/#.·:—\s]+", "", words)  # ids, numbers and the kit's name
        assert not words or cjk.search(words), f"<{tag}> not in Chinese: {words!r}"
    assert "被点名的错误" in zh and "全部学生的分数" in zh and "未正常评分" in zh
    assert "在输入 dtype 里做平方和求均值" in zh  # the mistake's title from its Chinese pitfall
    assert "Named mistakes" not in zh and "Every student" not in zh


def test_a_file_that_cannot_be_read_is_a_row_not_the_end_of_the_report(tmp_path):
    folder = synthetic_class(tmp_path / "graded")
    (folder / "frank").mkdir()
    (folder / "frank" / "graded.json").write_text('{"student": "frank", "status": "gra')  # cut short
    html = write_class_report(folder)[0].read_text()
    assert re.search(r'id="student-count">6<', html)
    frank = [row for row in cells(section(html, "not-graded"), "not-graded") if row[0] == "frank"]
    assert frank and frank[0][1] == "unreadable" and frank[0][2].startswith("graded.json could not be read")
