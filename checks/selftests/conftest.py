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
from dataclasses import dataclass
from pathlib import Path

import pytest

from checks.harness.loader import ROOT
from checks.harness.modules import modules

SEEDS = (2026, 7)  # fixed, so the self-tests are reproducible; the first run covers everything


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

    def __init__(self, tmp: Path, *args: str):
        self.report = tmp / "results.json"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "140"}
        self.process = subprocess.Popen([sys.executable, "-m", "checks", "all", *args, "--json", str(self.report)],
                                        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.done: Run | None = None

    def result(self) -> Run:
        if self.done is None:
            try:
                output, _ = self.process.communicate(timeout=1500)
            except subprocess.TimeoutExpired:
                self.process.kill()
                output, _ = self.process.communicate()
            if not self.report.is_file():
                pytest.fail(f"the checks did not run:\n{output}")
            self.done = Run(json.loads(self.report.read_text())["results"], output, self.process.returncode)
        return self.done


@pytest.fixture(scope="session")
def stubs_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("stubs")
    for m in modules():
        (folder / f"{m.stem}.py").write_text(shipped(f"mine/{m.stem}.py"))
    return folder


@pytest.fixture(scope="session")
def both_runs(tmp_path_factory, stubs_folder) -> tuple[Started, Started]:
    """The two runs below, started together: they are independent, and a machine has two cores at least."""
    full = Started(tmp_path_factory.mktemp("full"), "--seed", str(SEEDS[0]), "--time-limit", "3",
                   "--impl", "solutions", "--impl", str(stubs_folder),
                   "--impl", "mutants", "--impl", "variants", "--impl", "broken")
    second = Started(tmp_path_factory.mktemp("second"), "--seed", str(SEEDS[1]),
                     "--impl", "solutions", "--impl", "mutants", "--impl", "variants")
    return full, second


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
