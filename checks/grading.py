"""`./check.sh grade`: a submission's score, in the terminal, as Gradescope's results.json and as JUnit XML.

A check is worth the points its module declares (`POINTS` in `checks/test_<stem>.py`), shared out over
its cases: a check that passes 3 of 4 cases earns three quarters of its points. A case that did not
pass, for whatever reason (wrong, crashed, timed out, never ran), earns nothing. Skipped cases (an
optional oracle that is absent) are left out of the share; optional checks are worth nothing.
"""

import contextlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from checks.harness.limits import make_for_sandbox
from checks.harness.modules import find, modules
from checks.harness.report import SHOWN_MISTAKES, rank_mistakes

SANDBOX_OFF = ("graded WITHOUT the sandbox (--no-sandbox): the submission ran with the grader's own "
               "file system, network and user; a hostile submission could change its score")
WORKER_USER_ONLY = ("graded without the sandbox (--no-sandbox --worker-user {}): the submission ran as that user, "
                    "under the worker's time, memory and process limits, unable to read what only the grader's user "
                    "may read (the kit, its solutions, the results), but with the machine's network and shared "
                    "folders")


@dataclass
class Check:
    module: str  # stem
    title: str
    cases: list  # Result rows
    points: float

    @property
    def counted(self) -> list:
        return [c for c in self.cases if c.status != "skipped"]

    @property
    def passed(self) -> int:
        return sum(c.status == "passed" for c in self.counted)

    @property
    def score(self) -> float:
        return round(self.points * self.passed / len(self.counted), 2) if self.counted else 0.0

    @property
    def worth(self) -> float:
        """What the check counts for in the total: nothing when every case was skipped (an oracle or hardware
        this machine lacks: flash-attn, real weights, a second GPU), so the same work scores the same anywhere."""
        return self.points if self.counted else 0.0

    @property
    def status(self) -> str:
        return "passed" if self.passed == len(self.counted) else "failed"

    def output(self) -> str:
        lines = [f"{c.case + ': ' if c.case else ''}{c.reason}" for c in self.cases if c.status not in ("passed",
                                                                                                       "skipped")]
        named = rank_mistakes(self.cases)[:SHOWN_MISTAKES]
        if named:
            lines.append("matches the known mistake(s): " + ", ".join(named))
        return "\n".join(lines)


def checks_of(results: list) -> list[Check]:
    grouped: dict[tuple[str, str], Check] = {}
    for r in results:
        key = (r.module, r.function or r.check)
        if key not in grouped:
            grouped[key] = Check(r.module, r.check, [], r.points)
        grouped[key].cases.append(r)
    return list(grouped.values())


def module_name(stem: str) -> str:
    module = find(stem)
    return f"{module.id} · {module.title}" if module else stem


def score_lines(checks: list[Check], notices: list[str]) -> list[str]:
    lines, total, most = [], 0.0, 0.0
    for stem in dict.fromkeys(c.module for c in checks):
        mine = [c for c in checks if c.module == stem]
        got, out_of = sum(c.score for c in mine), sum(c.worth for c in mine)
        total, most = total + got, most + out_of
        lines.append(f"{module_name(stem)}: {got:g} / {out_of:g} points")
    lines.append(f"score: {total:g} / {most:g}")
    return lines + notices


MEMORY_UNCOUNTED = ("memory: no memory cgroup here ({}): the worker's limit counts its mapped memory only, not "
                    "shared memory or files it keeps in memory")
INTERRUPTED = "interrupted (Ctrl-C or SIGTERM) before the end: the checks that never ran are missing from this score"


def scale(checks: list[Check], points: dict[str, float]) -> None:
    """Make each module in `points` (stem -> points) worth that much: its checks' points in proportion."""
    for stem, wanted in points.items():
        mine = [c for c in checks if c.module == stem]
        declared = sum(c.worth for c in mine)  # what the module is worth here: its checks that ran
        for c in mine:
            c.points = round(c.worth * wanted / declared, 4) if declared else 0.0


def gradescope(checks: list[Check], seconds: float, notices: list[str], seed: int,
               visibility: str = "visible") -> dict:
    """Gradescope's autograder results.json: one test per check, with its score and its reasons."""
    tests = []
    for number, check in enumerate(checks, 1):
        module = find(check.module)
        tests.append({
            "name": f"{module.id if module else check.module} · {check.title}",
            "number": f"{module.id if module else check.module}.{number}",
            "score": check.score,
            "max_score": check.worth,
            "status": check.status,
            "output": check.output(),
            "visibility": visibility,
            "tags": [module.id if module else check.module],
        })
    summary = score_lines(checks, notices)
    return {
        "score": round(sum(c.score for c in checks), 2),
        "execution_time": round(seconds, 1),
        "output": "\n".join(summary + [f"seed {seed} (./check.sh MODULE --seed {seed} replays it)"]),
        "visibility": visibility,
        "stdout_visibility": "hidden",
        "tests": tests,
    }


def junit(results: list, notices: list[str]) -> bytes:
    """JUnit XML: a testsuite per module, a testcase per case, `<failure>` with the one-line reason."""
    suites = ET.Element("testsuites", name="KV Lab")
    for stem in dict.fromkeys(r.module for r in results):
        rows = [r for r in results if r.module == stem]
        failures = [r for r in rows if r.status not in ("passed", "skipped")]
        suite = ET.SubElement(suites, "testsuite", name=module_name(stem), tests=str(len(rows)),
                              failures=str(len(failures)), skipped=str(sum(r.status == "skipped" for r in rows)),
                              time=f"{sum(r.seconds for r in rows):.3f}")
        if notices:
            properties = ET.SubElement(suite, "properties")
            for number, notice in enumerate(notices, 1):
                ET.SubElement(properties, "property", name=f"notice{number}", value=notice)
        for r in rows:
            case = ET.SubElement(suite, "testcase", classname=f"{stem}.{r.function or 'check'}",
                                 name=f"{r.check} [{r.case}]" if r.case else r.check, time=f"{r.seconds:.3f}")
            if r.status == "skipped":
                ET.SubElement(case, "skipped", message=r.reason)
            elif r.status != "passed":
                ET.SubElement(case, "failure", message=r.reason, type=r.status).text = \
                    r.reason + (f"\nmatches: {', '.join(r.mistakes)}" if r.mistakes else "")
    return ET.tostring(suites, encoding="utf-8", xml_declaration=True)


def write_outputs(results: list, seconds: float, notices: list[str], seed: int, gradescope_file: str | None,
                  junit_file: str | None, points: dict[str, float] | None = None,
                  visibility: str = "visible") -> list[Check]:
    checks = checks_of(results)
    scale(checks, points or {})
    if gradescope_file:
        with open(gradescope_file, "w", encoding="utf-8") as out:
            json.dump(gradescope(checks, seconds, notices, seed, visibility), out, indent=1)
    if junit_file:
        with open(junit_file, "wb") as out:
            out.write(junit(results, notices))
    return checks


# ---- the command ---------------------------------------------------------------------------------


def sandbox_problem() -> str | None:
    """Why bubblewrap cannot sandbox here, or None when it can."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return "bubblewrap (bwrap) is not installed: `apt-get install bubblewrap` (Debian/Ubuntu)"
    probe = subprocess.run([bwrap, "--ro-bind", "/", "/", "--unshare-pid", "--unshare-net", "--dev", "/dev", "true"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return f"bubblewrap cannot build a sandbox here: {probe.stderr.strip().splitlines()[-1:]}"
    return None


def grade(args, registry, run) -> int:
    """`./check.sh grade DIR [MODULE ...]`: copy DIR, check the copy in the sandbox, print and export the score."""
    from checks.harness.report import Reporter

    if len(args.target) < 2:
        print("./check.sh grade: which folder? e.g. ./check.sh grade submissions/alice m01 m02", file=sys.stderr)
        return 2
    if len(args.seed or []) > 1:
        print("./check.sh grade: one --seed at most (a grade is one run)", file=sys.stderr)
        return 2
    submission = Path(args.target[1]).expanduser()
    if not submission.is_dir():
        print(f"./check.sh grade: no such folder {submission}", file=sys.stderr)
        return 2
    selected = []
    for name in args.target[2:] or [m.id for m in registry.modules()]:
        module = registry.find(name)
        if module is None:
            print(f"./check.sh grade: no module {name!r}", file=sys.stderr)
            return 2
        selected.append(module)
    sandboxed = not args.no_sandbox
    points = {}
    for item in args.points or []:
        name, _, value = item.partition("=")
        module = registry.find(name)
        try:
            points[module.stem] = float(value)
        except (AttributeError, ValueError):
            print(f"./check.sh grade: --points {item}: give MODULE=N, e.g. --points m02=40", file=sys.stderr)
            return 2
    worker_uid = None
    if args.worker_user:
        import pwd

        try:
            worker_uid = pwd.getpwnam(args.worker_user).pw_uid
        except KeyError:
            print(f"./check.sh grade: --worker-user {args.worker_user}: no such user", file=sys.stderr)
            return 2
        if sandboxed or os.getuid() != 0:
            print("./check.sh grade: --worker-user goes with --no-sandbox, run as root (the sandbox has its own "
                  "user)", file=sys.stderr)
            return 2
    problem = sandbox_problem() if sandboxed else None
    if problem:
        print(f"./check.sh grade: {problem}. Grading without it lets a submission reach the grader's files; "
              "to do it anyway, add --no-sandbox (every output will say so).", file=sys.stderr)
        return 2
    shown = str(submission).rstrip("/") or "."
    started = time.perf_counter()
    notices = [] if sandboxed else [WORKER_USER_ONLY.format(args.worker_user) if worker_uid is not None
                                    else SANDBOX_OFF]
    with private_folder("kvlab-grade-") as (temp, also_remove):
        copy, fixtures = Path(temp) / "submission", Path(temp) / "fixtures"
        for note in copy_submission(submission, copy):
            print(f"./check.sh grade: {note}", file=sys.stderr)
        fixtures.mkdir(mode=0o755)
        extra = ["--shown", shown, "--quiet-worker"]
        if worker_uid is not None:  # the worker's user reads the copy (and only it) in this private folder
            os.chmod(temp, 0o711)
            extra += ["--worker-uid", str(worker_uid)]
        if sandboxed:
            extra += ["--sandbox", str(copy), "--fixture-folder", str(fixtures)]
            cgroup, why_not = make_for_sandbox(Path(temp).name, int(args.memory_limit * 2**30))
            if cgroup is None:
                notices.append(MEMORY_UNCOUNTED.format(why_not))
            else:
                also_remove(cgroup.path)
                extra += ["--cgroup", str(cgroup.path)]
        reporter = Reporter(None, render=True, next_steps=False)
        code = run(selected, args, impls=[str(copy)], extra=extra, remember_results=False, reporter=reporter)
    seconds = time.perf_counter() - started
    if code >= 128:  # stopped by a signal: what finished is scored, and every output says so
        notices.append(INTERRUPTED)
    checks = write_outputs(reporter.results, seconds, notices, getattr(reporter.config, "kvlab_seed", 0),
                           args.gradescope, args.junit, points, args.visibility)
    print()
    for line in score_lines(checks, notices):
        print(line)
    for kind, path in (("Gradescope results", args.gradescope), ("JUnit XML", args.junit)):
        if path:
            print(f"{kind}: {path}")
    return code


def module_folder(submission: Path) -> Path | None:
    """Where a submission's module files are: the folder itself, or its one subfolder that holds them (an
    upload nested one level: `alice/mine/m01_rmsnorm.py`); None when neither holds any module file."""
    names = {f"{m.stem}.py" for m in modules()}

    def holds(folder: Path) -> bool:
        return any((folder / name).is_file() for name in names)

    if holds(submission):
        return submission
    inner = [d for d in sorted(submission.iterdir()) if d.is_dir() and not d.name.startswith((".", "__"))
             and holds(d)] if submission.is_dir() else []
    return inner[0] if len(inner) == 1 else None


MAX_SUBMISSION = 64 << 20  # bytes of a submission's files that are copied to grade (module files weigh kilobytes)


def copy_submission(source: Path, copy: Path) -> list[str]:
    """The grader's own copy of a submission: its folders, regular files and symbolic links (kept as links,
    never followed), skipping anything else (a named pipe would block the copy) and `.git`/`__pycache__`, up
    to `MAX_SUBMISSION` bytes. Returns what was left out, in words."""
    notes, total = [], 0
    copy.mkdir(mode=0o755)
    for folder, dirs, files in os.walk(source):
        dirs[:] = sorted(d for d in dirs if d not in (".git", "__pycache__"))
        here = copy / Path(folder).relative_to(source)
        here.mkdir(mode=0o755, exist_ok=True)
        for name in sorted(files) + [d for d in dirs if (Path(folder) / d).is_symlink()]:
            path, target = Path(folder) / name, here / name
            mode = path.lstat().st_mode
            if stat.S_ISLNK(mode):
                target.symlink_to(os.readlink(path))
            elif not stat.S_ISREG(mode):
                notes.append(f"left out {path.relative_to(source)}: not a regular file")
            elif total + path.lstat().st_size > MAX_SUBMISSION:
                notes.append(f"left out {path.relative_to(source)}: the submission's files pass "
                             f"{MAX_SUBMISSION >> 20} MiB")
            else:
                total += path.lstat().st_size
                shutil.copyfile(path, target, follow_symlinks=False)
                target.chmod(0o644)
    return notes


CLEANER = """import os, shutil, sys, time
folder, *empty = sys.stdin.buffer.read().decode().splitlines()  # until the grader's end closes, however it ends
shutil.rmtree(folder, ignore_errors=True)
for _ in range(1200):  # a cgroup goes once the sandbox's last process has ended (a minute at most)
    try:
        [os.rmdir(path) for path in empty if os.path.isdir(path)]
        break
    except OSError:
        time.sleep(0.05)
"""


@contextlib.contextmanager
def private_folder(prefix: str):
    """A new temporary folder (only this user may enter it), removed at the end of the block and also when this
    process ends however it ends (SIGKILL included): a small process of its own session reads its paths from a
    pipe until this process's end closes, which the kernel does on any exit, then removes the folder and the
    empty folders (a cgroup) given to `also_remove` in the block."""
    folder = tempfile.mkdtemp(prefix=prefix)
    cleaner = subprocess.Popen([sys.executable, "-I", "-c", CLEANER], stdin=subprocess.PIPE,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def also_remove(path: Path) -> None:
        cleaner.stdin.write(f"{path}\n".encode())
        cleaner.stdin.flush()

    also_remove(Path(folder))
    try:
        yield folder, also_remove
    finally:
        cleaner.stdin.close()
        cleaner.wait()
