"""`./check.sh autograder`: the zip is built, unpacked into a Gradescope root made here, and its
`run_autograder` grades uploads there as Gradescope would run it (setup.sh's installs are this machine's
own: `KVLAB_PYTHON` points at this Python)."""

import json
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from checks.grading import sandbox_problem
from checks.harness.loader import ROOT
from checks.harness.mistakes import catalogue

STEM = "m01_rmsnorm"


@pytest.fixture(scope="module")
def autograder(tmp_path_factory):
    """The zip of m01 at 10 points, visible after the due date, unpacked as /autograder/source is."""
    where = tmp_path_factory.mktemp("gradescope")
    out = where / "autograder.zip"
    done = subprocess.run([str(ROOT / "check.sh"), "autograder", str(out), "m01", "--visibility", "after_due_date",
                           "--points", "m01=10"], env={**os.environ, "KVLAB_PYTHON": sys.executable},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    with zipfile.ZipFile(out) as archive:
        names = archive.namelist()
        assert {"setup.sh", "run_autograder", "kvlab/autograder.json", "kvlab/check.sh"} <= set(names)
        assert not any(n.startswith(("kvlab/mine/", "kvlab/.kvlab/")) for n in names)
        assert archive.getinfo("run_autograder").external_attr >> 16 & 0o111  # executable
        archive.extractall(where / "root" / "source")
    return where / "root"


def grade(root, upload: dict[str, str | bytes], sandbox: bool = True) -> dict:
    """Put `upload` (path -> text, or bytes for a zip) in the root's submission folder and run run_autograder."""
    shutil.rmtree(root / "submission", ignore_errors=True)
    shutil.rmtree(root / "results", ignore_errors=True)
    for name, content in upload.items():
        path = root / "submission" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    (root / "submission").mkdir(exist_ok=True)
    env = {**os.environ, "KVLAB_GRADESCOPE_ROOT": str(root), "KVLAB_PYTHON": sys.executable,
           "KVLAB_AUTOGRADER_SANDBOX": "on" if sandbox else "off"}
    done = subprocess.run(["bash", str(root / "source" / "run_autograder")], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads((root / "results" / "results.json").read_text())


def zipped(files: dict[str, str]) -> bytes:
    import io

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    return buffer.getvalue()


@pytest.mark.skipif(sandbox_problem() is not None, reason=f"no sandbox here: {sandbox_problem()}")
def test_an_honest_upload_zipped_one_folder_down_scores_everything(autograder):
    reference = (ROOT / "solutions" / f"{STEM}.py").read_text()
    results = grade(autograder, {"work.zip": zipped({f"mine/{STEM}.py": reference})})
    assert results["score"] == pytest.approx(10) and results["visibility"] == "after_due_date"
    assert results["tests"] and all(t["status"] == "passed" and t["visibility"] == "after_due_date"
                                    for t in results["tests"])
    assert sum(t["max_score"] for t in results["tests"]) == pytest.approx(10)
    assert "without the sandbox" not in results["output"]


def test_a_mutant_that_tries_to_read_the_kit_is_named_and_scores_less(autograder):
    """Without bubblewrap (a container without user namespaces), the kit is root's alone (setup.sh) and the
    worker runs as nobody: a submission that would use the reference's code if it could read it cannot."""
    if os.getuid() != 0:
        pytest.skip("the unsandboxed worker drops to nobody only when the grader runs as root (as on Gradescope)")
    kit = autograder / "source"
    os.chmod(kit, 0o700)  # what setup.sh's `chmod -R go-rwx` leaves for the worker to see
    stolen = kit / "kvlab" / "solutions" / f"{STEM}.py"
    mutant = catalogue(STEM).mistake("sum-not-mean").patch((ROOT / "solutions" / f"{STEM}.py").read_text())
    thief = mutant + "\n\ntry:  # the reference, if this process can read it\n" \
                     f"    exec(open({str(stolen)!r}).read())\nexcept OSError:\n    pass\n"
    try:
        results = grade(autograder, {f"{STEM}.py": thief}, sandbox=False)
    finally:
        os.chmod(kit, 0o755)
    assert 0 < results["score"] < 10, results["output"]
    failed = [t for t in results["tests"] if t["status"] == "failed"]
    assert failed and any("matches the known mistake(s): sum-not-mean" in t["output"] for t in failed)
    assert "graded without the sandbox (--no-sandbox --worker-user nobody)" in results["output"]


def test_an_upload_without_module_files_says_what_to_upload(autograder):
    results = grade(autograder, {"notes.txt": "I could not finish"})
    assert results["score"] == 0 and results["tests"] == [] and results["visibility"] == "after_due_date"
    assert "No module file found" in results["output"] and f"{STEM}.py" in results["output"]


def test_a_check_this_machine_skips_whole_is_out_of_the_total():
    """A GPU grader skips the CPU-interpreter-only checks (and any machine may lack flash-attn or a second GPU):
    the reference still scores full marks, out of what was checked."""
    from checks.grading import checks_of, gradescope, scale
    from checks.harness.report import Result

    rows = [Result(STEM, "a", "1", "x", "passed", function="test_a", points=3),
            Result(STEM, "a", "2", "x", "passed", function="test_a", points=3),
            Result(STEM, "b", "", "x", "skipped", reason="needs two GPUs", function="test_b", points=2)]
    checks = checks_of(rows)
    out = gradescope(checks, 1.0, [], 0)
    assert out["score"] == 3 and sum(t["max_score"] for t in out["tests"]) == 3
    scale(checks, {STEM: 10})
    assert [c.score for c in checks] == [10, 0] and [c.worth for c in checks] == [10, 0]
