"""The worker side: a fork server and the workers it forks, the only processes that run learner code.

The checks' process starts the fork server once per run (`python -I`, so neither the kit nor the
current folder is on its import path; inside bubblewrap for `./check.sh grade`). The server imports
torch (and Triton) once, then forks a worker per request, in milliseconds. A worker
- gets a session and process group of its own, a memory limit, a process limit, no core dumps, and
  (when the server runs as root, i.e. in the sandbox) an unprivileged user;
- imports the learner's module once, then answers requests on its socket: read an attribute, take a
  length, call a function or method. Arguments arrive as copies; objects the learner's code makes stay
  here and travel as handles; a call's reply carries the result, the input it changed in place (if
  any), the tensors written into `Writes` arguments, and the state of the learner's objects involved.

The server reaps workers, kills a worker (and its process group) when asked, kills any process that
outlived its worker (it is the subreaper of everything forked below it), watches each worker's
resident memory, and says how a worker ended. Nothing here imports the kit: the checks' process ships
this file and its companions as text (see `worker.py`).
"""

import ctypes
import faulthandler
import json
import os
import resource
import signal
import socket
import sys
import threading
import time
import types
import warnings

import torch

from . import wire
from .loading import LoadError, Package, first_line
from .standins import use_standins
from .values import argument_names, changed_input, input_state, leaves, plain

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36
PROCESS_MARGIN = 128  # processes and threads a worker may add to its user's count (torch's threads, ptxas)
FILE_SIZE_LIMIT = 256 << 20  # bytes: no file a worker writes grows past this


# ---- values the learner's code receives -------------------------------------------------------------


class Record:
    """A kit value (weights, a namespace of tensors) as the learner's code receives it: its fields."""

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}=…" for k in vars(self))
        return f"{type(self).__name__}({fields})"


_record_classes: dict[str, type] = {}


def record(class_name: str, fields: dict) -> Record:
    cls = _record_classes.get(class_name)
    if cls is None:
        cls = _record_classes[class_name] = type(class_name, (Record,), {})
    obj = cls()
    obj.__dict__.update(fields)
    return obj


class WorkerCodec(wire.Codec):
    SNAPSHOT_DEPTH = 2  # an object's attributes travel with its handle, and those of the objects it holds

    def __init__(self, worker: "Worker"):
        super().__init__()
        self.worker = worker
        self.depth = 0
        self.records: dict[int, object] = {}  # number -> record: an object the checks give twice in a call is one

    def other(self, value):
        if isinstance(value, type):
            kind = "class"
        elif callable(value):
            kind = "function"
        else:
            kind = "object"
        owner = getattr(value, "__self__", None)
        name = getattr(value, "__name__", type(value).__name__)
        if owner is not None and not isinstance(owner, types.ModuleType):
            name = f"{type(owner).__name__}.{name}"
        elif kind == "object":
            name = type(value).__name__
        return ("H", self.worker.keep(value), str(name), kind, self.snapshot(value) if kind == "object" else None,
                methods(value) if kind == "object" else [])

    def snapshot(self, value):
        """The object's public instance attributes, so the checks read them without asking again."""
        if self.depth >= self.SNAPSHOT_DEPTH:
            return None
        try:
            found = vars(value)
        except TypeError:
            return None
        if type(found) is not dict:
            return None
        self.depth += 1
        try:
            pairs = [(k, self.encode(v)) for k, v in list(found.items()) if type(k) is str and not k.startswith("_")]
            if hasattr(type(value), "__len__"):
                try:
                    pairs.append(("__len__", len(value)))
                except Exception:  # noqa: BLE001 - the checks' own len() will ask, and report it
                    pass
            return pairs
        except (wire.WireError, RecursionError):
            return None
        finally:
            self.depth -= 1


    def decode_other(self, tag: str, rest: tuple):
        if tag == "R" and len(rest) == 1 and rest[0] in self.worker.objects:
            return self.worker.objects[rest[0]]
        if tag == "O" and len(rest) == 3 and type(rest[0]) is str and type(rest[2]) is int:
            self.records[rest[2]] = obj = record(rest[0], {})
            obj.__dict__.update({k: self._decode(v) for k, v in rest[1]})
            return obj
        if tag == "OR" and len(rest) == 1 and rest[0] in self.records:
            return self.records[rest[0]]
        if tag == "F" and len(rest) == 1:
            return self.worker.callback(rest[0])
        raise wire.WireError(f"unknown value {tag!r}")


def methods(value) -> list[str]:
    """The public methods of an object's class (defined in Python), which the checks may call."""
    found = []
    for cls in type(value).__mro__[:-1]:
        for name, member in vars(cls).items():
            if not name.startswith("_") and isinstance(member, types.FunctionType) and name not in found:
                found.append(name)
    return found


# ---- a worker ---------------------------------------------------------------------------------------


class Worker:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.objects: dict[int, object] = {}  # handle -> the object (kept alive while the checks hold it)
        self.handles: dict[int, int] = {}  # id(object) -> handle
        self.pinned = 0  # handles below this (the module's names) survive `forget`
        self.next_handle = 0
        self.package: Package | None = None
        self.stem = ""

    def keep(self, obj) -> int:
        handle = self.handles.get(id(obj))
        if handle is None or self.objects.get(handle) is not obj:
            handle, self.next_handle = self.next_handle, self.next_handle + 1
            self.objects[handle], self.handles[id(obj)] = obj, handle
        return handle

    def reply(self, *message, codec: WorkerCodec | None = None) -> None:
        codec = codec or WorkerCodec(self)
        try:
            tree = codec.encode(message)
        except (wire.WireError, RecursionError) as error:
            codec = WorkerCodec(self)
            tree = codec.encode(("raised", f"returned a value the checks cannot read: {first_line(error)}"))
        wire.send(self.sock, (tree, codec.storages))

    def receive(self):
        message, size, fds = wire.receive_with_fds(self.sock)
        tree, storages, size = wire.parts(message, size)
        if type(storages) is tuple:  # the call's inputs, in memory the checks read again after the call
            storages, shared = wire.shared_views(storages, fds)
            size += shared
        else:
            for fd in fds:
                os.close(fd)
        return WorkerCodec(self).decode(tree, storages, size)

    def callback(self, number: int):
        def call_back(*args, **kwargs):
            self.reply("callback", number, args, kwargs)
            answer = self.receive()
            if answer[0] == "callback-error":
                raise RuntimeError(answer[1])
            return answer[1]

        return call_back

    def serve(self) -> None:
        while True:
            try:
                request = self.receive()
            except (wire.Closed, ConnectionError):
                return
            handler = getattr(self, f"do_{request[0]}")
            try:
                handler(*request[1:])
            except Exception as error:  # noqa: BLE001 - the learner's code broke what this side relies on
                self.reply("raised", f"the worker could not report the result ({type(error).__name__}: "
                                     f"{first_line(error)}): has your code replaced parts of torch or Python?")

    def note(self, *message) -> None:
        """A one-way message to the checks while a call runs (a collective entered or left)."""
        self.reply("note", *message)

    # ---- requests ----
    def do_distributed(self, backend: str, init_method: str, rank: int, world_size: int, timeout: float) -> None:
        """Join `world_size` ranks as `rank` (before the learner's module is imported).

        With gloo (the CPU) the ranks never meet directly: the process group is torch's fake one, whose own
        collectives move no data, and `torch.distributed`'s collectives are replaced by ones the checks' process
        carries (each rank sends its part and waits for the result), so every collective is counted where the
        learner's code cannot reach and nothing bypasses the count and still works. Other backends (NCCL)
        join for real, with each collective noted by a wrapper here."""
        import datetime

        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the sandbox has a loopback device only
        carried = backend == "gloo"
        for name in COLLECTIVES:
            original = getattr(dist, name, None)
            if original is not None:
                replaced = _carried(self, name, original) if carried else _counted(self, name, original)
                setattr(dist, name, replaced)
                if getattr(c10d, name, None) is original:
                    setattr(c10d, name, replaced)
        try:
            if carried:
                from torch.testing._internal.distributed.fake_pg import FakeStore

                dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
            else:
                dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                        timeout=datetime.timedelta(seconds=timeout))
        except Exception as error:  # noqa: BLE001 - the checks say it in one line
            self.reply("raised", f"rank {rank} could not join the process group ({type(error).__name__}: "
                                 f"{first_line(error)})")
            return
        self.reply("value", None, None)

    def collective(self, name: str, part: dict):
        """Hand this rank's part of a collective to the checks' process and wait for its share of the result."""
        self.reply("collective", name, part)
        answer = self.receive()
        if answer[0] != "collective-result":
            raise RuntimeError(answer[1])
        return answer[1]

    def do_load(self, folder: str, shown: str, patch, label: str, stem: str, standins: bool) -> None:
        self.package, self.stem = Package(folder, shown, tuple(patch) if patch else None, label), stem
        try:
            module = self.package.load(stem)
        except LoadError as error:
            self.reply("load-error", str(error))
            return
        if standins:  # the catalogue's own code: the reference's kernels of the other modules, by PyTorch on a CPU
            use_standins(module, stem)
        names = {}
        for name, value in list(vars(module).items()):
            if not name.startswith("_") and not isinstance(value, types.ModuleType):
                names[name] = value
        self.reply("loaded", names)
        self.pinned = self.next_handle

    def do_forget(self) -> None:
        """The check ended: drop the objects it made (the module's names stay)."""
        for handle in [h for h in self.objects if h >= self.pinned]:
            obj = self.objects.pop(handle)
            self.handles.pop(id(obj), None)

    def do_spy(self, obj, method: str, callback, watched, attribute: str) -> None:
        """Wrap `obj.method` (on the instance) so that each call first calls the check's `callback` back with the
        call's arguments and `watched.attribute` as they are then; the method then runs as before."""
        def attach():
            original = getattr(obj, method)

            def spied(*args, **kwargs):
                callback(args, getattr(watched, attribute, None))
                return original(*args, **kwargs)

            setattr(obj, method, spied)

        self.run(attach, f"wrapping `.{method}`")

    def do_getattr(self, obj, name: str) -> None:
        self.run(lambda: getattr(obj, name), f"reading `.{name}`", obj)

    def do_len(self, obj) -> None:
        self.run(lambda: len(obj), "len()")

    def do_method(self, obj, method: str, name: str, args: tuple, kwargs: dict, writes: list,
                  rng_seed: int | None = None, watch: bool = False) -> None:
        try:
            fn = getattr(obj, method)
        except BaseException as error:  # noqa: BLE001
            self.reply("raised", f"`{name}` cannot be read: {self.package.describe(error, self.stem)}")
            return
        self.do_call(fn, name, args, kwargs, writes, rng_seed, watch)

    def do_call(self, fn, name: str, args: tuple, kwargs: dict, writes: list, rng_seed: int | None = None,
                watch: bool = False) -> None:
        written = [args[key] if isinstance(key, int) else kwargs[key] for key in writes]
        names = argument_names(fn, args, kwargs)
        before = {arg: input_state(value) for arg, value in names.items() if not any(value is w for w in written)}
        inputs = {_storage(t) for value in names.values() for t in leaves_of(value)}
        largest = LargestTensor() if watch else None
        if rng_seed is not None:  # torch's global generator, for code that draws from it: the same verdict every run
            torch.manual_seed(rng_seed)
        try:
            if largest is None:
                result = fn(*args, **kwargs)
            else:
                with largest:
                    result = fn(*args, **kwargs)
        except NotImplementedError as error:
            self.reply("not-started", self.package.not_started(error, self.stem, name))
            return
        except BaseException as error:  # noqa: BLE001 - exit(), KeyboardInterrupt too: the worker goes on
            self.reply("raised", f"`{name}` raised {self.package.describe(error, self.stem)}")
            return
        owner = getattr(fn, "__self__", None)
        involved = [v for v in names.values() if id(v) in self.handles and self.objects.get(self.handles[id(v)]) is v]
        if owner is not None and not isinstance(owner, types.ModuleType):
            involved.append(owner)
        codec = WorkerCodec(self)
        states = {codec.worker.keep(v): leaves(v) for v in involved}
        data = {codec.worker.keep(v): plain(v) for v in involved}
        subclass = [type(t).__name__ for t in leaves_of(result) if type(t) not in (torch.Tensor, torch.nn.Parameter)]
        if subclass:
            self.reply("raised", f"`{name}` returned a {subclass[0]} (a torch.Tensor subclass): return plain tensors")
            return
        aliased = [t for t in leaves_of(result) if _storage(t) in inputs]
        refused = f"`{name}` returned one of its inputs (or a view of it): return new tensors" if aliased else None
        changed = changed_input(before, names)
        if threading.active_count() > 1:  # a thread could change the learner's objects after the checks read them
            self.reply("raised", f"`{name}` left {threading.active_count() - 1} thread(s) running after it returned",
                       "end")
            os._exit(0)
        self.reply("returned", result, changed, states, data, dict(zip(writes, written)), refused, involved,
                   largest and largest.largest, codec=codec)  # `involved` again: their attributes as now

    def do_text(self, action: str, *args) -> None:
        """`./check.sh run`: load a checkpoint or generate with the learner's code (`textgen.py`)."""
        from . import textgen

        try:
            if action == "load":
                value = textgen.load(self.package, self.stem, *args)
            else:
                value = textgen.generate(*args)
        except NotImplementedError as error:
            self.reply("not-started", self.package.not_started(error, self.stem, textgen.RUNNING[0]))
            return
        except BaseException as error:  # noqa: BLE001 - exit(), KeyboardInterrupt too: the kit says what broke
            self.reply("raised", f"`{textgen.RUNNING[0]}` raised {self.package.describe(error, self.stem)}")
            return
        self.reply("value", value)

    def run(self, action, what: str, owner=None) -> None:
        try:
            value = action()
        except NotImplementedError:
            self.reply("raised", f"{what} raises NotImplementedError")
            return
        except BaseException as error:  # noqa: BLE001
            self.reply("raised", f"{what} raised {self.package.describe(error, self.stem)}")
            return
        self.reply("value", value, owner)  # the owner again: its attributes as they are now


COLLECTIVES = ("all_reduce", "gather", "all_gather", "all_gather_into_tensor", "broadcast", "reduce", "scatter",
               "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier", "send",
               "recv", "isend", "irecv", "batch_isend_irecv", "all_gather_object", "broadcast_object_list")


CARRIED = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "gather", "barrier",
           "all_to_all", "all_to_all_single")


def _carried(worker: Worker, name: str, original):
    """`torch.distributed.<name>` as the checks' process carries it between the ranks (see `do_distributed`)."""
    import inspect

    import torch.distributed as dist

    signature = inspect.signature(original)
    ops = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.PRODUCT: "product", dist.ReduceOp.MIN: "min",
           dist.ReduceOp.MAX: "max"}

    def collective(*args, **kwargs):
        if name not in CARRIED:  # said with the function that called it: its rule is that function's
            caller = sys._getframe(1).f_code.co_name
            raise RuntimeError(f"torch.distributed.{name} (called in `{caller}`) is not carried between the checks' "
                               f"ranks (they carry {', '.join(CARRIED)})")
        given = signature.bind(*args, **kwargs)
        given.apply_defaults()
        a = given.arguments
        if a.get("group") not in (None, dist.group.WORLD):
            raise RuntimeError(f"torch.distributed.{name}: the checks' ranks have the world group only")
        part = {"op": ops.get(a.get("op", dist.ReduceOp.SUM), "unsupported")}
        for key in ("src", "dst", "group_src", "group_dst"):
            if a.get(key) is not None:
                part[key.removeprefix("group_")] = int(a[key])
        tensor = a.get("tensor", a.get("input_tensor", a.get("input")))
        if isinstance(tensor, torch.Tensor):
            part["tensor"] = tensor.detach()
        if name == "all_to_all_single":  # the splits (None: equal parts) and the room the rank gives for its share
            part["splits"] = _sizes(a["input_split_sizes"])
            part["out_splits"] = _sizes(a["output_split_sizes"])
            part["out"] = _layout(a["output"])
        elif name == "all_to_all":  # a tensor for each rank, and a tensor to fill from each rank
            part["tensors"] = [t.detach() if isinstance(t, torch.Tensor) else t for t in a["input_tensor_list"]]
            part["outs"] = [_layout(t) for t in a["output_tensor_list"]]
        refused = _refused(name, a)
        if refused:  # torch (or its backend) refuses it on this rank before any data moves
            raise (ValueError if refused.startswith("Argument") or "dtypes" in refused else RuntimeError)(
                f"torch.distributed.{name}: {refused}")
        result = worker.collective(name, part)
        with torch.no_grad():
            if name in ("all_reduce", "broadcast") or (name == "reduce" and result is not None):
                tensor.copy_(result)
            elif name == "all_gather":
                for out, got in zip(a["tensor_list"], result):
                    out.copy_(got)
            elif name == "all_gather_into_tensor":
                a["output_tensor"].copy_(torch.cat(result).reshape(a["output_tensor"].shape))
            elif name == "gather" and a.get("gather_list") is not None and result is not None:
                for out, got in zip(a["gather_list"], result):
                    out.copy_(got)
            elif name == "all_to_all_single":
                a["output"].copy_(result)
            elif name == "all_to_all":
                for out, got in zip(a["output_tensor_list"], result):
                    out.copy_(got)
        return _Done() if a.get("async_op") else None

    collective.__name__ = collective.__qualname__ = name
    collective.__doc__ = original.__doc__
    return collective


def _refused(name: str, a: dict) -> str:
    """Why torch or any backend refuses a gather's or all_gather's output list on this rank before any data
    moves, as a real process group would ("" where it accepts it): the list the destination (every rank, for
    all_gather) fills holds one tensor per rank, each of the input's shape and dtype; other ranks give no list."""
    import torch.distributed as dist

    if name not in ("gather", "all_gather") or not isinstance(a.get("tensor"), torch.Tensor):
        return ""
    tensor, rank, world = a["tensor"], dist.get_rank(), dist.get_world_size()
    outs = a.get("tensor_list") if name == "all_gather" else a.get("gather_list")
    if name == "gather":
        dst = a.get("dst") if a.get("dst") is not None else (a.get("group_dst") or 0)
        if rank != dst:
            return "Argument ``gather_list`` must NOT be specified on non-destination ranks." if outs else ""
        if not outs:
            return "Argument ``gather_list`` must be specified on destination rank."
    if not isinstance(outs, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in outs):
        return f"rank {rank}'s output list must be a list of tensors"
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in (tensor, *outs)})
    if len(dtypes) > 1:
        return f"Invalid usage of tensors with different dtypes ({' and '.join(dtypes)}) on rank {rank}"
    if len(outs) != world:
        return (f"rank {rank}'s output list has {len(outs)} tensors; it must have {world}, one per rank of the "
                f"process group")
    for i, out in enumerate(outs):
        if out.shape != tensor.shape:
            return (f"rank {rank}'s output tensor {i} is {list(out.shape)}, the input {list(tensor.shape)}: each "
                    f"must have the input's shape")
    return ""


def _sizes(sizes) -> list | None:
    """A split-size list as plain ints (None stays None: equal parts); anything else as text, for the checks to
    refuse."""
    try:
        return None if sizes is None else [int(n) for n in sizes]
    except (TypeError, ValueError):
        return [str(sizes)]


def _layout(tensor) -> tuple | None:
    """The shape and dtype of a tensor a collective writes into (None for something that is not a tensor)."""
    return (list(tensor.shape), tensor.dtype) if isinstance(tensor, torch.Tensor) else None


class _Done:
    """The work handle of a collective that has already completed (`async_op=True`)."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _counted(worker: Worker, name: str, original):
    def collective(*args, **kwargs):
        worker.note("collective", name, "enter")
        result = original(*args, **kwargs)
        worker.note("collective", name, "done")
        return result

    collective.__name__ = collective.__qualname__ = name
    collective.__doc__, collective.__wrapped__ = original.__doc__, original
    return collective


def LargestTensor():
    """A dispatch mode that keeps the size in bytes of the largest tensor any torch operation returns
    while it is active (a check that a function never builds a whole score matrix)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Largest(TorchDispatchMode):
        @classmethod
        def _should_skip_dynamo(cls):  # no torch.compile runs here: don't import dynamo (2.4 s) to rule it out
            return False

        def __init__(self):
            super().__init__()
            self.largest = 0

        def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            for t in tree_leaves(result):
                if isinstance(t, torch.Tensor):
                    self.largest = max(self.largest, t.numel() * t.element_size())
            return result

    return Largest()


def leaves_of(value) -> list[torch.Tensor]:
    """The tensors in a result: itself, or the items of a tuple or list of them."""
    if isinstance(value, torch.Tensor):
        return [value]
    if type(value) in (tuple, list):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


def _storage(t: torch.Tensor):
    return (str(t.device), t.untyped_storage().data_ptr()) if t.untyped_storage().nbytes() else ("empty", id(t))


# ---- the fork server --------------------------------------------------------------------------------


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def lower(kind: int, value: int) -> None:
    """Hold this process to `value` (soft and hard), or to the hard limit it inherited where that is lower:
    a limit is only ever lowered (raising one needs a capability the sandbox does not give)."""
    _, hard = resource.getrlimit(kind)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(kind, (value, value))


def tasks_of(uid: int) -> int:
    """Processes and threads of `uid` that this process can see (what RLIMIT_NPROC counts)."""
    count = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as status:
                fields = dict(line.split(":", 1) for line in status if ":" in line)
        except OSError:
            continue
        if int(fields.get("Uid", "-1").split()[0]) == uid:
            count += int(fields.get("Threads", "1"))
    return count


def resident_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def virtual_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


class ForkServer:
    def __init__(self, control: socket.socket, options: dict):
        self.control, self.options = control, options
        self.workers: dict[int, dict] = {}  # pid -> {"status": text or None, "note": text}
        self.ended: dict[int, str] = {}

    def run(self) -> None:
        _libc().prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        if self.options.get("populate"):
            populate(*self.options["populate"])
        # the interpreter's own numpy warnings (log2 of 0 in a masked lane) are noise in a learner's report
        warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton")
        if self.options.get("triton"):
            import triton  # noqa: F401 - imported once here, not in every worker

            from .loading import one_config_per_kernel, preload_triton

            one_config_per_kernel()
            preload_triton()

            if os.environ.get("TRITON_INTERPRET") == "1":
                from .loading import prepare_interpreter

                prepare_interpreter()
        self.control.send(wire.pack(("ready", os.getpid())))
        while True:
            ready = __import__("select").select([self.control], [], [], 0.05)[0]
            self.tend()
            if not ready:
                continue
            try:
                data, fds, _, _ = socket.recv_fds(self.control, 1 << 16, 2)
            except OSError:
                data, fds = b"", []
            if not data:
                self.stop()
                return
            request = wire.unpack(data)
            if request[0] == "spawn":
                self.control.send(wire.pack(("spawned", self.spawn(*fds[:2]))))
            elif request[0] == "kill":
                self.control.send(wire.pack(("ended", self.kill(request[1]))))
            elif request[0] == "abort":
                self.control.send(wire.pack(("ended", self.abort(request[1]))))
            elif request[0] == "ended":
                self.tend()
                self.control.send(wire.pack(("ended", self.ended.get(request[1]))))
            elif request[0] == "stop":
                self.stop()
                self.control.send(wire.pack(("stopped",)))
                return

    def spawn(self, channel_fd: int, stderr_fd: int | None = None) -> int:
        """A worker on the socket `channel_fd`, its standard error going to `stderr_fd` (a memory file the checks
        read after each request), where Python's fault handler also writes the frames running when it crashes."""
        pid = os.fork()
        if pid == 0:  # the worker
            code = 0
            try:
                self.control.close()
                if stderr_fd is not None:
                    os.dup2(stderr_fd, 2)
                    os.close(stderr_fd)
                faulthandler.enable(all_threads=True)  # SIGSEGV, SIGABRT, ...: where it was, before it dies
                self.become_worker()
                Worker(socket.socket(fileno=channel_fd)).serve()
            except BaseException:  # noqa: BLE001 - a bug of the worker side itself: say so, exit 70
                import traceback

                traceback.print_exc()
                code = 70
            finally:
                os._exit(code)
        os.close(channel_fd)
        if stderr_fd is not None:
            os.close(stderr_fd)
        self.workers[pid] = {"note": ""}
        return pid

    def become_worker(self) -> None:
        os.setsid()
        limit = self.options.get("memory_limit")
        if limit and not self.options.get("cuda"):  # CUDA reserves far more address space than it uses
            lower(resource.RLIMIT_AS, virtual_bytes() + limit)
        lower(resource.RLIMIT_CORE, 0)
        lower(resource.RLIMIT_FSIZE, FILE_SIZE_LIMIT)
        try:  # at a memory cgroup's limit, the kernel stops a worker, not the fork server (which runs no learner code)
            with open("/proc/self/oom_score_adj", "w") as score:
                score.write("1000")
        except OSError:
            pass
        uid = self.options.get("uid")
        if uid is not None and os.getuid() == 0:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        if os.getuid() != 0:  # root is never held to RLIMIT_NPROC
            lower(resource.RLIMIT_NPROC, tasks_of(os.getuid()) + PROCESS_MARGIN)
        _libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # after setuid, which clears it

    def tend(self) -> None:
        """Reap what ended, kill what outlived its worker, and enforce the memory limit."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            info = self.workers.pop(pid, None)
            if info is not None:
                self.ended[pid] = info["note"] or how_it_ended(status)
        for pid in self.strays():
            _kill(pid)
        limit = self.options.get("memory_limit")
        for pid, info in self.workers.items():
            if limit and not info["note"] and resident_bytes(pid) > limit:
                info["note"] = f"was stopped at {limit / 2**30:g} GiB of memory (the memory limit, --memory-limit)"
                _kill(pid)

    def strays(self, thorough: bool = False) -> list[int]:
        """Processes whose parent is this server but which it did not fork as workers: a worker's
        children, orphaned and handed to this subreaper. Read from the kernel's list of this server's
        children (a few lines, read every tick); `thorough` reads every process's parent instead (the
        whole of /proc, once, as the server stops: the list can miss a child that forks as it is read)."""
        me = os.getpid()
        if not thorough:
            try:
                found = set()
                for thread in os.listdir(f"/proc/{me}/task"):
                    with open(f"/proc/{me}/task/{thread}/children") as children:
                        found.update(int(pid) for pid in children.read().split())
                return [pid for pid in found if pid not in self.workers]
            except (OSError, ValueError):
                pass  # a kernel without the list: read every process's parent
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in self.workers:
                continue
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == me:
                found.append(int(entry))
        return found

    def kill(self, pid: int) -> str | None:
        if pid in self.workers:
            _kill(pid)
            deadline = time.monotonic() + 5
            while pid in self.workers and time.monotonic() < deadline:
                self.tend()
                time.sleep(0.002)
        return self.ended.get(pid)

    def abort(self, pid: int) -> str | None:
        """Stop a worker with SIGABRT, so that Python's fault handler first writes the frames each of its threads
        was running (where a call that overran its time limit was stuck); killed if it outlives 2 s."""
        if pid in self.workers:
            try:
                os.kill(pid, signal.SIGABRT)
            except (ProcessLookupError, PermissionError):
                pass
            deadline = time.monotonic() + 2
            while pid in self.workers and time.monotonic() < deadline:
                self.tend()
                time.sleep(0.002)
        return self.kill(pid)

    def stop(self) -> None:
        for pid in list(self.workers):
            _kill(pid)
        deadline = time.monotonic() + 5
        while (self.workers or self.strays(thorough=True)) and time.monotonic() < deadline:
            self.tend()
            time.sleep(0.005)


def populate(source: str, target: str) -> None:
    """The worker's own copy of the submission, in the sandbox's memory filesystem at `target`: folders,
    regular files and symbolic links of `source` (the grader's copy, read-only), nothing else (a pipe or a
    device would block or leak), every file readable and writable by the workers' unprivileged user."""
    import stat

    for folder, dirs, files in os.walk(source):
        relative = os.path.relpath(folder, source)
        here = target if relative == "." else os.path.join(target, relative)
        os.makedirs(here, exist_ok=True)
        os.chmod(here, 0o777)
        for name in files + [d for d in dirs if os.path.islink(os.path.join(folder, d))]:
            path, copy = os.path.join(folder, name), os.path.join(here, name)
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode):
                os.symlink(os.readlink(path), copy)
            elif stat.S_ISREG(mode):
                with open(path, "rb") as src, open(copy, "wb") as dst:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
                os.chmod(copy, 0o666)


def _kill(pid: int) -> None:
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def how_it_ended(status: int) -> str:
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        return f"was killed by {name}" + (" (a crash in native code)" if name in ("SIGSEGV", "SIGBUS", "SIGABRT",
                                                                                     "SIGILL", "SIGFPE") else "")
    return f"exited with status {os.WEXITSTATUS(status)}"


def main() -> None:
    options = json.loads(sys.argv[1])
    control = socket.socket(fileno=int(options["control_fd"]))
    ForkServer(control, options).run()
