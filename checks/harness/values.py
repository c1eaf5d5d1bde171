"""What a call did to its values: copies that keep a tensor's layout, the tensors and plain data an object
holds, and the first input a call changed in place.

Both sides use this module: the worker process (which runs learner code and reports what the call
changed) and the checks' process (which replays recorded calls on the catalogue's mutants). It imports
only the standard library and torch, and nothing of the kit, so the worker can run it as shipped text.
"""

import inspect
from collections import deque
from collections.abc import Callable

import torch


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
    for attr, item in _attributes(obj).items():
        value = _plain_value(item, depth)
        if not attr.startswith("_") and value is not _SKIP:
            found[attr] = value
    return found


def _attributes(obj) -> dict:
    try:
        found = vars(obj)
    except TypeError:
        return {}
    return dict(found) if isinstance(found, dict) else {}


def _plain_value(value, depth: int):
    if value is None or type(value) in (bool, int, float, str):
        return value
    if type(value) in (list, tuple, deque, set, frozenset):
        items = [_plain_value(v, depth) for v in value]
        if any(v is _SKIP for v in items):
            return _SKIP
        return sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items
    if type(value) is dict:
        items = {k: _plain_value(v, depth) for k, v in value.items()}
        return _SKIP if any(v is _SKIP for v in items.values()) else items
    if depth > 0 and not callable(value) and not isinstance(value, torch.Tensor) and _attributes(value):
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
    """Clones of the tensors in `value`: itself, the items of a list, tuple or dict (a `*args` or
    `**kwargs` parameter), or an object's tensor attributes and the tensor items of its list attributes."""
    if isinstance(value, torch.Tensor):
        return {"": value.detach().clone()}
    found = {}
    if type(value) in (list, tuple):
        items = [(f"[{i}]", item) for i, item in enumerate(value)]
    elif type(value) is dict:
        items = [(f"[{k!r}]", item) for k, item in value.items()]
    else:
        items = [(f".{attr}", item) for attr, item in _attributes(value).items()]
    for path, item in items:
        if isinstance(item, torch.Tensor):
            found[path] = item.detach().clone()
        elif type(item) in (list, tuple):
            for i, element in enumerate(item):
                if isinstance(element, torch.Tensor):
                    found[f"{path}[{i}]"] = element.detach().clone()
    return found


CONTAINERS = (list, tuple, dict, set, frozenset, deque)
CONTENTS = "="  # the key of a container argument's plain contents in `input_state`


def input_state(value) -> dict:
    """What a call must leave as it was of one argument: clones of its tensors (`leaves`) and, for a list, tuple,
    dict, set or deque, its contents (`contents`) under the key CONTENTS."""
    state = leaves(value)
    if type(value) in CONTAINERS:
        state[CONTENTS] = contents(value)
    return state


def contents(value):
    """A container's items as comparable data, nested containers too: numbers and strings as they are (a float by
    its bits, so NaN equals NaN), any other object (a tensor, a request) by its identity (a tensor's values are
    `leaves`' to compare)."""
    if type(value) in CONTAINERS:
        items = value.items() if type(value) is dict else enumerate(value)
        rows = [(key, contents(item)) for key, item in items]
        return type(value).__name__, sorted(rows, key=repr) if type(value) in (set, frozenset) else rows
    if type(value) is float:
        return value.hex()
    if value is None or type(value) in (bool, int, str, bytes):
        return value
    return "object", id(value)


def changed_input(before: dict[str, dict], names: dict[str, object], bitwise: bool = False) -> str | None:
    """The first argument (or tensor inside one) that differs from its state taken before the call (`input_state`;
    `bitwise`: in any byte, as the worker sees an input in shared memory: -0.0 written over 0.0 is a change)."""
    for arg, snapshot in before.items():
        tensors = {path: t for path, t in snapshot.items() if path != CONTENTS}
        path = first_change(tensors, leaves(names[arg]), bitwise)
        if path is not None:
            return arg + path
        if CONTENTS in snapshot and contents(names[arg]) != snapshot[CONTENTS]:
            return arg
    return None


def first_change(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], bitwise: bool = False) -> str | None:
    for path, old in before.items():
        new = after.get(path)
        if new is None or not (same_bits(old, new) if bitwise else same(old, new)):
            return path
    return None


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype == torch.bool or not a.numel():
        return bool((a == b).all())
    return bool((a.reshape(-1).contiguous().view(torch.uint8) == b.reshape(-1).contiguous().view(torch.uint8)).all())


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    equal = a == b
    if a.is_floating_point():
        equal |= torch.isnan(a) & torch.isnan(b)
    return bool(equal.all())
