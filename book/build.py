"""Build the book: every exercise page as static HTML, in English and Simplified Chinese.

    ./check.sh book                 writes .kvlab/book/index.html (English) and .kvlab/book/zh/index.html
    ./check.sh book --out DIR       anywhere else

The folder opens from disk with no server and no network: one CSS file, no scripts, math as MathML,
hints folded with <details>. What a page shows is read when the book is built: the text from
`exercises/`, the contract from `mine/`, the toy's numbers from `solutions/` run on `toy_cases/`, the
mistakes from the catalogue in `checks/mutants/`, and the learner's last results from
`.kvlab/results.json` (written by `./check.sh`).
"""

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from jinja2 import Environment, FileSystemLoader, StrictUndefined, pass_context, select_autoescape
from markupsafe import Markup

from book import IMPORTED_AT, markup, pages, progress, toys
from book import contract as contracts
from book.i18n import (
    DIFFICULTY,
    HINT_LEVELS,
    HTML_LANG,
    LANGUAGE_NAMES,
    SECTION_TITLES,
    STATUS,
    TRACK_BLURBS,
    TRACKS,
    UI,
    T,
    text,
)
from checks.harness.loader import ROOT, display
from checks.harness.modules import modules

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = ROOT / ".kvlab" / "book"
RESULTS = ROOT / ".kvlab" / "results.json"
HINTS_OPENED = ROOT / ".kvlab" / "hints.json"  # written by `./check.sh MODULE --hint`
MARKER = ".kvlab-book"  # marks a folder the build may replace whole; any other non-empty folder is refused
TRACK_ORDER = ("M", "P")
HINTS = ("Hints L1", "Hints L2", "Hints L3")


class NotABookFolder(Exception):
    """--out names a folder with other files in it: the build replaces its folder whole, so it refuses."""


@dataclass
class Entry:
    """One module as the book lists it."""

    stem: str
    meta: dict  # the English page's front matter (empty when the page is not written yet)
    sources: dict[str, pages.Source]  # lang -> the page's text in that language, where written
    status: progress.Status
    toy: toys.ComputedToy | None = None
    contract: contracts.Contract | None = None
    hints_opened: tuple = ()  # the hint levels the learner opened with ./check.sh --hint

    @property
    def id(self) -> str:
        return self.meta.get("id", self.stem.split("_", 1)[0])

    @property
    def track(self) -> str:
        return self.meta.get("track", self.id[:1].upper())

    @property
    def minutes(self) -> int:
        return int(self.meta.get("minutes", 0) or 0)

    @property
    def difficulty(self) -> str:
        return str(self.meta.get("difficulty", ""))

    @property
    def has_page(self) -> bool:
        return "en" in self.sources

    def title(self, lang: str) -> str:
        source = self.sources.get(lang) or self.sources.get("en")
        return (source.meta.get("title") if source else None) or self.meta.get("title") or self.stem

    def summary(self, lang: str) -> str:
        source = self.sources.get(lang) or self.sources.get("en")
        return (source.meta.get("summary") if source else None) or ""

    @property
    def href(self) -> str:
        """The page, relative to the index of the same language (both live in one folder)."""
        return f"{self.stem}.html"


@dataclass
class Built:
    out: Path
    seconds: float
    files: list[Path] = field(default_factory=list)
    entries: list[Entry] = field(default_factory=list)

    @property
    def index(self) -> Path:
        return self.out / "index.html"


# ---- collecting what the book shows --------------------------------------------------------------------


def collect(results: Path, hints: Path = HINTS_OPENED) -> list[Entry]:
    state = progress.read_results(results)
    opened = progress.read_results(hints)
    stems = sorted({m.stem for m in modules()} | set(pages.stems_with_pages(ROOT)))
    entries = []
    for stem in stems:
        sources = {lang: s for lang in pages.LANGUAGES if (s := pages.load(ROOT, stem, lang)) is not None}
        meta = sources["en"].meta if "en" in sources else {}
        entry = Entry(stem, meta, sources, progress.status_of(state.get(stem)),
                      hints_opened=tuple(n for n in opened.get(stem, []) if n in (1, 2, 3)))
        if entry.has_page:
            entry.toy = toys.compute(stem)
            entry.contract = contracts.contract(ROOT, stem)
        entries.append(entry)
    return sorted(entries, key=lambda e: (_track_rank(e.track), e.id))


def _track_rank(track: str) -> int:
    return TRACK_ORDER.index(track) if track in TRACK_ORDER else len(TRACK_ORDER)


def tracks(entries: list[Entry]) -> list[dict]:
    """The index's groups: the two tracks always (a track may be empty while its modules are written)."""
    names = list(TRACK_ORDER) + sorted({e.track for e in entries} - set(TRACK_ORDER))
    found = []
    for name in names:
        members = [e for e in entries if e.track == name]
        done = [e for e in members if e.status.kind == "done"]
        found.append({
            "id": name, "title": TRACKS.get(name, T(f"Track {name}", f"Track {name}")), "blurb": TRACK_BLURBS.get(name),
            "entries": members, "done": len(done), "total": len(members),
            "minutes": sum(e.minutes for e in members), "minutes_done": sum(e.minutes for e in done),
        })
    return found


# ---- rendering -----------------------------------------------------------------------------------------


@pass_context
def _translate(context, value) -> str:
    return text(value, context["lang"])


def environment() -> Environment:
    env = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(["html"]),
                      undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    env.filters["t"] = _translate
    env.globals.update(UI=UI, SECTION_TITLES=SECTION_TITLES, HINT_LEVELS=HINT_LEVELS, DIFFICULTY=DIFFICULTY,
                       LANGUAGE_NAMES=LANGUAGE_NAMES, HTML_LANG=HTML_LANG, T=T)
    return env


def status_text(status: progress.Status) -> T:
    return STATUS[status.kind].format(passed=status.passed, checks=status.checks)


def render_sections(source: pages.Source) -> dict[str, dict]:
    """Section name -> {"html", "anchors"} for one page's text."""
    rendered = {}
    for name, body in source.sections.items():
        html = markup.to_html(body, where=display(source.path))
        anchors: list[str] = []
        if name == "Pitfalls":
            html, anchors = markup.anchor_pitfalls(html)
        rendered[name] = {"html": Markup(html), "anchors": anchors}
    return rendered


def page_context(entry: Entry, lang: str, entries: list[Entry]) -> dict:
    source = entry.sources.get(lang) or entry.sources["en"]
    sections = render_sections(source)
    pitfall_ids = sections.get("Pitfalls", {}).get("anchors", [])
    by_id = {e.id: e for e in entries}
    depends = [{"id": d, "entry": by_id.get(d)} for d in entry.meta.get("depends_on", [])]
    listed = [e for e in entries if e.has_page]
    position = listed.index(entry)
    blocks = []  # what the page shows, in order: sections, "contract" after the first, "hints" for L1-L3
    for name in pages.SECTIONS:
        if name in HINTS:
            if name in sections and "hints" not in blocks:
                blocks.append("hints")
        elif name in sections:
            blocks.append(name)
    blocks.insert(1 if blocks else 0, "contract")
    blocks += source.extra_sections
    titles = {"contract": UI["contract"], "hints": SECTION_TITLES["Hints L1"]}
    toc = [(pages.slug(b), titles.get(b) or SECTION_TITLES.get(b) or b) for b in blocks]
    return {
        "entry": entry, "source": source, "sections": sections, "blocks": blocks,
        "hints": [h for h in HINTS if h in sections], "toc": toc, "explain": explain,
        "opened": entry.hints_opened,
        "track_title": TRACKS.get(entry.track, T(f"Track {entry.track}", f"Track {entry.track}")),
        "translated": source.lang == lang, "pitfall_ids": pitfall_ids, "depends": depends,
        "previous": listed[position - 1] if position > 0 else None,
        "next": listed[position + 1] if position + 1 < len(listed) else None,
        "status": entry.status, "status_text": status_text(entry.status), "slug": pages.slug,
        "file": entry.meta.get("file", f"{entry.stem}.py"), "check": entry.meta.get("check", f"./check.sh {entry.id}"),
    }


def explain(hidden: toys.Hidden) -> T:
    """What a larger case shows of a mistake the toy cannot show."""
    if hidden.error:
        return UI["mutant_unavailable"].format(error=hidden.error)
    if hidden.scenario is None:
        return UI["invisible_nowhere"]
    return T("; ".join(d.evidence.en for d in hidden.differences), "；".join(d.evidence.zh for d in hidden.differences))


def write(path: Path, html: str, built: Built) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(html, encoding="utf-8")
    built.files.append(path)


def build(out: Path | None = None, results: Path | None = None, hints: Path | None = None) -> Built:
    """Render every page in both languages into `out` (replaced whole), and return what was written. The
    progress and the opened hints come from `results` and `hints` (by default the learner's own, in .kvlab)."""
    started = time.perf_counter()
    out = Path(out or DEFAULT_OUT)
    entries = collect(Path(results or RESULTS), Path(hints or HINTS_OPENED))
    env = environment()
    if out.exists() and any(out.iterdir()):
        if not (out / MARKER).is_file():
            raise NotABookFolder(f"{out} is not empty and was not written by ./check.sh book: pick a new folder")
        shutil.rmtree(out)
    out.mkdir(parents=True)
    (out / MARKER).write_text("Written by ./check.sh book, and replaced whole by the next build.\n")
    built = Built(out, 0.0, entries=entries)
    groups = tracks(entries)
    for lang in pages.LANGUAGES:
        folder = out if lang == "en" else out / lang
        common = {"lang": lang, "root": "" if lang == "en" else "../", "other_lang": "zh" if lang == "en" else "en"}
        other = "zh/index.html" if lang == "en" else "../index.html"
        index = env.get_template("index.html").render(**common, tracks=groups, status_text=status_text,
                                                      other_href=other)
        write(folder / "index.html", index, built)
        for entry in entries:
            if not entry.has_page:
                continue
            other = f"zh/{entry.stem}.html" if lang == "en" else f"../{entry.stem}.html"
            context = page_context(entry, lang, entries)
            html = env.get_template("page.html").render(**common, **context, other_href=other)
            write(folder / f"{entry.stem}.html", html, built)
    shutil.copyfile(HERE / "static" / "book.css", out / "book.css")
    built.files.append(out / "book.css")
    built.seconds = time.perf_counter() - started
    return built


def main(out: str | None = None) -> int:
    """`./check.sh book`: build, then say where the book is and how long it took."""
    try:
        built = build(Path(out).resolve() if out else None)
    except (markup.MarkupError, toys.ToyDrift, NotABookFolder) as error:
        print(f"./check.sh book: {error}")
        return 1
    seconds = time.perf_counter() - IMPORTED_AT
    modules_shown = sum(1 for e in built.entries if e.has_page)
    print(f"Built the book in {seconds:.1f} s: {modules_shown} module pages in English and Chinese.")
    print(f"Open {built.index.as_uri()}")
    print(f"  中文: {(built.out / 'zh' / 'index.html').as_uri()}")
    return 0
