"""Fixtures every check file shares: which implementation is checked, and the seed of each case.

Run through `./check.sh` (which adds the report); plain pytest works too:
`python -m pytest checks/test_m02_thinker_attention.py --impl solutions`.
"""

import os
import random
import sys
import zlib

import pytest
import torch

# Triton kernels run in its CPU interpreter when there is no GPU. The switch is read when a kernel is
# decorated, i.e. when a learner's module is imported, so it is set here, before any check runs
# (./check.sh sets it too, for the same reason).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from checks.harness.guard import Guarded
from checks.harness.loader import Implementation, named
from checks.harness.mistakes import catalogue
from checks.harness.report import Reporter

sys.dont_write_bytecode = True  # sibling imports in a checked folder must not leave __pycache__ there

# Labels --impl accepts besides folders: the catalogue's mutants, variants and broken samples.
GROUPS = {"mutants": "mistakes", "variants": "variants", "broken": "broken"}


def pytest_addoption(parser):
    group = parser.getgroup("kvlab", "KV Lab checks")
    group.addoption("--impl", action="append", default=None,
                    help="mine (default), solutions, a folder with the same file names, or mutants/variants/broken")
    group.addoption("--seed", type=int, default=None, help="base seed of every case (default: random, printed)")
    group.addoption("--time-limit", type=float, default=10.0, help="seconds one learner call may take")


def pytest_configure(config):
    seed = config.getoption("--seed")
    config.kvlab_seed = random.randrange(10_000) if seed is None else seed
    if not config.pluginmanager.has_plugin("kvlab-reporter"):
        config.pluginmanager.register(Reporter(config, render=False), "kvlab-reporter")


def module_stem(module) -> str:
    return module.__name__.rsplit(".", 1)[-1].removeprefix("test_")


def implementations(config, stem: str) -> list[Implementation]:
    found = []
    for label in config.getoption("--impl") or ["mine"]:
        if label in GROUPS:
            entries = getattr(catalogue(stem), GROUPS[label])
            found += [catalogue(stem).implementation(e) for e in entries]
        else:
            found.append(named(label))
    return found


def pytest_generate_tests(metafunc):
    if "impl" in metafunc.fixturenames:
        impls = implementations(metafunc.config, module_stem(metafunc.module))
        metafunc.parametrize("impl", impls, ids=[i.label for i in impls], indirect=True)


@pytest.fixture
def impl(request) -> Guarded:
    """The implementation under check, every call guarded (see harness/guard.py)."""
    return Guarded(request.param, module_stem(request.module), request.module.CONTRACTS,
                   request.config.getoption("--time-limit"))


def case_id(item) -> str:
    """The case's parameters without the implementation (`fp32-H8-KVH2`), the same for every impl."""
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return ""
    label = callspec.params["impl"].label if "impl" in callspec.params else None
    parts = callspec.id
    if label is not None:
        for cut in (f"-{label}", f"{label}-", label):
            if parts.endswith(cut) or parts.startswith(cut):
                parts = parts[: -len(cut)] if parts.endswith(cut) else parts[len(cut):]
                break
    return parts


def case_seed(item) -> int:
    name = f"{item.module.__name__}::{item.originalname}[{case_id(item)}]"
    return zlib.crc32(f"{item.config.kvlab_seed}:{name}".encode()) % 1_000_000


@pytest.fixture
def seed(request) -> int:
    """This case's seed: derived from the run's base seed (printed by the report) and the case id."""
    return case_seed(request.node)


@pytest.fixture
def gen(seed) -> torch.Generator:
    """The case's random generator: every shape and value a check draws comes from it."""
    return torch.Generator().manual_seed(seed)
