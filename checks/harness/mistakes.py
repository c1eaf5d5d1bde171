"""The mistake catalogue: known mistakes as mutants of the reference, and how a learner's is named.

Every module has `checks/mutants/<stem>.py` with three lists, each entry a patch of the reference
source in `solutions/<stem>.py`:
- `MISTAKES`: a known mistake. The kit's self-tests prove that the module's checks reject each one,
  and that the report names it.
- `VARIANTS`: a correct implementation that rounds in another order (e.g. Hugging Face's vs
  nano-vllm's). The self-tests prove each one passes: the tolerances are not too tight.
- `BROKEN`: code that crashes, hangs or returns garbage. The self-tests prove each gets a one-line
  reason on every check.

A patch must apply exactly once, so a mutant cannot silently stop being a mutant when the reference
is edited. When a learner fails a check, the calls the check made are replayed on every mutant, and a
mutant whose outputs (and cache states) match the learner's within the check's tolerance is named.
A replay makes the same objects (with the same arguments), calls the same functions and methods, and
compares results, tensors written into arguments, and the plain data of the objects involved.
"""

import importlib
import signal
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch

from .compare import TOLERANCES, close_enough
from .guard import Call, New, Remote
from .loader import ROOT, Implementation
from .values import argument_names, changed_input, copy_with_layout, leaves, plain, same, whole_storage

Patch = Callable[[str], str]


class StalePatch(Exception):
    """A mutant's patch no longer matches the reference source: the catalogue must be updated."""


def replace(old: str, new: str) -> Patch:
    def patch(source: str) -> str:
        found = source.count(old)
        if found != 1:
            raise StalePatch(f"expected exactly one {old!r} in the reference, found {found}")
        return source.replace(old, new)

    return patch


def append(code: str) -> Patch:
    """Add code at the end of the module (e.g. a wrapper that redefines a function)."""
    return lambda source: source.rstrip("\n") + "\n\n\n" + code.strip("\n") + "\n"


def chain(*patches: Patch) -> Patch:
    def patch(source: str) -> str:
        for p in patches:
            source = p(source)
        return source

    return patch


class TimeLimitReached(BaseException):  # BaseException: a mutant's `except Exception` cannot swallow it
    pass


def run_with_time_limit(fn: Callable, seconds: float, *args, **kwargs):
    """The kit's own code (a mutant in a replay) under a time limit; learner code never runs here."""

    def on_alarm(signum, frame):
        raise TimeLimitReached

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn(*args, **kwargs)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@dataclass(frozen=True)
class Mistake:
    id: str
    title: str  # what the learner did, in a few words
    hint: str  # one sentence on how to find it in their code
    patch: Patch


@dataclass(frozen=True)
class Variant:
    id: str
    title: str
    patch: Patch


@dataclass(frozen=True)
class Broken:
    id: str
    patch: Patch
    expect: str  # text the one-line reason must contain


def everyday_breakage(anchor: str, function: str, message: str = "shape mismatch in my code") -> list[Broken]:
    """The breakage every module must survive: a syntax error, a renamed public function, an exception
    and an endless loop. `anchor` is one whole line of the reference, inside code the checks run;
    `function` is a public function's name."""
    indent = anchor[: len(anchor) - len(anchor.lstrip())]
    return [
        Broken("syntax-error", replace(anchor, anchor + ")"), "SyntaxError"),
        Broken("missing-function", replace(f"def {function}(", f"def {function}_v2("), f"has no `{function}`"),
        Broken("raises", replace(anchor, f"{indent}raise RuntimeError({message!r})\n{anchor}"),
               f"RuntimeError: {message}"),
        Broken("hang", replace(anchor, f"{indent}while True:\n{indent}    pass\n{anchor}"), "did not return within"),
    ]


@dataclass(frozen=True)
class Catalogue:
    stem: str
    mistakes: tuple[Mistake, ...]
    variants: tuple[Variant, ...]
    broken: tuple[Broken, ...]

    def implementation(self, entry: Mistake | Variant | Broken) -> Implementation:
        kind = {Mistake: "mutant", Variant: "variant", Broken: "broken"}[type(entry)]
        return _implementation(self.stem, kind, entry)

    def mistake(self, mistake_id: str) -> Mistake:
        return next(m for m in self.mistakes if m.id == mistake_id)


@cache
def _implementation(stem: str, kind: str, entry) -> Implementation:
    return Implementation(f"{kind}:{stem}:{entry.id}", ROOT / "solutions", (stem, entry.patch), kind)


@cache
def catalogue(stem: str) -> Catalogue:
    module = importlib.import_module(f"checks.mutants.{stem}")
    return Catalogue(
        stem,
        tuple(module.MISTAKES),
        tuple(getattr(module, "VARIANTS", ())),
        tuple(getattr(module, "BROKEN", ())),
    )


def identify(events: list, stem: str, tolerance_kind: str, time_limit: float) -> list[Mistake]:
    """The catalogued mistakes whose replay of `events` reproduces the learner's outputs."""
    found = []
    for mistake in catalogue(stem).mistakes:
        try:
            module = catalogue(stem).implementation(mistake).load(stem)
        except Exception:  # noqa: BLE001 - a stale mutant must not hide the learner's result
            continue
        if _replays_alike(events, module, tolerance_kind, time_limit):
            found.append(mistake)
    return found


def _replays_alike(events: list, module, tolerance_kind: str, time_limit: float) -> bool:
    made = {}
    for event in events:
        try:
            args = tuple(_fresh(a, made) for a in event.args)
            kwargs = {k: _fresh(v, made) for k, v in event.kwargs.items()}
            if isinstance(event, New):
                made[id(event.obj)] = getattr(module, event.name)(*args, **kwargs)
                continue
            assert isinstance(event, Call)
            if event.owner is None:
                function = getattr(module, event.name)
            else:  # a method: `Class.method` of an object made earlier in the replay
                function = getattr(made[event.owner], event.name.rsplit(".", 1)[1])
            names = argument_names(function, args, kwargs)
            written = {key: (args[key] if isinstance(key, int) else kwargs[key]) for key in event.written}
            before = {arg: leaves(value) for arg, value in names.items()
                      if not any(value is w for w in written.values())}
            result = run_with_time_limit(function, time_limit, *args, **kwargs)
        except BaseException:  # noqa: BLE001 - the mutant crashed where the learner did not
            return False
        # objects a method returned (a list of requests) become the replay's too, for the calls that pass them on
        if not _alike(result, event.result, tolerance_kind, event.returned, made):
            return False
        if (changed_input(before, names) is None) != (event.changed is None):
            return False
        for key, after in event.written.items():
            if not _alike(whole_storage(written[key]), whole_storage(after), tolerance_kind):
                return False
        if not all(obj_id in made for obj_id in (*event.states, *event.data)):
            return False  # an object the replay never made or got back
        for obj_id, state in event.states.items():
            mine = leaves(made[obj_id])
            if mine.keys() != state.keys():
                return False
            if not all(_alike(mine[path], state[path], tolerance_kind) for path in state):
                return False
        for obj_id, data in event.data.items():
            mine = plain(made[obj_id])  # the mutant's attributes: what the contract documents
            if any(key not in data or data[key] != value for key, value in mine.items()):
                return False
    return True


_MISSING = object()


def _fresh(value, made: dict):
    if isinstance(value, torch.Tensor):
        return copy_with_layout(value)
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):  # not a NamedTuple
        return type(value)(_fresh(v, made) for v in value)
    if isinstance(value, Remote) and id(value) not in made:
        raise KeyError("an object the replay did not make")  # never hand a learner's object to a mutant
    return made.get(id(value), value)


def _alike(a, b, tolerance_kind: str, returned: dict | None = None, made: dict | None = None) -> bool:
    """`a` (the mutant's) is `b` (the learner's, as recorded) within the tolerance. A `Remote` in `b` is alike
    when the mutant's object has its attributes as they came back (`returned`, else the latest); with `made`,
    it must also be the object the replay already matched to it, or it is registered as that object."""
    if isinstance(b, (tuple, list)):
        return isinstance(a, (tuple, list)) and len(a) == len(b) and all(
            _alike(x, y, tolerance_kind, returned, made) for x, y in zip(a, b)
        )
    if isinstance(b, Remote):  # an object the learner's call returned: alike when its attributes are
        attributes = (returned or {}).get(id(b), b._attributes)
        shown = {k: v for k, v in attributes.items() if k != "__len__"}
        if not shown or not all(_alike(getattr(a, k, _MISSING), v, tolerance_kind) for k, v in shown.items()):
            return False
        if made is not None:
            if id(b) in made:
                return made[id(b)] is a  # the same object the learner's call handed back before
            made[id(b)] = a
        return True
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return type(a) is type(b) and a == b  # 1 is not True: a wrong type is not a match
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    tol = TOLERANCES.get((tolerance_kind, b.dtype))
    if tol is None:
        return same(a, b)  # exact, with NaN equal to NaN (a cache's untouched slots)
    return close_enough(a, b, tol)
