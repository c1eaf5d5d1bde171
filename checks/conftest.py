"""Fixtures every check file shares: which implementation is checked, and the seed of each case.

Run through `./check.sh` (which adds the report); plain pytest works too:
`python -m pytest checks/test_m02_thinker_attention.py --impl solutions`.
"""

import dataclasses
import os
import random
import sys
from pathlib import Path

import pytest
import torch

# Triton kernels run in its CPU interpreter when there is no GPU. The switch is read when a kernel is
# decorated, i.e. when a module is imported (by the worker, or by a replay of a mutant here), so it is
# set before anything starts (./check.sh sets it too, for the same reason).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from checks.harness.cases import case_seed, module_stem
from checks.harness.guard import Guarded, Runs
from checks.harness.limits import Cgroup
from checks.harness.loader import Implementation, named
from checks.harness.mistakes import catalogue
from checks.harness.report import Reporter, check_title
from checks.harness.worker import DEFAULT_MEMORY_LIMIT, Sandbox

sys.dont_write_bytecode = True  # sibling imports in a checked folder must not leave __pycache__ there

# Labels --impl accepts besides folders: the catalogue's mutants, variants and broken samples; and the broken
# samples split in two, those that hang (each costs a whole time limit) and the rest (the kit's self-tests
# give the hanging ones a short limit, the rest the learner's own).
GROUPS = {"mutants": "mistakes", "variants": "variants", "broken": "broken", "hangs": "broken",
          "crashes": "broken"}


def _hangs(entry) -> bool:
    return entry.id.endswith(("hang", "hangs"))


# a mistake only a GPU can reject (`Mistake.needs`) is not run where there is none: every check would pass it
GROUP_FILTERS = {"hangs": _hangs, "crashes": lambda entry: not _hangs(entry), "mutants": lambda m: m.runs_here()}


def pytest_addoption(parser):
    group = parser.getgroup("kvlab", "KV Lab checks")
    group.addoption("--impl", action="append", default=None,
                    help="mine (default), solutions, a folder with the same file names, or mutants/variants/broken "
                         "(broken = hangs + crashes)")
    group.addoption("--seed", type=int, default=None, help="base seed of every case (default: random, printed)")
    group.addoption("--time-limit", type=float, default=10.0, help="seconds one learner call may take")
    group.addoption("--memory-limit", type=float, default=DEFAULT_MEMORY_LIMIT / 2**30,
                    help="GiB of memory the worker running learner code may use")
    group.addoption("--sandbox", default=None, metavar="SUBMISSION",
                    help="run the worker inside bubblewrap, with its own copy of the folder SUBMISSION (./check.sh "
                         "grade)")
    group.addoption("--fixture-folder", default=None, metavar="DIR",
                    help="with --sandbox: a folder only the grader writes, where checks put files for the worker "
                         "to read (a checkpoint); read-only in the sandbox")
    group.addoption("--worker-uid", type=int, default=None, metavar="UID",
                    help="without --sandbox, as root: the user id the workers run as (./check.sh grade --worker-user)")
    group.addoption("--cgroup", default=None, metavar="DIR",
                    help="with --sandbox: the memory cgroup the sandbox runs in (./check.sh grade makes it)")
    group.addoption("--quiet-worker", action="store_true", help="drop what learner code prints")
    group.addoption("--shown", default=None, help="how reports name the checked folder (./check.sh grade)")
    group.addoption("--title-phrase", default=None, metavar="WORDS",
                    help="only the checks whose title (as the report shows it) holds WORDS (./check.sh -k with "
                         "several words and no and/or/not)")
    group.addoption("--until-named", action="store_true",
                    help="skip a mutant's remaining checks once one rejects it by its own name (its failures are "
                         "replayed on that mutant only, not on the whole catalogue as a learner's are)")
    group.addoption("--named-first", metavar="RESULTS", action="append", default=None,
                    help="with --until-named: check each mutant first with the checks that named it in RESULTS "
                         "(an earlier run's --json), then with the rest")
    group.addoption("--keep-server", action="store_true",
                    help="keep the workers' fork server for the next run in this process (./check.sh --watch)")


# `./check.sh m02 --watch` runs the checks again and again in one process: the fork server (torch imported,
# ready to fork a fresh worker for each run) is kept from one run to the next.
KEPT: dict = {}


def pytest_configure(config):
    seed = config.getoption("--seed")
    config.kvlab_seed = random.randrange(10_000) if seed is None else seed
    if not config.pluginmanager.has_plugin("kvlab-reporter"):
        config.pluginmanager.register(Reporter(config, render=False), "kvlab-reporter")
    if config.pluginmanager.has_plugin("kvlab-workers") or not hasattr(config.option, "time_limit"):
        return
    # Started now, so the worker side imports torch while this process collects the checks.
    args = " ".join(map(str, config.args))
    triton = "test_p" in args or not any("test_" in a for a in map(str, config.args))
    sandbox, fixtures, cgroup = (config.getoption(name) for name in ("--sandbox", "--fixture-folder", "--cgroup"))
    keep = config.getoption("--keep-server")
    runs = KEPT.get("runs") if keep else None
    if runs is None:
        runs = Runs(triton=triton, cuda=torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    memory_limit=int(config.getoption("--memory-limit") * 2**30),
                    sandbox=Sandbox(Path(sandbox), fixtures and Path(fixtures),
                                    cgroup and Cgroup.at(cgroup)) if sandbox else None,
                    quiet=config.getoption("--quiet-worker"), worker_uid=config.getoption("--worker-uid"))
        if not all("selftests" in a for a in map(str, config.args)):  # the kit's self-tests check no module here
            runs.start()
        if keep:
            KEPT["runs"] = runs
    config.kvlab_runs = runs
    config.pluginmanager.register(_CloseRuns(runs, keep), "kvlab-workers")


class _CloseRuns:
    """Ends each module's workers when its checks are done, and the fork server with the session."""

    def __init__(self, runs: Runs, keep: bool = False):
        self.runs, self.keep = runs, keep

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_teardown(self, item, nextitem):
        if nextitem is None or nextitem.module is not item.module:
            self.runs.close_module(module_stem(item.module))

    def pytest_unconfigure(self, config):
        if self.keep:
            self.runs.close_runs()  # the next run forks new workers, which import the saved files
        else:
            self.runs.close()


@pytest.hookimpl(tryfirst=True)  # before pytest's own -k selection reads the keywords
def pytest_collection_modifyitems(config, items):
    """-k matches the titles the report shows (a check's docstring), besides its test function's name. With
    --until-named --named-first: each mutant's checks together, the ones that named it in the earlier
    run first. The verdict asked for is the same (named by some check on this seed); the checks that rarely
    name it run only when the likely ones did not."""
    for item in items:
        item.extra_keyword_matches.add(check_title(item))
    phrase = config.getoption("--title-phrase", None)
    if phrase:
        wanted = phrase.casefold()
        deselected = [item for item in items if wanted not in check_title(item).casefold()]
        if deselected:
            config.hook.pytest_deselected(items=deselected)
            items[:] = [item for item in items if wanted in check_title(item).casefold()]
    earlier = config.getoption("--named-first", None)
    if not (earlier and config.getoption("--until-named")):
        return
    import json

    rows = [r for path in earlier for r in json.loads(Path(path).read_text())["results"]]
    named = {(r["impl"], r["nodeid"].split("[")[0]) for r in rows if r["impl"].rsplit(":", 1)[-1] in r["mistakes"]}

    def impl_of(item) -> str:
        params = getattr(item, "callspec", None)
        return params.params["impl"].label if params and "impl" in params.params else ""

    def key(position: int):  # a module's items stay together (its workers end with it)
        item = items[position]
        likely = (impl_of(item), item.nodeid.split("[")[0]) in named
        return (module_order[item.module], impl_of(item), not likely, position)

    module_order = {}
    for item in items:
        module_order.setdefault(item.module, len(module_order))
    items[:] = [items[i] for i in sorted(range(len(items)), key=key)]


def implementations(config, stem: str) -> list[Implementation]:
    found = []
    for label in config.getoption("--impl") or ["mine"]:
        if label in GROUPS:
            entries = getattr(catalogue(stem), GROUPS[label])
            entries = [e for e in entries if GROUP_FILTERS.get(label, bool)(e)]
            found += [catalogue(stem).implementation(e) for e in entries]
        else:
            impl = named(label)
            shown = config.getoption("--shown")
            found.append(dataclasses.replace(impl, label=shown, shown=shown) if shown else impl)
    return found


def pytest_generate_tests(metafunc):
    if "impl" in metafunc.fixturenames:
        impls = implementations(metafunc.config, module_stem(metafunc.module))
        metafunc.parametrize("impl", impls, ids=[i.label for i in impls], indirect=True)


@pytest.fixture
def impl(request) -> Guarded:
    """The implementation under check: its code runs in a worker process, every call guarded (guard.py)."""
    stem, time_limit = module_stem(request.module), request.config.getoption("--time-limit")
    if request.config.getoption("--until-named") and request.param.label in _reporter(request.config).named:
        pytest.skip("already rejected by its name (--until-named)")
    run = request.config.kvlab_runs.run(request.param, stem, time_limit)
    guarded = Guarded(run, stem, request.module.CONTRACTS, time_limit)
    yield guarded
    run.end_check()


def _reporter(config) -> Reporter:
    return config.pluginmanager.get_plugin("kvlab-reporter")


@pytest.fixture
def seed(request) -> int:
    """This case's seed: derived from the run's base seed (printed by the report) and the case id."""
    return case_seed(request.node)


@pytest.fixture
def gen(seed) -> torch.Generator:
    """The case's random generator: every shape and value a check draws comes from it."""
    return torch.Generator().manual_seed(seed)
