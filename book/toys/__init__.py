"""Computed toys: the numbers a page shows, produced at build time by the reference from `toy_cases/`.

How to run one module's toy is a small adapter, `book/toys/<stem>.py`. Adding one for a new module is
the whole extension point; a module without an adapter still gets its page (the prose Toy section,
and a note that the computed toy is not available). An adapter defines:

- `walkthrough(reference, toy) -> list[Step]`: the toy worked step by step. `reference` is
  `solutions/<stem>.py` loaded as the checks load it; `toy` is `toy_cases/<stem>.json`. Every number
  a table shows must come from `reference` or from `toy`; arithmetic the adapter adds to show the
  in-between steps must be tied to the reference's result with `agree(...)`, so a drifted step fails
  the build instead of printing a wrong page.
- `scenarios(toy) -> list[Scenario]`: the runs of the toy that the mistakes are shown on, in order.
- `PROBE_CASE: T` and `probes() -> list[Scenario]`: a larger case like the checks' random ones, for
  mistakes the toy cannot show (one head hides GQA mistakes, a zero angle hides RoPE mistakes, ...).

A scenario's `run(module)` calls the module and returns `Field`s: tensors (compared at the page's
four decimals on the toy, to a few roundings on probes), or short texts (shapes, dtypes, "inputs unchanged").
"""

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from book.i18n import UI, T
from checks.harness.loader import named
from checks.harness.mistakes import catalogue
from checks.harness.toys import load_toy
from checks.harness.values import argument_names, changed_input, leaves

DECIMALS = 4


class ToyDrift(Exception):
    """An adapter's worked step disagrees with the reference: the page would show wrong numbers."""


# ---- numbers as the page shows them ----------------------------------------------------------------


def number(value: float) -> str:
    """Four decimals, trailing zeros dropped, no negative zero: 1.0 -> "1", 0.19557 -> "0.1956", 1e-06 -> "1e-6"."""
    value = float(value)
    if value != value:
        return "nan"
    if value in (float("inf"), float("-inf")):
        return "inf" if value > 0 else "-inf"
    if 0 < abs(value) < 1e-3:  # eps and friends: 1e-6, not 0
        mantissa, exponent = f"{value:.3e}".split("e")
        return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
    out = f"{value:.{DECIMALS}f}".rstrip("0").rstrip(".")
    return "0" if out in ("-0", "") else out


def vector(values) -> str:
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    return "[" + ", ".join(number(v) for v in values) + "]"


def lines(value) -> list[str]:
    """A tensor as the lines a cell shows: one per row for a matrix, one line for a vector or scalar."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            return [number(value.item())]
        if value.dim() == 1:
            return [vector(value)]
        if value.dim() == 2:
            return [vector(row) for row in value]
        return [f"tensor of shape {list(value.shape)}"]
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], (list, tuple)):
        return [vector(row) for row in value]
    if isinstance(value, (list, tuple)):
        return [vector(value)]
    return [value if isinstance(value, T) else str(value)]


def shape(value) -> str:
    return "[" + ", ".join(str(n) for n in value) + "]"


def agree(worked: torch.Tensor, reference: torch.Tensor, what: str) -> None:
    """Tie an adapter's in-between arithmetic to the reference's output."""
    # 1e-6: the reference may round through fp32 on the way (its norms do); the page shows 4 decimals.
    if worked.shape != reference.shape or not torch.allclose(worked.double(), reference.double(), atol=1e-6, rtol=0):
        raise ToyDrift(f"the worked steps for {what} give {vector(worked.flatten())}, the reference "
                       f"{vector(reference.flatten())}: the adapter in book/toys/ no longer matches solutions/")


# ---- what an adapter returns --------------------------------------------------------------------


@dataclass(frozen=True)
class Cell:
    lines: tuple  # of str or T
    marked: frozenset = frozenset()  # indices of lines shown as wrong
    kind: str = "num"  # num | text | mask

    @classmethod
    def of(cls, value, kind: str | None = None) -> "Cell":
        found = tuple(lines(value))
        guess = "text" if isinstance(value, (str, T)) else "num"
        return cls(found, frozenset(), kind or guess)


@dataclass(frozen=True)
class Table:
    id: str  # stable, for the page's self-tests: data-toy="<id>"
    columns: tuple  # of str or T
    rows: tuple  # of tuples of Cell

    @classmethod
    def of(cls, id: str, columns, rows) -> "Table":
        return cls(id, tuple(columns), tuple(tuple(c if isinstance(c, Cell) else Cell.of(c) for c in row)
                                             for row in rows))


@dataclass(frozen=True)
class Step:
    title: T
    table: Table
    text: T | None = None  # a sentence under the title, with numbers filled in by the adapter


@dataclass(frozen=True)
class Field:
    key: str
    label: T
    value: object  # torch.Tensor, str or T


@dataclass(frozen=True)
class Scenario:
    id: str
    title: T
    run: Callable[[object], list[Field]]


def call(function, *args, **kwargs):
    """Call `function`; also return the name of the first input it changed in place, or None."""
    names = argument_names(function, args, kwargs)
    before = {arg: leaves(value) for arg, value in names.items()}
    result = function(*args, **kwargs)
    return result, changed_input(before, names)


def inputs_field(changed: str | None) -> Field:
    value = T("unchanged", "未被修改") if changed is None else T(f"{changed} changed in place", f"{changed} 被原地修改")
    return Field("inputs", T("inputs", "输入"), value)


# ---- the mistakes, run on the toy -----------------------------------------------------------------


@dataclass(frozen=True)
class Difference:
    label: T
    got: Cell
    expected: Cell
    evidence: T  # one clause, e.g. "rows off by up to 0.41"


@dataclass(frozen=True)
class Shown:
    """A mistake the toy shows: the first scenario where its result differs."""

    mistake: object  # checks.harness.mistakes.Mistake
    scenario: Scenario
    differences: tuple[Difference, ...]


@dataclass(frozen=True)
class Hidden:
    """A mistake the toy cannot show, with what a larger case shows instead (None: nothing here does)."""

    mistake: object
    scenario: Scenario | None
    differences: tuple[Difference, ...]
    error: str = ""  # the mutant could not be built


def _run(scenario: Scenario, module) -> list[Field]:
    try:
        return scenario.run(module)
    except Exception as error:  # noqa: BLE001 - a mistake that crashes is a result to show
        message = str(error).splitlines()[0] if str(error) else ""
        message = message if len(message) <= 90 else message[:87] + "..."
        return [Field("error", T("raises", "报错"), f"{type(error).__name__}: {message}")]


def _text(value) -> str:
    return value.en if isinstance(value, T) else str(value)


def _mark(got: Cell, expected: Cell) -> Cell:
    wrong = {i for i, line in enumerate(got.lines)
             if i >= len(expected.lines) or _text(line) != _text(expected.lines[i])}
    return Cell(got.lines, frozenset(wrong), got.kind)


def differences(correct: list[Field], got: list[Field], on_toy: bool) -> tuple[Difference, ...]:
    """The fields that differ: at the page's four decimals on the toy, beyond a few roundings on probes."""
    found = []
    expected = {f.key: f for f in correct}
    for f in got:
        if f.key == "error":
            return (Difference(f.label, Cell.of(f.value, "text"), Cell.of("", "text"),
                               T("raises {v}", "报错 {v}").format(v=f.value)),)
        want = expected.get(f.key)
        if want is None:
            continue
        a, b = f.value, want.value
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.shape != b.shape:
                clause = _clause(T("{l}: shape {a} instead of {b}", "{l}：形状是 {a}，应为 {b}"), f.label,
                                 shape(a.shape), shape(b.shape))
                found.append(Difference(f.label, Cell.of(shape(a.shape), "text"), Cell.of(shape(b.shape), "text"),
                                        clause))
                continue
            if a.dtype != b.dtype:
                name = (str(a.dtype).removeprefix("torch."), str(b.dtype).removeprefix("torch."))
                found.append(Difference(f.label, Cell.of(name[0], "text"), Cell.of(name[1], "text"),
                                        _clause(T("{l}: {a} instead of {b}", "{l}：dtype 是 {a}，应为 {b}"),
                                                f.label, *name)))
                continue
            shown_a, shown_b = Cell.of(a), Cell.of(b)
            if not on_toy:
                gap = (a.double() - b.double()).abs().nan_to_num(float("inf")).max().item() if a.numel() else 0.0
                size = max(1.0, b.double().abs().max().item() if b.numel() else 1.0)
                if gap <= 8 * torch.finfo(b.dtype).eps * size:  # a few roundings apart: the same result
                    continue
                if a.numel() <= 8:
                    clause = _clause(T("{l}: {a} instead of {b}", "{l}：得到 {a}，应为 {b}"), f.label,
                                     " ".join(shown_a.lines), " ".join(shown_b.lines))
                else:
                    clause = _clause(T("{l}: off by up to {a}", "{l}：最大偏差 {a}"), f.label, f"{gap:.3g}", "")
            else:
                if shown_a.lines == shown_b.lines:
                    continue
                clause = _clause(T("{l}: {a} instead of {b}", "{l}：得到 {a}，应为 {b}"), f.label,
                                 " ".join(shown_a.lines), " ".join(shown_b.lines))
            found.append(Difference(f.label, _mark(shown_a, shown_b), shown_b, clause))
        elif _text(a) != _text(b):
            if f.key == "inputs":  # "sin changed in place" says it all
                zh = a.zh if isinstance(a, T) else a
                clause = T(f"{_text(a)}: inputs must stay as they were", f"{zh}：输入必须保持原样")
            else:
                clause = _clause(T("{l}: {a} instead of {b}", "{l}：{a}，应为 {b}"), f.label, a, b)
            found.append(Difference(f.label, _mark(Cell.of(a, "text"), Cell.of(b, "text")), Cell.of(b, "text"), clause))
    return tuple(found)


def _clause(template: T, label: T, a, b) -> T:
    return T(template.en.format(l=label.en, a=_text(a), b=_text(b)),
             template.zh.format(l=label.zh, a=a.zh if isinstance(a, T) else a, b=b.zh if isinstance(b, T) else b))


def gallery(stem: str, adapter, reference, toy: dict) -> list[Shown | Hidden]:
    """Every catalogued mistake: shown on the toy where it differs, else on the adapter's probes."""
    entries: list[Shown | Hidden] = []
    toy_runs = adapter.scenarios(toy)
    probes = adapter.probes() if hasattr(adapter, "probes") else []
    correct = {s.id: _run(s, reference) for s in [*toy_runs, *probes]}
    for mistake in catalogue(stem).mistakes:
        try:
            module = catalogue(stem).implementation(mistake).load(stem)
        except Exception as error:  # noqa: BLE001 - a stale patch is reported, not fatal to the book
            entries.append(Hidden(mistake, None, (), f"{type(error).__name__}: {error}"))
            continue
        entry: Shown | Hidden = Hidden(mistake, None, ())
        for scenario in toy_runs:
            found = differences(correct[scenario.id], _run(scenario, module), on_toy=True)
            if found:
                entry = Shown(mistake, scenario, found)
                break
        else:
            for scenario in probes:
                found = differences(correct[scenario.id], _run(scenario, module), on_toy=False)
                if found:
                    entry = Hidden(mistake, scenario, found)
                    break
        entries.append(entry)
    return entries


# ---- one module's computed toy -----------------------------------------------------------------------


@dataclass
class ComputedToy:
    stem: str
    available: bool
    reason: T | None = None  # why not, when not available
    steps: list[Step] = field(default_factory=list)
    shown: list[Shown] = field(default_factory=list)
    hidden: list[Hidden] = field(default_factory=list)
    probe_case: T | None = None

    @property
    def tables(self) -> list[Table]:
        return [step.table for step in self.steps]


def adapter_for(stem: str):
    """`book.toys.<stem>`, or None when no adapter has been written for the module yet."""
    name = f"{__name__}.{stem}"
    if importlib.util.find_spec(name) is None:
        return None
    return importlib.import_module(name)


def compute(stem: str) -> ComputedToy:
    adapter = adapter_for(stem)
    if adapter is None:
        return ComputedToy(stem, False, UI["no_adapter"])
    try:
        toy = load_toy(stem)
        reference = named("solutions").load(stem)
    except Exception as error:  # noqa: BLE001 - a missing toy file or reference is a note on the page
        return ComputedToy(stem, False, UI["toy_unavailable"].format(reason=f"{type(error).__name__}: {error}"))
    steps = adapter.walkthrough(reference, toy)
    try:
        entries = gallery(stem, adapter, reference, toy)
    except ModuleNotFoundError as error:  # no checks/mutants/<stem>.py yet: the toy without its mistakes
        if error.name != f"checks.mutants.{stem}":
            raise
        entries = []
    return ComputedToy(stem, True, None, steps,
                       [e for e in entries if isinstance(e, Shown)], [e for e in entries if isinstance(e, Hidden)],
                       getattr(adapter, "PROBE_CASE", None))
