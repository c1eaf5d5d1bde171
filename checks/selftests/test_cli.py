"""`./check.sh` as learners and instructors type it."""

import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch

from checks.harness.loader import ROOT
from checks.harness.mistakes import catalogue
from checks.harness.modules import modules
from checks.selftests.conftest import shipped


def check_sh(*args, kit=ROOT, cwd=None):
    env = {**os.environ, "KVLAB_PYTHON": sys.executable, "COLUMNS": "120"}
    done = subprocess.run([str(kit / "check.sh"), *args], cwd=cwd or kit, env=env, capture_output=True, text=True,
                          timeout=600)
    return done.returncode, done.stdout + done.stderr


def with_shipped_stubs(kit):
    for m in modules():
        (kit / "mine" / f"{m.stem}.py").write_text(shipped(f"mine/{m.stem}.py"))


def test_first_command_on_untouched_stub(kit_copy):
    with_shipped_stubs(kit_copy)
    code, out = check_sh("m02", kit=kit_copy)
    assert code == 1
    assert "not started" in out and "mine/m02_thinker_attention.py" in out and "Nothing written yet" in out
    assert "Traceback" not in out
    code, out = check_sh("list", kit=kit_copy)  # the run is remembered
    assert code == 0 and "not started" in out.split("m02")[1].splitlines()[0], out


def test_reference_passes_through_check_sh():
    code, out = check_sh("p02", "--impl", "solutions")  # p02: a module whose checks need no HF oracle (fast)
    assert code == 0, out
    assert "All checks pass" in out and "Next: ./check.sh p03" in out  # the next module in the book's order


def test_list_shows_every_module():
    code, out = check_sh("list")
    assert code == 0
    for m in modules():
        assert m.id in out and m.title[:20] in out


def test_unknown_module_and_missing_folder_are_usage_errors():
    assert check_sh("m99")[0] == 2
    assert check_sh("m01", "--impl", "no/such/folder")[0] == 2


def test_student_folder_is_checked_in_isolation_and_left_clean(tmp_path):
    student = tmp_path / "student"
    shutil.copytree(ROOT / "solutions", student)
    source = (student / "p01_block_manager.py").read_text()
    (student / "p01_block_manager.py").write_text(source.replace("def __len__(self) -> int:", "def __len__(self) -> int", 1))
    code, out = check_sh("p01", "p02", "--impl", str(student), cwd=tmp_path)  # modules without HF oracles: fast
    assert code == 1
    assert "SyntaxError" in out and "p01_block_manager.py line" in out
    assert out.count("SyntaxError") == 1 and re.search(r"none of the \d+ checks can run", out)  # once, not per check
    assert re.search(r"p02: \d+ passed", out) and "failed" not in out.split("p02:")[1].splitlines()[0]
    assert sorted(p.name for p in student.iterdir()) == sorted(p.name for p in (ROOT / "solutions").iterdir()
                                                               if p.suffix == ".py")


def test_reset_backs_up_first(kit_copy):
    work = "def rms_norm(x, weight, eps):\n    return x  # my attempt\n"
    (kit_copy / "mine" / "m01_rmsnorm.py").write_text(work)
    code, out = check_sh("reset", "m01", kit=kit_copy)
    assert code == 0, out
    backups = list((kit_copy / ".kvlab" / "backups").glob("m01_rmsnorm.*.py"))
    assert [b.read_text() for b in backups] == [work]
    assert (kit_copy / "mine" / "m01_rmsnorm.py").read_text() == shipped("mine/m01_rmsnorm.py")


def test_a_filter_that_matches_nothing_says_so():
    code, out = check_sh("p01", "-k", "nonsense")
    assert code == 2 and "no check of p01 matches -k 'nonsense'" in out and "exit code" not in out


def test_a_filter_of_several_words_is_a_phrase_of_the_shown_names():
    """`-k "toy rows"` (words copied from the report, which pytest's -k cannot parse) selects the checks whose title
    holds the phrase, and says which it ran."""
    code, out = check_sh("m01", "--impl", "solutions", "-k", "hand-computed toy rows")
    assert code == 0, out
    assert "All 3 selected checks pass (-k hand-computed toy rows)" in " ".join(out.split())  # the toy's 3 rows
    assert "m01: 3 passed (3 checks)" in out and "Next:" not in out


def test_list_into_a_closed_pipe_is_quiet():
    done = subprocess.run(f"{ROOT / 'check.sh'} list | head -1", shell=True, capture_output=True, text=True,
                          env={**os.environ, "KVLAB_PYTHON": sys.executable})
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr


def test_only_whole_runs_count_as_progress_and_reset_forgets_it(kit_copy):
    # p02: a module whose checks need no HF oracle, so its runs start fast
    (kit_copy / "mine" / "p02_store_kvcache.py").write_text((ROOT / "solutions" / "p02_store_kvcache.py").read_text())
    state = kit_copy / ".kvlab" / "results.json"
    before = state.read_text() if state.exists() else None
    code, out = check_sh("p02", "-k", "toy", kit=kit_copy)
    assert (state.read_text() if state.exists() else None) == before  # a filtered run is not the module's status
    assert code == 0 and "selected checks pass (-k toy). The whole module: ./check.sh p02" in out, out
    assert "All checks pass" not in out and "Next:" not in out
    code, out = check_sh("p02", "-k", "NaN", kit=kit_copy)  # a word of a title the report shows, not of a test name
    assert code == 0 and "a NaN-filled cache ends with exactly the mapped slots written" in out, out
    assert "selected check passes (-k NaN)" in out or "selected checks pass (-k NaN)" in out
    checks = re.search(r"p02: (\d+) passed", check_sh("p02", kit=kit_copy)[1]).group(1)
    assert f"done ({checks}/{checks} passed)" in check_sh("list", kit=kit_copy)[1]
    code, out = check_sh("reset", "p02", kit=kit_copy)
    assert code == 0 and "to restore it: cp .kvlab/backups/p02_store_kvcache." in out
    assert f"done ({checks}/" not in check_sh("list", kit=kit_copy)[1]


def test_hints_in_the_terminal():
    code, out = check_sh("m01", "--hint", "2")
    assert code == 0 and "Hints L2" in out and "--hint 3" in out
    code, out = check_sh("m02", "--hint", "1", "--lang", "zh")  # in Chinese from the header to the last line
    assert code == 0 and "提示 L1" in out and "Hints" not in out and "下一步：./check.sh m02 --hint 2" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU, --bench times for real")
def test_bench_on_a_cpu_says_a_gpu_is_needed():
    code, out = check_sh("p03", "p06", "--bench")
    assert code == 0, out
    assert out.strip().splitlines() == [out.strip()] and "needs a CUDA GPU" in out, out
    assert check_sh("m01", "--bench")[0] == 2  # no benchmark for it: a usage error


def test_progress_is_kept_per_function():
    """A module whose PyTorch half passes while its kernel is a stub shows both, in `list` and in the book."""
    from book.progress import status_of
    from checks.__main__ import by_function, counts, function_marks
    from checks.harness.report import Result

    def row(status, calls):
        return Result("p02_store_kvcache", "a check", "", "mine", status, calls=calls)

    rows = [row("passed", ["store_kvcache_torch"])] * 3 + [row("not started", ["store_kvcache"])] * 4 + [
        row("failed", ["store_kvcache_torch", "store_kvcache"])]
    entry = {"when": "now", **counts(rows), "functions": by_function(rows)}
    assert entry["functions"] == {"store_kvcache_torch": {"checks": 4, "passed": 3, "not_started": 0},
                                  "store_kvcache": {"checks": 5, "passed": 0, "not_started": 4}}
    assert function_marks(entry) == "store_kvcache_torch 3/4  store_kvcache 0/5"
    done = {"when": "now", **counts(rows[:3]), "functions": by_function(rows[:3])}
    assert function_marks(done) == "store_kvcache_torch ✓"
    status = status_of(entry)
    assert status.kind == "partial" and status.functions == (("store_kvcache_torch", "partial", 3, 4),
                                                             ("store_kvcache", "partial", 0, 5))
    assert status_of({"when": "x", **counts(rows[3:7]), "functions": by_function(rows[3:7])}).functions == (
        ("store_kvcache", "not-started", 0, 4),)


def test_watch_checks_again_after_a_save(tmp_path):
    """`--watch` prints a verdict, then a fresh one after each save of a file in the checked folder."""
    from checks.benchmarks.check_speed import wait_for
    from checks.selftests.test_grader_attacks import run_tag, worker_processes

    shutil.copy2(ROOT / "solutions" / "m01_rmsnorm.py", tmp_path)
    tag = run_tag()
    process = subprocess.Popen([sys.executable, "-m", "checks", "m01", "--watch", "--impl", str(tmp_path)], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "COLUMNS": "120", **tag})
    try:
        wait_for(process, "watching")
        target = tmp_path / "m01_rmsnorm.py"
        target.write_text(target.read_text().replace("torch.rsqrt(variance + eps)", "torch.rsqrt(variance + 2 * eps)"))
        lines = []
        for line in process.stdout:
            lines.append(line)
            if "from the save to this verdict" in line:
                break
        output = "".join(lines)
        assert "failed" in output and "s from the save to this verdict" in output, output
    finally:
        process.terminate()  # as a learner's Ctrl-C or a closed terminal would
        process.wait(timeout=10)
    assert process.returncode == 143, "a watch stopped by SIGTERM exits 143"
    deadline = time.time() + 5
    while worker_processes(tag["KVLAB_RUN_TAG"]) and time.time() < deadline:
        time.sleep(0.1)
    assert not worker_processes(tag["KVLAB_RUN_TAG"]), "--watch left its workers running"


def test_doctor_lists_what_the_kit_uses():
    """`./check.sh doctor` names every package and tool the kit uses, with what to do when one is missing."""
    done = subprocess.run([sys.executable, "-m", "checks", "doctor"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "160"})
    assert done.returncode == 0, done.stdout + done.stderr
    for item in ("Python", "torch", "triton", "transformers", "watchfiles", "GPU", "flash-attn", "bubblewrap",
                 "Chromium"):
        assert item in done.stdout, item
    assert "Everything the checks need is here." in done.stdout


def test_hint_opens_the_next_level_and_remembers_it_for_the_book(kit_copy):
    """`--hint` with no level prints the next level not opened yet, and records the levels opened in the file
    the book reads (test_book's test_opened_hints_are_marked renders one)."""
    import json

    (kit_copy / ".kvlab" / "hints.json").unlink(missing_ok=True)
    for level in (1, 2):
        code, out = check_sh("m03", "--hint", kit=kit_copy)
        assert code == 0 and f"Hints L{level}" in out, out
    assert json.loads((kit_copy / ".kvlab" / "hints.json").read_text()) == {"m03_rope": [1, 2]}


def children() -> dict[int, list[int]]:
    """Every process's children, read from /proc."""
    found: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            found.setdefault(parent, []).append(int(entry))
    return found


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (the workers, the fork server and their children)."""
    below = children()
    found, todo = [], [pid]
    while todo:
        for child in below.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def workers_started(run: subprocess.Popen, at_least: int, timeout: float = 300) -> None:
    """Wait until `run` has started `at_least` workers (children of its fork server, which is its own child):
    a point in the run that does not depend on the machine's speed."""
    seen: set[int] = set()
    deadline = time.monotonic() + timeout
    while len(seen) < at_least:
        assert run.poll() is None, f"the run ended after {len(seen)} workers:\n{run.communicate()[0]}"
        assert time.monotonic() < deadline, f"the run started {len(seen)} workers in {timeout} s"
        below = children()
        seen |= {worker for server in below.get(run.pid, []) for worker in below.get(server, [])}
        time.sleep(0.1)  # a read of every process's parent costs milliseconds: not more often


# kind -> (signal, exit code, the run, how many workers it starts before the second module)
SIGNALLED = {
    # the reference: p06's engine running in the worker when the signal comes
    "run": ("SIGTERM", 143, ["p02", "p06", "--impl", "solutions"], 1),
    # the catalogue: the checks' process replays mutants (Triton's interpreter) to name them, and a signal
    # there must not pass for a mutant's crash
    "mutants": ("SIGINT", 130, ["p02", "p04", "--impl", "mutants"], len(catalogue("p02_store_kvcache").mistakes)),
    # a grade: the score of what finished, every output saying it was cut short
    "grade": ("SIGTERM", 143, ["grade", "solutions", "p02", "p06", "--no-sandbox"], 1),
    # a run still loading torch and the oracles: no check ran, and the files asked for say so
    "starting": ("SIGTERM", 143, ["grade", "solutions", "m01", "--no-sandbox"], None),
}


@pytest.mark.parametrize("kind", SIGNALLED)
def test_a_signal_stops_the_run_within_seconds(tmp_path, kind):
    """SIGTERM (a `timeout`, a grader's kill) or Ctrl-C stops a run in a few seconds, ends its workers, says
    "interrupted" with what had finished, and still writes --json (or a grade's results), marked incomplete."""
    import json
    import signal

    signal_name, code, args, first_module = SIGNALLED[kind]
    report = tmp_path / "results.json"
    written = ["--gradescope", str(report)] if kind == "grade" else ["--json", str(report)]
    env = {**os.environ, "COLUMNS": "120", "PYTHONPATH": str(ROOT)}
    run = subprocess.Popen([sys.executable, "-m", "checks", *args, *written], cwd=ROOT, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if first_module is None:  # torch loading (the moment does not depend on the machine's speed)
        deadline = time.monotonic() + 60
        while b"libtorch" not in open(f"/proc/{run.pid}/maps", "rb").read():
            assert run.poll() is None and time.monotonic() < deadline, "the run never loaded torch"
            time.sleep(0.01)
    else:
        workers_started(run, first_module + 1)  # the first module done, the second started
        time.sleep(2)
    below = descendants(run.pid)
    sent = time.perf_counter()
    run.send_signal(getattr(signal, signal_name))
    out, _ = run.communicate(timeout=60)
    took = time.perf_counter() - sent
    assert took < 5, f"the run took {took:.1f} s to stop"
    assert run.returncode == code, out
    assert "interrupted" in out and "Traceback" not in out, out
    if kind == "grade":  # a grade --no-sandbox says so, on screen and in Gradescope's results
        assert "interrupted" in json.loads(report.read_text())["output"]
        assert "WITHOUT the sandbox" in out and "WITHOUT the sandbox" in json.loads(report.read_text())["output"]
    else:
        assert json.loads(report.read_text())["complete"] is False
    time.sleep(0.5)
    left = [pid for pid in below if os.path.exists(f"/proc/{pid}") and
            open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"]
    assert not left, f"processes of the run still there: {left}"
