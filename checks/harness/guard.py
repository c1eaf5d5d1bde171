"""The learner's module as the checks see it: every call is time-limited, checked and recorded.

A check never calls learner code directly. It asks the `impl` fixture (a `Guarded`) for a public name
and gets a wrapper that
- turns `NotImplementedError` into `NotStarted`, and any other exception, a hang past the time limit,
  a missing name or a file that does not import into a `LearnerError` with a one-line reason;
- checks the returned value against the module's contract (type, shape, dtype, device, finite);
- checks that no input was changed in place (tensors, tensors held by argument objects, and chunks
  already in a cache; a cache may grow), except the arguments a `Writes` contract names;
- records the call so that, when a check fails, the same calls can be replayed on every mutant of the
  reference to name the mistake the learner's output matches (see `mistakes.py`).

A class the learner writes (one not in `stubs.GIVEN_CLASSES`, e.g. p01's `BlockManager`) is made through
the same wrapper, and its objects come back as an `Instance`: each public method call is guarded and
recorded like a function call (named `Class.method` in reasons), and attributes read through.
"""

import inspect
import signal
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .loader import Implementation, LoadError, display, last_line_in
from .stubs import GIVEN_CLASSES


class NotStarted(Exception):
    """The learner's function still raises `NotImplementedError`."""


class LearnerError(Exception):
    """The learner's code failed in a way that has a one-line explanation.

    `identifiable`: the call returned, so its recorded output can be compared with known mistakes.
    """

    def __init__(self, reason: str, identifiable: bool = False):
        super().__init__(reason)
        self.identifiable = identifiable


class TimeLimitReached(BaseException):  # BaseException: a learner's `except Exception` cannot swallow it
    pass


@dataclass(frozen=True)
class Returns:
    """What a function must return: a tensor of this shape, dtype and device (`shape_text` explains)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    shape_text: str

    @classmethod
    def like(cls, t: torch.Tensor, shape_text: str, shape: tuple[int, ...] | None = None):
        return cls(tuple(t.shape) if shape is None else tuple(shape), t.dtype, t.device, shape_text)


class Writes:
    """The contract of a function that writes its result into some of its arguments (a cache) and
    returns nothing: those arguments may change in place, every other input must not.
    `Writes(k_cache, v_cache)`: the argument objects themselves, so a renamed parameter still counts."""

    def __init__(self, *arguments: torch.Tensor):
        self.arguments = arguments

    def includes(self, value) -> bool:
        return any(value is argument for argument in self.arguments)


@dataclass
class Call:
    name: str  # a function, or `Class.method`
    args: tuple
    kwargs: dict
    result: object
    states: dict  # id(object made by the learner's classes) -> its tensor leaves after the call
    changed: str | None  # the input the call changed in place (`sin`, `cache.k[0]`), if any
    data: dict = field(default_factory=dict)  # id(object made by the learner's classes) -> its `plain` data after
    written: dict = field(default_factory=dict)  # position (or keyword) of a `Writes` argument -> it after the call
    owner: int | None = None  # for a method: id of the object it was called on


@dataclass
class New:
    name: str
    obj: object
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


_hung: set[tuple[str, str]] = set()  # (implementation label, function): a hang is reported once


def run_with_time_limit(fn: Callable, seconds: float, *args, **kwargs):
    def on_alarm(signum, frame):
        raise TimeLimitReached

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn(*args, **kwargs)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Guarded:
    def __init__(self, impl: Implementation, stem: str, contracts: dict, time_limit: float):
        self.impl, self.stem, self.contracts, self.time_limit = impl, stem, contracts, time_limit
        self.path = impl.shown_path(stem)
        self.events: list[Call | New] = []
        self.made: set[int] = set()

    def module(self):
        try:
            return self.impl.load(self.stem)
        except LoadError as error:
            raise LearnerError(str(error)) from None

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        module = self.module()
        if not hasattr(module, name):
            raise LearnerError(f"{self.path} has no `{name}`: the checks call it by that name")
        obj = getattr(module, name)
        if isinstance(obj, type):
            return self._maker(name, obj)
        if callable(obj):
            return self._caller(name, obj)
        return obj

    def start_over(self) -> None:
        """Forget the calls recorded so far: a property test's examples are independent, and only the
        last one's calls (the shrunk failing example) are replayed to name a mistake."""
        self.events.clear()

    def _maker(self, name: str, cls: type):
        def make(*args, **kwargs):
            try:
                obj = cls(*args, **kwargs)
            except NotImplementedError:
                raise NotStarted(f"{self.path}: `{name}(...)` raises NotImplementedError") from None
            except (Exception, SystemExit) as error:  # noqa: BLE001
                raise LearnerError(f"creating `{name}` raised {describe(error, self.impl, self.stem)}")
            self.made.add(id(obj))
            recorded_kwargs = {k: self._snapshot(v) for k, v in kwargs.items()}
            self.events.append(New(name, obj, tuple(self._snapshot(a) for a in args), recorded_kwargs))
            return obj if name in GIVEN_CLASSES else Instance(self, name, obj)

        return make

    def _caller(self, name: str, fn: Callable):
        def call(*args, **kwargs):
            return self.call(name, fn, args, kwargs)

        return call

    def call(self, name: str, fn: Callable, args: tuple, kwargs: dict, owner: object = None):
        if (self.impl.label, name) in _hung:
            raise LearnerError(f"not run: `{name}` hung in an earlier check (time limit {self.time_limit:g} s)")
        args = tuple(unwrapped(a) for a in args)
        kwargs = {k: unwrapped(v) for k, v in kwargs.items()}
        contract = self.contracts.get(name)
        expected = None if contract is None else contract(*args, **kwargs)  # reads shapes and dtypes only
        writes = expected if isinstance(expected, Writes) else Writes()
        names = argument_names(fn, args, kwargs)
        before = {arg: leaves(value) for arg, value in names.items() if not writes.includes(value)}
        recorded_args = tuple(self._snapshot(a) for a in args)
        recorded_kwargs = {k: self._snapshot(v) for k, v in kwargs.items()}
        try:
            result = run_with_time_limit(fn, self.time_limit, *args, **kwargs)
        except TimeLimitReached:
            _hung.add((self.impl.label, name))
            raise LearnerError(
                f"`{name}` did not return within {self.time_limit:g} s (an endless loop?)"
            ) from None
        except NotImplementedError as error:
            raise NotStarted(not_started_reason(error, self.impl, self.stem, name)) from None
        except (Exception, SystemExit) as error:  # noqa: BLE001 - exit() too: the other checks must still run
            raise LearnerError(f"`{name}` raised {describe(error, self.impl, self.stem)}") from None
        involved = [v for v in names.values() if id(v) in self.made] + ([owner] if owner is not None else [])
        states = {id(v): leaves(v) for v in involved}
        data = {id(v): plain(v) for v in involved}
        written = {key: copy_with_layout(value) for key, value in [*enumerate(args), *kwargs.items()]
                   if writes.includes(value)}
        changed = changed_input(before, names)
        self.events.append(Call(name, recorded_args, recorded_kwargs, detach(result), states, changed, data,
                                written, None if owner is None else id(owner)))
        if changed is not None:
            raise LearnerError(f"`{name}` changed its input `{changed}` in place", identifiable=True)
        if expected is not None and not isinstance(expected, Writes):
            problem = contract_problem(result, expected)
            if problem:
                raise LearnerError(f"`{name}` {problem}", identifiable=True)
        return result

    def _snapshot(self, value):
        if isinstance(value, torch.Tensor):
            return copy_with_layout(value)
        return value  # objects the learner made are matched by identity; others are left untouched


class Instance:
    """An object of a class the learner writes, as the checks see it: public method calls go through
    `Guarded.call` (named `Class.method`), and attributes read through to the object itself."""

    def __init__(self, guarded: Guarded, class_name: str, obj: object):
        self._guarded, self._class_name, self._obj = guarded, class_name, obj

    def __getattr__(self, name: str):
        try:
            value = getattr(self._obj, name)
        except Exception as error:  # noqa: BLE001 - a missing attribute is the learner's to see
            raise LearnerError(f"`{self._class_name}` object has no `{name}`: the checks read it "
                               f"({type(error).__name__})") from None
        if name.startswith("_") or not inspect.ismethod(value):
            return value
        qualified = f"{self._class_name}.{name}"
        return lambda *args, **kwargs: self._guarded.call(qualified, value, args, kwargs, owner=self._obj)

    def __repr__(self) -> str:
        return f"<{self._class_name} (guarded)>"


def unwrapped(value):
    """The learner's own object behind an `Instance` (learner code never sees the wrapper)."""
    return value._obj if isinstance(value, Instance) else value


def copy_with_layout(t: torch.Tensor) -> torch.Tensor:
    """A copy that keeps `t`'s strides and storage offset, and whatever lies around it in its storage:
    a replay must see a non-contiguous slice as a slice, and a write outside a view must land in a copy
    of the buffer the check surrounded it with, not in foreign memory."""
    t = t.detach()
    storage = t.untyped_storage().clone()
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, t.storage_offset(), t.size(), t.stride())


def whole_storage(t: torch.Tensor) -> torch.Tensor:
    """All of `t`'s storage as one flat tensor of its dtype (to compare what a write did around a view)."""
    n = t.untyped_storage().nbytes() // t.element_size()
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), 0, (n,), (1,))


_SKIP = object()  # a value `plain` leaves out (tensors, functions, ...)


def plain(obj, depth: int = 1) -> dict:
    """The public plain data of an object: numbers, strings, and lists, sets and dicts of them, and the
    same of objects it holds, `depth` levels down. A replay compares it exactly (tensors go to `leaves`)."""
    found = {}
    for attr, item in getattr(obj, "__dict__", {}).items():
        value = _plain_value(item, depth)
        if not attr.startswith("_") and value is not _SKIP:
            found[attr] = value
    return found


def _plain_value(value, depth: int):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple, deque, set, frozenset)):
        items = [_plain_value(v, depth) for v in value]
        if any(v is _SKIP for v in items):
            return _SKIP
        return sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items
    if isinstance(value, dict):
        items = {k: _plain_value(v, depth) for k, v in value.items()}
        return _SKIP if any(v is _SKIP for v in items.values()) else items
    if depth > 0 and hasattr(value, "__dict__") and not callable(value) and not isinstance(value, torch.Tensor):
        return plain(value, depth - 1)
    return _SKIP


def argument_names(fn: Callable, args: tuple, kwargs: dict) -> dict[str, object]:
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
        return dict(bound.arguments)
    except (TypeError, ValueError):
        named = {f"argument {i + 1}": a for i, a in enumerate(args)}
        named.update(kwargs)
        return named


def leaves(value) -> dict[str, torch.Tensor]:
    """Clones of the tensors in `value`: itself, or its attributes and the items of list attributes."""
    if isinstance(value, torch.Tensor):
        return {"": value.detach().clone()}
    found = {}
    for attr, item in getattr(value, "__dict__", {}).items():
        if isinstance(item, torch.Tensor):
            found[f".{attr}"] = item.detach().clone()
        elif isinstance(item, (list, tuple)):
            for i, element in enumerate(item):
                if isinstance(element, torch.Tensor):
                    found[f".{attr}[{i}]"] = element.detach().clone()
    return found


def changed_input(before: dict[str, dict], names: dict[str, object]) -> str | None:
    """The first argument (or tensor inside one) that differs from its copy taken before the call."""
    for arg, snapshot in before.items():
        path = first_change(snapshot, leaves(names[arg]))
        if path is not None:
            return arg + path
    return None


def first_change(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> str | None:
    for path, old in before.items():
        new = after.get(path)
        if new is None or not same(old, new):
            return path
    return None


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    equal = a == b
    if a.is_floating_point():
        equal |= torch.isnan(a) & torch.isnan(b)
    return bool(equal.all())


def detach(result):
    if isinstance(result, torch.Tensor):
        return result.detach().clone()
    if isinstance(result, tuple):
        return tuple(detach(r) for r in result)
    return result


def contract_problem(result, expected) -> str | None:
    if isinstance(expected, tuple):
        if not isinstance(result, tuple) or len(result) != len(expected):
            got = f"a {type(result).__name__}" + (f" of {len(result)}" if isinstance(result, tuple) else "")
            return f"returned {got}, expected a tuple of {len(expected)} tensors"
        for i, (r, e) in enumerate(zip(result, expected)):
            problem = contract_problem(r, e)
            if problem:
                return problem.replace("returned", f"returned (item {i})", 1)
        return None
    if not isinstance(result, torch.Tensor):
        return f"returned a {type(result).__name__}, expected a tensor {expected.shape_text}"
    if tuple(result.shape) != expected.shape:
        return f"returned shape {list(result.shape)}, expected {list(expected.shape)} = {expected.shape_text}"
    if result.dtype != expected.dtype:
        return f"returned {dtype_name(result.dtype)}, expected {dtype_name(expected.dtype)} (the input's dtype)"
    if result.device != expected.device:
        return f"returned a tensor on {result.device}, expected {expected.device}"
    if result.is_floating_point():
        bad = ~torch.isfinite(result)
        if bad.any():
            kind = "NaN" if torch.isnan(result).any() else "inf"
            return f"returned {kind} in {int(bad.sum())} of {result.numel()} values"
    return None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def not_started_reason(error: NotImplementedError, impl: Implementation, stem: str, name: str) -> str:
    """`<file>: `name` raises NotImplementedError`, naming the sibling module that raised it when the
    function runs on another of the learner's files (m04 runs on their m01-m03) that is still a stub."""
    frames = traceback.extract_tb(error.__traceback__)
    raiser = Path(frames[-1].filename) if frames else None
    if raiser is None or frames[-1].filename.startswith(str(impl.path(stem))) or raiser.parent != impl.folder:
        return f"{impl.shown_path(stem)}: `{name}` raises NotImplementedError"
    return (f"{impl.shown_path(stem)}: `{name}` reaches `{frames[-1].name}` in {display(raiser)}, which raises "
            f"NotImplementedError: finish {raiser.stem.split('_')[0]} first")


def describe(error: BaseException, impl: Implementation, stem: str) -> str:
    """`TypeError: message (mine/m02_thinker_attention.py line 57)`, the learner's deepest line."""
    message = str(error).strip().splitlines()[0] if str(error).strip() else ""
    line = last_line_in(error.__traceback__, impl.source_name(stem))
    if line is None:  # raised from a helper file the learner imported: point at the deepest frame
        frames = traceback.extract_tb(error.__traceback__)
        where = f" ({frames[-1].filename.rsplit('/', 1)[-1]} line {frames[-1].lineno})" if frames else ""
    else:
        where = f" ({impl.shown_path(stem)} line {line})"
    return f"{type(error).__name__}: {message}{where}".replace(": (", " (")
