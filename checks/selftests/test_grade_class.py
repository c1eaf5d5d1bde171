"""`./check.sh grade-class`: a made-up class graded in sandboxes, its score sheet, a second run that grades only
what changed, and a grade that breaks the grader's own limit as one row (m01 only: the cheapest module)."""

import csv
import json
import os
import subprocess
import sys

import pytest

from checks.grading import sandbox_problem
from checks.harness.loader import ROOT
from checks.harness.mistakes import catalogue

pytestmark = pytest.mark.skipif(sandbox_problem() is not None, reason=f"no sandbox here: {sandbox_problem()}")
STEM = "m01_rmsnorm"
REFERENCE = (ROOT / "solutions" / f"{STEM}.py").read_text()


def grade_class(*args) -> subprocess.CompletedProcess:
    return subprocess.run([str(ROOT / "check.sh"), "grade-class", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, "KVLAB_PYTHON": sys.executable}, timeout=300)


def sheet(out) -> dict[str, dict]:
    with open(out / "scores.csv", newline="") as f:
        return {row["student"]: row for row in csv.DictReader(f)}


def test_a_class_is_graded_once_and_again_only_where_it_changed(tmp_path):
    submissions, out = tmp_path / "class", tmp_path / "out"
    mutant = catalogue(STEM).mistake("sum-not-mean").patch(REFERENCE)
    for student, source in (("alice", REFERENCE), ("bob", mutant)):
        (submissions / student).mkdir(parents=True)
        (submissions / student / f"{STEM}.py").write_text(source)
    (submissions / "carol").mkdir()  # uploaded nothing
    done = grade_class(submissions, "m01", "--out", out, "-j", "2", "--seed", "5")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 students: 2 graded, 1 empty" in done.stdout
    rows = sheet(out)
    assert (rows["alice"]["status"], rows["alice"]["m01"], rows["alice"]["max"]) == ("graded", "20", "20")
    assert rows["bob"]["status"] == "graded" and 0 < float(rows["bob"]["m01"]) < 20
    assert (rows["carol"]["status"], rows["carol"]["total"], rows["carol"]["max"]) == ("empty", "0", "20")
    log = (out / "alice" / "grade.log").read_text()  # grade's report speaks to the instructor: no learner's next step
    assert "All checks pass." in log and "Next:" not in log
    bob = json.loads((out / "bob" / "graded.json").read_text())
    assert bob["sources"] and bob["seconds"] > 0 and (out / "bob" / "junit.xml").is_file()
    checks = json.loads((out / "bob" / "checks.json").read_text())
    assert any("sum-not-mean" in r["mistakes"] for r in checks["results"])
    kept = {s: (out / s / "graded.json").stat().st_mtime_ns for s in ("alice", "bob", "carol")}

    (submissions / "bob" / f"{STEM}.py").write_text(REFERENCE)  # bob fixed his file: only he is graded again
    again = grade_class(submissions, "m01", "--out", out, "-j", "2")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "2 already graded, 1 to grade" in again.stderr and "seed 5" in again.stderr  # the class keeps its seed
    assert [s for s in kept if (out / s / "graded.json").stat().st_mtime_ns != kept[s]] == ["bob"]
    assert sheet(out)["bob"]["m01"] == "20"


def test_a_grade_past_the_student_limit_is_one_row_and_the_class_goes_on(tmp_path):
    submissions, out = tmp_path / "class", tmp_path / "out"
    (submissions / "dan").mkdir(parents=True)
    (submissions / "dan" / f"{STEM}.py").write_text(REFERENCE.replace("def rms_norm(x", "def rms_norm(x, *_, **__):\n"
                                                                      "    while True: pass\n\n\ndef _unused(x", 1))
    done = grade_class(submissions, "m01", "--out", out, "--time-limit", "60", "--student-limit", "3")
    assert done.returncode == 0, done.stdout + done.stderr
    row = sheet(out)["dan"]
    assert row["status"] == "grader-error" and "longer than --student-limit 3 s" in row["reason"]
    assert not list(out.glob("*.partial"))
