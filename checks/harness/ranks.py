"""Ranks: one implementation's module in `world_size` workers joined in a real process group.

Tensor parallelism runs one process per rank, each with the same code and its own shard of the weights,
meeting in collectives (`all_reduce`, `gather`, ...). A check does the same: `ranks(impl, 2)` forks two
workers from the same fork server (inside the same limits and sandbox as every other check), each joins
a gloo process group as its rank before it imports the module, and `ranks.call(name, args_per_rank)`
calls the function on every rank at once and returns the results in rank order.

The ranks never meet directly: each collective a rank makes comes here (its part of the data), waits until
every rank has made its own, and goes back with its share of the result (`Rendezvous`). So every collective
is counted in this process, where the learner's code cannot reach: `ranks.collectives[r]` lists rank r's in
the last call. A rank that raises or dies ends every rank, and the check gets one line naming the rank that
failed first, with its own reason (a collective whose parts do not fit blames the rank whose part it is), and
one short line under it for what followed on the others (stopped while they waited in a collective, their
own errors after it) and what a distributed backend printed; when the ranks overrun the time limit, the line
names the rank that was still running its own code while the others waited in a collective (or, if all wait,
where each waits).
A call on every rank is recorded for the mistakes' replays as one `RankCall`, which `mistakes.py` plays
with threads standing in for the ranks (`simdist.py`).
"""

import functools
import socket
import threading
import time
from collections import Counter
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from . import wire
from .guard import Call, Guarded, LearnerError, ModuleRun, New, NotStarted, _hung
from .values import copy_with_layout

JOIN_TIMEOUT = 60.0  # seconds a real process group (NCCL) may wait for the ranks to join
GRACE = 1.0  # seconds the other ranks get to finish after one fails, before they are ended


@dataclass
class RankCall(Call):
    """One function called on every rank: `args[r]` and `result[r]` are rank r's."""

    world_size: int = 1


def ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Ranks:
    """`world_size` ranks of the implementation `guarded` checks (made by `ranks()`, ended by `close()`)."""

    def __init__(self, guarded: Guarded, world_size: int, backend: str = "gloo"):
        self.guarded, self.world_size = guarded, world_size
        base = guarded.run
        init = f"tcp://127.0.0.1:{free_port()}"
        timeout = max(JOIN_TIMEOUT, 6 * base.time_limit)
        self.runs = [ModuleRun(base.session.server, base.impl, base.stem, base.time_limit,
                               ("distributed", backend, init, rank, world_size, timeout))
                     for rank in range(world_size)]
        self.guards = [Guarded(run, base.stem, guarded.contracts, base.time_limit) for run in self.runs]
        self.collectives: list[list[str]] = [[] for _ in range(world_size)]
        # (name, shape of the tensor it was given, or None) of each collective rank r made in the last call, as it
        # reached this process
        self.shapes: list[list[tuple]] = [[] for _ in range(world_size)]
        self.dtypes: list[list] = [[] for _ in range(world_size)]  # the dtype of each of those tensors, or None
        self.failed_at: list[float | None] = [None] * world_size  # when each rank's call failed, in the last call
        self.rendezvous = Rendezvous(world_size)
        for rank, run in enumerate(self.runs):
            run.session.on_collective = functools.partial(self._meet, rank)
        self.broken: str | None = None
        self.started = False
        self.pool = ThreadPoolExecutor(max_workers=world_size)

    def start(self) -> None:
        """Every rank's worker forked and joined (once, by the first call)."""
        if not self.started:
            self.started = True
            self._on_every_rank([guard.run.names for guard in self.guards], "joining the process group")

    def end_check(self) -> None:
        for run in self.runs:
            run.end_check()

    def close(self) -> None:
        self.close_workers()
        self.pool.shutdown(wait=True)

    def close_workers(self) -> None:
        for run in self.runs:
            run.close()

    def call(self, name: str, args_per_rank: list[tuple]) -> list:
        """`name(*args_per_rank[r])` on every rank r at once: the results, in rank order."""
        if len(args_per_rank) != self.world_size:
            raise ValueError(f"{len(args_per_rank)} argument tuples for {self.world_size} ranks")
        if (self.guarded.impl.label, name) in _hung:  # as Guarded.call says it, without starting the ranks
            raise LearnerError(f"not run: `{name}` hung in an earlier check (time limit {self.guarded.time_limit:g} s)")
        self.start()
        for guard in self.guards:
            guard.events.clear()
        jobs = [lambda guard=guard, args=args: getattr(guard, name)(*args)
                for guard, args in zip(self.guards, args_per_rank)]
        return self._on_every_rank(jobs, f"`{name}`", name)

    def make_on(self, rank: int, class_name: str, *args):
        """An object of the module's class `class_name`, made on rank `rank` (it lives there, as a handle)."""
        if self.broken is not None:
            raise LearnerError(f"not run: {self.broken}")
        self.start()
        obj = getattr(self.guards[rank], class_name)(*args)
        # the check's own record (a rank's guard forgets it at the next call): a mutant's replay makes its own
        # object in its place, and the calls that pass this one get that
        self.guarded.events.append(New(class_name, obj, tuple(copy_with_layout(a) if isinstance(a, torch.Tensor)
                                                              else a for a in args), {}))
        return obj

    def set_up(self, obj, name: str, *args):
        """`obj.name(*args)` for an object `make_on` made (state a check sets up, such as a cache filled ahead):
        recorded with the object as its owner, so that a mutant's replay sets up its own object the same way."""
        result = getattr(obj, name)(*args)
        self.guarded.events.append(Call(f"{type(obj).__name__}.{name}", tuple(copy_with_layout(a) if isinstance(
            a, torch.Tensor) else a for a in args), {}, result, {}, None, owner=id(obj)))
        return result

    def _meet(self, rank: int, name: str, part, deadline: float):
        tensor = part.get("tensor") if isinstance(part, dict) else None
        self.shapes[rank].append((name, tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else None))
        self.dtypes[rank].append(tensor.dtype if isinstance(tensor, torch.Tensor) else None)
        return self.rendezvous.meet(rank, name, part, deadline)

    # ---- running on every rank ----

    def _on_every_rank(self, jobs: list, what: str, name: str | None = None) -> list:
        if self.broken is not None:
            raise LearnerError(f"not run: {self.broken}")
        for run in self.runs:
            run.session.notes.clear()
        self.rendezvous = Rendezvous(self.world_size)
        self.shapes = [[] for _ in range(self.world_size)]
        self.dtypes = [[] for _ in range(self.world_size)]
        self.failed_at = [None] * self.world_size
        futures = [self.pool.submit(self._timed, rank, job) for rank, job in enumerate(jobs)]
        done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        if pending:  # a rank failed: the others may be about to fail too, or be waiting for it in a collective
            done, pending = wait(futures, timeout=GRACE)
            if pending:
                self.rendezvous.abort()
        first_failed = next((f for f in futures if f.done() and f.exception() is not None), None)
        stopped = set()  # the ranks ended here because another one failed
        if first_failed is not None and pending and "did not return within" not in str(first_failed.exception()):
            for rank, (future, run) in enumerate(zip(futures, self.runs)):  # the others would wait forever
                if not future.done() and run.session.pid is not None:
                    stopped.add(rank)
                    run.session.server.kill(run.session.pid)
        wait(futures)
        self.collectives = [[n[1] for n in run.session.notes if n[:1] == ("collective",) and n[2] == "enter"]
                            for run in self.runs]
        errors = [f.exception() for f in futures]
        if name is not None:
            self._record(name)
        if stopped:  # a rank that was ended cannot rejoin this group: the next call starts a new one
            self.broken = "an earlier call on these ranks failed"
            self.close_workers()
        if all(e is None for e in errors):
            return [f.result() for f in futures]
        for error in errors:
            if isinstance(error, NotStarted):
                raise error
        first = next((e for r, e in enumerate(errors) if e is not None and r not in stopped), None) or \
            next(e for e in errors if e is not None)
        # Importing the file is the same on every rank: its failure is said once, as for any other module.
        reason, detail = (str(first), "") if name is None and "could not join" not in str(first) else \
            self._reason(errors, what, stopped)
        identifiable = all(e is None or getattr(e, "identifiable", False) for e in errors)
        if not identifiable:
            self.broken = "an earlier call on these ranks failed"
            self.close_workers()
        raise LearnerError(reason, identifiable=identifiable, detail=detail)

    def _timed(self, rank: int, job):
        try:
            return job()
        except BaseException:
            self.failed_at[rank] = time.monotonic()
            raise

    def _record(self, name: str) -> None:
        """Every rank's call, as one event of the check's own guard (mistakes are named from it)."""
        calls = [guard.events[-1] if guard.events else None for guard in self.guards]
        if any(not isinstance(c, Call) or c.name != name for c in calls):
            return
        self.guarded.events.append(RankCall(name, tuple(c.args for c in calls), {}, [c.result for c in calls], {},
                                            next((c.changed for c in calls if c.changed), None),
                                            world_size=self.world_size))
        if name not in self.guarded.called:
            self.guarded.called.append(name)

    def _reason(self, errors: list, what: str, stopped: set) -> tuple[str, str]:
        """One line: which rank failed first, and how; and one short line: what followed on the others."""
        overran = [r for r, e in enumerate(errors) if e is not None and "did not return within" in str(e)]
        if overran:
            waiting = {r: self._waiting_in(r) for r in range(self.world_size)}
            running = [r for r in overran if waiting[r] is None]
            if running:
                others = [f"rank {r} in {waiting[r]}" for r in range(self.world_size) if waiting[r]]
                tail = f" while {', '.join(others)} waited for it" if others else ""
                return f"rank {running[0]}: {errors[running[0]]}{tail}", ""
            returned = [r for r in range(self.world_size) if errors[r] is None]
            if returned:  # the others wait in a collective these ranks never made
                where = ", ".join(f"rank {r} in {waiting[r]}" for r in overran)
                gone = "; ".join(f"rank {r} returned " + (f"after {self._made(r)}" if self._made(r) else "without any")
                                 for r in returned)
                return (f"{what} did not return on {_ranks(overran)}: {where}, a collective the other ranks never "
                        f"made ({gone}); every rank must make the same collectives in the same order"), ""
            where = ", ".join(f"rank {r} in {waiting[r]}" for r in range(self.world_size))
            return (f"{what} did not return on any rank: each waits in a collective ({where}); every rank must "
                    f"make the same collectives in the same order"), ""
        failed = [r for r, e in enumerate(errors) if e is not None]
        # A rank stopped here, or one whose collective was given up, failed because another one did; of the rest,
        # a rank a collective blames (its part did not fit) and then the earliest to fail
        followed = stopped | self.rendezvous.abandoned
        culprits = self.rendezvous.culprits
        rank = min([r for r in failed if r not in followed] or failed,
                   key=lambda r: (r not in culprits, self.failed_at[r] or 0.0, r))
        rank = min(r for r in failed if str(errors[r]) == str(errors[rank]))  # all the same: the lowest says it
        after = []
        for r in failed:
            if r == rank:
                continue
            if r in followed:
                waiting = self._waiting_in(r)
                after.append(f"rank {r} was stopped" + (f" as it waited in {waiting}" if waiting else ""))
            elif str(errors[r]) == str(errors[rank]):
                after.append(f"rank {r} failed the same way")
            else:
                said = str(errors[r]).removeprefix(f"{what} raised ").removeprefix(f"{what}: ")
                after.append(f"rank {r} then: {said if len(said) <= 90 else said[:89] + '…'}")
        backend = next((self.runs[r].session.backend for r in [rank, *failed] if self.runs[r].session.backend), "")
        detail = "; ".join(after) + (f" · {backend}" if backend and after else backend)
        return f"rank {rank}: {errors[rank]}", detail

    def _made(self, rank: int) -> str:
        """The collectives rank `rank` made in the last call, counted by name ("5 all_reduce, 1 gather"; "": none)."""
        return ", ".join(f"{n} {name}" for name, n in Counter(self.collectives[rank]).items())

    def _waiting_in(self, rank: int) -> str | None:
        """The collective rank `rank` entered last and never left, in words ("its 2nd all_reduce")."""
        entered: dict[str, int] = {}
        open_one = None
        for note in self.runs[rank].session.notes:
            if note[:1] != ("collective",):
                continue
            if note[2] == "enter":
                entered[note[1]] = entered.get(note[1], 0) + 1
                open_one = f"its {ordinal(entered[note[1]])} {note[1]}"
            else:
                open_one = None
        return open_one


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


class Rendezvous:
    """Where the ranks' collectives meet: the k-th collective of every rank, combined once all have come."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.changed = threading.Condition()
        self.made = [0] * world_size  # collectives each rank has entered
        self.parts: dict[int, dict[int, tuple]] = {}  # k -> rank -> (name, part)
        self.answers: dict[int, list] = {}  # k -> each rank's answer
        self.aborted = False
        self.abandoned: set[int] = set()  # ranks whose collective was given up when another rank failed
        self.culprits: set[int] = set()  # ranks whose part of a collective did not fit (the others' error follows)

    def meet(self, rank: int, name: str, part, deadline: float):
        with self.changed:
            k = self.made[rank]
            self.made[rank] += 1
            self.parts.setdefault(k, {})[rank] = (name, part)
            if len(self.parts[k]) == self.world_size:
                self.answers[k], culprits = combine([self.parts[k][r] for r in range(self.world_size)])
                self.culprits |= culprits
                self.changed.notify_all()
            while k not in self.answers:
                if self.aborted:
                    self.abandoned.add(rank)
                    raise wire.Closed  # another rank failed: this one is ended with it
                left = deadline - time.monotonic()
                if left <= 0:
                    raise wire.Timeout
                self.changed.wait(left)
            return self.answers[k][rank]

    def abort(self) -> None:
        with self.changed:
            self.aborted = True
            self.changed.notify_all()


REDUCE = {"sum": lambda t: t.sum(0), "product": lambda t: t.prod(0), "min": lambda t: t.amin(0),
          "max": lambda t: t.amax(0)}


def combine(entered: list[tuple]) -> tuple[list[tuple], set[int]]:
    """Each rank's answer to one collective, from every rank's (name, part): ("collective-result", share) or,
    when the ranks' parts do not fit together, ("collective-error", why) for all; and the ranks to blame for
    that, where the error is one rank's part (a broadcast's tensor that is not the source's shape and dtype)."""
    world = len(entered)
    names = [name for name, _ in entered]
    if len(set(names)) != 1:
        made = ", ".join(f"rank {r} {n}" for r, n in enumerate(names))
        return [("collective-error", f"the ranks made different collectives at once ({made}): every rank must make "
                                     "the same collectives in the same order")] * world, set()
    if names[0] in ("all_to_all", "all_to_all_single"):
        return _all_to_all(names[0], entered)
    return _combine(names[0], entered), _misfits(names[0], entered)


class _Misfit(Exception):
    """One rank's part of an all_to_all does not fit: `rank` is the one to blame."""

    def __init__(self, rank: int, why: str):
        super().__init__(why)
        self.rank = rank


def _shown(shape, dtype) -> str:
    return f"{list(shape)} {str(dtype).removeprefix('torch.')}"


def _all_to_all(name: str, entered: list[tuple]) -> tuple[list[tuple], set[int]]:
    """Rank r's share of an all_to_all: from every rank s (in rank order) the piece s sends r. A piece that
    does not fit where r receives it blames the rank whose split or room is wrong, and every rank is told."""
    world = len(entered)
    try:
        parts = [dict(part) for _, part in entered]
        pieces = [_pieces(name, part, rank, world) for rank, part in enumerate(parts)]  # pieces[s][r]: s -> r
        answers = []
        for r, part in enumerate(parts):
            got = [pieces[s][r] for s in range(world)]
            if name == "all_to_all":
                outs = part.get("outs")
                if not isinstance(outs, list) or len(outs) != world:
                    raise _Misfit(r, f"rank {r} gave {len(outs) if isinstance(outs, list) else 'no list of'} output "
                                     f"tensors for {world} ranks")
                for s, (piece, out) in enumerate(zip(got, outs)):
                    if out is None or (tuple(out[0]), out[1]) != (tuple(piece.shape), piece.dtype):
                        room = "no tensor" if out is None else _shown(*out)
                        raise _Misfit(r, f"rank {s} sends rank {r} {_shown(piece.shape, piece.dtype)}, rank {r}'s "
                                         f"output tensor {s} is {room}")
                answers.append(("collective-result", got))
                continue
            out, out_splits = part.get("out"), part.get("out_splits")
            if out is None:
                raise _Misfit(r, f"rank {r} gave no output tensor")
            if out_splits is not None:
                if len(out_splits) != world or not all(isinstance(n, int) for n in out_splits):
                    raise _Misfit(r, f"rank {r}'s output_split_sizes {out_splits} is not {world} sizes")
                for s, piece in enumerate(got):
                    if piece.shape[0] != out_splits[s]:
                        raise _Misfit(r, f"rank {s} sends rank {r} {piece.shape[0]} rows, rank {r} expects "
                                         f"{out_splits[s]} from it (output_split_sizes {out_splits})")
            joined = torch.cat(got) if got[0].dim() else torch.stack(got)
            if joined.numel() != _numel(out[0]) or joined.dtype != out[1] or tuple(joined.shape[1:]) != \
                    tuple(out[0][1:]):
                raise _Misfit(r, f"rank {r} receives {_shown(joined.shape, joined.dtype)} in all, its output tensor "
                                 f"is {_shown(*out)}")
            answers.append(("collective-result", joined.reshape(out[0])))
        return answers, set()
    except _Misfit as misfit:
        why = f"torch.distributed.{name}: {misfit}"
        return [("collective-error", why if r == misfit.rank else f"torch.distributed.{name}: rank {misfit.rank}'s "
                 f"part did not fit") for r in range(world)], {misfit.rank}
    except Exception as error:  # noqa: BLE001 - what the ranks sent is theirs: each gets the reason
        return [("collective-error", f"torch.distributed.{name}: {error}")] * world, set()


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _pieces(name: str, part: dict, rank: int, world: int) -> list[torch.Tensor]:
    """What rank `rank` sends each rank, in rank order."""
    if name == "all_to_all":
        tensors = part.get("tensors")
        if not isinstance(tensors, list) or len(tensors) != world or \
                not all(isinstance(t, torch.Tensor) for t in tensors):
            raise _Misfit(rank, f"rank {rank} gave {len(tensors) if isinstance(tensors, list) else 'no list of'} "
                                f"input tensors for {world} ranks")
        return tensors
    tensor, splits = part.get("tensor"), part.get("splits")
    if not isinstance(tensor, torch.Tensor):
        raise _Misfit(rank, f"rank {rank} gave no input tensor")
    rows = tensor.shape[0] if tensor.dim() else 0
    if splits is None:
        if rows % world:
            raise _Misfit(rank, f"rank {rank}'s input has {rows} rows, which do not split equally over {world} "
                                f"ranks (give input_split_sizes)")
        splits = [rows // world] * world
    if len(splits) != world or not all(isinstance(n, int) and n >= 0 for n in splits) or sum(splits) != rows:
        raise _Misfit(rank, f"rank {rank}'s input_split_sizes {splits} are not {world} sizes adding up to its "
                            f"input's {rows} rows")
    return list(tensor.split(splits))


def _misfits(name: str, entered: list[tuple]) -> set[int]:
    """The ranks whose broadcast tensor is not the source's shape and dtype (a real backend fails on them)."""
    if name != "broadcast":
        return set()
    try:
        parts = [dict(part) for _, part in entered]
        source = parts[parts[0]["src"]]["tensor"]
        return {r for r, p in enumerate(parts) if (p["tensor"].shape, p["tensor"].dtype) != (source.shape,
                                                                                             source.dtype)}
    except Exception:  # noqa: BLE001 - parts that do not fit otherwise: `_combine` says so to every rank
        return set()


def _combine(name: str, entered: list[tuple]) -> list[tuple]:
    world = len(entered)
    try:
        parts = [dict(part) for _, part in entered]
        if name == "barrier":
            return [("collective-result", None)] * world
        tensors = [p["tensor"] for p in parts]
        if not all(isinstance(t, torch.Tensor) for t in tensors):
            raise ValueError("a rank gave no tensor")
        if name in ("all_reduce", "reduce", "all_gather_into_tensor", "all_gather"):
            shapes = {(tuple(t.shape), t.dtype) for t in tensors}
            if len(shapes) != 1:
                raise ValueError(f"the ranks' tensors differ ({', '.join(f'{list(s)} {d}' for s, d in shapes)})")
        for key in ("src", "dst"):
            values = {p.get(key) for p in parts}
            if len(values) > 1 or (values != {None} and not 0 <= next(iter(values)) < world):
                raise ValueError(f"the ranks gave {key} {sorted(map(str, values))}")
        if name in ("all_reduce", "reduce"):
            op = parts[0]["op"]
            if op not in REDUCE or any(p["op"] != op for p in parts):
                raise ValueError(f"the reduce op {op} (the checks carry sum, product, min and max)")
            reduced = REDUCE[op](torch.stack(tensors)).to(tensors[0].dtype)
            if name == "reduce":
                return [("collective-result", reduced if r == parts[0]["dst"] else None) for r in range(world)]
            return [("collective-result", reduced)] * world
        if name == "broadcast":
            src = parts[0]["src"]
            wrong = _misfits(name, entered)
            if wrong:
                def shown(t: torch.Tensor) -> str:
                    return f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}"

                return [("collective-error", f"torch.distributed.broadcast: rank {r}'s tensor is {shown(tensors[r])}, "
                                             f"the source rank {src}'s {shown(tensors[src])}: every rank passes a "
                                             f"tensor of the source's shape and dtype") if r in wrong else
                        ("collective-error", f"torch.distributed.broadcast: rank {min(wrong)}'s tensor did not fit")
                        for r in range(world)]
            return [("collective-result", tensors[src])] * world
        if name in ("all_gather", "all_gather_into_tensor"):
            return [("collective-result", tensors)] * world
        if name == "gather":
            return [("collective-result", tensors if r == parts[0]["dst"] else None) for r in range(world)]
        raise ValueError("the checks do not carry it")
    except Exception as error:  # noqa: BLE001 - what the ranks sent is theirs: each gets the reason
        return [("collective-error", f"torch.distributed.{name}: {error}")] * world


def ranks(guarded: Guarded, world_size: int) -> Ranks:
    """The implementation's `world_size` ranks: started by the first call a check makes on them, kept for the
    next checks (a group a failure ended is started again), ended with the module's run."""
    groups = guarded.run.rank_groups
    group = groups.get(world_size)
    if group is None or group.broken is not None:
        if group is not None:
            group.close()
        group = groups[world_size] = Ranks(guarded, world_size)
    group.guarded = guarded  # this check's guard: its events name the mistakes
    return group
