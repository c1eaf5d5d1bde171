"""Submissions that attack the grader, and what they get: a failed verdict with a one-line reason.

Every attack is an `m01_rmsnorm.py` (the smallest module) whose functions misbehave in one way. The
ones that need nothing but the worker process run together as `--impl` folders of one learner-mode
run; the ones that reach for the machine (the kit's files, the results file, memory, processes, the
network, the grader's environment) run through `./check.sh grade` in the sandbox, one by one. Each
must end with a nonzero exit, a report and JSON that say failed, and nothing changed outside the
submission's copy.
"""

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from checks.grading import sandbox_problem
from checks.harness.limits import own_memory_cgroup
from checks.harness.loader import ROOT

CORRECT = (ROOT / "solutions" / "m01_rmsnorm.py").read_text()
ZEROS = """
def rms_norm(x, weight, eps):
    return torch.zeros_like(x)


def add_rms_norm(x, residual, weight, eps):
    return torch.zeros_like(x), torch.zeros_like(x)
"""


def attack(body: str, functions: str = ZEROS) -> str:
    return "import os, signal, sys, time\nimport torch\n\n" + textwrap.dedent(body) + "\n" + functions


def both(statement: str) -> str:
    """Both public functions run `statement` (then return zeros)."""
    lines = textwrap.indent(textwrap.dedent(statement).strip(), "    ")
    return (f"def rms_norm(x, weight, eps):\n{lines}\n    return torch.zeros_like(x)\n\n\n"
            f"def add_rms_norm(x, residual, weight, eps):\n{lines}\n"
            "    return torch.zeros_like(x), torch.zeros_like(x)\n")


FORGE = """
import pickle, struct


def forge(message):
    \"\"\"Write `message`, framed as the worker's replies are, to every descriptor the worker may hold.\"\"\"
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    for fd in range(3, 64):
        try:
            os.write(fd, struct.pack("<Q", len(data)) + data)
        except OSError:
            pass
"""

# name -> (the file, text its reasons must contain)
IN_THE_WORKER = {
    "patches-the-harness": (attack("""
        for name, module in list(sys.modules.items()):
            if name.startswith("checks"):
                for attr in ("expect_close", "close_enough", "contract_problem"):
                    if hasattr(module, attr):
                        setattr(module, attr, lambda *a, **k: True)
        try:
            import checks.harness.compare as compare
            compare.expect_close = lambda *a, **k: None
        except Exception:
            pass
    """), "max error"),
    "patches-torch": (attack("""
        torch.allclose = lambda *a, **k: True
        torch.equal = lambda *a, **k: True
        torch.Tensor.__eq__ = lambda self, other: torch.ones((), dtype=torch.bool)
        torch.isclose = lambda a, b, *args, **kw: torch.ones_like(a, dtype=torch.bool)
    """), ""),
    "patches-pytest-and-the-reporter": (attack("""
        import pytest
        pytest.fail = lambda *a, **k: None
        try:
            from checks.harness import report
            report.Reporter.classify = lambda self, item, call, rep: None
        except Exception:
            pass
    """), "max error"),
    "imports-the-reference": (attack("from solutions.m01_rmsnorm import *  # noqa\n", ""), "No module named"),
    "sys-exit-at-import": (attack("sys.exit(0)"), "importing"),
    "os-exit-at-import": (attack("os._exit(0)"), "exited with status 0"),
    "kills-itself-at-import": (attack("os.kill(os.getpid(), signal.SIGKILL)"), "SIGKILL"),
    "sys-exit-in-a-call": (attack("", both("sys.exit(0)")), "SystemExit"),
    "os-exit-in-a-call": (attack("", both("os._exit(3)")), "exited with status 3"),
    "kills-itself-in-a-call": (attack("", both("os.kill(os.getpid(), signal.SIGTERM)")), "SIGTERM"),
    "segfaults": (attack("", both("import ctypes; ctypes.string_at(0)")), "SIGSEGV"),
    # stopped at the time limit, the report says the learner's line it was on (line 6: the statement `both` adds)
    "hangs-in-python": (attack("", both("while True: pass")), "m01_rmsnorm.py line 6) when stopped"),
    "hangs-inside-a-torch-call": (attack("", both("torch.linalg.matrix_power(torch.randn(2500, 2500), 10**9)")),
                                  "m01_rmsnorm.py line 6) when stopped"),
    "reads-the-callers-frames": (attack("", both("""
        frame = sys._getframe(1)
        while frame is not None:
            for value in list(frame.f_locals.values()):
                if isinstance(value, torch.Tensor) and value.shape == x.shape and value is not x:
                    return value
            frame = frame.f_back
    """)), "max error"),
    "returns-its-input": (attack("", "def rms_norm(x, weight, eps):\n    return x\n\n\n"
                                     "def add_rms_norm(x, residual, weight, eps):\n    return x, residual\n"),
                          "returned one of its inputs"),
    "returns-a-view-of-its-input": (attack("", "def rms_norm(x, weight, eps):\n    return x.view_as(x)\n\n\n"
                                               "def add_rms_norm(x, residual, weight, eps):\n"
                                               "    return x[:], residual.view_as(residual)\n"),
                                    "returned one of its inputs"),
    "returns-a-lying-tensor-subclass": (attack("""
        class Liar(torch.Tensor):
            def __eq__(self, other):
                return True
            def __sub__(self, other):
                return torch.zeros(()).as_subclass(Liar)
            def abs(self):
                return torch.zeros(())
    """, "def rms_norm(x, weight, eps):\n    return torch.zeros_like(x).as_subclass(Liar)\n\n\n"
         "def add_rms_norm(x, residual, weight, eps):\n"
         "    return torch.zeros_like(x).as_subclass(Liar), torch.zeros_like(x).as_subclass(Liar)\n"),
        "subclass"),
    "raises-keyboard-interrupt": (attack("", both("raise KeyboardInterrupt")), "KeyboardInterrupt"),
    "raises-pytest-skip": (attack("", both("import pytest; pytest.skip('not today')")), "Skipped"),
    "raises-pytest-exit": (attack("", both("import pytest; pytest.exit('stop', returncode=0)")), "Exit"),
    "raises-a-base-exception": (attack("class Escape(BaseException):\n    pass\n", both("raise Escape('out')")),
                                "Escape"),
    "hides-an-in-place-write-behind-star-args": (attack("", """
def rms_norm(*args):
    x = args[0]
    out = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + args[2])).to(x.dtype) * args[1]
    x.zero_()
    return out


def add_rms_norm(*args):
    x, residual = args[0], args[1]
    x.add_(residual)
    return torch.zeros_like(x), x.clone()
"""), "in place"),
    "behaves-differently-when-it-detects-the-checks": (attack("""
        WATCHED = "pytest" in sys.modules or "PYTEST_CURRENT_TEST" in os.environ or any(
            name.startswith("checks") for name in sys.modules)
    """, both("""
        if WATCHED:
            raise RuntimeError("found the checks")
    """)), "max error"),
    "writes-garbage-to-its-channel": (attack("", both("""
        for fd in range(3, 64):
            try:
                os.write(fd, b"\\xff" * 64)
            except OSError:
                pass
    """)), "not a reply"),
    "leaves-a-thread-and-a-child-behind": (attack("""
        import threading
        MARKER = "{marker}"
        def later():
            time.sleep(4)
            with open(MARKER, "a") as f:
                f.write("still running after the checks ended\\n")
        def leave_behind():
            threading.Thread(target=later, daemon=False).start()
            if os.fork() == 0:
                os.setsid()
                if os.fork() == 0:
                    later()
                os._exit(0)
    """, both("leave_behind()")), "thread(s) running"),
    "forges-a-passing-reply": (attack("""
        import pickle, struct
        def forge():
            message = pickle.dumps((("T", ["returned", ("X", 0, "float32", [1], [1], 0, "cpu"), None,
                                             ("D", []), ("D", []), ("D", []), None, ("L", []), 0]), [b"\\0\\0\\0\\0"]))
            for fd in range(3, 64):
                try:
                    os.write(fd, struct.pack("<Q", len(message)) + message)
                except OSError:
                    pass
    """, both("forge()")), ""),
    "disables-the-in-place-detector-then-writes-its-input": (attack("""
        def blind():  # the worker's own before/after comparison of the inputs now finds nothing
            for name, module in list(sys.modules.items()):
                if hasattr(module, "changed_input"):
                    module.changed_input = lambda *args, **kwargs: None
    """, """
def rms_norm(x, weight, eps):
    blind()
    out = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight
    x.mul_(0.5)
    return out


def add_rms_norm(x, residual, weight, eps):
    blind()
    total = x + residual
    residual.zero_()
    return rms_norm(total.clone(), weight, eps), total
"""), "changed its input"),
    "forges-a-reply-that-never-ends-decoding": (FORGE + attack("", both("""
        node = ("T", [])
        for _ in range(120):  # 2**120 nodes in a few kilobytes: pickle's memo shares each level twice
            node = ("T", [node, node])
        forge((("T", ["returned", node, None, ("D", []), ("D", []), ("D", []), None, ("L", []), 0]), []))
    """)), "not a reply"),
    "forges-one-blob-as-many-storages": (FORGE + attack("", both("""
        blob = bytes(4 << 20)
        tensors = [("X", i, "uint8", [4 << 20], [1], 0, "cpu") for i in range(200)]  # 800 MB if each were its own
        forge((("T", ["returned", ("L", tensors), None, ("D", []), ("D", []), ("D", []), None, ("L", []), 0]),
               [blob] * 200))
    """)), "not a reply"),
    "forges-a-dict-keyed-by-a-list": (FORGE + attack("", both("""
        forge((("T", ["returned", ("D", [(("L", []), 1)]), None, ("D", []), ("D", []), ("D", []), None,
                      ("L", []), 0]), []))
    """)), "not a reply"),
    "forges-a-message-that-is-not-a-pair": (FORGE + attack("", both("forge(12345)")), "not a reply"),
    "forges-a-reason-that-rewrites-the-terminal": (FORGE + attack("", both("""
        forge((("T", ["raised", "\\x1b[2J\\x1b[H\\x1b[32m all checks pass \\x1b[0m\\x07\\x00\\u202e" + "A" * (4 << 20)]), []))
    """)), "all checks pass"),
}


def write_attack(folder: Path, text: str) -> Path:
    folder.mkdir(parents=True)
    (folder / "m01_rmsnorm.py").write_text(text)
    return folder


def check_sh(*args, cwd=ROOT, env=None, timeout=600):
    done = subprocess.run([str(ROOT / "check.sh"), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "KVLAB_PYTHON": sys.executable, "COLUMNS": "140", **(env or {})})
    return done.returncode, done.stdout + done.stderr


def one_line_failures(rows: list[dict], expect: str) -> None:
    """Every check fails (the untouched-inputs check may pass on zeros), each with one line."""
    assert rows, "the attack was not run"
    value_checks = [r for r in rows if r["function"] != "test_fp32_inputs_are_not_modified"]
    assert all(r["status"] == "failed" for r in value_checks), {(r["check"], r["status"], r["reason"]) for r in
                                                              value_checks if r["status"] != "failed"}
    for r in rows:
        assert "\n" not in r["reason"] and len(r["reason"]) < 400 and "Traceback" not in r["reason"], r["reason"][:400]
        assert r["reason"].isprintable(), r["reason"][:400]  # no escape sequence, control or format character
    assert any(expect in r["reason"] for r in value_checks), [r["reason"] for r in value_checks][:4]


@pytest.fixture(scope="module")
def worker_attacks(tmp_path_factory):
    top = tmp_path_factory.mktemp("attacks")
    marker = top / "marker.txt"
    folders = {name: write_attack(top / name, text.replace("{marker}", str(marker)))
               for name, (text, _) in IN_THE_WORKER.items()}
    impls = [arg for folder in folders.values() for arg in ("--impl", str(folder))]
    report = top / "results.json"
    started = time.monotonic()
    tag = run_tag()
    # m01's checks but its HF sweeps (11 cases of 32): each attack meets the toys, the fp16, eps and untouched-input
    # checks, and those that crash a worker start one per check
    code, out = check_sh("m01", *impls, "-k", "not matches_hf", "--time-limit", "2", "--json", str(report), env=tag)
    seconds = time.monotonic() - started
    time.sleep(5)  # longer than the threads and children an attack leaves behind wait before they write
    return folders, code, out, json.loads(report.read_text()), seconds, marker, tag["KVLAB_RUN_TAG"]


@pytest.mark.parametrize("name", IN_THE_WORKER)
def test_an_attack_from_the_worker_fails(worker_attacks, name):
    folders, code, out, results, _, _, _ = worker_attacks
    assert code == 1 and results["passed"] is False
    rows = [r for r in results["results"] if r["impl"].endswith(f"/{name}")]
    one_line_failures(rows, IN_THE_WORKER[name][1])
    assert sorted(p.name for p in folders[name].iterdir()) == ["m01_rmsnorm.py"]  # nothing written beside it


def test_the_run_goes_on_and_leaves_nothing_running(worker_attacks):
    _, _, out, results, seconds, marker, tag = worker_attacks
    assert "Traceback" not in out and "\x1b[2J" not in out and "\u202e" not in out
    assert "runs as you" in out and "check.sh grade" in out  # --impl DIR outside mine/: use grade for others' code
    assert not any(r["status"] == "kit error" for r in results["results"])
    assert not marker.exists(), marker.read_text()
    assert len({r["impl"] for r in results["results"]}) == len(IN_THE_WORKER)
    assert not worker_processes(tag), f"worker processes left running: {worker_processes(tag)}"


def worker_processes(tag: str | None = None) -> list[int]:
    """Processes running the worker side: those of the run started with KVLAB_RUN_TAG=tag (the tag is in the
    clean environment of its fork server, its workers and what they start), else any whose command line holds
    the shipped `kvlab_worker` package (a fork server started afresh, as in the sandbox)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit():
                continue
            if tag is None:
                hit = b"kvlab_worker" in (entry / "cmdline").read_bytes()
            else:
                hit = f"KVLAB_RUN_TAG={tag}".encode() in (entry / "environ").read_bytes().split(b"\0")
            if hit and int(entry.name) != os.getpid():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def run_tag() -> dict[str, str]:
    """An environment that tags a run, so `worker_processes(tag)` finds its processes and no other run's."""
    return {"KVLAB_RUN_TAG": f"selftest-{os.getpid()}-{time.monotonic_ns()}"}


def test_values_a_check_cannot_read_fail_the_submission_not_the_kit(tmp_path):
    """A `KVCache` whose `.k` and `.v` hold Python lists, not tensors: the checks that read them say so as the
    submission's failure; none reports a kit error."""
    source = (ROOT / "solutions" / "m02_thinker_attention.py").read_text()
    source = source.replace("        self.k.append(k)\n        self.v.append(v)\n",
                            "        self._k.append(k)\n        self._v.append(v)\n"
                            "        self.k.append(k.tolist())\n        self.v.append(v.tolist())\n")
    source = source.replace("torch.cat(cache.k), torch.cat(cache.v)", "torch.cat(cache._k), torch.cat(cache._v)")
    source = source.replace("        self.v: list[torch.Tensor] = []\n",
                            "        self.v: list[torch.Tensor] = []\n        self._k, self._v = [], []\n")
    source = source.replace("return sum(chunk.shape[0] for chunk in self.k)", "return sum(len(chunk) for chunk in self.k)")
    folder = tmp_path / "lists"
    folder.mkdir()
    (folder / "m02_thinker_attention.py").write_text(source)
    report = tmp_path / "results.json"
    code, out = check_sh("m02", "--impl", str(folder), "--json", str(report), "-k", "cache or chunk or decode")
    rows = json.loads(report.read_text())["results"]
    assert code == 1 and rows and not [r["reason"] for r in rows if r["status"] == "kit error"], out[-3000:]
    assert any(r["status"] == "failed" and "could not use" in r["reason"] for r in rows), [r["reason"] for r in rows]


def test_a_collective_hidden_from_the_count_carries_nothing(tmp_path):
    """p07 counts collectives where the ranks' code cannot reach: a rank that all-reduces through the process group
    object or an original it found behind the counted function (here o_proj's, with a harmless counted one in its
    place so the count still says two) moves no data, and the layer's output is wrong."""
    folder = tmp_path / "hidden"
    folder.mkdir()
    for name in ("m01_rmsnorm", "m02_thinker_attention", "m03_rope", "m04_qwen3_model"):
        (folder / f"{name}.py").write_text((ROOT / "solutions" / f"{name}.py").read_text())
    source = (ROOT / "solutions" / "p07_tensor_parallel.py").read_text()
    assert source.count("    dist.all_reduce(attended)\n") == 1
    source = source.replace("    dist.all_reduce(attended)\n",
                            "    _hidden_all_reduce(attended)\n    dist.all_reduce(torch.zeros(1))\n") + """

def _hidden_all_reduce(t):
    original = getattr(dist.all_reduce, "__wrapped__", None)
    if original is not None:
        original(t)
    else:
        dist.distributed_c10d._get_default_group().allreduce([t]).wait()
"""
    (folder / "p07_tensor_parallel.py").write_text(source)
    report = tmp_path / "results.json"
    code, out = check_sh("p07", "--impl", str(folder), "--json", str(report), "-k", "layer_matches_hf or collectives")
    rows = json.loads(report.read_text())["results"]
    layer = [r for r in rows if r["function"] == "test_layer_matches_hf"]
    assert code == 1 and layer and all(r["status"] == "failed" for r in layer), out[-3000:]
    assert not any(r["status"] == "kit error" for r in rows)


# ---- through `./check.sh grade`, in the sandbox -------------------------------------------------------

needs_sandbox = pytest.mark.skipif(sandbox_problem() is not None, reason=f"no sandbox here: {sandbox_problem()}")


def kit_fingerprint() -> dict[str, str]:
    """Every file of the kit but run state and environments, by content."""
    found = {}
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in (".venv", "__pycache__", ".kvlab") and not d.startswith("pytest-")]
        for name in files:
            path = Path(folder) / name
            if path.is_file():
                found[str(path.relative_to(ROOT))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def grade(tmp_path: Path, text: str, *extra: str, env=None, cwd=ROOT, folder: Path | None = None):
    submission = folder or write_attack(tmp_path / "submission", text)
    results = tmp_path / "results.json"
    code, out = check_sh("grade", str(submission), "m01", "--gradescope", str(results), "--time-limit", "3",
                         *extra, cwd=cwd, env=env)
    return code, out, json.loads(results.read_text()), submission


def assert_graded_as_failed(code: int, out: str, scored: dict, out_of: float = 20) -> None:
    assert code == 1, out[-2000:]
    assert "could not start" not in out, "the sandbox itself failed: the attack proved nothing\n" + out[-1500:]
    assert scored["score"] < out_of and "Traceback" not in out
    assert any(t["status"] == "failed" for t in scored["tests"])
    for test in scored["tests"]:
        for line in test["output"].splitlines():
            assert len(line) < 400


@needs_sandbox
def test_a_process_that_outlives_the_grader_cannot_rewrite_the_results(tmp_path):
    results = tmp_path / "results.json"
    text = attack(f"""
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                time.sleep(3)
                for target in ({str(results)!r}, {str(ROOT / ".kvlab" / "late.json")!r}):
                    try:
                        with open(target, "w") as f:
                            f.write('{{"score": 100}}')
                    except OSError:
                        pass
            os._exit(0)
    """)
    code, out, scored, _ = grade(tmp_path, text)
    assert_graded_as_failed(code, out, scored)
    time.sleep(4)
    assert json.loads(results.read_text()) == scored
    assert not (ROOT / ".kvlab" / "late.json").exists()


@needs_sandbox
def test_grading_from_inside_a_folder_that_ships_its_own_checks(tmp_path):
    submission = write_attack(tmp_path / "student", attack(""))
    fake = submission / "checks"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "__main__.py").write_text("import json, sys\nprint('score: 20 / 20')\nsys.exit(0)\n")
    code, out, scored, _ = grade(tmp_path, "", cwd=submission, folder=Path("."))
    assert_graded_as_failed(code, out, scored)


@needs_sandbox
def test_an_honest_submission_scores_everything_under_an_inherited_hard_limit(tmp_path):
    """Started under `ulimit -v` (soft and hard), the grader's workers take the lower of the inherited hard limit
    and their own: the sandbox can no longer raise a limit, and the worker must not try to. The submission also
    holds links where a checkpoint could go (`.kvlab-checkpoint` to the kit's checks, `checkpoint` to the kit):
    the checks write m04's checkpoint with the grader's rights, into a private folder of their own, and the kit
    is untouched."""
    submission = tmp_path / "submission"
    submission.mkdir()
    for name in ("m01_rmsnorm", "m02_thinker_attention", "m03_rope", "m04_qwen3_model"):
        (submission / f"{name}.py").write_text((ROOT / "solutions" / f"{name}.py").read_text())
    (submission / ".kvlab-checkpoint").symlink_to(ROOT / "checks")
    (submission / "checkpoint").symlink_to(ROOT)
    before = kit_fingerprint()
    results = tmp_path / "results.json"
    done = subprocess.run(["bash", "-c", f'ulimit -v {12 << 20} && exec "$@"', "bash", str(ROOT / "check.sh"), "grade",
                           str(submission), "m01", "m04", "-k", "rmsnorm or checkpoint", "--gradescope", str(results),
                           "--memory-limit", "64"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "KVLAB_PYTHON": sys.executable, "COLUMNS": "140"})
    out = done.stdout + done.stderr
    scored = json.loads(results.read_text())
    assert kit_fingerprint() == before, "the grader wrote into the kit"
    assert done.returncode == 0, out[-2000:]
    assert all(t["status"] == "passed" for t in scored["tests"]) and scored["score"] == 23, out[-2000:]
    assert any("checkpoint" in t["name"] for t in scored["tests"])
    assert "m01 · RMSNorm and the fused residual add: 20 / 20 points" in out


# One submission tries everything it should not be able to do on the machine and says what it found (a grade
# of its own for each try would cost the suite a sandbox start each): `rms_norm` probes, `add_rms_norm` sends a
# reason meant to rewrite the terminal. The probe's findings are cached, so every check says the same.
PROBE = FORGE + attack("""
    import socket, tempfile
    FOUND = []
    KIT = {kit!r}


    def writable_mib(folder, most=1024):
        \"\"\"MiB this worker can write into `folder`, in 64 MiB files, up to `most`.\"\"\"
        written, chunk = 0, b"\\0" * (64 << 20)
        try:
            while written < most:
                with open(os.path.join(folder, f"fill-{{written}}"), "wb") as f:
                    f.write(chunk)
                written += 64
        except OSError:
            pass
        for name in os.listdir(folder):
            if name.startswith("fill-"):
                os.remove(os.path.join(folder, name))
        return written


    def tried(action):
        try:
            action()
            return "yes"
        except BaseException as error:
            return type(error).__name__


    def write(path):
        with open(path, "w") as f:
            f.write("pwned")


    def forks():
        children = []
        try:
            for _ in range(1000):
                pid = os.fork()
                if pid == 0:
                    time.sleep(60)
                    os._exit(0)
                children.append(pid)
        except OSError:
            pass
        for pid in children:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        return len(children)


    def probe():
        if not FOUND:
            import site
            with open(f"/proc/{{os.getppid()}}/status") as status:
                caps = next(line.split()[1] for line in status if line.startswith("CapEff"))
            temporary = [tempfile.mkstemp(dir=d)[1] for d in ("/tmp", "/dev/shm")]
            mine = os.path.dirname(os.path.abspath(__file__))
            sizes = {{name: writable_mib(d) for name, d in (("tmp", "/tmp"), ("shm", "/dev/shm"), ("own", mine))}}
            found = {{
                "caps": caps, "temporary": len(temporary), **sizes, "forks": forks(),
                "reference": tried(lambda: open(os.path.join(KIT, "solutions", "m01_rmsnorm.py")).read()),
                "kit": tried(lambda: [write(os.path.join(KIT, t)) for t in (
                    "solutions/m01_rmsnorm.py", ".kvlab/results.json", ".git/hooks/pre-commit",
                    "checks/harness/compare.py")]),
                "sitepackages": tried(lambda: [write(os.path.join(d, "sitecustomize.py")) for d in site.getsitepackages()]),
                "oracle": tried(lambda: __import__("transformers.models.qwen3.modeling_qwen3")),
                "network": tried(lambda: socket.create_connection(("127.0.0.1", {port}), timeout=1).sendall(b"hi")),
                "secret": "s3cret-token-42" in " ".join(os.environ.values()),
            }}
            items = [f"{{k}}={{v}}" for k, v in found.items()]
            FOUND.extend("probe " + " ".join(items[i::3]) for i in range(3))  # a reason is cut at 200 characters
        FOUND.append(FOUND.pop(0))
        raise RuntimeError(FOUND[-1])
""", """
def rms_norm(x, weight, eps):
    probe()


def add_rms_norm(x, residual, weight, eps):
    forge((("T", ["raised", "\\x1b[2J\\x1b]0;owned\\x07\\x1b[32m✓ all pass\\x1b[0m\\x00\\x0b\\u202e" + "A" * (4 << 20)]), []))
    return torch.zeros_like(x), torch.zeros_like(x)
""")


@needs_sandbox
def test_the_sandbox_holds_what_a_submission_tries_on_the_machine(tmp_path):
    """The probe finds: the reference unreadable, the kit, its git hooks and site-packages unwritable, no oracle
    library, no network, none of the grader's environment, a bounded number of processes, only the capabilities
    to become the unprivileged user and end it, and private memory filesystems (/tmp, /dev/shm, its own folder)
    of at most 256 MiB each. Its 4 MB reason with terminal escapes, control characters and a direction override
    reaches the report, the Gradescope file and the JUnit XML as one short clean line (the XML parses)."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    before = kit_fingerprint()
    junit = tmp_path / "report.xml"
    text = PROBE.replace("{kit!r}", repr(str(ROOT))).replace("{port}", str(listener.getsockname()[1]))
    text = text.replace("{{", "{").replace("}}", "}")
    code, out, scored, submission = grade(tmp_path, text, "--junit", str(junit), "-k", "toy", "--time-limit", "60",
                                          env={"KVLAB_GRADER_SECRET": "s3cret-token-42"})  # it writes 768 MiB, forks
    assert_graded_as_failed(code, out, scored)
    assert kit_fingerprint() == before, "the submission changed the kit"
    assert sorted(p.name for p in submission.iterdir()) == ["m01_rmsnorm.py"], "grade wrote into the submission"
    with pytest.raises(TimeoutError):
        listener.accept()
    line = " ".join(line[line.index("probe "):] for t in scored["tests"] for line in t["output"].splitlines()
                    if "probe " in line)
    found = dict(re.findall(r"\b(\w+)=(\w+)", line))
    assert int(found["caps"], 16) == (1 << 5) | (1 << 6) | (1 << 7), line  # CAP_KILL, CAP_SETGID, CAP_SETUID only
    assert found["temporary"] == "2", line  # a temporary file in /tmp and in /dev/shm
    for place in ("tmp", "shm", "own"):  # writable, and no more than the memory filesystem's size
        assert 0 < int(found[place]) <= 256, line
    assert int(found["forks"]) <= 200, line  # the process limit: its user's tasks + 128
    assert found["reference"] == "FileNotFoundError" and found["oracle"] == "ModuleNotFoundError", line
    assert found["kit"] != "yes" and found["sitepackages"] != "yes" and found["network"] != "yes", line
    assert found["secret"] == "False", line
    assert "\x1b" not in out and "\u202e" not in out and "\x00" not in out
    assert (tmp_path / "results.json").stat().st_size < 50_000 and junit.stat().st_size < 50_000
    ET.parse(junit)
    for test in scored["tests"]:
        assert test["output"].replace("\n", "").isprintable(), test["output"][:300]
    assert any("all pass" in test["output"] for test in scored["tests"])


@needs_sandbox
def test_memory_past_the_limit_stops_the_worker(tmp_path):
    """`rms_norm` asks for 64 GiB of tensors and buffers: the worker's limit stops it. `add_rms_norm` fills memfds
    with 3 GiB that it never maps, which an address-space limit and a resident-memory watch both miss: in a
    memory cgroup it counts, and the worker is stopped at the limit; where none can be made, every output says so."""
    text = attack("""
        def hog():
            marker = "/tmp/hogged"
            if os.path.exists(marker):
                return
            open(marker, "w").close()
            chunk, held = b"\\1" * (64 << 20), []
            for _ in range(24):  # 128 MiB each: a file's size is limited (RLIMIT_FSIZE), the number of files not
                held.append(os.memfd_create("hog"))
                os.write(held[-1], chunk)
                os.write(held[-1], chunk)
            raise RuntimeError("held 3 GiB in memfds")
    """, """
def rms_norm(x, weight, eps):
    hog = torch.ones(64 * 2**30 // 4)
    blocks = [bytearray(2**30) for _ in range(64)]
    return torch.zeros_like(x)


def add_rms_norm(x, residual, weight, eps):
    hog()
    return torch.zeros_like(x), torch.zeros_like(x)
""")
    code, out, scored, _ = grade(tmp_path, text, "--memory-limit", "1", "-k", "toy")
    assert_graded_as_failed(code, out, scored)
    toy = {t["name"].split(" · ")[1].split()[0]: t["output"] for t in scored["tests"]}
    assert "memory" in toy["rms_norm"].lower() or "MemoryError" in toy["rms_norm"], toy["rms_norm"]
    if "no memory cgroup here" in scored["output"]:
        assert "no memory cgroup here" in out
    else:
        assert "memory limit" in toy["add_rms_norm"] and "held 3 GiB" not in toy["add_rms_norm"], toy


@needs_sandbox
def test_a_score_matrix_hidden_from_the_workers_watch_is_seen_from_outside(tmp_path):
    """p03's tiled attention that builds the whole score matrix and switches off the worker's own watch of its
    tensors: under `grade` with a memory cgroup, the kernel's count of the sandbox's memory still sees it."""
    source = (ROOT / "solutions" / "p03_flash_attention.py").read_text() + """

def tiled_attention(q, k, v, block_q, block_k, softmax_scale=None, causal=True):
    import contextlib, sys

    class Blind(contextlib.nullcontext):
        largest = 0

    for module in list(sys.modules.values()):  # the worker's watch of the largest tensor: now sees nothing
        if hasattr(module, "LargestTensor"):
            module.LargestTensor = Blind
    Tq, H, D = q.shape
    k, v = (t.repeat_interleave(H // t.shape[1], dim=1).float() for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * (softmax_scale or D ** -0.5)  # [H, Tq, Tk]
    if causal:
        Tk = k.shape[0]
        scores.masked_fill_(torch.ones(Tq, Tk, dtype=torch.bool).triu(Tk - Tq + 1), float("-inf"))
    lse = torch.logsumexp(scores, -1)
    out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v)
    return out.to(q.dtype), lse
"""
    submission = tmp_path / "submission"
    submission.mkdir()
    (submission / "p03_flash_attention.py").write_text(source)
    results = tmp_path / "results.json"
    code, out = check_sh("grade", str(submission), "p03", "--gradescope", str(results), "-k", "tiled")
    scored = json.loads(results.read_text())
    watched = [t for t in scored["tests"] if "no tensor is half the size" in t["name"]]
    assert watched, [t["name"] for t in scored["tests"]]
    if "no memory cgroup here" in scored["output"]:
        return  # nothing measures it from outside on this machine, and the grade says so
    assert watched[0]["status"] == "failed" and "memory grew" in watched[0]["output"], watched[0]
    assert all(t["status"] == "passed" for t in scored["tests"] if t is not watched[0]), out[-2000:]


@needs_sandbox
def test_a_killed_grader_leaves_no_copy_behind(tmp_path):
    """SIGKILL gives the grader no chance to clean up: its copy of the submission and its cgroup go all the same."""
    submission = write_attack(tmp_path / "submission", attack("", both("while True: pass")))
    private = tmp_path / "tmp"
    private.mkdir()
    tag = run_tag()
    grader = subprocess.Popen([str(ROOT / "check.sh"), "grade", str(submission), "m01", "--time-limit", "60"], cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env={**os.environ, "KVLAB_PYTHON": sys.executable, "TMPDIR": str(private), **tag})
    def sandboxed() -> list[int]:  # the fork server in the sandbox and its workers (a fresh `python -I -c ...`)
        return [pid for pid in worker_processes(tag["KVLAB_RUN_TAG"]) if b"kvlab_worker" in _cmdline(pid)]

    deadline = time.monotonic() + 120
    while len(sandboxed()) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    copies = list(private.glob("kvlab-grade-*"))
    assert copies and len(sandboxed()) >= 2, "the grade never started its workers"
    grader.kill()
    grader.wait()
    deadline = time.monotonic() + 10
    while list(private.glob("kvlab-grade-*")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not list(private.glob("kvlab-grade-*")), "the copy was left behind"
    deadline = time.monotonic() + 60
    while sandboxed() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not sandboxed(), "the sandbox outlived the grader"
    try:
        parent, _ = own_memory_cgroup()
    except OSError:
        return
    deadline = time.monotonic() + 60  # on a loaded machine the sandbox's processes take a while to go
    while (parent / copies[0].name).exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not (parent / copies[0].name).exists(), "the cgroup was left behind"


def test_grade_refuses_without_a_sandbox_unless_told(tmp_path):
    submission = write_attack(tmp_path / "submission", CORRECT)
    env = {"PATH": "/nonexistent"}  # no bwrap on this PATH
    done = subprocess.run([sys.executable, "-P", "-m", "checks", "grade", str(submission), "m01"], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, **env, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2 and "--no-sandbox" in done.stderr
    # with --no-sandbox it grades, and says so on screen and in the results: test_cli's signal test, whose grade
    # (of the reference) runs so, checks both
