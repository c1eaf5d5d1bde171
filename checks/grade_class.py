"""`./check.sh grade-class SUBMISSIONS --out DIR [-j N] [MODULE ...]`: a whole class, each student in a sandbox.

Every subfolder of SUBMISSIONS is one student (its module files there or one folder down). Each is
graded by its own `./check.sh grade` process, N at a time, and leaves in `DIR/<student>/` Gradescope's
`results.json`, JUnit's `junit.xml`, the checks' `checks.json`, the grader's `grade.log` and
`graded.json` (status, scores, hashes), written last: a student with a `graded.json` is done. Then
`DIR/scores.csv` (a row per student: status, points per module, total), a copy of the book in
`DIR/book`, and the class report `DIR/class.html` (`class.zh.html` in Chinese).

Started again with the same options, it grades only the students whose files changed (the hash of a
submission and of the options is kept with its result), so an interrupted run loses nothing graded. A
submission that breaks the grader (a crash of `grade` itself, a grade past `--student-limit`) is one row
with its reason; the class goes on. All students share one seed (kept in `DIR/class.json`): the same
cases for everyone.
"""

import argparse
import ast
import contextlib
import csv
import ctypes
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from checks.grading import module_folder
from checks.harness.loader import ROOT
from checks.harness.modules import find, modules
from checks.harness.stubs import stub_for

STATUSES = ("graded", "crashed", "hung", "empty", "grader-error")
LIBC = ctypes.CDLL(None, use_errno=True)
PR_SET_PDEATHSIG = 1


def _end_with_this_process() -> None:
    """In a student's `grade` process, before it runs: SIGTERM when the thread that started it ends (a
    grade-class killed by SIGKILL leaves no grade running: `grade` stops at SIGTERM and removes its sandbox)."""
    LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
HUNG, CRASHED = "did not return within", "the worker process running it"  # words of the one-line reasons


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="./check.sh grade-class", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("submissions", metavar="SUBMISSIONS", help="a folder with one subfolder per student")
    parser.add_argument("modules", nargs="*", metavar="MODULE", help="the modules to grade (default: all)")
    parser.add_argument("--out", required=True, metavar="DIR", help="where the results and the report go")
    parser.add_argument("-j", type=int, default=max(1, (os.cpu_count() or 2) // 2), metavar="N",
                        help="students graded at once (default: half the cores)")
    parser.add_argument("--time-limit", type=float, default=10.0, metavar="S", help="seconds one call may take")
    parser.add_argument("--memory-limit", type=float, default=4.0, metavar="GIB", help="GiB per sandbox")
    parser.add_argument("--student-limit", type=float, default=1800.0, metavar="S",
                        help="seconds one student's whole grade may take before it counts as a grader error")
    parser.add_argument("--seed", type=int, help="the class's seed (default: drawn once, kept in DIR/class.json)")
    parser.add_argument("--no-sandbox", action="store_true", help="grade without bubblewrap (every output says so)")
    args = parser.parse_args(argv)
    if args.j < 1:
        parser.error("-j must be at least 1")
    return args


# ---- what a student handed in --------------------------------------------------------------------------


def files_hash(folder: Path, options: str) -> str:
    """The submission's files (paths, contents, links) and the grading options, as one sha256."""
    digest = hashlib.sha256(options.encode())
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        if any(part in (".git", "__pycache__") for part in relative.parts):
            continue
        if path.is_symlink():
            digest.update(f"link {relative} {os.readlink(path)}\n".encode())
        elif path.is_file():
            digest.update(f"file {relative} {path.stat().st_size}\n".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def normalised(source: str) -> str:
    """A hash of the code without its formatting, comments and docstrings: two copies of one file that differ
    only in those have the same one."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return hashlib.sha256("".join(source.split()).encode()).hexdigest()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and \
                isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
    return hashlib.sha256(ast.dump(tree, annotate_fields=False).encode()).hexdigest()


def written_sources(folder: Path, stems: list[str], stubs: dict[str, str]) -> dict[str, str]:
    """file name -> normalised hash, for the module files that differ from the shipped stub."""
    found = {}
    for stem in stems:
        path = folder / f"{stem}.py"
        if path.is_file() and not path.is_symlink():
            digest = normalised(path.read_text(encoding="utf-8", errors="replace"))
            if digest != stubs[stem]:
                found[path.name] = digest
    return found


# ---- one student ---------------------------------------------------------------------------------------


class Student:
    def __init__(self, folder: Path, out: Path):
        self.id, self.folder, self.out = folder.name, folder, out / folder.name
        self.process: subprocess.Popen | None = None

    def done(self, key: str) -> dict | None:
        try:
            record = json.loads((self.out / "graded.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) and record.get("hash") == key else None

    def grade(self, args, stems: list[str], seed: int, key: str, stubs: dict[str, str], stopping) -> dict:
        started = time.perf_counter()
        partial = self.out.with_name(self.out.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        record = {"student": self.id, "hash": key, "status": "graded", "reason": "", "seconds": 0.0,
                  "modules": stems, "scores": dict.fromkeys(stems, 0.0), "max": {}, "total": 0.0, "max_total": 0.0,
                  "sources": {}}
        folder = module_folder(self.folder)
        if folder is None:
            record.update(status="empty", reason="no module file (m01_rmsnorm.py, …) in the folder or one folder down")
        else:
            record["sources"] = written_sources(folder, stems, stubs)
            self.run_grade(args, folder, stems, seed, partial, record, stopping)
        record["seconds"] = round(time.perf_counter() - started, 1)
        record["total"], record["max_total"] = round(sum(record["scores"].values()), 2), sum(record["max"].values())
        (partial / "graded.json").write_text(json.dumps(record, indent=1), encoding="utf-8")
        shutil.rmtree(self.out, ignore_errors=True)
        partial.rename(self.out)  # the result appears whole or not at all
        return record

    def run_grade(self, args, folder: Path, stems: list[str], seed: int, partial: Path, record: dict, stopping):
        command = [sys.executable, "-P", "-m", "checks", "grade", str(folder), *stems, "--seed", str(seed),
                   "--gradescope", str(partial / "results.json"), "--junit", str(partial / "junit.xml"),
                   "--json", str(partial / "checks.json"), "--time-limit", str(args.time_limit),
                   "--memory-limit", str(args.memory_limit)] + (["--no-sandbox"] if args.no_sandbox else [])
        env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "120"}
        with open(partial / "grade.log", "wb") as log:
            if stopping.is_set():
                raise KeyboardInterrupt
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=env, cwd=ROOT, start_new_session=True,
                                            preexec_fn=_end_with_this_process)
            try:
                code = self.process.wait(timeout=args.student_limit)
            except subprocess.TimeoutExpired:
                self.stop()
                code = None
            finally:
                self.process = None
        if stopping.is_set():
            raise KeyboardInterrupt
        try:
            checks = json.loads((partial / "checks.json").read_text(encoding="utf-8"))
            gradescope = json.loads((partial / "results.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            checks = gradescope = None
        if code is None:
            record.update(status="grader-error", reason=f"the grade took longer than --student-limit "
                                                         f"{args.student_limit:g} s and was stopped")
        elif code not in (0, 1) or checks is None or gradescope is None or not checks.get("complete"):
            tail = (partial / "grade.log").read_text(encoding="utf-8", errors="replace").strip().splitlines()
            record.update(status="grader-error", reason=f"the grader ended with status {code}: "
                                                        f"{tail[-1][:200] if tail else 'no output'}")
        if gradescope is not None:
            for test in gradescope.get("tests", []):
                stem = find(test["tags"][0]).stem
                record["scores"][stem] = round(record["scores"].get(stem, 0.0) + test["score"], 2)
                record["max"][stem] = record["max"].get(stem, 0.0) + test["max_score"]
        if record["status"] == "graded" and checks is not None:
            reasons = [r["reason"] for r in checks["results"] if r["status"] not in ("passed", "skipped")]
            for status, words in (("crashed", CRASHED), ("hung", HUNG)):
                found = next((r for r in reasons if words in r), None)
                if found:
                    record.update(status=status, reason=found[:200])
                    break

    def stop(self) -> None:
        process = self.process
        if process is not None and process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGTERM)  # `grade` ends its sandbox and cleans up
                process.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()


# ---- the class -----------------------------------------------------------------------------------------


def class_seed(out: Path, asked: int | None) -> int:
    path = out / "class.json"
    try:
        kept = json.loads(path.read_text(encoding="utf-8"))["seed"]
    except (OSError, ValueError, KeyError, TypeError):
        kept = None
    seed = asked if asked is not None else kept if isinstance(kept, int) else random.randrange(10_000)
    path.write_text(json.dumps({"seed": seed}), encoding="utf-8")
    return seed


def write_scores(out: Path, records: list[dict], stems: list[str]) -> Path:
    path = out / "scores.csv"
    with open(path, "w", newline="", encoding="utf-8") as sheet:
        writer = csv.writer(sheet)
        writer.writerow(["student", "status", *[find(s).id for s in stems], "total", "max", "seconds", "reason"])
        for r in sorted(records, key=lambda r: r["student"]):
            writer.writerow([r["student"], r["status"], *[f"{r['scores'].get(s, 0):g}" for s in stems],
                             f"{r['total']:g}", f"{r['max_total']:g}", r["seconds"], r["reason"]])
    return path


def main(argv: list[str]) -> int:
    args = parse(argv)
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    submissions, out = Path(args.submissions).expanduser(), Path(args.out).expanduser()
    if not submissions.is_dir():
        print(f"./check.sh grade-class: no such folder {submissions}", file=sys.stderr)
        return 2
    stems = []
    for name in args.modules or [m.id for m in modules()]:
        module = find(name)
        if module is None:
            print(f"./check.sh grade-class: no module {name!r}", file=sys.stderr)
            return 2
        stems.append(module.stem)
    if out.resolve().is_relative_to(submissions.resolve()):
        print("./check.sh grade-class: --out must not lie inside SUBMISSIONS (it would be graded as a student)",
              file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    seed = class_seed(out, args.seed)
    options = json.dumps({"modules": stems, "seed": seed, "time_limit": args.time_limit,
                          "memory_limit": args.memory_limit, "sandbox": not args.no_sandbox})
    students = [Student(f, out) for f in sorted(submissions.iterdir()) if f.is_dir() and not f.name.startswith(".")]
    if not students:
        print(f"./check.sh grade-class: {submissions} has no subfolder (one per student)", file=sys.stderr)
        return 2
    stubs = {stem: normalised(stub_for(ROOT, stem)) for stem in stems}
    keys = {s.id: files_hash(s.folder, options) for s in students}
    records = {s.id: r for s in students if (r := s.done(keys[s.id])) is not None}
    todo = [s for s in students if s.id not in records]
    console = Console(highlight=False, stderr=True)
    console.print(f"grade-class: {len(students)} students, {', '.join(find(s).id for s in stems)}, seed {seed}, "
                  f"{args.j} at a time; {len(records)} already graded, {len(todo)} to grade"
                  + ("" if not args.no_sandbox else " · WITHOUT the sandbox (--no-sandbox)"))
    stopping = threading.Event()
    interrupted = False
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("left"), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as progress, ThreadPoolExecutor(args.j) as pool:
        task = progress.add_task("grading", total=len(todo))
        futures = {pool.submit(s.grade, args, stems, seed, keys[s.id], stubs, stopping): s for s in todo}
        try:
            for future in as_completed(futures):
                student = futures[future]
                try:
                    record = future.result()
                except KeyboardInterrupt:
                    continue
                except Exception as error:  # noqa: BLE001 - a bug of this command: the student's row says so
                    record = {"student": student.id, "status": "grader-error", "reason": f"{type(error).__name__}: "
                              f"{error}", "scores": {}, "total": 0.0, "max_total": 0.0, "seconds": 0.0}
                records[student.id] = record
                progress.advance(task)
                console.print(f"  {student.id}: {record['total']:g} / {record['max_total']:g} · {record['status']}"
                              f"{' · ' + record['reason'] if record['reason'] else ''} ({record['seconds']:g} s)")
        except KeyboardInterrupt:
            interrupted = True
            stopping.set()
            for future in futures:
                future.cancel()
            for student in todo:
                student.stop()
    if interrupted:
        print(f"./check.sh grade-class: interrupted: {len(records)} of {len(students)} students graded and kept in "
              f"{out}; the same command goes on from there", file=sys.stderr)
        return 130
    ordered = [records[s.id] for s in students]
    most = {stem: max((r.get("max", {}).get(stem, 0.0) for r in ordered), default=0.0) for stem in stems}
    for r in ordered:  # an empty folder or a grader error is out of the same points as everyone
        r["max"] = most
        r["max_total"] = sum(most.values())
    scores = write_scores(out, ordered, stems)
    try:
        report = write_report(out)
    except ImportError as error:  # a library of the kit's own missing: the scores stand, the report says why not
        print(f"./check.sh grade-class: the class report could not be written ({error}); the kit's dependencies "
              "are incomplete: pip install -e . in the kit's folder, then run the same command again", file=sys.stderr)
        report = []
    counts = {status: sum(r["status"] == status for r in ordered) for status in STATUSES}
    print(f"{len(ordered)} students: " + ", ".join(f"{n} {status}" for status, n in counts.items() if n))
    print(f"scores: {scores}")
    for path in report:
        print(f"report: {path}")
    return 0


def write_report(out: Path) -> list[Path]:
    """The book (for the mistakes' links) and the class report."""
    from book.class_report import write_class_report

    if not (out / "book" / "index.html").is_file():  # the pages do not depend on the grades: built once
        try:
            from book.build import main as build_book

            with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
                build_book(str(out / "book"))
        except Exception as error:  # noqa: BLE001 - the report still tells the class's story, without links
            print(f"./check.sh grade-class: the book could not be built ({type(error).__name__}: {error}); the "
                  "report's mistakes are not linked to their pitfalls", file=sys.stderr)
            return write_class_report(out, None)
    return write_class_report(out, "book")
