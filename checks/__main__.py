"""`./check.sh`: check a module, list the modules, reset a file to its stub, build the book, grade, or run your engine.

    ./check.sh m02                      check mine/m02_thinker_attention.py
    ./check.sh m02 --impl solutions     check the reference (or --impl DIR: a student's folder)
    ./check.sh all --json results.json  check every module, write every result to a file
    ./check.sh list                     modules, titles and the status of your last check, per function
    ./check.sh reset m02                back up mine/m02_... and put the stub back
    ./check.sh book                     build the book (a page per module, with your progress) in .kvlab/book/
    ./check.sh m02 --watch              check m02 again each time you save a file in mine/
    ./check.sh doctor                   what this machine has for the kit, and what to do about the rest
    ./check.sh p03 --bench              on a GPU: time your kernel (p03, p04, p08) or engine (p06, p09) against
                                        the reference and torch
    ./check.sh grade DIR [MODULE ...] --gradescope results.json --junit report.xml
                                        grade a student's folder in a sandbox (instructors)
    ./check.sh autograder OUT.zip [MODULE ...]
                                        a Gradescope autograder (setup.sh, run_autograder, the kit)
    ./check.sh grade-class SUBMISSIONS --out DIR [-j N] [MODULE ...]
                                        grade a whole class, N students at a time: scores.csv and class.html
    ./check.sh run --model DIR "prompt" your engine (or model) on a local Qwen3 checkpoint, text out
                                        (./check.sh run --help)
"""

import _thread
import argparse
import json
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

if __name__ == "__main__":
    SIGNALLED: list[int] = []

    def _stop(signum, frame):  # SIGTERM while the kit starts stops it as Ctrl-C does (`run`, `--watch` take over)
        SIGNALLED.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)  # first, before anything slow loads

sys.dont_write_bytecode = True  # never leave __pycache__ in a learner's or student's folder
# The checks' tensors are tiny: one thread is faster than two spin-waiting ones, and far faster on a busy box.
os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
STATE = ROOT / ".kvlab"  # the learner's last results (read by `list` and the book) and reset backups
HINTS = STATE / "hints.json"  # the hint levels the learner opened in the terminal, per module (the book marks them)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run"]:  # commands with options of their own
        from checks.run import main as run_model

        return run_model(argv[1:])
    if argv[:1] == ["autograder"]:
        from checks.autograder import main as autograder

        return autograder(argv[1:])
    if argv[:1] == ["grade-class"]:
        from checks.grade_class import main as grade_class

        return grade_class(argv[1:])
    parser = argparse.ArgumentParser(prog="./check.sh", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("target", nargs="*", metavar="MODULE",
                        help="module ids (m01 m02 ...), all, list, book, doctor, reset MODULE, grade DIR; or the commands "
                             "run, grade-class and autograder, each with its own --help")
    parser.add_argument("--impl", action="append", metavar="IMPL",
                        help="mine (default), solutions, a folder with mine/'s file names; or mutants, variants, "
                             "broken: the kit's catalogue of known mistakes, accepted variants and broken code")
    parser.add_argument("--seed", type=int, action="append",
                        help="base seed; a run prints its own so it can be replayed (given again: one run per seed, "
                             "in one process)")
    parser.add_argument("--json", metavar="FILE", help="also write every result to FILE as JSON")
    parser.add_argument("-k", metavar="EXPR",
                        help="only the checks whose title (as the report shows it) or test name matches EXPR "
                             "(pytest -k: words, and/or/not; several words alone are a phrase of a title: -k "
                             "'budget of 5')")
    parser.add_argument("--time-limit", type=float, default=10.0, help="seconds one call of your code may take")
    parser.add_argument("--memory-limit", type=float, default=4.0, metavar="GIB",
                        help="GiB of memory the process running your code may use")
    parser.add_argument("--gradescope", metavar="FILE", help="with grade: write Gradescope's results.json to FILE")
    parser.add_argument("--junit", metavar="FILE", help="with grade: write JUnit XML to FILE")
    parser.add_argument("--no-sandbox", action="store_true",
                        help="with grade: run the submission without bubblewrap (every output says so)")
    parser.add_argument("--worker-user", metavar="USER",
                        help="with grade --no-sandbox, as root: run the submission as USER (e.g. nobody), who cannot "
                             "read the kit")
    parser.add_argument("--points", action="append", metavar="MODULE=N",
                        help="with grade: what a module is worth (its checks scaled to N points in all)")
    parser.add_argument("--visibility", default="visible",
                        choices=("visible", "hidden", "after_due_date", "after_published"),
                        help="with grade --gradescope: when students see the results (Gradescope's visibility)")
    parser.add_argument("--hint", type=int, nargs="?", const=0, choices=(1, 2, 3), metavar="N",
                        help="print the module's next unopened hint level, or level N (1: a nudge, 2: the pitfalls, "
                             "3: nearly the code); the book marks the levels you opened")
    parser.add_argument("--lang", choices=("en", "zh"), default="en", help="with --hint: English or Chinese")
    parser.add_argument("--pytest", action="store_true", help="show pytest's own output as well (for kit developers)")
    parser.add_argument("--bench", action="store_true",
                        help="time the module (p03, p04, p06, p08, p09) on a GPU against the reference and torch, "
                             "instead of checking it")
    parser.add_argument("--watch", action="store_true",
                        help="stay running: check the module(s) again each time a file of your folder is saved")
    parser.add_argument("--until-named", action="store_true",
                        help="with --impl mutants: stop checking a mutant once a check rejects it by its name, its "
                             "failures replayed on that mutant only, not the whole catalogue (the kit's self-tests)")
    parser.add_argument("--named-first", metavar="RESULTS", action="append",
                        help="with --until-named: try each mutant first on the checks that named it in RESULTS (an "
                             "earlier run's --json)")
    parser.add_argument("--out", metavar="DIR", help="with book: the folder to write the book to (default .kvlab/book)")
    args = parser.parse_args(argv)
    PARSED.append(args)

    from checks.harness import modules as registry

    if not args.target:
        parser.print_help()
        print()
        return list_modules(registry.modules()) or 2

    if args.target == ["list"]:
        return list_modules(registry.modules())
    if args.target == ["doctor"]:
        from checks.doctor import doctor

        return doctor()
    if args.target[0] == "reset":
        return reset(args.target[1:], registry)
    if args.target[0] == "grade":
        from checks.grading import grade

        return grade(args, registry, run)
    if args.bench:
        from checks.benchmarks.bench import bench

        return bench(args.target, (args.impl or ["mine"])[-1])
    if args.target == ["book"]:
        from book.build import main as build_book

        return build_book(args.out)
    if args.target == ["all"]:
        selected = registry.modules()
    else:
        selected = []
        for name in args.target:
            module = registry.find(name)
            if module is None:
                known = ", ".join(m.id for m in registry.modules())
                print(f"./check.sh: no module {name!r} (known: {known}, all, list, book, reset, doctor)",
                      file=sys.stderr)
                return 2
            selected.append(module)
    if args.hint is not None:
        return print_hints(selected, args.hint, args.lang)
    if args.watch:
        return watch(selected, args)
    return run(selected, args)


def watch(selected, args) -> int:
    """Check `selected` now and again after every save of a `.py` file in the checked folder, in this process:
    torch, the checks and the workers' fork server stay loaded, and each run forks a fresh worker that
    imports the saved files (learner code still never runs here)."""
    import watchfiles

    from checks.conftest import GROUPS
    from checks.harness.loader import LoadError, display, named

    label = (args.impl or ["mine"])[-1]
    try:
        if label in GROUPS or len(args.impl or []) > 1:
            raise LoadError("--watch checks one folder: mine (the default) or --impl DIR")
        folder = named(label).folder
    except LoadError as error:
        print(f"./check.sh: {error}", file=sys.stderr)
        return 2
    if args.seed is None:  # one seed for the whole session: a verdict changes only because the file did
        import random

        args.seed = [random.randrange(10_000)]
    names = ", ".join(m.id for m in selected)
    waiting = f"watching {display(folder)}/*.py: each save checks {names} again (Ctrl-C stops)"
    stopped_by: list[int] = []

    def interrupted(signum, frame):  # SIGTERM stops a watch as Ctrl-C does
        stopped_by.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    announced = False
    try:
        code = run(selected, args, extra=["--keep-server"])
        if code >= 128:  # stopped during the run
            return code
        # an empty set every 200 ms: the first says the watcher is in place, so no save can slip by unseen
        for changes in watchfiles.watch(folder, watch_filter=lambda change, path: path.endswith(".py"), debounce=300,
                                        step=10, recursive=False, rust_timeout=200, yield_on_timeout=True):
            if not changes:
                if not announced:
                    print(f"\n{waiting}", flush=True)
                    announced = True
                continue
            started = time.perf_counter()
            code = run(selected, args, extra=["--keep-server"])
            if code >= 128:
                return code
            print(f"\n{time.perf_counter() - started:.2f} s from the save to this verdict · {waiting}", flush=True)
    except KeyboardInterrupt:
        print("\n./check.sh: interrupted: the watch ends", file=sys.stderr)
        return 128 + (stopped_by[0] if stopped_by else signal.SIGINT)
    finally:
        from checks.conftest import KEPT

        if "runs" in KEPT:
            KEPT.pop("runs").close()  # the fork server and any worker end with the session
    return 0


# --hint's own words, in the language of the page it prints: (the section's name, the last line, what follows L3)
HINT_WORDS = {"en": ("Hints", "The whole page: {path} (or ./check.sh book). Next: {more}.", "the Follow-ups on the page"),
              "zh": ("提示", "整页：{path}（或 ./check.sh book）。下一步：{more}。", "页面末尾的 Follow-ups")}


def print_hints(selected, level: int, lang: str) -> int:
    """The page's `Hints L<level>` section in the terminal (and where the rest of the page is)."""
    from rich.console import Console
    from rich.markdown import Markdown

    from book.pages import load
    from book.progress import read_results

    console = Console(highlight=False, width=None if sys.stdout.isatty() else 110)
    opened = read_results(HINTS)
    asked = level
    for module in selected:
        seen = [n for n in opened.get(module.stem, []) if n in (1, 2, 3)]
        level = asked or next((n for n in (1, 2, 3) if n not in seen), 3)  # 0: the next level not opened yet
        page = load(ROOT, module.stem, lang) or load(ROOT, module.stem, "en")
        text = page.sections.get(f"Hints L{level}") if page else None
        if not text:
            print(f"./check.sh: {module.id} has no Hints L{level}", file=sys.stderr)
            return 2
        opened[module.stem] = sorted(set(seen) | {level})  # kept first: a reader may close the pipe early
        STATE.mkdir(exist_ok=True)
        HINTS.write_text(json.dumps(opened, indent=1))  # the book marks the levels opened
        hints, footer, last = HINT_WORDS[page.lang]
        title = page.meta.get("title", module.title)  # in the page's own language
        console.print(f"[bold]{module.id} · {title} · {hints} L{level}[/]")
        console.print(Markdown(text))
        more = f"./check.sh {module.id} --hint {level + 1}" if level < 3 else last
        console.print("[dim]" + footer.format(path=page.path.relative_to(ROOT), more=more) + "[/]")
    return 0


def run(selected, args, impls: list[str] | None = None, extra: list[str] = (), remember_results: bool = True,
        reporter=None) -> int:
    """Run the checks of `selected` in this process (the report is a pytest plugin); learner code runs
    in worker processes (checks/harness/worker.py). Exit status 0 only when every selected check passed."""
    from checks.harness.loader import NOT_SANDBOXED, LoadError, named

    impls = impls or args.impl or ["mine"]
    for label in impls:  # a folder that is not there is said before torch loads
        try:
            impl = named(label)
            if impl.kind == "learner" and not impl.folder.is_relative_to(ROOT / "mine") and "--shown" not in extra:
                print(NOT_SANDBOXED.format(impl.shown_folder()), file=sys.stderr)
        except LoadError as error:
            from checks.conftest import GROUPS  # the catalogue's groups (this imports torch)

            if label not in GROUPS:
                print(f"./check.sh: {error}", file=sys.stderr)
                return 2
    import torch

    # Triton kernels run in its CPU interpreter when there is no GPU; it must be set before they load.
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import pytest

    from checks.harness.report import Reporter, to_json

    # The checks are the kit's pytest run, not the user's: options meant for their own test runs must not change it
    os.environ.pop("PYTEST_ADDOPTS", None)
    pytest_args = [str(m.checks) for m in selected] + [
        "--time-limit", str(args.time_limit), "--memory-limit", str(args.memory_limit), "-p", "no:cacheprovider",
        "-p", "no:logging",  # the checks log nothing; its capture costs ~7% of a run over many cases
        # nor do they report exceptions raised in __del__ or threads as warnings: these plugins' garbage
        # collections at the end cost about 0.7 s a run
        "-p", "no:unraisableexception", "-p", "no:threadexception",
        "--rootdir", str(ROOT), "-c", str(ROOT / "pyproject.toml"), *extra,
    ]
    for label in impls:
        pytest_args += ["--impl", label]
    if args.k:
        phrase = title_phrase(args.k)
        pytest_args += ["--title-phrase", phrase] if phrase else ["-k", args.k]
    if args.until_named:
        pytest_args += ["--until-named"]
        for earlier in args.named_first or []:
            pytest_args += ["--named-first", earlier]
    if not args.pytest:
        pytest_args += ["-p", "no:terminal", "-s"]  # -s: a learner's print() shows up while debugging
    # Several seeds: one run each, in this process (torch, the oracles and the workers' fork server loaded once).
    seeds = args.seed or [None]
    assert reporter is None or len(seeds) == 1, "one seed per run when the caller reports"
    own_server = len(seeds) > 1 and "--keep-server" not in extra  # kept from seed to seed, ended here
    if own_server:
        pytest_args.append("--keep-server")
    finished = (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED)
    reporters, codes = [], []
    stopped_by: list[int] = []
    returned: list[bool] = []

    def interrupted(signum, frame):  # a `timeout` or a grader's kill: stop the checks, still write --json
        stopped_by.append(signum)
        if len(stopped_by) == 1:
            threading.Thread(target=stop_anyway, args=(signum,), daemon=True).start()
        raise KeyboardInterrupt

    def stop_anyway(signum: int) -> None:
        """The KeyboardInterrupt a signal raises can be lost (raised inside a finalizer, which Python reports and
        drops): if the run has not wound down within a few seconds, end its workers and leave from here, with
        what had finished in --json, marked incomplete."""
        time.sleep(STOP_GRACE)
        if returned:  # the run wound down by itself
            return
        for each in reporters:
            runs = getattr(getattr(each, "config", None), "kvlab_runs", None)
            process = getattr(getattr(runs, "server", None), "process", None)
            if process is not None:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        if args.json:
            from checks.harness.report import to_json

            results = [r for each in reporters for r in each.results]
            seed = getattr(reporters[0].config, "kvlab_seed", None) if reporters else None
            Path(args.json).write_text(json.dumps(to_json(results, seed, complete=False), indent=1))
        print("./check.sh: interrupted; the workers were stopped"
              f"{'; --json marks the run incomplete' if args.json else ''}", file=sys.stderr)
        leave(128 + signum)

    unraisable = sys.unraisablehook

    def quiet(lost) -> None:
        """Our KeyboardInterrupt, raised inside a finalizer, is dropped there: deliver it again, unprinted, once
        the finalizer is over (stop_anyway still ends a run that hangs)."""
        if stopped_by and isinstance(lost.exc_value, KeyboardInterrupt):  # from another thread, a moment later
            threading.Timer(0.05, _thread.interrupt_main, args=(signal.SIGINT,)).start()
        else:
            unraisable(lost)

    sys.unraisablehook = quiet
    previous = signal.signal(signal.SIGTERM, interrupted)
    previous_int = signal.signal(signal.SIGINT, interrupted)
    RAN.append(True)  # from here on, an interruption is this function's to report (and --json its to write)
    try:
        for seed in seeds:
            # --named-first (the self-tests' runs of the catalogue on the later seeds, read from --json) prints no report
            reporters.append(reporter or Reporter(None, render=not args.named_first))
            codes.append(pytest.ExitCode.INTERRUPTED)  # until pytest says otherwise
            seeded = pytest_args + (["--seed", str(seed)] if seed is not None else [])
            codes[-1] = pytest.main(seeded, plugins=[_Attach(reporters[-1])])
            if codes[-1] not in finished:
                break
    except KeyboardInterrupt:  # a second Ctrl-C while pytest was already winding down
        codes[-1:] = [pytest.ExitCode.INTERRUPTED]
    finally:
        returned.append(True)
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
        sys.unraisablehook = unraisable
        if own_server:
            from checks.conftest import KEPT

            if "runs" in KEPT:
                KEPT.pop("runs").close()
        results = [r for each in reporters for r in each.results]
        code = next((c for c in codes if c not in finished), codes[-1] if codes else pytest.ExitCode.INTERRUPTED)
        if args.json:  # always written: a run cut short says so, it never leaves an old file or none
            seed = getattr(reporters[0].config, "kvlab_seed", None) if reporters else None
            complete = len(codes) == len(seeds) and all(c in finished for c in codes)
            Path(args.json).write_text(json.dumps(to_json(results, seed, complete=complete), indent=1))
    if code == pytest.ExitCode.INTERRUPTED:
        done = sum(r.status in ("passed", "skipped") for r in results)
        modules_done = ", ".join(dict.fromkeys(r.module.split("_")[0] for r in results)) or "none"
        print(f"./check.sh: interrupted: {len(results)} checks had finished ({done} passed; modules reached: "
              f"{modules_done}); the workers were stopped{'; --json marks the run incomplete' if args.json else ''}",
              file=sys.stderr)
        return 128 + (stopped_by[0] if stopped_by else signal.SIGINT)
    if code == pytest.ExitCode.NO_TESTS_COLLECTED and args.k:
        print(f"./check.sh: no check of {', '.join(m.id for m in selected)} matches -k {args.k!r} "
              "(it matches words of the checks' names, e.g. -k decode)", file=sys.stderr)
        return 2
    if code not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED) or not results:
        print(f"./check.sh: the checks did not run (pytest exit code {int(code)}); rerun with --pytest to see why",
              file=sys.stderr)
        return 3
    if remember_results and impls == ["mine"] and not args.k:  # progress is what a whole module run says
        remember(results)
    return 0 if all(r.status in ("passed", "skipped") for r in results) else 1


class _Attach:
    """Hands the pytest config to the reporter, which the CLI made before pytest started."""

    def __init__(self, reporter):
        self.reporter = reporter

    @__import__("pytest").hookimpl(tryfirst=True)
    def pytest_configure(self, config):
        if config.pluginmanager.get_plugin("terminalreporter") is None:
            # the report gives one-line reasons: pytest need not format a traceback for every failing case
            # (that formatting is half the time of a sweep over the mutants)
            config.option.tbstyle = "no"
        self.reporter.config = config
        config.pluginmanager.register(self.reporter, "kvlab-reporter")


def remember(results) -> None:
    """Keep the learner's latest result per module for `./check.sh list` and the book."""
    path = STATE / "results.json"
    state = json.loads(path.read_text()) if path.is_file() else {}
    for stem in {r.module for r in results}:
        rows = [r for r in results if r.module == stem]
        state[stem] = {"when": time.strftime("%Y-%m-%d %H:%M"), **counts(rows), "functions": by_function(rows)}
    STATE.mkdir(exist_ok=True)
    path.write_text(json.dumps(state, indent=1))


def counts(rows) -> dict:
    return {"checks": len(rows), "passed": sum(r.status == "passed" for r in rows),
            "not_started": sum(r.status == "not started" for r in rows)}


def by_function(rows) -> dict:
    """Per learner function (or `Class.method`): the counts of the checks that called it, in the order the
    checks first called them. A check counts for every function it called, so a kernel's stub shows as not
    started while its PyTorch half is done."""
    names = list(dict.fromkeys(name for r in rows for name in r.calls))
    return {name: counts([r for r in rows if name in r.calls]) for name in names}


def function_marks(entry: dict) -> str:
    """`store_kvcache_torch ✓  store_kvcache ·  flash_attn_varlen 3/8` (✓ all passed, · not started)."""
    marks = []
    for name, c in (entry.get("functions") or {}).items():
        done, unstarted = c["passed"] == c["checks"], c["not_started"] == c["checks"]
        mark = "✓" if done else "·" if unstarted else f"{c['passed']}/{c['checks']}"
        marks.append(f"{name.rsplit('.', 1)[-1]} {mark}")
    return "  ".join(marks)


def forget(stem: str) -> None:
    """After a reset, the module's last result no longer describes the file."""
    path = STATE / "results.json"
    if path.is_file():
        state = json.loads(path.read_text())
        if state.pop(stem, None) is not None:
            path.write_text(json.dumps(state, indent=1))


def status_text(entry: dict | None) -> str:
    if entry is None:
        return "never checked"
    if entry["not_started"] == entry["checks"]:
        return "not started"
    if entry["passed"] == entry["checks"]:
        return f"done ({entry['checks']}/{entry['checks']} passed)"
    return f"{entry['passed']}/{entry['checks']} passed"


def list_modules(found) -> int:
    path = STATE / "results.json"
    state = json.loads(path.read_text()) if path.is_file() else {}
    from rich.console import Console
    from rich.table import Table

    table = Table(title="KV Lab modules (your files are mine/<id>_….py)", title_justify="left", show_edge=False,
                  pad_edge=False)
    for column in ("id", "title", "track", "min", "difficulty", "your status", "by function"):
        table.add_column(column, no_wrap=column not in ("title", "by function"))
    for m in found:
        entry = state.get(m.stem)
        table.add_row(m.id, m.title, m.track, str(m.minutes or ""), m.difficulty, status_text(entry),
                      function_marks(entry) if entry else "")
    Console(highlight=False, width=None if sys.stdout.isatty() else 110).print(table)
    print("\nCheck one with ./check.sh <id>, e.g. ./check.sh m02")
    return 0


def reset(names: list[str], registry) -> int:
    from checks.harness.stubs import stub_for

    if not names:
        print("./check.sh reset: which module? e.g. ./check.sh reset m02", file=sys.stderr)
        return 2
    for name in names:
        module = registry.find(name)
        if module is None:
            print(f"./check.sh reset: no module {name!r}", file=sys.stderr)
            return 2
        target = ROOT / "mine" / f"{module.stem}.py"
        if target.exists():
            backup = STATE / "backups" / f"{module.stem}.{time.strftime('%Y%m%d-%H%M%S')}.py"
            backup.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(target, backup)
            print(f"backed up mine/{module.stem}.py to {backup.relative_to(ROOT)}")
            print(f"  to restore it: cp {backup.relative_to(ROOT)} mine/{module.stem}.py")
        target.write_text(stub_for(ROOT, module.stem), encoding="utf-8")
        forget(module.stem)
        print(f"mine/{module.stem}.py is the stub again")
    return 0


STOP_GRACE = 4.0  # seconds a signalled run has to wind down by itself before it is ended from a thread
PARSED: list = []  # the command line, once parsed
RAN: list = []  # set once `run` started


def stopped_early(signum: int) -> int:
    """A signal before any check ran (while torch and the oracles load): say so, and write the files asked
    for, marked as cut short, as a run stopped later would."""
    if RAN:  # the run itself said what had finished; this came after it
        print("./check.sh: interrupted", file=sys.stderr)
        return 128 + signum
    print("./check.sh: interrupted while starting, before any check ran", file=sys.stderr)
    args = PARSED[0] if PARSED else None
    if getattr(args, "json", None):
        Path(args.json).write_text(json.dumps({"seed": None, "torch": None, "complete": False, "passed": False,
                                               "results": []}, indent=1))
    if getattr(args, "gradescope", None):
        from checks.grading import INTERRUPTED

        Path(args.gradescope).write_text(json.dumps({"score": 0, "output": INTERRUPTED, "visibility": "visible",
                                                     "stdout_visibility": "hidden", "tests": []}, indent=1))
    if getattr(args, "junit", None):
        Path(args.junit).write_text('<?xml version="1.0" encoding="utf-8"?>\n<testsuites name="KV Lab" />\n')
    return 128 + signum


def title_phrase(expression: str) -> str | None:
    """`-k "budget of 5"`: words copied from a title as the report shows it, which pytest's -k cannot read (it wants
    single words joined by and/or/not): the phrase to look for in the titles instead; None for an expression."""
    words = expression.split()
    if len(words) < 2 or any(w in ("and", "or", "not") for w in words) or any(c in expression for c in "()"):
        return None
    return " ".join(words)


def leave(code: int) -> None:
    """Exit now that everything is written: tearing down an interpreter that holds torch, the oracle library
    and pytest takes longer than some whole checks (about 1.7 s on two cores), after a signal too."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BrokenPipeError:
        pass
    os._exit(code)


if __name__ == "__main__":
    try:
        leave(main())
    except KeyboardInterrupt:
        leave(stopped_early(SIGNALLED[0] if SIGNALLED else signal.SIGINT))
    except BrokenPipeError:  # `./check.sh list | head`: the reader left, nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        leave(0)
