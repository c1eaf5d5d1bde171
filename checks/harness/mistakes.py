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

import copy
import hashlib
import importlib
import signal
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch

from .compare import TOLERANCES, close_enough
from .guard import Call, New, Raised, Remote, class_name_of
from .loader import ROOT, Implementation
from .ranks import RankCall
from .simdist import run_ranks
from .standins import use_standins
from .values import argument_names, changed_input, copy_with_layout, input_state, leaves, plain, same, whole_storage

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
    # where a run can reject it: "cuda" on a GPU only (a CUDA graph's padding), "no-cuda" where there is none (a
    # check of two ranks on gloo, which a GPU machine of one GPU skips); elsewhere it is left out
    needs: str = ""

    def runs_here(self) -> bool:
        return {"cuda": torch.cuda.is_available(), "no-cuda": not torch.cuda.is_available()}.get(self.needs, True)


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
        # an endless loop that sleeps: the kit's self-tests pay its time limit, not a core spinning for as long
        Broken("hang", replace(anchor, f"{indent}while True:\n{indent}    __import__('time').sleep(0.01)\n{anchor}"),
               "did not return within"),
    ]


@dataclass(frozen=True)
class Rule:
    """A rule of a module's contract that a check can tell is broken, whatever the code that breaks it: the
    report names it where no catalogued mistake reproduces the learner's outputs."""

    id: str
    says: str  # the rule, one sentence
    do: str  # what to change, one sentence


@dataclass(frozen=True)
class Catalogue:
    stem: str
    mistakes: tuple[Mistake, ...]
    variants: tuple[Variant, ...]
    broken: tuple[Broken, ...]
    rules: tuple[Rule, ...] = ()
    # how the report picks among the rules a learner's failures break: "checks" (the one most checks break) or
    # "layers" (the first in the catalogue's order: its rules build on each other, a broken function breaks those
    # that call it)
    rule_ranking: str = "checks"

    def implementation(self, entry: Mistake | Variant | Broken) -> Implementation:
        kind = {Mistake: "mutant", Variant: "variant", Broken: "broken"}[type(entry)]
        return _implementation(self.stem, kind, entry)

    def mistake(self, mistake_id: str) -> Mistake:
        return next(m for m in self.mistakes if m.id == mistake_id)

    def rule(self, rule_id: str) -> Rule | None:
        return next((r for r in self.rules if r.id == rule_id), None)


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
        tuple(getattr(module, "RULES", ())),
        getattr(module, "RULE_RANKING", "checks"),
    )


def identify(events: list, stem: str, tolerance_kind: str, time_limit: float,
             only: Callable[[str], bool] | None = None, distances: dict | None = None,
             failed: bool = False) -> list[Mistake]:
    """The catalogued mistakes (those whose id `only` accepts, when given) whose replay of `events`
    reproduces the learner's outputs. `distances`, when given, gets every replayed mistake's distance from
    the learner's outputs: 0 for those, else the share of the compared values it gets wrong (1 where it
    crashed or cannot be measured), so a report can rank near misses.

    `failed`: the events are a failing check's. Then none where the reference's own replay reproduces them: the
    check failed on a difference finer than the replay's tolerance (a probability of 1e-9 set to 0, say), and
    every mutant that leaves that code alone would match by accident."""
    key = _inputs_key(events)
    if any(memo[0] != stem for memo in _REPLAYED):
        _REPLAYED.clear()  # a run checks one module after another: keep only this one's replays
    if failed and _reproduces(events, stem, "reference", _reference(), tolerance_kind, time_limit, key)[0]:
        return []
    found = []
    for mistake in catalogue(stem).mistakes:
        if (only is not None and not only(mistake.id)) or not mistake.runs_here():
            continue
        alike, distance = _reproduces(events, stem, mistake.id, catalogue(stem).implementation(mistake),
                                      tolerance_kind, time_limit, key, distances is not None)
        if alike:
            found.append(mistake)
        if distances is not None and alike is not None:
            distances[mistake.id] = distance
    return found


@cache
def _reference() -> Implementation:
    return Implementation("solutions", ROOT / "solutions", kind="reference")


def _reproduces(events: list, stem: str, name: str, implementation: Implementation, tolerance_kind: str,
                time_limit: float, key, measure: bool = False) -> tuple[bool | None, float]:
    """Whether `implementation`'s replay of `events` gives the learner's outputs (None where it does not load),
    and, with `measure`, its distance from them (0 when it does)."""
    try:
        module = implementation.load(stem)
    except Exception:  # noqa: BLE001 - a stale mutant must not hide the learner's result
        return None, 1.0
    use_standins(module, stem)  # the reference's kernels of the other modules, by PyTorch on a CPU
    if key is None:
        alike = _replays_alike(events, module, tolerance_kind, time_limit)
        return alike, 0.0 if alike else 1.0
    memo = (stem, name, time_limit, key)  # the outputs depend on the calls' inputs alone: replay them once per run
    if memo not in _REPLAYED:
        _REPLAYED[memo] = _replay(events, module, time_limit)
    alike = _trace_alike(_REPLAYED[memo], events, tolerance_kind)
    if alike or not measure:
        return alike, 0.0 if alike else 1.0
    return False, _trace_distance(_REPLAYED[memo], events, tolerance_kind)


# (module, mistake, time limit, the calls' inputs) -> what the mutant did with them. Every failing check
# replays every mutant; the self-tests fail the same checks, on the same inputs, once per mutant.
_REPLAYED: dict = {}


class _Unkeyable(Exception):
    pass


def _inputs_key(events: list) -> tuple | None:
    """The calls' inputs as a hashable value, or None when a replay depends on more than them (a call-back,
    an object a method returned) and must compare as it goes."""
    made: dict[int, int] = {}  # id(object the learner's classes made) -> its order of making
    key = []
    try:
        for event in events:
            if isinstance(event, Call) and event.returned:
                return None
            own = () if isinstance(event, New) else (
                made[event.owner] if event.owner is not None else None, tuple(sorted(map(str, event.written))),
                tuple(made[i] for i in event.states), tuple(made[i] for i in event.data))
            key.append((type(event).__name__, event.name, _key(event.args, made), _key(event.kwargs, made), own,
                        event.rng_seed))
            if isinstance(event, New):
                made[id(event.obj)] = len(made)
    except (_Unkeyable, KeyError):
        return None
    return tuple(key)


def _key(value, made: dict):
    if isinstance(value, torch.Tensor):
        flat = whole_storage(value.detach()).cpu()
        digest = hashlib.blake2b(flat.view(torch.uint8).numpy().tobytes(), digest_size=16).hexdigest()
        return ("T", str(value.dtype), tuple(value.shape), value.stride(), value.storage_offset(), str(value.device),
                digest)
    if isinstance(value, Remote):
        return ("R", made[id(value)])
    if value is None or type(value) in (bool, int, float, str, torch.dtype, torch.device):
        return (type(value).__name__, repr(value))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_key(v, made) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((repr(k), _key(v, made)) for k, v in value.items()))
    if callable(value) or not hasattr(value, "__dict__"):
        raise _Unkeyable(type(value).__name__)
    return ("O", type(value).__qualname__, _key(vars(value), made))  # a dataclass of weights, a record


def _replay(events: list, module, time_limit: float, compare=None) -> list:
    """Run `events`' calls on `module`: per call, what the comparison needs (None where the mutant crashed,
    and nothing after). `compare(event, result, made)`, when given, judges each result as it comes (it may
    add the objects a result holds to `made`); a replay stops at the first result it rejects."""
    with torch.random.fork_rng(devices=[]):  # the checks' own draws from torch's global generator stay theirs
        return _replay_seeded(events, module, time_limit, compare)


def _replay_seeded(events: list, module, time_limit: float, compare) -> list:
    made, trace = {}, []
    for event in events:
        try:
            args = tuple(_fresh(a, made) for a in event.args)
            kwargs = {k: _fresh(v, made) for k, v in event.kwargs.items()}
            if event.rng_seed is not None:  # as the worker seeded it before the learner's call
                torch.manual_seed(event.rng_seed)
            if isinstance(event, New):
                made[id(event.obj)] = getattr(module, event.name)(*args, **kwargs)
                trace.append({})
                continue
            assert isinstance(event, Call)
            if isinstance(event, RankCall):  # every rank at once, threads standing in for the processes
                result = run_ranks(getattr(module, event.name), list(args), event.world_size, 4 * time_limit)
                if compare is not None and not compare(event, result, made):
                    trace.append(None)
                    return trace
                trace.append({"result": None if compare is not None else copy.deepcopy(result), "unchanged": True,
                              "written": {}, "states": [], "data": []})
                continue
            if event.owner is None:
                function = getattr(module, event.name)
            else:  # a method: `Class.method` of an object made earlier in the replay
                function = getattr(made[event.owner], event.name.rsplit(".", 1)[1])
            names = argument_names(function, args, kwargs)
            written = {key: (args[key] if isinstance(key, int) else kwargs[key]) for key in event.written}
            before = {arg: input_state(value) for arg, value in names.items()
                      if not any(value is w for w in written.values())}
            result = run_with_time_limit(function, time_limit, *args, **kwargs)
            aliased = _aliases(result, (args, kwargs))
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM (./check.sh turns it into this): the run stops here
            raise
        except BaseException as error:  # noqa: BLE001 - the mutant raised: where the learner did too, a match so far
            if isinstance(event, Call) and isinstance(event.result, Raised):
                trace.append({"result": Raised(type(error).__name__), "unchanged": True, "aliased": False,
                              "written": {}, "states": [], "data": []})
                continue
            trace.append(None)  # the mutant crashed where the learner did not
            return trace
        if compare is not None and not compare(event, result, made):
            trace.append(None)
            return trace
        if not all(obj_id in made for obj_id in (*event.states, *event.data)):
            trace.append(None)  # an object the replay never made or got back
            return trace
        trace.append({
            "result": None if compare is not None else copy.deepcopy(result),
            "unchanged": changed_input(before, names, bitwise=True) is None,
            "aliased": aliased,
            "written": {key: whole_storage(w).clone() for key, w in written.items()},
            "states": [leaves(made[obj_id]) for obj_id in event.states],
            "data": [copy.deepcopy(plain(made[obj_id])) for obj_id in event.data],
        })
    return trace


def _trace_alike(trace: list, events: list, tolerance_kind: str, results_compared: bool = False) -> bool:
    if len(trace) != len(events) or any(t is None for t in trace):
        return False
    for event, done in zip(events, trace):
        if isinstance(event, New):
            continue
        if not results_compared and not _alike(done["result"], event.result, tolerance_kind):
            return False
        aliased = getattr(event, "aliased", False)  # a rank call's result is never refused as an alias
        if done["unchanged"] != (event.changed is None) or done.get("aliased", False) != aliased:
            return False  # a generic failure (an input changed, a view returned) is the mutant's only if it does it too
        for key, after in event.written.items():
            if not _alike(done["written"][key], whole_storage(after), tolerance_kind):
                return False
        for mine, state in zip(done["states"], event.states.values()):
            if mine.keys() != state.keys() or not all(_alike(mine[p], state[p], tolerance_kind) for p in state):
                return False
        for mine, data in zip(done["data"], event.data.values()):  # the mutant's attributes: the documented ones
            if any(key not in data or data[key] != value for key, value in mine.items()):
                return False
    return True


def _trace_distance(trace: list, events: list, tolerance_kind: str) -> float:
    """The share of the learner's returned values a replay gets wrong, averaged over the calls (1 for a call
    the replay never reached or crashed in). A call whose result agrees but whose other outputs do not (a
    tensor written, an object's state or plain data: an engine's counters) counts the share of those it gets
    wrong, so a replay that differs only there is not mistaken for one that reproduces the call."""
    calls = [(e, t) for e, t in zip(events, trace + [None] * (len(events) - len(trace))) if not isinstance(e, New)]
    if not calls:
        return 1.0
    wrong = [1.0 if t is None else _call_distance(t, e, tolerance_kind) for e, t in calls]
    return sum(wrong) / len(wrong)


def _call_distance(done: dict, event, tolerance_kind: str) -> float:
    result = _value_distance(done["result"], event.result, tolerance_kind)
    if result > 0:
        return result
    if _trace_alike([done], [event], tolerance_kind):
        return 0.0
    parts = [done["unchanged"] == (event.changed is None) and
             done.get("aliased", False) == getattr(event, "aliased", False)]
    parts += [_alike(done["written"][key], whole_storage(after), tolerance_kind)
              for key, after in event.written.items()]
    for mine, state in zip(done["states"], event.states.values()):
        parts += [mine.keys() == state.keys() and all(_alike(mine[p], state[p], tolerance_kind) for p in state)]
    for mine, data in zip(done["data"], event.data.values()):
        parts += [key in data and data[key] == value for key, value in mine.items()]
    return max(sum(not ok for ok in parts) / len(parts), 1e-3)


def _value_distance(a, b, tolerance_kind: str) -> float:
    if isinstance(b, (tuple, list)):
        if not isinstance(a, (tuple, list)) or len(a) != len(b):
            return 1.0
        return sum(_value_distance(x, y, tolerance_kind) for x, y in zip(a, b)) / len(b) if b else 0.0
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return 1.0
        if not b.numel():
            return 0.0
        tol = TOLERANCES.get((tolerance_kind, b.dtype))
        if tol is None or not b.is_floating_point():
            return float((a != b).float().mean())
        return 0.0 if close_enough(a, b, tol) else float((~torch.isclose(a.double(), b.double(), rtol=1e-3,
                                                                            atol=1e-3)).float().mean())
    return 0.0 if _alike(a, b, tolerance_kind) else 1.0


def _replays_alike(events: list, module, tolerance_kind: str, time_limit: float) -> bool:
    """A replay that compares each result as it comes: objects a method returned (a list of requests)
    become the replay's too, for the calls that pass them on."""
    def compare(event, result, made):
        return _alike(result, event.result, tolerance_kind, event.returned, made)

    return _trace_alike(_replay(events, module, time_limit, compare), events, tolerance_kind, results_compared=True)


_MISSING = object()


def _aliases(result, inputs) -> bool:
    """Whether `result` (a tensor, or a tuple or list of them) shares memory with a tensor among `inputs`."""
    def tensors(value, depth: int = 0):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)) and depth < 2:
            for item in value:
                yield from tensors(item, depth + 1)
        elif isinstance(value, dict) and depth < 2:
            for item in value.values():
                yield from tensors(item, depth + 1)

    held = {t.untyped_storage().data_ptr() for t in tensors(inputs) if t.untyped_storage().nbytes()}
    outs = [result] if isinstance(result, torch.Tensor) else list(result) if type(result) in (list, tuple) else []
    return any(isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() and t.untyped_storage().data_ptr() in held
               for t in outs)


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
        if not shown:  # nothing to compare but what it is (a generator the learner's object holds)
            if type(a).__name__ != class_name_of(b):
                return False
        elif not all(_alike(getattr(a, k, _MISSING), v, tolerance_kind) for k, v in shown.items()):
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
