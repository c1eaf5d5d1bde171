"""The report: a pytest plugin that turns each check's outcome into one row and a short reason.

Statuses: passed, failed, not started (the stub's NotImplementedError), skipped (an optional oracle
is absent), and kit error (a bug in the check itself, never the learner's fault). A failure carries
one-line reasons only: the case's seed, the error against the tolerance, and the name of the known
mistake the learner's output matches, if any — never a pytest traceback.
"""

import re
import sys
import time
from dataclasses import asdict, dataclass, field

import pytest
import torch

from .cases import case_id, case_seed, module_stem
from .compare import Mismatch
from .guard import LearnerError, NotStarted
from .mistakes import catalogue, identify
from .modules import find, modules


@dataclass
class Result:
    module: str  # stem
    check: str  # the check's title (its docstring's first line)
    case: str  # parameters, e.g. "bf16-H8-KVH2"
    impl: str
    status: str  # passed | failed | not started | skipped | kit error
    reason: str = ""
    mistakes: list[str] = field(default_factory=list)
    seed: int | None = None
    seconds: float = 0.0
    verified_on: str = ""
    nodeid: str = ""
    function: str = ""  # the check's test function (what POINTS names)
    points: float = 0.0  # what the whole check is worth in `./check.sh grade`
    calls: list[str] = field(default_factory=list)  # the learner's functions and methods it called (progress)
    slowest_call: float = 0.0  # seconds of its longest learner call, against the time limit
    slowest_call_cpu: float = 0.0  # the worker's CPU seconds in its costliest call (0 where not measured)
    time_limit: float = 0.0
    run_seed: int | None = None  # the run's base seed (./check.sh --seed S), from which `seed` is derived
    detail: str = ""  # one short line under the reason: what followed from the failure (the other ranks' errors)
    # a failing case's distance to each catalogued mistake replayed on it: 0 where it reproduces the learner's
    # outputs (those are `mistakes`), else the share of values it gets wrong (ranks the names: rank_mistakes)
    distances: dict = field(default_factory=dict)
    # catalogued mistakes this failure reproduces whose mutant gives other outputs than the learner's code on a
    # check it PASSED: not the learner's mistake, whatever they share (rank_mistakes leaves them out)
    contradicted: list[str] = field(default_factory=list)
    # the id of the contract's rule this failure breaks, where the check can tell (the catalogue's `RULES`): said
    # where no catalogued mistake reproduces the learner's outputs (rank_rules)
    rule: str = ""


REASON_LIMIT = 300  # characters of one reason: what a learner's code says is cut here, before any output


def first_line(text: str) -> str:
    text = text.strip()
    end = text.find("\n")
    return text if end < 0 else text[:end]


def said(text: str, lines: bool = False, limit: int = REASON_LIMIT) -> str:
    """`text` as every output may show it: no terminal escape sequences or other control or format characters
    (a reason must not move the cursor, recolour the report, reorder text or break XML), at most `limit`
    characters per line (and four lines where `lines`)."""
    text = _ESCAPES.sub("", text[: 8 * limit])
    kept = "".join(c if c == "\n" and lines else c if c.isprintable() else "?" if c not in "\n\t" else " " for c in text)
    rows = kept.split("\n")[:4] if lines else [kept]
    return "\n".join(row if len(row) <= limit else row[: limit - 1] + "…" for row in rows)


_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-_]|\x9b[0-?]*[ -/]*[@-~]")


def check_title(item) -> str:
    """The check's docstring's first paragraph, on one line (a title that wraps in the source is not cut)."""
    doc = (getattr(item, "function", None) and item.function.__doc__) or ""
    if not doc.strip():
        return item.originalname.removeprefix("test_")
    first = doc.strip().split("\n\n", 1)[0]
    return " ".join(line.strip() for line in first.splitlines()).rstrip(".")


def verified_on(item) -> str:
    describe = getattr(item.module, "verified_on", None)
    return describe() if describe else f"CPU (PyTorch {torch.__version__.split('+')[0]})"


class Reporter:
    def __init__(self, config, render: bool, next_steps: bool = True):
        self.config = config
        self.render = render
        self.next_steps = next_steps  # a grade's report names no next module
        self.results: list[Result] = []
        self.collected: list = []
        self.named: set[str] = set()  # labels of mutants a check has rejected by their own id
        # (module, implementation) -> what each check it passed recorded, to test the names against (contradict)
        self.passed: dict[tuple[str, str], list] = {}
        # modules whose replays are cheap (no engine runs): there a single name is tested against the passed checks too
        self.cheap_replays: set[str] = set()
        self.started = time.perf_counter()

    def pytest_collection_finish(self, session):
        self.collected = list(session.items)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        if report.when == "call" or (report.when == "setup" and not report.passed):
            result = self.classify(item, call, report)
            self.results.append(result)
            if result.status == "failed" and result.impl.startswith("mutant:") and \
                    result.impl.rsplit(":", 1)[1] in result.mistakes:
                self.named.add(result.impl)
            if self.render and result.status != "passed":
                report.longrepr = result.reason  # keep pytest's own output short if it is shown at all

    def classify(self, item, call, report) -> Result:
        stem = module_stem(item.module)
        params = item.callspec.params if hasattr(item, "callspec") else {}
        impl = params["impl"].label if "impl" in params else ""
        result = Result(stem, check_title(item), case_id(item), impl, "passed", seed=case_seed(item),
                        seconds=round(call.duration, 3), verified_on=verified_on(item), nodeid=item.nodeid,
                        function=item.originalname, points=getattr(item.module, "POINTS", {}).get(item.originalname, 0),
                        run_seed=getattr(self.config, "kvlab_seed", None))
        guarded = item.funcargs.get("impl")
        result.calls = list(getattr(guarded, "called", []))
        result.slowest_call = round(getattr(guarded, "slowest", 0.0), 3)
        result.slowest_call_cpu = round(getattr(guarded, "slowest_cpu", 0.0), 3)
        result.time_limit = getattr(guarded, "time_limit", 0.0)
        if report.skipped:
            result.status = "skipped"
            longrepr = report.longrepr
            result.reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
            result.reason = result.reason.removeprefix("Skipped: ")
            return result
        if call.excinfo is None:
            self.keep_passed(item, stem, impl, guarded)
            return result
        error = call.excinfo.value
        if isinstance(error, NotStarted):
            result.status, result.reason = "not started", said(str(error), lines=True)
        elif isinstance(error, (LearnerError, Mismatch)) or type(error) is AssertionError:
            result.status, result.reason = "failed", said(first_line(str(error)))
            result.detail = said(first_line(getattr(error, "detail", "") or ""), limit=160)
            # the rule the failure says it breaks, else the one the check stands for (not for a crash, which may be
            # anything)
            result.rule = getattr(error, "rule", "") or ("" if isinstance(error, LearnerError) else
                                                         getattr(item.module, "RULE_OF", {}).get(item.originalname, ""))
            refused = re.match(r"`(\w+)` raised ValueError", result.reason) if isinstance(error, LearnerError) else None
            if refused and not result.rule:  # a refusal of what the function must serve breaks that function's rule
                result.rule = getattr(item.module, "REFUSAL_RULES", {}).get(refused.group(1), "")
            if isinstance(error, LearnerError) and not result.rule:  # an error that itself says which rule broke
                result.rule = next((rule for said_, rule in getattr(item.module, "REASON_RULES", {}).items()
                                    if re.search(said_, result.reason)), "")
            result.rule = "" if result.rule == "-" else result.rule  # "-": the failure breaks no rule of this module
            if result.rule and catalogue(stem).rule(result.rule) is None:  # a check naming a rule its catalogue lacks
                result.status, result.reason = "kit error", f"the check names the rule {result.rule!r}, which " \
                    f"checks/mutants/{stem}.py's RULES does not have"
            if isinstance(error, Mismatch) or getattr(error, "identifiable", False):
                self.distances = {}
                result.mistakes = self.name_mistakes(item, stem)
                result.distances = self.distances
        else:
            entry = call.excinfo.traceback[-1]
            where = f"{str(entry.path).rsplit('/', 1)[-1]} line {entry.lineno + 1}"
            failure = f"{type(error).__name__}: {first_line(str(error))}"
            if guarded is not None and guarded.impl.kind == "learner" and guarded.called:
                # What a learner's code gave the check (an object whose fields are not what the page says, a reply
                # the worker forged) broke the check's own reading of it: the submission's failure, not the kit's.
                result.status = "failed"
                result.reason = said(f"the check could not use what `{guarded.called[-1]}` gave it ({failure}, at "
                                     f"{where})")
            else:
                result.status, result.reason = "kit error", said(f"{failure} ({where})")
        return result

    def deny_missing(self) -> None:
        """Default-deny: a collected check that left no result (it never ran, or its run was cut short)
        counts as failed, never as passed."""
        seen = {r.nodeid for r in self.results}
        for item in self.collected:
            if item.nodeid in seen:
                continue
            params = item.callspec.params if hasattr(item, "callspec") else {}
            self.results.append(Result(
                module_stem(item.module), check_title(item), case_id(item),
                params["impl"].label if "impl" in params else "", "failed", "the check did not finish (no result)",
                seed=case_seed(item), verified_on=verified_on(item), nodeid=item.nodeid, function=item.originalname,
                points=getattr(item.module, "POINTS", {}).get(item.originalname, 0),
                run_seed=getattr(self.config, "kvlab_seed", None)))

    def name_mistakes(self, item, stem: str) -> list[str]:
        guarded = item.funcargs.get("impl")
        if guarded is None or not guarded.events or item.originalname in getattr(item.module, "UNNAMED", ()):
            return []
        kind = getattr(item.module, "TOLERANCE_KIND", "elementwise")
        only = getattr(item.module, "NAMED_BY", {}).get(item.originalname)
        label = guarded.impl.label
        if self.config.getoption("--until-named", False) and label.startswith("mutant:"):
            # the question asked of a catalogued mutant here is only whether it is named as itself, and once a
            # check has said yes, the mutant's later failures need not be replayed to ask it again
            if label in self.named:
                return []
            own, named_by = label.rsplit(":", 1)[1], only
            only = lambda mistake_id: mistake_id == own and (named_by is None or named_by(mistake_id))  # noqa: E731
        distances: dict[str, float] = {}
        found = [m.id for m in identify(guarded.events, stem, kind, guarded.time_limit, only, distances, failed=True)]
        self.distances = {k: round(v, 4) for k, v in distances.items()}
        return found

    def keep_passed(self, item, stem: str, label: str, guarded) -> None:
        """Keep a passed check's calls (a learner's, not the catalogue's own mutants and variants): a name its
        failures suggest must not contradict them (`contradict`)."""
        if guarded is None or not guarded.events or label.split(":", 1)[0] in ("mutant", "variant", "broken") or \
                item.originalname in getattr(item.module, "UNNAMED", ()):
            return
        if getattr(item.module, "CHEAP_REPLAYS", False):
            self.cheap_replays.add(stem)
        self.passed.setdefault((stem, label), []).append(
            (list(guarded.events), getattr(item.module, "TOLERANCE_KIND", "elementwise"), guarded.time_limit))

    def contradict(self) -> None:
        """Where a learner's failures reproduce two or more mistakes, replay them on the checks that learner PASSED:
        a mistake whose mutant gives other outputs there is not theirs (a mutant that also changes what the learner
        got right explains the failures by accident), and its rows say so in `contradicted`."""
        for (stem, label), passed in self.passed.items():
            rows = [r for r in self.results if (r.module, r.impl) == (stem, label) and r.status == "failed"]
            suggested = list(dict.fromkeys(m for r in rows for m in r.mistakes))
            if len(suggested) < (1 if stem in self.cheap_replays else 2):
                continue  # one name where replays are costly: nothing to choose between (an engine run costs seconds)
            wrong = [m for m in suggested
                     if any(not identify(events, stem, kind, limit, only=lambda i, m=m: i == m)
                            for events, kind, limit in passed)]
            for r in rows:
                r.contradicted = [m for m in r.mistakes if m in wrong]

    def pytest_sessionfinish(self, session):
        self.deny_missing()
        self.contradict()
        if self.render:
            render(self.results, self.config.kvlab_seed, time.perf_counter() - self.started,
                   selection=self.config.getoption("keyword", "") or self.config.getoption("--title-phrase", "") or "",
                   next_steps=self.next_steps)


ICONS = {"passed": "[green]✓[/]", "failed": "[red]✗[/]", "not started": "[yellow]·[/]",
         "skipped": "[blue]-[/]", "kit error": "[magenta]![/]"}
WORST_FIRST = ("kit error", "failed", "not started", "skipped", "passed")
SHOWN_CASES = 2  # failing cases listed per check; the rest are counted


def render(results: list[Result], seed: int, seconds: float, file=None, selection: str = "",
           next_steps: bool = True) -> None:
    """The report. `selection`: the -k expression of a filtered run (its passes are not the module's);
    `next_steps`: point to the next module (not in a grade, which speaks to an instructor)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.padding import Padding

    if not results:
        return
    out = file or sys.stdout
    console = Console(file=out, highlight=False, width=None if out.isatty() else 110)

    def indented(text: str, left: int = 6) -> None:
        console.print(Padding(text, (0, 0, 0, left), expand=False))

    by_module: dict[tuple[str, str], list[Result]] = {}
    for r in results:
        by_module.setdefault((r.module, r.impl), []).append(r)
    for (stem, label), rows in by_module.items():
        module = find(stem)
        name = module.id if module else stem
        path = f"{label}/{stem}.py" if label in ("mine", "solutions") else f"{label} ({stem}.py)"
        console.print()
        console.print(f"[bold]KV Lab · {name} · {escape(module.title if module else stem)}[/]")
        console.print(f"[dim]checking {escape(path)} · seed {seed} · verified on {rows[0].verified_on}[/]")
        console.print()
        shared = shared_reason(rows)
        if shared:  # the file does not import: one reason for every check, said once
            console.print(f" {ICONS['failed']}  [bold]{escape(shared)}[/]")
            runnable = sum(r.status != "skipped" for r in rows)
            console.print(f"      [dim]so none of the {runnable} checks can run; fix that line and check again[/]")
        ranking = rank_mistakes(rows)
        by_check: dict[str, list[Result]] = {}
        for r in rows:
            by_check.setdefault(r.check, []).append(r)
        for check, cases in by_check.items():
            status = next(s for s in WORST_FIRST if any(c.status == s for c in cases))
            bad = [c for c in cases if c.status == status] if status != "passed" else []
            count = f"  [dim]{len(bad)} of {len(cases)} cases {status}[/]" if len(cases) > 1 and bad else ""
            if len(cases) > 1 and not bad:
                count = f"  [dim]{len(cases)} cases[/]"
            console.print(f" {ICONS[status]}  {escape(check)}{count}")
            if status == "passed" or shared:
                continue
            if status == "not started":  # say so when the stub that stops it is another module's
                for reason in sorted({c.reason for c in bad if " reaches " in c.reason}):
                    indented(f"[dim]{escape(reason)}[/]")
                continue
            for c in bad[:SHOWN_CASES]:
                case = f"[cyan]{escape(c.case)}[/] " if c.case else ""
                seed_note = f" [dim]· case seed {c.seed}[/]" if c.status == "failed" else ""
                likely = [m for m in ranking if m in c.mistakes][:SHOWN_MISTAKES]
                named = f" [yellow]→ looks like {' or '.join(likely)}[/]" if likely else ""
                if not likely and c.rule and not ranking:
                    named = f" [yellow]→ breaks {escape(c.rule)}[/]"
                indented(f"{case}{escape(c.reason)}{seed_note}{named}")
                if c.detail:
                    indented(f"[dim]{escape(c.detail)}[/]", 8)
            if len(bad) > SHOWN_CASES:
                indented(f"[dim]… and {len(bad) - SHOWN_CASES} more (--json FILE lists every case)[/]")
        if ranking:
            console.print()
            console.print("[bold yellow]Your output matches a known mistake:[/]")
            for mistake_id in ranking[:SHOWN_MISTAKES]:
                mistake = catalogue(stem).mistake(mistake_id)
                n = len({r.check for r in rows if mistake_id in r.mistakes})
                reproduces = plural(n, "failing check")
                indented(f"[bold]{mistake_id}[/] — {escape(mistake.title)} [dim](reproduces {reproduces})[/]", 2)
                indented(escape(mistake.hint), 4)
            if len(ranking) > SHOWN_MISTAKES:
                indented(f"[dim]{plural(len(ranking) - SHOWN_MISTAKES, 'other known mistake')} also reproduce some of "
                         "these failures; the two above reproduce the most failing checks, and come closest to your "
                         "outputs on the rest[/]", 2)
            first = ranking[0]
            indented(f"[dim]More: ./check.sh {name} --hint 2 (or exercises/{stem}.md › Pitfalls); in the book "
                     f"(./check.sh book): .kvlab/book/{stem}.html#pitfall-{first}[/]", 2)
        broken = rank_rules(rows) if not ranking else []
        causes = plain_causes(rows) if not ranking else []
        if causes:
            console.print()
            console.print("[bold yellow]Fix this first:[/]")
            for cause in causes[:SHOWN_MISTAKES]:
                indented(escape(cause), 2)
            then = " (the rules below may only follow from it)" if broken else ""
            indented(f"[dim]a result against its function's contract (the docstring's shape and dtype, new tensors, "
                     f"inputs left as they were) fails every check that uses it{then}[/]", 2)
        if broken:
            console.print()
            console.print("[bold yellow]The rule your code breaks:[/]" if len(broken) == 1 else
                          "[bold yellow]The rules your code breaks:[/]")
            for rule_id in broken[:SHOWN_MISTAKES]:
                rule = catalogue(stem).rule(rule_id)
                n = len({r.check for r in rows if r.status == "failed" and r.rule == rule_id})
                indented(f"[bold]{rule_id}[/] — {escape(rule.says)} [dim](breaks {plural(n, 'check')})[/]", 2)
                indented(f"Do: {escape(rule.do)}", 4)
            if len(broken) > SHOWN_MISTAKES:
                indented(f"[dim]{plural(len(broken) - SHOWN_MISTAKES, 'other rule')} also broken: fix these first; "
                         "the first is broken by the most checks[/]", 2)
        counts = {s: sum(r.status == s for r in rows) for s in WORST_FIRST}
        summary = " · ".join(f"{n} {s}" for s, n in counts.items() if n)
        console.print()
        console.print(f"[bold]{name}: {summary}[/] [dim]({plural(len(rows), 'check')})[/]")
        if counts["not started"] == len(rows):
            console.print(f"Nothing written yet: open {escape(path)}, read the docstring, and fill in the body. "
                          f"The exercise page is exercises/{stem}.md.")
        elif counts["passed"] == len(rows) and selection:
            passed = "The selected check passes" if len(rows) == 1 else f"All {len(rows)} selected checks pass"
            console.print(f"[green]{passed}[/] (-k {escape(selection)}). "
                          f"The whole module: ./check.sh {name}")
        elif counts["passed"] == len(rows):
            console.print(f"[green]All checks pass.[/] {next_step(stem) if next_steps else ''}".rstrip())
    console.print(f"[dim]{seconds:.1f} s · replay this run exactly: add --seed {seed}[/]")


SHOWN_MISTAKES = 2  # known mistakes named for a module (and for a case): the best-matching ones
# A failing case's reason that says a call of the checked code returned what its contract rules out (a shape, a
# dtype, not a tensor, a view of an input) or changed an input in place: guard.py's and serve.py's own words
CONTRACT_CAUSE = re.compile(r"^(rank \d+: )?`[^`]+` (returned (\(item \d+\) )?(shape \[|a \w+, expected a tensor|"
                            r"\w+, expected \w+ \()|returned one of its inputs|changed its input)")


def plain_causes(rows: list[Result]) -> list[str]:
    """The contract breaches the failing cases report (the reason before its notes), in the report's order: said
    before any rule, since every check that uses such a result fails with it."""
    found: list[str] = []
    for r in rows:
        head = r.reason.split(" · ")[0]
        if r.status == "failed" and CONTRACT_CAUSE.match(head) and head not in found:
            found.append(head)
    return found


def rank_mistakes(rows: list[Result]) -> list[str]:
    """The known mistakes the rows' failures reproduce, best first: by how many failing checks each reproduces,
    then how close its outputs come to the learner's on the failing cases it does not reproduce (the share of
    values it gets wrong, summed), then the page's order of pitfalls. A mistake is named only where it gives the
    learner's outputs on every failing case it was replayed on (one it explains in part is another mistake that
    shares a symptom; the report then says the rule instead), and not where another one beats it on every
    failing case (as close or closer everywhere, closer somewhere), nor where its mutant gives other outputs than
    the learner's code on a check the learner passed (`Result.contradicted`)."""
    checks: dict[str, set] = {}
    wrong = {m for r in rows for m in r.contradicted}
    for r in rows:
        for mistake_id in r.mistakes:
            if mistake_id not in wrong:
                checks.setdefault(mistake_id, set()).add(r.check)
    measured = [r for r in rows if r.distances]

    def distance(m: str, r: Result) -> float:
        return 0.0 if m in r.mistakes else r.distances.get(m, 1.0)

    def beaten(m: str) -> bool:
        return any(all(distance(o, r) <= distance(m, r) for r in measured) and
                   any(distance(o, r) < distance(m, r) for r in measured)
                   for o in {k for r in measured for k in r.distances} - wrong if o != m)

    def unexplained(m: str) -> bool:  # a failing case it was replayed on, whose outputs it does not give
        return any(m in r.distances and r.distances[m] > 0 and m not in r.mistakes for r in measured)

    kept = [m for m in checks if not unexplained(m) and not (measured and beaten(m))]
    order = {m.id: i for i, m in enumerate(catalogue(rows[0].module).mistakes)} if rows else {}
    return sorted(kept, key=lambda m: (-len(checks[m]), sum(distance(m, r) for r in measured),
                                       order.get(m, len(order))))


def rank_rules(rows: list[Result]) -> list[str]:
    """The catalogued rules the failing rows say they break, most checks first, then the catalogue's order (its
    rules go from the most specific to the most general); for a catalogue whose rules are layers (a function's rule
    before the rules of the functions that call it), the catalogue's order alone."""
    if not rows:
        return []
    rules = catalogue(rows[0].module)
    known = {r.id: i for i, r in enumerate(rules.rules)}
    checks: dict[str, set] = {}
    for r in rows:
        if r.status == "failed" and r.rule in known:
            checks.setdefault(r.rule, set()).add(r.check)
    if rules.rule_ranking == "layers":
        return sorted(checks, key=lambda rule: known[rule])
    return sorted(checks, key=lambda rule: (-len(checks[rule]), known[rule]))


def next_step(stem: str) -> str:
    """The module after `stem` in the book's order (Track M, then Track P)."""
    order = [m for m in modules() if m.id]
    later = [m for i, m in enumerate(order) if i > 0 and order[i - 1].stem == stem]
    if not later:
        return "That was the last module."
    from rich.markup import escape

    return f"Next: ./check.sh {later[0].id} ({escape(later[0].title)})."


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def shared_reason(rows: list[Result]) -> str | None:
    """The reason every row failed with, when it is the file failing to import (the same for all)."""
    rows = [r for r in rows if r.status != "skipped"]  # an absent optional oracle skips whatever the file
    reasons = {r.reason for r in rows}
    if len(reasons) == 1 and all(r.status == "failed" for r in rows):
        reason = next(iter(reasons))
        if "importing it" in reason or "SyntaxError" in reason or "does not exist" in reason:
            return reason
    return None


def to_json(results: list[Result], seed: int | None, complete: bool = True) -> dict:
    passed = bool(results) and complete and all(r.status in ("passed", "skipped") for r in results)
    return {"seed": seed, "torch": torch.__version__, "complete": complete, "passed": passed,
            "results": [asdict(r) for r in results]}
