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

# Fixed, so the self-tests are reproducible. The first seed's run covers the reference, the stubs, every variant
# and broken sample on every check, and each catalogued mistake until a check names it (checks in their order;
# a check's robustness to what a submission returns is the broken samples' and the grader attacks' to show);
# the second seed, what must hold for any seed (the reference and the variants pass); on every seed but the
# first, every catalogued mistake must still be rejected by its name (a verdict that does not depend on the
# seed), each mutant checked only until that happens, first by the check that named it on the first seed.
SEEDS = (2026, 7, 3, 11, 41)
# The broken samples that hang cost a whole time limit each (once per sample: the checks after it say "not
# run"); they run under a short one. Everything else runs under the learner's own limit, which a reference
# call stays far below on a slow or busy machine (test_reference_calls_are_far_below_the_time_limit).
HANG_LIMIT = 3
# The first seed's run in lanes, one process each, that end at about the same time once each lane's
# mutants have run on the other seeds too: the model, the kernels and the scheduler; the engine and tensor
# parallelism (whose mutants cost the most on the other seeds). A module not named here goes in the first
# lane. (A third lane, the scheduler's, made the suite slower on two cores: one more process to start, and
# the tests beside the catalogue waited longer for a core.)
LANES = (("p06", "p07"),)


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

    def __init__(self, tmp: Path, *args: str, after: "tuple[Started, ...]" = (), targets: tuple[str, ...] = ("all",)):
        self.report, self.args, self.after = tmp / "results.json", args, after
        self.targets = targets
        self.process: subprocess.Popen | None = None
        self.done: Run | None = None
        self.output = ""
        self.ready = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        for before in self.after:  # a chain of runs, one after another
            before.ready.wait()
        env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "140"}
        # every run at the suite's own priority: at a lower one, other work on a busy machine would starve it
        self.process = subprocess.Popen([sys.executable, "-m", "checks", *self.targets, *self.args, "--json",
                                         str(self.report)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True)
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


class Joined:
    """Runs that together make one seed's run: `result()` waits for all of them."""

    def __init__(self, runs: tuple[Started, ...]):
        self.runs = runs

    def result(self) -> Run:
        return joined(*(run.result() for run in self.runs))


def joined(*runs: Run) -> Run:
    return Run([r for run in runs for r in run.results], "\n".join(run.output for run in runs),
               max(run.returncode for run in runs))


def stubs(factory) -> Path:
    """The stubs as shipped, in a folder of their own (made once a session)."""
    if "stubs" not in STUBS:
        folder = STUBS["stubs"] = factory.mktemp("stubs")
        for m in modules():
            (folder / f"{m.stem}.py").write_text(shipped(f"mine/{m.stem}.py"))
    return STUBS["stubs"]


STUBS: dict[str, Path] = {}


@pytest.fixture(scope="session")
def stubs_folder(tmp_path_factory) -> Path:
    return stubs(tmp_path_factory)


STARTED: dict[str, Started] = {}  # the runs below, by name (and "seed S" for the mutants on SEEDS[1:])


def start_runs(tmp_path_factory, stubs_folder: Path) -> dict[str, Started]:
    """The first seed's run (in lanes), its hanging samples and the second seed's reference and variants,
    started together as the session starts (they are independent, and a machine has two cores at least); then,
    as each lane of the first seed's run ends, the mutants of its modules on the other seeds, in one process
    (a run per seed), which reads which checks named each mutant there."""
    if STARTED:
        return STARTED
    stems = [m.id for m in modules()]
    laned = {stem for lane in LANES for stem in lane}
    lanes = (tuple(i for i in stems if i not in laned),) + tuple(tuple(i for i in stems if i in lane) for lane in LANES)
    firsts = tuple(Started(tmp_path_factory.mktemp(f"full{n}"), "--seed", str(SEEDS[0]), "--impl", "solutions",
                           "--impl", str(stubs_folder), "--impl", "mutants", "--impl", "variants", "--impl", "crashes",
                           "--until-named", targets=lane) for n, lane in enumerate(lanes))
    STARTED["full"] = firsts
    STARTED["hangs"] = Started(tmp_path_factory.mktemp("hangs"), "--seed", str(SEEDS[0]), "--time-limit",
                               str(HANG_LIMIT), "--impl", "hangs")
    STARTED["second"] = Started(tmp_path_factory.mktemp("second"), "--seed", str(SEEDS[1]),
                                "--impl", "solutions", "--impl", "variants")
    seeds = [a for seed in SEEDS[1:] for a in ("--seed", str(seed))]
    chains = tuple(Started(tmp_path_factory.mktemp(f"chain{n}"), *seeds, "--impl", "mutants", "--until-named",
                           "--named-first", str(first.report), after=(first,), targets=lane)
                   for n, (lane, first) in enumerate(zip(lanes, firsts)))
    STARTED["chains"] = chains
    for seed in SEEDS[1:]:
        STARTED[f"seed {seed}"] = Joined(tuple(OneSeed(chain, seed) for chain in chains))
    return STARTED


class OneSeed:
    """One seed's rows of a run over several seeds."""

    def __init__(self, run: Started, seed: int):
        self.run, self.seed = run, seed

    def result(self) -> Run:
        whole = self.run.result()
        return Run([r for r in whole.results if r["run_seed"] == self.seed], whole.output, whole.returncode)


CATALOGUE_RUNS = {"seed_runs", "full_run", "second_seed_run", "both_runs"}


def pytest_collection_modifyitems(session, config, items):
    """The catalogue's runs take most of the suite's time: they start before the first test and run beside
    the others, and the tests that read them go last (those that read the first seed's run before those
    that wait for the other seeds), so no test waits for a run while others could go on."""
    if config.option.collectonly:
        return

    def waits_for(item) -> int:
        names = set(getattr(item, "fixturenames", ()))
        if not CATALOGUE_RUNS & names:
            return 0
        params = getattr(item, "callspec", None)
        later_seed = "seed_runs" in names and params is not None and params.params.get("seed") != SEEDS[0]
        return 2 if later_seed else 1

    order = {id(item): (waits_for(item), n) for n, item in enumerate(items)}
    items.sort(key=lambda item: order[id(item)])
    if any(key[0] for key in order.values()):
        start_runs(config._tmp_path_factory, stubs(config._tmp_path_factory))


@pytest.fixture(scope="session")
def both_runs(tmp_path_factory, stubs_folder) -> dict[str, Started]:
    return start_runs(tmp_path_factory, stubs_folder)


@pytest.fixture(scope="session")
def seed_runs(both_runs) -> dict[int, Started]:
    """Every seed's run of the mutants (on SEEDS[1:], a mutant's rows end where a check named it)."""
    return {SEEDS[0]: Joined(both_runs["full"]), **{seed: both_runs[f"seed {seed}"] for seed in SEEDS[1:]}}


@pytest.fixture(scope="session")
def full_run(both_runs) -> Run:
    """Seed 2026: the reference, the stubs, and every mutant, variant and broken sample."""
    return joined(*(half.result() for half in both_runs["full"]), both_runs["hangs"].result())


@pytest.fixture(scope="session")
def second_seed_run(both_runs) -> Run:
    """Another seed: what must hold for any seed (the reference and the variants pass)."""
    return both_runs["second"].result()


# The book as a learner who finished m01, is half way through m02 and opened m03's first two hints would see
# it, built once for the book's tests and the browser's.
PROGRESS = {
    "m01_rmsnorm": {"when": "2026-11-29 10:00", "checks": 12, "passed": 12, "not_started": 0},
    "m02_thinker_attention": {"when": "2026-11-29 11:00", "checks": 29, "passed": 17, "not_started": 0},
}
HINTS_OPENED = {"m03_rope": [1, 2]}


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    from book import build as book

    state = tmp_path_factory.mktemp("state")
    (state / "results.json").write_text(json.dumps(PROGRESS))
    (state / "hints.json").write_text(json.dumps(HINTS_OPENED))
    return book.build(tmp_path_factory.mktemp("book") / "out", state / "results.json", state / "hints.json")


@pytest.fixture(scope="session")
def kit_copy(tmp_path_factory) -> Path:
    """A copy of the kit, for commands that write (reset)."""
    target = tmp_path_factory.mktemp("kit") / "kit"
    shutil.copytree(ROOT, target, ignore=shutil.ignore_patterns(".venv", ".git", ".kvlab", "__pycache__"))
    return target
