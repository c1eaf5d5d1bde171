"""Shared runs of the checks for the kit's self-tests.

The checks run as a learner runs them (`python -m checks`, a separate process) over every
implementation at once — the reference, the stubs as shipped, and the catalogue's mutants, variants
and broken samples — and the self-tests read the JSON results and the rendered report.
"""

import json
import os
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from checks.harness.loader import ROOT
from checks.harness.modules import modules

# Fixed, so the self-tests are reproducible. The first run covers everything, the second what must hold for
# any seed; on the rest, every catalogued mistake must still be rejected by its name (a verdict that does not
# depend on the seed), each mutant checked only until that happens.
SEEDS = (2026, 7, 3, 11, 41, 99, 2718, 12345)


@dataclass
class Run:
    results: list[dict]
    output: str
    returncode: int

    def of(self, impl: str, module: str | None = None) -> list[dict]:
        return [r for r in self.results if r["impl"] == impl and (module is None or r["module"] == module)]


def shipped(path: str) -> str:
    """A file as committed (what a learner receives), falling back to the working copy outside git."""
    found = subprocess.run(["git", "show", f"HEAD:{path}"], cwd=ROOT, capture_output=True, text=True)
    return found.stdout if found.returncode == 0 else (ROOT / path).read_text()


class Started:
    """`./check.sh all` running in the background; `result()` waits for it."""

    def __init__(self, tmp: Path, *args: str, after: "Started | None" = None, idle: bool = False):
        self.report, self.args, self.after, self.idle = tmp / "results.json", args, after, idle
        self.process: subprocess.Popen | None = None
        self.done: Run | None = None
        self.output = ""
        self.ready = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        if self.after is not None:  # a chain of runs, one after another
            self.after.ready.wait()
        env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "140"}
        # An idle run takes only the CPU time the others leave: their time limits stay those of a quiet machine.
        self.process = subprocess.Popen([sys.executable, "-m", "checks", "all", *self.args, "--json",
                                         str(self.report)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True,
                                        preexec_fn=(lambda: os.nice(19)) if self.idle else None)
        try:
            self.output, _ = self.process.communicate(timeout=1500)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.output, _ = self.process.communicate()
        self.ready.set()

    def result(self) -> Run:
        if self.done is None:
            self.ready.wait()
            if not self.report.is_file():
                pytest.fail(f"the checks did not run:\n{self.output}")
            self.done = Run(json.loads(self.report.read_text())["results"], self.output, self.process.returncode)
        return self.done


@pytest.fixture(scope="session")
def stubs_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("stubs")
    for m in modules():
        (folder / f"{m.stem}.py").write_text(shipped(f"mine/{m.stem}.py"))
    return folder


@pytest.fixture(scope="session")
def both_runs(tmp_path_factory, stubs_folder) -> tuple[Started, Started]:
    """The two runs below, started together: they are independent, and a machine has two cores at least.
    The other seeds' runs go in two chains, at the lowest priority, once the first run is done."""
    full = Started(tmp_path_factory.mktemp("full"), "--seed", str(SEEDS[0]), "--time-limit", "3",
                   "--impl", "solutions", "--impl", str(stubs_folder),
                   "--impl", "mutants", "--impl", "variants", "--impl", "broken")
    second = Started(tmp_path_factory.mktemp("second"), "--seed", str(SEEDS[1]),
                     "--impl", "solutions", "--impl", "mutants", "--impl", "variants")
    for chain in (SEEDS[2::2], SEEDS[3::2]):
        previous = full  # its 3 s time limit (for the hanging samples) wants the machine to itself
        for seed in chain:
            previous = MORE_SEEDS[seed] = Started(tmp_path_factory.mktemp(f"seed{seed}"), "--seed", str(seed),
                                                   "--impl", "mutants", "--until-named", after=previous, idle=True)
    return full, second


MORE_SEEDS: dict[int, Started] = {}  # the mutants' runs on SEEDS[2:], started with both_runs


@pytest.fixture(scope="session")
def seed_runs(both_runs) -> dict[int, Started]:
    """Every seed's run (a mutant's rows on SEEDS[2:] end where a check named it)."""
    return {SEEDS[0]: both_runs[0], SEEDS[1]: both_runs[1], **MORE_SEEDS}


@pytest.fixture(scope="session")
def full_run(both_runs) -> Run:
    """Seed 2026: the reference, the stubs, and every mutant, variant and broken sample."""
    return both_runs[0].result()


@pytest.fixture(scope="session")
def second_seed_run(both_runs) -> Run:
    """Another seed: what must hold for any seed (reference and variants pass, mutants fail)."""
    return both_runs[1].result()


@pytest.fixture(scope="session")
def kit_copy(tmp_path_factory) -> Path:
    """A copy of the kit, for commands that write (reset)."""
    target = tmp_path_factory.mktemp("kit") / "kit"
    shutil.copytree(ROOT, target, ignore=shutil.ignore_patterns(".venv", ".git", ".kvlab", "__pycache__"))
    return target
