"""The learner's module as the checks see it: every call crosses to a worker, is checked and recorded.

A check never calls learner code, and never holds a learner object. It asks the `impl` fixture (a
`Guarded`) for a public name and gets a wrapper that sends the call to the worker process of this
module run (`worker.py`), then
- turns `NotImplementedError` into `NotStarted`, and any other exception, a hang past the time limit
  (the worker is killed), a worker that exits or dies, a missing name or a file that does not import
  into a `LearnerError` with a one-line reason;
- checks the returned value against the module's contract (type, shape, dtype, device, finite);
- reports an input the call changed in place (tensors, tensors held by argument objects, and chunks
  already in a cache; a cache may grow), except the arguments a `Writes` contract names: those come
  back from the worker and are copied into the check's own tensors;
- records the call so that, when a check fails, the same calls can be replayed on every mutant of the
  reference to name the mistake the learner's output matches (see `mistakes.py`).

Arguments travel as copies, so nothing the worker does can change the check's own inputs or its
expected values. Objects the learner's classes make (`KVCache`, `BlockManager`, `Sequence`...) stay
in the worker; the check holds a `Remote` whose method calls are guarded like function calls (named
`Class.method`) and whose attributes are read from the worker. The check's own values that are not
plain data (weights dataclasses, namespaces) arrive as records with the same fields, and its callables
(a `trace`, a `hash_block`) are called back in the checks' process while the call runs.
"""

import ast
import dataclasses
import functools
import os
import re
import time
from dataclasses import dataclass, field

import torch

from . import wire
from .loader import ROOT, Implementation
from .values import copy_with_layout, whole_storage
from .worker import DEFAULT_MEMORY_LIMIT, ForkServer, Overran, Sandbox, Session, WorkerGone

IMPORT_TIME_LIMIT = 30.0  # seconds; importing torch inside a learner's file is already paid for


class NotStarted(Exception):
    """The learner's function still raises `NotImplementedError`."""


class LearnerError(Exception):
    """The learner's code failed in a way that has a one-line explanation.

    `identifiable`: the call returned, so its recorded output can be compared with known mistakes.
    `crash`: the worker died running it (`WorkerGone`); `arguments`: then, the call's arguments in words
    (`q [9, 8, 16] bf16`), said after the reason as far as `CRASH_REASON_LIMIT` allows.
    `detail`: one short line the report shows under the reason (what followed from the failure: the other ranks'
    errors; what a distributed backend printed). `rule`: as `Mismatch.rule`.
    """

    def __init__(self, reason: str, identifiable: bool = False, crash: WorkerGone | None = None,
                 arguments: tuple[str, ...] = (), detail: str = "", rule: str = ""):
        super().__init__(with_arguments(reason, arguments))
        self.identifiable, self.crash, self.head, self.arguments = identifiable, crash, reason, arguments
        self.detail, self.rule = detail, rule

    def noted(self, note: str) -> "LearnerError":
        """The same failure with `note` after its reason (before the arguments, which give way first)."""
        return LearnerError(f"{self.head} · {note}", self.identifiable, self.crash, self.arguments, self.detail)


CRASH_REASON_LIMIT = 280  # characters: the report cuts a reason at 300, and a rank's adds its own words


def with_arguments(reason: str, arguments: tuple[str, ...], limit: int = CRASH_REASON_LIMIT) -> str:
    """`reason; called with q [9, 8, 16] bf16, max_seqlen_q 5`: the arguments that fit within `limit`, then `…`."""
    if not arguments:
        return reason
    head = f"{reason}; called with "
    shown = []
    for n, argument in enumerate(arguments):
        more = n + 1 < len(arguments)
        if len(head) + len(", ".join([*shown, argument])) + (3 if more else 0) > limit:
            return head + ", ".join([*shown, "…"]) if shown else reason
        shown.append(argument)
    return head + ", ".join(shown)


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
    returned: dict = field(default_factory=dict)  # id(a `Remote` in the result) -> its attributes as it came back
    aliased: bool = False  # the result was (a view of) one of the inputs: a mutant must do the same to match
    rng_seed: int | None = None  # torch's global generator was seeded with it just before the call (a replay too)


@dataclass(frozen=True)
class Raised:
    """A call's result where it raised (the exception's type name): a replay matches it only by raising one too.
    A check that catches a refusal (a ValueError it asks for) and goes on keeps the refusal among the calls."""

    kind: str


@dataclass
class New:
    name: str
    obj: object
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    rng_seed: int | None = None


# ---- the check's side of the wire -------------------------------------------------------------------


class Remote:
    """An object that lives in the worker (made by the learner's code), as the check holds it."""

    def __init__(self, session: "ModuleRun", handle: int, generation: int, class_name: str, kind: str):
        self._session, self._handle, self._generation = session, handle, generation
        self._class_name, self._kind = class_name, kind
        self._attributes: dict = {}  # its instance attributes as the worker last sent them
        self._methods: tuple = ()  # its class's public methods
        self._epoch = -1  # ... valid while no call has run since (ModuleRun.epoch)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if name in self._methods and name not in self._attributes:
            qualified = f"{self._class_name}.{name}"
            return lambda *args, **kwargs: self._session.guarded.call(qualified, (self, name), args, kwargs,
                                                                       owner=self)
        if self._epoch == self._session.epoch and name in self._attributes:
            value = self._attributes[name]
        else:
            value = self._session.ask(("getattr", self, name), f"`{self._class_name}.{name}`")
        if isinstance(value, Remote) and value._kind == "function":
            qualified = f"{self._class_name}.{name}"
            return lambda *args, **kwargs: self._session.guarded.call(qualified, value, args, kwargs, owner=self)
        return value

    def __len__(self) -> int:
        if self._epoch == self._session.epoch and "__len__" in self._attributes:
            value = self._attributes["__len__"]
        else:
            value = self._session.ask(("len", self), f"len(`{self._class_name}`)")
        if type(value) is not int or value < 0:
            raise LearnerError(f"len() of a `{self._class_name}` returned {value!r}, expected an int >= 0")
        return value

    def __bool__(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"<{self._class_name} in the worker>"


def class_name_of(value) -> str:
    """The class of a value the learner's code returned, whether it came back as a copy or lives in the worker."""
    return value._class_name if isinstance(value, Remote) else type(value).__name__


def snapshot_of(value, name: str, default=None):
    """An attribute of a `Remote` as the worker sent it with the object, without asking the worker again (inside a
    callback the worker is busy with the learner's call); `default` where it was not sent."""
    return value._attributes.get(name, default) if isinstance(value, Remote) else default


class ParentCodec(wire.Codec):
    def __init__(self, run: "ModuleRun"):
        super().__init__()
        self.run = run
        self.callbacks = run.callbacks  # the worker may call one back later (a hash function a manager keeps)
        self.sent: dict[int, tuple] = {}  # id -> (number, object): one object given twice in a call arrives as one

    def other(self, value):
        if isinstance(value, Remote):
            if value._session is not self.run or value._generation != self.run.session.generation:
                raise LearnerError(f"a `{value._class_name}` made in a worker process that has ended since")
            return ("R", value._handle)
        if dataclasses.is_dataclass(value) or hasattr(value, "__dict__") and not callable(value):
            if id(value) in self.sent:
                return ("OR", self.sent[id(value)][0])
            number = len(self.sent)
            self.sent[id(value)] = (number, value)  # (held, so no other object takes its id while encoding)
            return ("O", type(value).__name__, [(k, self.encode(v)) for k, v in vars(value).items()], number)
        if callable(value):
            self.callbacks.append(value)
            return ("F", len(self.callbacks) - 1)
        raise wire.WireError(f"a {type(value).__name__} cannot be sent to the worker")

    def decode_other(self, tag: str, rest: tuple):
        if tag == "H" and len(rest) == 5 and type(rest[0]) is int and all(type(r) is str for r in rest[1:3]):
            remote = self.run.remote(*rest[:3])
            if type(rest[4]) is list:
                remote._methods = tuple(m for m in rest[4] if type(m) is str)
            if type(rest[3]) is list:
                remote._attributes = {name: self._decode(v) for name, v in (wire._pair(p) for p in rest[3])
                                      if type(name) is str}
                remote._epoch = self.run.epoch
            return remote
        raise wire.WireError(f"unknown value {tag!r}")


class ModuleRun:
    """One implementation's module in its worker, for a whole run (every check of the module)."""

    def __init__(self, server: ForkServer, impl: Implementation, stem: str, time_limit: float,
                 prelude: tuple | None = None):
        self.impl, self.stem, self.time_limit = impl, stem, time_limit
        self.session = Session(server, impl.spec(stem), lambda session: ParentCodec(self), IMPORT_TIME_LIMIT, prelude)
        self.remotes: dict[tuple[int, int], Remote] = {}
        self.callbacks: list = []  # the check's callables the worker holds, by number
        self.epoch = 0  # counts calls: an object's attributes read before the last call may be stale
        self.guarded: Guarded | None = None  # the check running now
        self.rank_groups: dict = {}  # world size -> its `Ranks` (ranks.py), kept from one check to the next

    def remote(self, handle: int, class_name: str, kind: str) -> Remote:
        key = (self.session.generation, handle)
        found = self.remotes.get(key)
        if found is None:
            found = self.remotes[key] = Remote(self, handle, self.session.generation, class_name, kind)
        return found

    def names(self) -> dict:
        try:
            loaded = self.session.ensure()
        except (Overran, WorkerGone) as error:
            raise LearnerError(str(error).replace("importing it", f"importing {self.impl.shown_path(self.stem)}"))
        if loaded[0] != "loaded":
            raise LearnerError(loaded[1])
        return loaded[1]

    def ask(self, message, what: str):
        """A request that runs learner code (an attribute, a length): its value, or a `LearnerError`."""
        reply = self.exchange(message, what)
        if reply[0] == "value":
            return reply[1]
        raise LearnerError(reply[1])

    def exchange(self, message, what: str):
        self.names()
        if message[0] in ("call", "method"):
            self.epoch += 1
        try:
            reply = self.session.request(message, self.time_limit, what)
        except Overran as error:
            raise LearnerError(str(error)) from None
        except WorkerGone as error:
            raise LearnerError(str(error), crash=error, detail=error.backend) from None
        if reply[0] == "not-started":
            raise NotStarted(reply[1])
        if reply[0] in ("raised", "load-error"):
            if reply[-1] == "end":  # the worker ends itself (it left threads running): the next check gets a new one
                self.session.end()
            # a second line is the exception's note (`add_note`): a tensor-parallel engine's other ranks
            reason, _, note = str(reply[1]).partition("\n")
            raise LearnerError(reason, detail=" · ".join(filter(None, (note, self.session.backend))))
        return reply

    def worker_cpu(self) -> float | None:
        """CPU seconds the worker has used so far (None where its pid is not this process's to read: in the
        sandbox's own pid namespace, or with no worker)."""
        pid = self.session.pid
        if pid is None or self.session.server.sandboxed:
            return None
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
        except (OSError, IndexError, ValueError):
            return None

    def end_check(self) -> None:
        self.session.forget()
        self.remotes = {k: v for k, v in self.remotes.items() if v._kind != "object"}
        self.callbacks.clear()
        for group in self.rank_groups.values():
            group.end_check()

    def close(self) -> None:
        self.session.end()
        for group in self.rank_groups.values():
            group.close()
        self.rank_groups.clear()


class Runs:
    """Every module run of this pytest session, over one fork server."""

    def __init__(self, *, triton: bool, cuda: bool, memory_limit: int = DEFAULT_MEMORY_LIMIT,
                 sandbox: Sandbox | None = None, quiet: bool = False, worker_uid: int | None = None):
        self.server = ForkServer(triton=triton, cuda=cuda, memory_limit=memory_limit, sandbox=sandbox, quiet=quiet,
                                 worker_uid=worker_uid)
        self.runs: dict[tuple[str, str], ModuleRun] = {}

    def start(self) -> None:
        self.server.start()

    def run(self, impl: Implementation, stem: str, time_limit: float) -> ModuleRun:
        key = (impl.label, stem)
        if key not in self.runs:
            self.runs[key] = ModuleRun(self.server, impl, stem, time_limit)
        return self.runs[key]

    def close_module(self, stem: str) -> None:
        for key in [k for k in self.runs if k[1] == stem]:
            self.runs.pop(key).close()

    def close_runs(self) -> None:
        """End every module's worker, keeping the fork server for another run."""
        for run in self.runs.values():
            run.close()
        self.runs.clear()

    def close(self) -> None:
        self.close_runs()
        self.server.stop()


# ---- the guard ------------------------------------------------------------------------------------

_hung: set[tuple[str, str]] = set()  # (implementation label, function): a hang is reported once


RNG_SEED = 20_240_601  # the first call's seed of torch's global generator in a check (the next, one more)


class Guarded:
    def __init__(self, run: ModuleRun, stem: str, contracts: dict, time_limit: float):
        self.run, self.stem, self.contracts, self.time_limit = run, stem, contracts, time_limit
        self.impl = run.impl
        self.path = self.impl.shown_path(stem)
        self.events: list[Call | New] = []
        self.called: list[str] = []  # every learner function or method the check called, in order (progress)
        self.slowest = 0.0  # seconds of the longest call (the self-tests hold the reference far below the limit)
        self.slowest_cpu = 0.0  # CPU seconds the worker spent on its costliest call: what the call takes on an
        # idle machine, whatever else this one is doing
        self.made: set[int] = set()
        self.watch: TensorWatch | None = None
        self.calls_made = 0  # seeds torch's global generator before each call: RNG_SEED + the call's number
        run.guarded = self

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        names = self.run.names()
        if name not in names:
            raise LearnerError(f"{self.path} has no `{name}`: the checks call it by that name")
        value = names[name]
        if isinstance(value, Remote) and value._kind == "class":
            return lambda *args, **kwargs: self.call(name, value, args, kwargs, making=True)
        if isinstance(value, Remote) and value._kind == "function":
            return lambda *args, **kwargs: self.call(name, value, args, kwargs)
        return value

    def watch_tensors(self) -> "TensorWatch":
        """`with impl.watch_tensors() as watch:` the calls inside report the largest tensor (in bytes) any
        torch operation made while they ran, in the worker: `watch.largest` (what the worker says); and, under
        `grade` where the sandbox has a memory cgroup, `watch.outside`: the most its memory grew during a call,
        measured by the kernel (None elsewhere)."""
        return TensorWatch(self)

    def spy(self, owner: Remote, method: str, callback, watched: Remote, attribute: str) -> None:
        """From now on each call of `owner.method` in the worker (the learner's own calls included) first calls
        `callback(args, value)` here, with the call's arguments and `watched.attribute` as they are at that moment
        (learner objects as `Remote`s whose attributes were read then: read them with `snapshot_of`)."""
        self.run.ask(("spy", owner, method, callback, watched, attribute), f"`{owner._class_name}.{method}`")

    def fresh_worker(self) -> None:
        """The next call runs in a new worker process, which has imported the module afresh: nothing the
        learner's code kept from the calls before (a cache of outputs) is there. Objects made before are gone
        with the old worker (using one is a one-line failure)."""
        self.run.session.end()

    def start_over(self) -> None:
        """Forget the calls recorded so far: a property test's examples are independent, and only the
        last one's calls (the shrunk failing example) are replayed to name a mistake."""
        self.events.clear()

    def call(self, name: str, target: "Remote | tuple[Remote, str]", args: tuple, kwargs: dict,
             owner: Remote | None = None,
             making: bool = False):
        if name not in self.called:
            self.called.append(name)
        if (self.impl.label, name) in _hung:
            raise LearnerError(f"not run: `{name}` hung in an earlier check (time limit {self.time_limit:g} s)")
        contract = self.contracts.get(name)
        expected = None if contract is None else contract(*args, **kwargs)  # reads shapes and dtypes only
        writes = expected if isinstance(expected, Writes) else Writes()
        arguments = [*enumerate(args), *kwargs.items()]
        write_keys = [key for key, value in arguments if writes.includes(value)]
        recorded_args = tuple(snapshot(a) for a in args)
        recorded_kwargs = {k: snapshot(v) for k, v in kwargs.items()}
        watch = self.watch is not None
        rng_seed = RNG_SEED + self.calls_made  # a learner's draws from torch's global generator repeat run after run,
        self.calls_made += 1  # and differ from one call to the next, as an unseeded generator's would
        # `watch` goes last: worker.py reads it there, to measure the sandbox's memory during the call
        if isinstance(target, tuple):  # (object, method name): one request, not a read then a call
            message = ("method", target[0], target[1], name, args, kwargs, write_keys, rng_seed, watch)
        else:
            message = ("call", target, name, args, kwargs, write_keys, rng_seed, watch)
        started, cpu = time.perf_counter(), None
        try:
            self.run.names()  # the worker started and the module imported: not part of the call's time
            cpu = self.run.worker_cpu()
            reply = self.run.exchange(message, f"`{name}`")
        except LearnerError as error:
            raised = re.match(r"`[^`]*` raised (\w+)", str(error))
            if raised and not making and error.crash is None:
                self.events.append(Call(name, recorded_args, recorded_kwargs, Raised(raised.group(1)), {}, None,
                                        owner=None if owner is None else id(owner), rng_seed=rng_seed))
            if "did not return within" in str(error):
                _hung.add((self.impl.label, name))
            if error.crash is not None:  # which call, on what: the worker that could say more is gone
                shown = arguments_shown(self.stem, name, args, kwargs)
                raise LearnerError(error.head, crash=error.crash, arguments=shown, detail=error.detail) from None
            raise
        finally:
            self.slowest = max(self.slowest, time.perf_counter() - started)
            after = self.run.worker_cpu() if cpu is not None else None
            if after is not None:
                self.slowest_cpu = max(self.slowest_cpu, after - cpu)
        if reply[0] != "returned" or len(reply) != 9:
            raise LearnerError(f"`{name}`: the worker sent an unexpected reply")
        _, result, changed, states, data, written, refused, _, largest = reply
        if type(changed) is not str:
            changed = None
        seen = self.run.session.written  # the inputs' memory as this process reads it after the call
        if seen and changed is None:
            changed = next((path for key, value in arguments if key not in write_keys
                            for path, t in tensor_paths(value, argument_label(key))
                            if wire.storage_key(t) in seen and not any(wire.storage_key(t) == wire.storage_key(w)
                                                                         for w in writes.arguments)), None)
        if watch:
            self.watch.largest = max(self.watch.largest, largest if type(largest) is int else 0)
            outside = self.run.session.peak
            if outside is not None:
                self.watch.outside = max(self.watch.outside or 0, outside)
        if making:
            if not isinstance(result, Remote):
                raise LearnerError(f"`{name}(...)` did not make an object")
            self.made.add(id(result))
            self.events.append(New(name, result, recorded_args, recorded_kwargs, rng_seed))
            return result
        after = {}
        for key, value in arguments:
            if key in write_keys:
                copy_back(value, written.get(key), name, key)
                after[key] = copy_with_layout(value)
        by_id = {id(self.run.remote(h, "", "object")): s for h, s in states.items()} if states else {}
        data_by_id = {id(self.run.remote(h, "", "object")): d for h, d in data.items()} if data else {}
        self.events.append(Call(name, recorded_args, recorded_kwargs, snapshot(result), by_id, changed, data_by_id,
                                after, None if owner is None else id(owner), returned_attributes(result),
                                refused is not None, rng_seed))
        if changed is not None:
            raise LearnerError(f"`{name}` changed its input `{changed}` in place", identifiable=True)
        if refused is not None:  # an alias of an input: only a mutant that returns one too can match
            raise LearnerError(str(refused), identifiable=True)
        if expected is not None and not isinstance(expected, Writes):
            problem = contract_problem(result, expected)
            if problem:
                raise LearnerError(f"`{name}` {problem}", identifiable=True)
        return result


class TensorWatch:
    def __init__(self, guarded: Guarded):
        self.guarded, self.largest = guarded, 0
        self.outside: int | None = None

    def __enter__(self) -> "TensorWatch":
        self.guarded.watch = self
        return self

    def __exit__(self, *exc) -> None:
        self.guarded.watch = None


def arguments_shown(stem: str, name: str, args: tuple, kwargs: dict) -> tuple[str, ...]:
    """A call's arguments in words, each named as the reference names it: `q [9, 8, 16] bf16`, `max_seqlen_q 5`."""
    names = reference_parameters(stem).get(name, ())
    positional = [f"{names[i]} {value_shown(v)}" if i < len(names) else value_shown(v) for i, v in enumerate(args)]
    return (*positional, *(f"{k} {value_shown(v)}" for k, v in kwargs.items()))


@functools.cache
def reference_parameters(stem: str) -> dict[str, tuple[str, ...]]:
    """Function (`paged_prefill`), class (its `__init__`) or method (`LLM.generate`) -> its parameters' names in
    `solutions/<stem>.py`, read from its syntax (nothing of it runs here); a learner's signature is the same."""
    try:
        tree = ast.parse((ROOT / "solutions" / f"{stem}.py").read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return {}

    def parameters(node: ast.FunctionDef, method: bool) -> tuple[str, ...]:
        found = tuple(a.arg for a in node.args.posonlyargs + node.args.args)
        return found[1:] if method else found

    found = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            found[node.name] = parameters(node, False)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    found[f"{node.name}.{item.name}"] = parameters(item, True)
                    if item.name == "__init__":
                        found[node.name] = parameters(item, True)
    return found


SHORT_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}


def value_shown(value, depth: int = 0) -> str:
    """An argument in a few words: a tensor as `[4, 8, 16] bf16`, numbers as they are, a short list item by item,
    anything else by its kind (`list of 12`, `a KVCache`)."""
    if isinstance(value, torch.Tensor):
        shown = f"{list(value.shape)} {SHORT_DTYPES.get(value.dtype, dtype_name(value.dtype))}"
        return shown if value.device.type == "cpu" else f"{shown} {value.device.type}"
    if value is None or type(value) in (bool, int):
        return repr(value)
    if type(value) is float:
        return f"{value:g}"
    if type(value) is str:
        return repr(value) if len(value) <= 24 else repr(value[:20])[:-1] + "…'"
    if isinstance(value, torch.dtype):
        return dtype_name(value)
    if isinstance(value, Remote):
        return f"a {value._class_name}"
    if type(value) in (list, tuple):
        items = [value_shown(v, depth + 1) for v in value] if depth == 0 and len(value) <= 4 else None
        if items is not None and sum(map(len, items)) <= 40:
            return ("[{}]" if type(value) is list else "({},)" if len(items) == 1 else "({})").format(", ".join(items))
        return f"{type(value).__name__} of {len(value)}"
    if type(value) is dict:
        return f"dict of {len(value)}"
    if callable(value):
        return "a function"
    return f"a {type(value).__name__}"


def argument_label(key) -> str:
    return f"argument {key + 1}" if isinstance(key, int) else key


def tensor_paths(value, path: str, depth: int = 2):
    """(where, tensor) for every tensor in a check's argument: itself, the items of its lists, tuples and dicts,
    and the fields of its records, `depth` levels down."""
    if isinstance(value, torch.Tensor):
        yield path, value
        return
    if depth < 0:
        return
    if type(value) in (list, tuple):
        items = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
    elif type(value) is dict:
        items = [(f"{path}[{k!r}]", v) for k, v in value.items()]
    elif dataclasses.is_dataclass(value) or hasattr(value, "__dict__") and not callable(value) \
            and not isinstance(value, Remote):
        items = [(f"{path}.{k}", v) for k, v in vars(value).items()]
    else:
        items = []
    for where, item in items:
        yield from tensor_paths(item, where, depth - 1)


def snapshot(value):
    if isinstance(value, torch.Tensor):
        return copy_with_layout(value)
    if type(value) is tuple:
        return tuple(snapshot(v) for v in value)
    return value  # objects in the worker are matched by identity; others are left untouched


def returned_attributes(value, found: dict | None = None) -> dict:
    """The attributes of every `Remote` in a result (inside lists and tuples too), as they came back: a
    Remote's own `_attributes` follow the object as later replies refresh them, and a replay compares the
    mutant's object with what the learner's was just after this call."""
    found = {} if found is None else found
    if isinstance(value, Remote) and id(value) not in found:
        found[id(value)] = dict(value._attributes)
    elif type(value) in (list, tuple):
        for item in value:
            returned_attributes(item, found)
    return found


def copy_back(target: torch.Tensor, written, name: str, key) -> None:
    """What the worker wrote into a `Writes` argument, into the check's own tensor (its whole storage)."""
    where = f"argument {key + 1}" if isinstance(key, int) else f"`{key}`"
    if not isinstance(written, torch.Tensor) or written.dtype != target.dtype or written.shape != target.shape \
            or written.untyped_storage().nbytes() != target.untyped_storage().nbytes():
        raise LearnerError(f"`{name}` replaced its {where} instead of writing into it")
    with torch.no_grad():
        whole_storage(target).copy_(whole_storage(written))


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
        kind = result._class_name if isinstance(result, Remote) else type(result).__name__
        return f"returned a {kind}, expected a tensor {expected.shape_text}"
    if tuple(result.shape) != expected.shape:
        return f"returned shape {list(result.shape)}, expected {list(expected.shape)} = {expected.shape_text}"
    if result.dtype != expected.dtype:
        return f"returned {dtype_name(result.dtype)}, expected {dtype_name(expected.dtype)} ({expected.shape_text})"
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


__all__ = ["Call", "Guarded", "LearnerError", "New", "NotStarted", "Remote", "Returns", "Runs", "Writes"]
