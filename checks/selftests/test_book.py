"""The book builds, shows what the checks use, and holds together as a folder of static pages."""

import functools
import re
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from jinja2 import StrictUndefined

from book import build as book
from book import contract as contracts
from book import markup, pages, progress, toys
from book.i18n import SECTION_TITLES, UI, T, text
from checks.harness.loader import ROOT, named
from checks.harness.mistakes import catalogue
from checks.harness.stubs import stub_for
from checks.harness.toys import load_toy

STEMS = pages.stems_with_pages(ROOT)
ZH_STEMS = sorted(p.stem for p in (ROOT / "exercises" / "zh").glob("*.md"))


class Parsed(HTMLParser):
    """What the tests read from a built page: ids, links, resources, and the computed toy tables."""

    def __init__(self, path: Path):
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[str] = []
        self.resources: list[tuple[str, str]] = []  # (tag, address) of everything the page loads
        self.tables: dict[str, list[dict]] = {}
        self.details: list[dict] = []
        self._table = None
        self._row = None
        self._cell = None
        self._line = None
        self.feed(path.read_text(encoding="utf-8"))

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a:
            self.ids.add(a["id"])
        if tag == "a" and "href" in a:
            self.links.append(a["href"])
        if tag in ("link", "script", "img", "iframe", "source", "object", "embed"):
            self.resources.append((tag, a.get("href") or a.get("src") or ""))
        if tag == "details":
            self.details.append(a)
        if tag == "table" and "data-toy" in a:
            self._table = self.tables.setdefault(a["data-toy"], [])
        elif tag == "tr" and self._table is not None:
            self._row = {"attrs": a, "cells": []}
            self._table.append(self._row)
        elif tag == "td" and self._row is not None:
            self._cell = {"attrs": a, "lines": []}
            self._row["cells"].append(self._cell)
        elif tag == "span" and self._cell is not None and "line" in a.get("class", "").split():
            self._line = []

    def handle_endtag(self, tag):
        if tag == "span" and self._line is not None:
            self._cell["lines"].append("".join(self._line))
            self._line = None
        elif tag == "td":
            self._cell = None
        elif tag == "tr":
            self._row = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data):
        if self._line is not None:
            self._line.append(data)

    def rows(self, table: str) -> list[list[list[str]]]:
        """The body rows of a computed table: cells as lists of lines."""
        return [[c["lines"] for c in r["cells"]] for r in self.tables[table] if r["cells"]]


def page(built: book.Built, stem: str, lang: str = "en") -> Path:
    return built.out / ("" if lang == "en" else lang) / f"{stem}.html"


def all_html(built: book.Built) -> list[Path]:
    return sorted(built.out.rglob("*.html"))


# ---- the build --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stem", STEMS)
def test_every_exercise_renders_in_both_languages(built, stem):
    source = pages.load(ROOT, stem, "en")
    for lang in ("en", "zh"):
        html = page(built, stem, lang).read_text(encoding="utf-8")
        parsed = Parsed(page(built, stem, lang))
        assert f"<title>{source.meta['id'].upper()} · " in html
        assert source.meta["check"] in html and f"mine/{source.meta['file']}" in html
        for name in pages.SECTIONS:
            if name.startswith("Hints"):
                assert pages.slug(name) in parsed.ids, f"{lang}: hint {name} missing"
            else:
                assert pages.slug(name) in parsed.ids, f"{lang}: section {name} missing"
                assert f">{SECTION_TITLES[name](lang)}</h2>" in html
        assert "contract" in parsed.ids and "computed-toy" in parsed.ids
        for missing in (UI["no_adapter"], UI["toy_unavailable"]):  # every page's toy is computed at build time
            words = missing(lang).split(":")[0]
            assert words not in html, f"{lang}: the toy is not computed ({words})"


def test_templates_are_strict_and_nothing_is_left_unrendered(built):
    assert book.environment().undefined is StrictUndefined
    for path in all_html(built):
        html = path.read_text(encoding="utf-8")
        for leftover in ("{{", "}}", "{%", "%}", "{#", "T(en="):
            assert leftover not in html, f"{path.name}: {leftover!r} left in the page"


def test_pages_are_offline_and_static(built):
    for path in all_html(built):
        parsed = Parsed(path)
        assert [tag for tag, _ in parsed.resources] == ["link"], f"{path.name} loads {parsed.resources}"
        for _, address in parsed.resources:
            assert "://" not in address and not address.startswith("//")


def test_internal_links_resolve(built):
    checked = 0
    parsed = functools.cache(Parsed)  # each page read once, however many links point into it
    for path in all_html(built):
        for href in parsed(path).links + [a for _, a in parsed(path).resources]:
            assert not href.startswith(("http:", "https:", "//")), f"{path.name} links out: {href}"
            target, _, anchor = href.partition("#")
            file = (path.parent / target).resolve() if target else path
            assert file.is_file(), f"{path.relative_to(built.out)}: {href} does not exist"
            if anchor:
                assert anchor in parsed(file).ids, f"{path.relative_to(built.out)}: #{anchor} not in {file.name}"
            checked += 1
    assert checked > 50


def test_every_page_links_to_the_same_page_in_the_other_language(built):
    for stem in STEMS + ["index"]:
        en, zh = built.out / f"{stem}.html", built.out / "zh" / f"{stem}.html"
        assert f'class="lang-switch" href="zh/{stem}.html"' in en.read_text(encoding="utf-8")
        assert f'class="lang-switch" href="../{stem}.html"' in zh.read_text(encoding="utf-8")
        assert '<html lang="zh-Hans">' in zh.read_text(encoding="utf-8")


def test_opened_hints_are_marked(built):
    """The levels a learner opened with `./check.sh MODULE --hint` (test_cli checks the file it writes, and
    the book reads that very file unless told another)."""
    from checks.__main__ import HINTS

    assert book.HINTS_OPENED == HINTS and book.collect.__defaults__ == (HINTS,)
    html = page(built, "m03_rope").read_text(encoding="utf-8")
    assert 'class="hint level-1 opened"' in html and 'class="hint level-2 opened"' in html
    assert 'class="hint level-3"' in html
    assert 'class="hint level-1 opened"' not in page(built, "m02_thinker_attention").read_text(encoding="utf-8")


def test_hints_are_folded_and_levelled(built):
    parsed = Parsed(page(built, "m02_thinker_attention"))
    hints = [d for d in parsed.details if "hint" in d.get("class", "")]
    assert [d["id"] for d in hints] == ["hints-l1", "hints-l2", "hints-l3"]
    assert all("open" not in d for d in hints)


def test_math_is_mathml(built):
    html = page(built, "m02_thinker_attention").read_text(encoding="utf-8")
    assert html.count("<math ") >= 3 and 'display="block"' in html
    assert "$$" not in html


def test_pages_without_chinese_text_say_so_in_chinese(built):
    note = UI["pending_translation"]("zh")
    for stem in STEMS:
        html = page(built, stem, "zh").read_text(encoding="utf-8")
        assert (note in html) == (stem not in ZH_STEMS)


def test_build_command_prints_the_index_and_its_time(tmp_path, capsys, monkeypatch, built):
    toys_of = {entry.stem: entry.toy for entry in built.entries if entry.has_page}
    monkeypatch.setattr(book.toys, "compute", toys_of.__getitem__)  # computed once, by `built`
    assert book.main(str(tmp_path / "book")) == 0
    out = capsys.readouterr().out
    assert re.search(r"Built the book in \d+\.\d s", out) and (tmp_path / "book" / "index.html").as_uri() in out
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "notes.txt").write_text("mine")
    assert book.main(str(tmp_path / "elsewhere")) == 1  # never replaces a folder it did not write
    assert (tmp_path / "elsewhere" / "notes.txt").read_text() == "mine"


# ---- numbers: the computed toys are the reference's -------------------------------------------------------


def _m02_reference_rows(sizes: list[int] | None) -> list[list[str]]:
    """Run solutions/ on the toy as the checks do (fp32), call by call: the rows each call returns."""
    stem = "m02_thinker_attention"
    ref, toy = named("solutions").load(stem), load_toy(stem)
    w = SimpleNamespace(**{k: torch.tensor(v) if isinstance(v, list) else v for k, v in toy["weights"].items()})
    x, cos, sin = (torch.tensor(toy[k]) for k in ("x", "cos", "sin"))
    if sizes is None:
        return [[toys.vector(r) for r in ref.attention_forward(w, x, cos, sin)]]
    cache, start, calls = ref.KVCache(), 0, []
    for size in sizes:
        rows = slice(start, start + size)
        calls.append([toys.vector(r) for r in ref.attention_forward(w, x[rows], cos[rows], sin[rows], cache)])
        start += size
    return calls


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_m02_toy_tables_are_what_the_reference_computes(built, lang):
    parsed = Parsed(page(built, "m02_thinker_attention", lang))
    whole = _m02_reference_rows(None)[0]
    assert [row[-1][0] for row in parsed.rows("prefill")] == whole
    toy = load_toy("m02_thinker_attention")
    expected_calls = _m02_reference_rows(None) + _m02_reference_rows(toy["split"]) + _m02_reference_rows([1, 1, 1])
    assert [row[2] for row in parsed.rows("feedings")] == expected_calls
    assert [row[1][0] for row in parsed.rows("feedings")] == ["0", "0", "2", "0", "1", "2"]  # past, per call
    assert whole == [toys.vector(r) for r in toy["shown_on_page"]]  # and the toy file agrees


def test_m02_mistake_outputs_are_the_mutants_and_the_toy_file(built):
    parsed = Parsed(page(built, "m02_thinker_attention"))
    got = {r["attrs"]["data-mistake"]: r["cells"][2]["lines"] for r in parsed.tables["mistakes"] if r["cells"]}
    for mistake_id, entry in load_toy("m02_thinker_attention")["mistakes"].items():
        assert got[mistake_id] == [toys.vector(r) for r in entry["output"]], mistake_id
    shown = set(got)
    hidden = {r["attrs"]["data-mistake"] for r in parsed.tables["invisible"] if r["cells"]}
    assert shown | hidden == {m.id for m in catalogue("m02_thinker_attention").mistakes} and not shown & hidden


def test_m01_toy_tables_are_what_the_reference_computes(built):
    parsed = Parsed(page(built, "m01_rmsnorm"))
    ref, toy = named("solutions").load("m01_rmsnorm"), load_toy("m01_rmsnorm")
    expected = [toys.vector(r) for case in toy["rms_norm"]
                for r in ref.rms_norm(torch.tensor(case["x"]), torch.tensor(case["weight"]), case["eps"])]
    assert [row[-1][0] for row in parsed.rows("rms_norm")] == expected
    got = {r["attrs"]["data-mistake"]: r["cells"][2]["lines"] for r in parsed.tables["mistakes"] if r["cells"]}
    stored = toy["rms_norm"][1]["mistakes"]["eps-outside-sqrt"]
    assert got["eps-outside-sqrt"] == [toys.vector(r) for r in stored]


def test_every_table_shows_exactly_the_computed_data(built):
    """The HTML of every computed table is its data, cell for cell, in both languages."""
    for entry in built.entries:
        if not (entry.toy and entry.toy.available):
            continue
        for lang in ("en", "zh"):
            parsed = Parsed(page(built, entry.stem, lang))
            for table in entry.toy.tables:
                want = [[[text(line, lang) for line in cell.lines] for cell in row] for row in table.rows]
                assert parsed.rows(table.id) == want, f"{entry.stem} {lang}: table {table.id}"


def test_number_format():
    assert [toys.number(v) for v in (1.0, 0.19557, -0.0, 1e-6, 12.5, -1.56789, 0.0004321)] == \
        ["1", "0.1956", "0", "1e-6", "12.5", "-1.5679", "4.321e-4"]


# ---- progress, contract, and modules still being written ---------------------------------------------------


def test_progress_on_the_index_and_the_pages(built):
    index = (built.out / "index.html").read_text(encoding="utf-8")
    assert 'pill status-done">done<' in index and "17 of 29 passed" in index
    track_m = [e for e in built.entries if e.track == "M"]
    assert f"1 of {len(track_m)} modules done · 25 of {sum(e.minutes for e in track_m)} min" in index
    assert "17 of 29 passed" in page(built, "m02_thinker_attention").read_text(encoding="utf-8")
    assert "通过 17/29" in page(built, "m02_thinker_attention", "zh").read_text(encoding="utf-8")


def test_status_words():
    assert progress.status_of(None).kind == "never" and progress.status_of({"checks": "x"}).kind == "never"
    assert progress.status_of({"checks": 3, "passed": 0, "not_started": 3}).kind == "not-started"
    assert progress.status_of({"checks": 3, "passed": 1, "not_started": 0}).kind == "partial"
    assert progress.status_of({"checks": 3, "passed": 3, "not_started": 0}).kind == "done"
    assert progress.read_results(Path("/nonexistent/results.json")) == {}


def test_contract_comes_from_mine_or_from_the_stub(tmp_path, built):
    stem = "m02_thinker_attention"
    html = page(built, stem).read_text(encoding="utf-8")
    ours = contracts.contract(ROOT, stem)
    assert ours is not None and [p.name for p in ours.functions] == ["attention_forward"]
    assert "def attention_forward(" in html and "raise NotImplementedError" not in html
    assert "Causal GQA self-attention over the cached tokens and T new ones." in html
    (tmp_path / "solutions").mkdir()
    (tmp_path / "mine").mkdir()
    (tmp_path / "solutions" / f"{stem}.py").write_text((ROOT / "solutions" / f"{stem}.py").read_text())
    (tmp_path / "mine" / f"{stem}.py").write_text(stub_for(ROOT, stem).replace(
        'raise NotImplementedError("attention_forward (mine/m02_thinker_attention.py) is not written yet")',
        "return x  # my first try"))
    edited = contracts.contract(tmp_path, stem)
    assert edited.origin == "stub" and edited.pieces == contracts.pieces_of(stub_for(ROOT, stem))
    assert "my first try" not in "".join(p.code for p in edited.pieces)


def test_a_module_without_a_computed_toy_still_gets_its_page():
    assert toys.compute("x99_not_a_module").available is False
    source = pages.Source("x99_new", "en", ROOT / "exercises" / "x99_new.md",
                          {"id": "x99", "title": "A module being written", "track": "P", "minutes": 30},
                          {"Statement": "Write `f`.", "Toy": "Not yet.", "Hints L1": "Think."}, ["Pitfalls"])
    entry = book.Entry("x99_new", source.meta, {"en": source}, progress.status_of(None),
                       toys.compute("x99_new"), None)
    html = book.environment().get_template("page.html").render(
        lang="zh", root="../", other_lang="en", other_href="../x99_new.html", **book.page_context(entry, "zh", [entry]))
    assert "A module being written" in html and UI["no_adapter"]("zh") in html
    assert UI["contract_missing"]("zh") in html and UI["pending_translation"]("zh") in html
    assert 'id="hints-l1"' in html and 'id="hints-l2"' not in html
    assert UI["missing"]("zh") in html and SECTION_TITLES["Pitfalls"]("zh") in html


def test_math_and_code_in_markdown():
    html = markup.to_html("Costs $5 and $6; $x^2$ here, `$not math$` there.\n\n$$a = b$$")
    assert html.count("<math") == 2 and "<code>$not math$</code>" in html and "Costs $5 and $6" in html
    with pytest.raises(markup.MarkupError, match="page.md"):
        markup.to_html(r"$\left( x$", where="page.md")


# ---- the Chinese pages ------------------------------------------------------------------------------------


@pytest.mark.parametrize("stem", ZH_STEMS)
def test_chinese_page_matches_the_english_one(stem):
    """Same front matter (ids, file, check command, numbers), the same 12 sections, the same pitfall ids."""
    english, chinese = pages.load(ROOT, stem, "en"), pages.load(ROOT, stem, "zh")
    assert english is not None, f"exercises/zh/{stem}.md has no English page"
    for key in ("id", "track", "minutes", "difficulty", "depends_on", "file", "check"):
        assert chinese.meta.get(key) == english.meta[key], key
    assert chinese.meta["title"] and chinese.meta["summary"]
    assert list(chinese.sections) == pages.SECTIONS
    pitfalls = re.findall(r"^- `([a-z0-9-]+)`[:：]", chinese.sections["Pitfalls"], re.M)
    assert sorted(pitfalls) == sorted(m.id for m in catalogue(stem).mistakes)
    assert re.search(r"[\u4e00-\u9fff]", chinese.sections["Statement"])


def test_ui_has_both_languages():
    from book import i18n

    for table in (i18n.UI, i18n.SECTION_TITLES, i18n.STATUS, i18n.TRACKS, i18n.DIFFICULTY):
        for key, value in table.items():
            assert isinstance(value, T) and value.en and value.zh, key
