"""The class report: what a whole class got right and wrong, as one offline HTML page per language.

`./check.sh grade-class SUBMISSIONS --out DIR` grades every student's folder into `DIR/<student>/`
(`graded.json`, and `checks.json` where the code ran) and then calls `write_class_report(DIR)`, which
writes `DIR/class.html` and `DIR/class.zh.html` beside one stylesheet, `DIR/class.css` (the book's own,
plus the report's few rules): the pages open from disk with no server, no script and no network.

What a page shows, read from those files alone: how many students and in which state; per module the
spread of its score (a histogram), each check's pass rate (a check passes for a student when every
case of it that was not skipped passed) and the catalogued mistakes ranked by how many students made
them, each linked to its Pitfalls entry in the built book; groups of students whose normalised source
of one file is identical (a hint for a person to look, never a verdict); the students not graded
normally; and every student's scores. The plots are SVG drawn by matplotlib and inlined, byte for byte
the same for the same inputs (a fixed hash salt, no date).
"""

import dataclasses
import io
import json
import math
import re
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib
from markupsafe import Markup
from matplotlib.figure import Figure  # a Figure without pyplot: no backend with a display, no global state

from book import markup, pages
from book.build import environment
from book.i18n import T, text
from checks.harness.loader import ROOT
from checks.harness.mistakes import catalogue
from checks.harness.modules import modules
from checks.harness.report import SHOWN_MISTAKES, Result, rank_mistakes

HERE = Path(__file__).resolve().parent
RESULT_FIELDS = {f.name for f in dataclasses.fields(Result)}
PAGES = {"en": "class.html", "zh": "class.zh.html"}
STYLESHEET = "class.css"
RAN = ("graded", "crashed", "hung")  # statuses whose code ran: they have checks.json and scores
STATUS_ORDER = ("graded", "crashed", "hung", "empty", "grader-error", "unreadable")
HISTOGRAM_BINS = 10  # at most; a module worth fewer points gets one bin per point
TITLE_WIDTH = 60  # characters of a check's title on the pass-rate chart (the folded table has it whole)

# The report's own words. Check titles and mistake ids stay as the checks name them in both pages; the
# plots' labels are English and ids in both.
TEXT = {
    "title": T("Class report", "全班报告"),
    "book": T("KV Lab — the book", "KV Lab 练习册"),
    "other_language": T("中文", "English"),
    "contents": T("On this page", "本页目录"),
    "overview": T("Overview", "概况"),
    "lead": T("What {students} got right and wrong, from the grader's results in this folder.",
              "根据本文件夹里的评分结果，汇总 {students}做对和做错的地方。"),
    "students": T("Students", "学生人数"),
    "mean_total": T("Mean total", "总分均值"),
    "median_total": T("Median total", "总分中位数"),
    "of_points": T("of {points}", "满分 {points}"),
    "over_ran": T("Scores, pass rates and mistakes are over the {students} whose code ran (graded, crashed "
                  "or hung); the others score 0 and are listed under “Not graded normally”.",
                  "分数、通过率和错误统计只计入代码实际运行过的 {students}（已评分、崩溃或超时）；"
                  "其余学生记 0 分，列在“未正常评分”一节。"),
    "module": T("Module", "模块"),
    "mean": T("Mean", "均值"),
    "median": T("Median", "中位数"),
    "max": T("Of", "满分"),
    "full_marks": T("Full marks", "满分人数"),
    "mistakes_named": T("Mistakes named", "被点名的错误数"),
    "module_stats": T("Mean {mean}, median {median} of {max} points over {students}.",
                      "{students}的均值 {mean}，中位数 {median}，满分 {max}。"),
    "histogram": T("Scores", "分数分布"),
    "histogram_alt": T("Histogram of {module}'s scores: students per score range",
                       "{module} 的分数直方图：各分数段的学生人数"),
    "pass_rates": T("Pass rate per check", "每项检查的通过率"),
    "pass_rates_alt": T("Pass rate of each check of {module}", "{module} 每项检查的通过率"),
    "pass_rates_note": T("A check passes for a student when every case of it that was not skipped passed.",
                         "一项检查对某名学生算作通过，当且仅当它所有未被跳过的用例都通过。"),
    "pass_rates_table": T("The same as a table", "以表格显示"),
    "check": T("Check", "检查"),
    "function": T("Function", "测试函数"),
    "passed": T("Passed", "通过"),
    "rate": T("Rate", "通过率"),
    "mistakes": T("Named mistakes", "被点名的错误"),
    "mistakes_note": T("Mistakes from the catalogue that failing checks matched, by how many students made each "
                       "(a student counts once per mistake). Each id links to its pitfall in the book.",
                       "未通过的检查所匹配到的目录中的已知错误，按犯错学生人数排序（同一错误每名学生只计一次）。"
                       "每个 id 都链接到练习册里对应的易错点。"),
    "no_mistakes": T("No catalogued mistake was named in this module.", "这个模块里没有点名任何已知错误。"),
    "rank": T("#", "#"),
    "mistake": T("Mistake", "错误"),
    "count": T("Students", "人数"),
    "who": T("Who", "名单"),
    "no_checks": T("No results for this module.", "这个模块没有检查结果。"),
    "duplicates": T("Identical sources", "源码完全相同"),
    "duplicates_note": T(
        "These students' normalised source of the same file is identical. This is only a hint for a person to "
        "look at: identical code has innocent causes too (a short module, a shared starting point, the same "
        "worked example). Read the code and talk to the students before drawing any conclusion.",
        "下面这些学生同一个文件的规范化源码完全相同。这只是提示，需要由人去查看：代码相同也可能有正当原因"
        "（模块很短、起点相同、参照了同一个示例）。请先阅读代码、与学生沟通，再下任何结论。"),
    "no_duplicates": T("No two students share the normalised source of a file.",
                       "没有两名学生的同一文件规范化源码完全相同。"),
    "file": T("File", "文件"),
    "sharing": T("Students", "学生"),
    "fingerprint": T("Source hash", "源码哈希"),
    "not_graded": T("Not graded normally", "未正常评分"),
    "not_graded_note": T("Crashed and hung students were still graded: what passed before it counts.",
                         "崩溃和超时的学生仍然评了分：出问题之前通过的检查照样计分。"),
    "all_graded": T("Every student was graded normally.", "所有学生都正常评分。"),
    "student": T("Student", "学生"),
    "status": T("Status", "状态"),
    "reason": T("Reason", "原因"),
    "scores": T("Every student's scores", "全部学生的分数"),
    "total": T("Total", "总分"),
    "footer": T("Written by ./check.sh grade-class from the graded.json and checks.json files beside this page.",
                "由 ./check.sh grade-class 根据本页旁边的 graded.json 和 checks.json 生成。"),
    "unreadable_json": T("{file} could not be read: {error}", "无法读取 {file}：{error}"),
}
STATUS_NAMES = {
    "graded": T("graded", "已评分"),
    "crashed": T("crashed", "崩溃"),
    "hung": T("hung", "超时"),
    "empty": T("empty", "空提交"),
    "grader-error": T("grader error", "评分程序出错"),
    "unreadable": T("unreadable", "无法读取"),
}
LANG_ATTR = {"en": "en", "zh": "zh-Hans"}


def student_count(n: int) -> T:
    return T("1 student" if n == 1 else f"{n} students", f"{n} 名学生")


def say(words: T, **values) -> T:
    """`words` with `values` filled in, each value in the same language (a `T` or anything else)."""
    return T(words.en.format(**{k: text(v, "en") for k, v in values.items()}),
             words.zh.format(**{k: text(v, "zh") for k, v in values.items()}))


# The book's colours (book.css), so the plots sit in the page.
INK, MUTED, LINE, ACCENT = "#1d2330", "#6b7385", "#e3e6ec", "#2f5bd3"
GOOD, WARN, BAD = "#1d7a46", "#b06d00", "#b3261e"


# ---- reading the grader's files ------------------------------------------------------------------------


@dataclass
class Student:
    id: str
    status: str
    reason: str = ""
    seconds: float = 0.0
    scores: dict[str, float] = field(default_factory=dict)
    max: dict[str, float] = field(default_factory=dict)
    total: float = 0.0
    max_total: float = 0.0
    modules: list[str] = field(default_factory=list)
    sources: dict[str, str] = field(default_factory=dict)  # module file -> sha256 of its normalised source
    results: list[dict] = field(default_factory=list)  # checks.json's rows; [] where the code did not run

    @property
    def ran(self) -> bool:
        return self.status in RAN


def read_students(out: Path) -> list[Student]:
    """Every `out/*/graded.json`, with its `checks.json`; a file that cannot be read is a student marked
    "unreadable" (or a reason on a graded one), never the end of the report."""
    students = []
    for graded in sorted(out.glob("*/graded.json")):
        name = graded.parent.name
        try:
            data = json.loads(graded.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            students.append(Student(name, "unreadable", TEXT["unreadable_json"].format(
                file="graded.json", error=error).en))
            continue
        student = Student(
            id=str(data.get("student") or name), status=str(data.get("status", "unreadable")),
            reason=str(data.get("reason") or ""), seconds=float(data.get("seconds") or 0.0),
            scores={k: float(v) for k, v in (data.get("scores") or {}).items()},
            max={k: float(v) for k, v in (data.get("max") or {}).items()},
            total=float(data.get("total") or 0.0), max_total=float(data.get("max_total") or 0.0),
            modules=list(data.get("modules") or []), sources=dict(data.get("sources") or {}))
        checks = graded.parent / "checks.json"
        if checks.is_file():
            try:
                student.results = list(json.loads(checks.read_text(encoding="utf-8")).get("results") or [])
            except (OSError, ValueError, AttributeError) as error:
                student.reason = "; ".join(filter(None, [student.reason, TEXT["unreadable_json"].format(
                    file="checks.json", error=error).en]))
        students.append(student)
    return sorted(students, key=lambda s: s.id)


# ---- what the page shows -------------------------------------------------------------------------------


@dataclass
class CheckRate:
    function: str
    title: str
    passed: int
    students: int  # those who ran it (a check every case of which was skipped is not counted)

    @property
    def rate(self) -> float:
        return self.passed / self.students if self.students else 0.0


@dataclass
class MistakeCount:
    id: str
    title: T
    students: list[str]


@dataclass
class ModuleReport:
    stem: str
    id: str
    title: T
    max: float
    scores: list[float]  # one per student whose code ran
    checks: list[CheckRate]
    mistakes: list[MistakeCount]
    histogram: Markup = Markup("")
    pass_chart: Markup = Markup("")

    @property
    def mean(self) -> str:
        return number(statistics.mean(self.scores)) if self.scores else "—"

    @property
    def median(self) -> str:
        return number(statistics.median(self.scores)) if self.scores else "—"

    @property
    def full_marks(self) -> int:
        return sum(1 for score in self.scores if self.max and score >= self.max)


def module_order(students: list[Student]) -> list[str]:
    """The modules any student was graded on, in the kit's order (unknown ones after, by name)."""
    kit = [m.stem for m in modules()]
    seen = {stem for s in students for stem in [*s.modules, *s.scores, *s.max]}
    return [stem for stem in kit if stem in seen] + sorted(seen - set(kit))


def check_rates(stem: str, students: list[Student]) -> list[CheckRate]:
    """Per check (a test function of the module), how many students passed it of those who ran it."""
    order: dict[str, str] = {}  # function -> title, in the order the checks ran
    outcome: dict[str, dict[str, bool]] = defaultdict(dict)  # function -> student -> passed
    for student in students:
        cases: dict[str, list[str]] = defaultdict(list)
        for row in student.results:
            if row.get("module") != stem:
                continue
            function = row.get("function") or row.get("check", "")
            order.setdefault(function, row.get("check") or function)
            cases[function].append(row.get("status", ""))
        for function, statuses in cases.items():
            ran = [s for s in statuses if s != "skipped"]
            if ran:
                outcome[function][student.id] = all(s == "passed" for s in ran)
    return [CheckRate(f, title, sum(outcome[f].values()), len(outcome[f])) for f, title in order.items()
            if outcome[f]]


def mistake_titles(stem: str) -> dict[str, T]:
    """Mistake id -> its title: the catalogue's in English, the first sentence of its Chinese pitfall in
    Chinese (the English title where the Chinese page does not list it)."""
    try:
        english = {m.id: m.title for m in catalogue(stem).mistakes}
    except Exception:  # noqa: BLE001 - a module without a catalogue still gets its ids shown
        english = {}
    chinese = {}
    source = pages.load(ROOT, stem, "zh")
    if source is not None:
        for found in re.finditer(r"^[-*] `([a-z0-9][a-z0-9-]*)`[：:]\s*(.+)$", source.sections.get("Pitfalls", ""),
                                 re.MULTILINE):
            first = re.split(r"(?<=[。；])", found.group(2), maxsplit=1)[0]
            try:
                chinese[found.group(1)] = markup.to_html(first).strip().removeprefix("<p>").removesuffix("</p>")
            except markup.MarkupError:
                continue
    return {i: T(Markup.escape(english.get(i, "")), Markup(chinese[i]) if i in chinese else
                 Markup.escape(english.get(i, ""))) for i in set(english) | set(chinese)}


def as_result(row: dict) -> Result | None:
    """A checks.json row as the report's `Result`, or None when it lacks a field (a hand-edited file)."""
    try:
        return Result(**{k: v for k, v in row.items() if k in RESULT_FIELDS})
    except TypeError:
        return None


def mistake_counts(stem: str, students: list[Student]) -> list[MistakeCount]:
    """Per mistake, the students whose own report names it (the best-ranked ones, as `./check.sh` shows)."""
    who: dict[str, set[str]] = defaultdict(set)
    for student in students:
        rows = [result for row in student.results if row.get("module") == stem and isinstance(row.get("mistakes"), list)
                and (result := as_result(row)) is not None]
        for mistake in rank_mistakes(rows)[:SHOWN_MISTAKES] if rows else []:
            who[str(mistake)].add(student.id)
    titles = mistake_titles(stem) if who else {}
    ranked = sorted(who.items(), key=lambda item: (-len(item[1]), item[0]))
    return [MistakeCount(i, titles.get(i, T("", "")), sorted(names)) for i, names in ranked]


def module_title(stem: str) -> T:
    english = pages.load(ROOT, stem, "en")
    chinese = pages.load(ROOT, stem, "zh")
    en = (english.meta.get("title") if english else None) or stem
    return T(en, (chinese.meta.get("title") if chinese else None) or en)


def module_report(stem: str, students: list[Student]) -> ModuleReport:
    ran = [s for s in students if s.ran]
    top = max([s.max.get(stem, 0.0) for s in students] + [0.0])
    report = ModuleReport(stem, stem.split("_", 1)[0], module_title(stem), top,
                          [s.scores.get(stem, 0.0) for s in ran], check_rates(stem, ran), mistake_counts(stem, ran))
    report.histogram = histogram(report)
    report.pass_chart = pass_chart(report)
    return report


def duplicate_sources(students: list[Student], order: list[str]) -> list[dict]:
    """Groups of two or more students whose normalised source of one file is the same, in module order."""
    groups: dict[tuple[str, str], list[str]] = defaultdict(list)
    for student in students:
        for file, digest in student.sources.items():
            groups[(file, digest)].append(student.id)
    rank = {f"{stem}.py": n for n, stem in enumerate(order)}
    found = [{"file": file, "hash": digest, "students": sorted(names)}
             for (file, digest), names in groups.items() if len(names) > 1]
    return sorted(found, key=lambda g: (rank.get(g["file"], len(rank)), g["file"], -len(g["students"]), g["students"]))


# ---- plots ---------------------------------------------------------------------------------------------


def number(value: float) -> str:
    """17.5 -> "17.5", 20.0 -> "20", 2/3 -> "0.67"."""
    return f"{value:.2f}".rstrip("0").rstrip(".") if not math.isclose(value, round(value)) else str(round(value))


def svg(figure: Figure, name: str, label: str) -> Markup:
    """The figure as SVG to inline: the same bytes for the same figure (a hash salt of its own, no date), its
    ids prefixed with `name` so several plots can share one page, labelled for screen readers."""
    buffer = io.StringIO()
    with matplotlib.rc_context({"svg.hashsalt": f"kvlab-{name}", "svg.fonttype": "none"}):
        figure.savefig(buffer, format="svg", bbox_inches="tight", pad_inches=0.08, metadata={"Date": None})
    text = buffer.getvalue()
    text = text[text.index("<svg"):]
    text = re.sub(r"<metadata>.*?</metadata>\s*", "", text, flags=re.DOTALL)
    text = re.sub(r'\bid="([^"]+)"', lambda m: f'id="{name}-{m.group(1)}"', text)
    text = re.sub(r'(href="#|url\(#)([^")]+)', lambda m: f"{m.group(1)}{name}-{m.group(2)}", text)
    label = str(Markup.escape(label))
    text = text.replace("<svg ", f'<svg role="img" aria-label="{label}" class="plot" ', 1)
    return Markup(text.strip())


def _axes(figure: Figure):
    axes = figure.add_subplot()
    for side in ("top", "right"):
        axes.spines[side].set_visible(False)
    for side in ("left", "bottom"):
        axes.spines[side].set_color(MUTED)
    axes.tick_params(colors=INK, labelsize=8.5)
    return axes


def histogram(report: ModuleReport) -> Markup:
    """Students per score range, those with full marks in green on top of the last range; the median dashed."""
    if not report.scores:
        return Markup("")
    top = report.max or max(report.scores) or 1.0
    bins = max(1, min(HISTOGRAM_BINS, math.ceil(top)))
    width = top / bins
    edges = [width * n for n in range(bins + 1)]
    full = [0] * bins
    partial = [0] * bins
    for value in report.scores:
        where = min(bins - 1, max(0, int(value // width)))  # [a, b) ranges; the last one holds the top too
        (full if value >= top else partial)[where] += 1
    figure = Figure(figsize=(7.2, 2.5))
    axes = _axes(figure)
    axes.bar(edges[:-1], partial, width=width, align="edge", color=ACCENT, edgecolor="white", linewidth=1)
    axes.bar(edges[:-1], full, width=width, align="edge", bottom=partial, color=GOOD, edgecolor="white",
             linewidth=1, label=f"full marks ({sum(full)})")
    for left, count in zip(edges, (p + f for p, f in zip(partial, full))):
        if count:
            axes.text(left + width / 2, count, str(count), ha="center", va="bottom", fontsize=8, color=INK)
    middle = statistics.median(report.scores)
    axes.axvline(middle, color=WARN, linestyle="--", linewidth=1.2, label=f"median {number(middle)}")
    axes.set_xlim(0, top)
    ticks = edges if bins <= 10 else edges[::2]
    axes.set_xticks(ticks, [number(e) for e in ticks])
    axes.yaxis.get_major_locator().set_params(integer=True)
    axes.set_ylim(0, max(p + f for p, f in zip(partial, full)) * 1.15 + 0.3)
    axes.set_xlabel(f"{report.id} score (of {number(top)} points)", fontsize=9, color=INK)
    axes.set_ylabel("students", fontsize=9, color=INK)
    axes.legend(loc="lower left", bbox_to_anchor=(0, 1.0), ncols=3, frameon=False, fontsize=8, borderaxespad=0.2,
                handlelength=1.6)
    return svg(figure, f"{report.id}-scores", TEXT["histogram_alt"].en.format(module=report.id))


def pass_chart(report: ModuleReport) -> Markup:
    if not report.checks:
        return Markup("")
    rows = list(reversed(report.checks))  # barh draws bottom-up; the first check goes on top
    figure = Figure(figsize=(6.4, 0.5 + 0.28 * len(rows)))
    axes = _axes(figure)
    colours = [GOOD if c.rate >= 0.8 else WARN if c.rate >= 0.5 else BAD for c in rows]
    positions = range(len(rows))
    axes.barh(positions, [100 * c.rate for c in rows], color=colours, height=0.66)
    axes.barh(positions, [100 * (1 - c.rate) for c in rows], left=[100 * c.rate for c in rows], color=LINE,
              height=0.66)
    for y, check in zip(positions, rows):
        axes.text(101.5, y, f"{check.passed}/{check.students}", va="center", fontsize=8, color=INK)
    titles = [c.title if len(c.title) <= TITLE_WIDTH else c.title[: TITLE_WIDTH - 1] + "…" for c in rows]
    axes.set_yticks(list(positions), titles)
    axes.tick_params(axis="y", length=0)
    axes.spines["left"].set_visible(False)
    axes.set_xlim(0, 100)
    axes.set_ylim(-0.6, len(rows) - 0.4)
    axes.set_xticks([0, 25, 50, 75, 100], ["0%", "25%", "50%", "75%", "100%"])
    axes.set_xlabel("students who passed the check", fontsize=9, color=INK)
    return svg(figure, f"{report.id}-checks", TEXT["pass_rates_alt"].en.format(module=report.id))


# ---- the pages -----------------------------------------------------------------------------------------


def write_class_report(out: Path, book: str | None = "book") -> list[Path]:
    """Write `out/class.html` (English) and `out/class.zh.html` (Chinese), each linking to the other, from every
    `out/*/graded.json` and `checks.json`, and return their paths; their stylesheet `out/class.css` is written
    beside them. `book` is the path, relative to `out`, of a built book the modules and mistakes link to
    (its pages and their `#pitfall-<id>` anchors); None: no links."""
    out = Path(out)
    students = read_students(out)
    order = module_order(students)
    reports = [module_report(stem, students) for stem in order]
    ran = [s for s in students if s.ran]
    totals = [s.total for s in ran]
    found = Counter(s.status for s in students)
    counts = {status: found[status] for status in [*STATUS_ORDER, *sorted(set(found) - set(STATUS_ORDER))]
              if found[status]}
    context = {
        "T": TEXT, "STATUS_NAMES": STATUS_NAMES, "students": students, "ran": ran, "reports": reports,
        "counts": counts, "number": number, "book": book.rstrip("/") if book else None,
        "mean": number(statistics.mean(totals)) if totals else "—",
        "median": number(statistics.median(totals)) if totals else "—",
        "max_total": number(sum(r.max for r in reports)),
        "duplicates": duplicate_sources(students, order),
        "not_graded": [s for s in students if s.status != "graded"],
        "stylesheet": STYLESHEET, "LANG_ATTR": LANG_ATTR, "say": say,
        "student_count": student_count,
    }
    template = environment().get_template("class_report.html")
    written = []
    for lang, name in PAGES.items():
        other = "zh" if lang == "en" else "en"
        html = template.render(**context, lang=lang, other_lang=other, other_href=PAGES[other])
        (out / name).write_text(html, encoding="utf-8")
        written.append(out / name)
    css = (HERE / "static" / "book.css").read_text(encoding="utf-8") + "\n" + \
        (HERE / "static" / "class_report.css").read_text(encoding="utf-8")
    (out / STYLESHEET).write_text(css, encoding="utf-8")
    return written
