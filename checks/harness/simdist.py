"""`torch.distributed` played by threads of this process, for kit code only (mutants' replays, the book's toy).

`run_ranks(function, per_rank_args, world_size)` runs `function` once per rank, each in a thread that
`torch.distributed` sees as that rank: while it runs, the module's collectives (`all_reduce`, `gather`,
`all_gather`, `broadcast`, `barrier`, `all_to_all`, `all_to_all_single`) and `get_rank` / `get_world_size` /
`is_initialized` are replaced by versions that meet at a barrier. Sums add the ranks' tensors in rank order.
Learner code never runs here: it runs in workers joined in a real process group (`ranks.py`).
"""

import os
import threading
from contextlib import contextmanager

import torch
import torch.distributed as dist

WAIT = 30.0  # seconds a rank waits at a collective for the others (a mutant that skips one on a rank)


class _Group:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size, timeout=WAIT)
        self.slots: list = [None] * world_size
        self.local = threading.local()

    def rank(self) -> int:
        return self.local.rank

    def exchange(self, value):
        """Every rank's `value`, in rank order (each rank waits for the others, twice: a round at a time)."""
        self.slots[self.rank()] = value
        self.barrier.wait()
        values = list(self.slots)
        self.barrier.wait()
        return values

    # ---- the collectives, as torch.distributed names them ----
    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        values = self.exchange(tensor.clone())
        if op == dist.ReduceOp.SUM:
            total = values[0].clone()
            for v in values[1:]:
                total += v
        elif op == dist.ReduceOp.MAX:
            total = torch.stack(values).amax(0)
        else:
            raise NotImplementedError(f"reduce op {op}")
        tensor.copy_(total)

    def gather(self, tensor, gather_list=None, dst=0, group=None, async_op=False):
        values = self.exchange(tensor.clone())
        if self.rank() == dst:
            for out, v in zip(gather_list, values):
                out.copy_(v)

    def all_gather(self, tensor_list, tensor, group=None, async_op=False):
        for out, v in zip(tensor_list, self.exchange(tensor.clone())):
            out.copy_(v)

    def broadcast(self, tensor, src=0, group=None, async_op=False):
        tensor.copy_(self.exchange(tensor.clone())[src])

    def all_to_all(self, output_tensor_list, input_tensor_list, group=None, async_op=False):
        sent = self.exchange([t.clone() for t in input_tensor_list])  # sent[s][r]: what rank s sends rank r
        for out, parts in zip(output_tensor_list, sent):
            out.copy_(parts[self.rank()])

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        sizes = input_split_sizes or [input.shape[0] // self.world_size] * self.world_size
        sent = self.exchange([part.clone() for part in input.split(list(sizes))])
        output.copy_(torch.cat([parts[self.rank()] for parts in sent]).reshape(output.shape))

    def barrier_(self, group=None, async_op=False):
        self.exchange(None)


_NAMES = ("all_reduce", "gather", "all_gather", "broadcast", "barrier", "all_to_all", "all_to_all_single", "get_rank",
          "get_world_size", "is_initialized")
_lock = threading.Lock()  # one simulated group at a time


@contextmanager
def _patched(group: _Group):
    saved = {name: getattr(dist, name) for name in _NAMES}
    simulated = group
    replacements = {"all_reduce": group.all_reduce, "gather": group.gather, "all_gather": group.all_gather,
                    "broadcast": group.broadcast, "barrier": group.barrier_,
                    "all_to_all": group.all_to_all, "all_to_all_single": group.all_to_all_single,
                    "get_rank": lambda group=None: simulated.rank(),
                    "get_world_size": lambda group=None: simulated.world_size, "is_initialized": lambda: True}
    for name, value in replacements.items():
        setattr(dist, name, value)
    executor = _interpreter_grid()
    launch = executor and executor.__call__
    if executor is not None:  # Triton's interpreter keeps a launch's grid in globals: two rank threads launching at
        # once corrupt each other's (`x >= grid_dim[0]`), so the ranks' kernels run one at a time here
        turn = threading.Lock()

        def in_turn(self, *args, **kwargs):
            with turn:
                return launch(self, *args, **kwargs)

        executor.__call__ = in_turn
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(dist, name, value)
        if executor is not None:
            executor.__call__ = launch


def _interpreter_grid():
    """Triton's interpreter's grid executor, where kernels run in it (TRITON_INTERPRET=1), else None."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return None
    try:
        from triton.runtime.interpreter import GridExecutor
    except ImportError:  # no Triton, or another layout of it: nothing launches kernels here
        return None
    return GridExecutor


def run_ranks(function, per_rank_args: list[tuple], world_size: int, timeout: float = 60.0) -> list:
    """`function(*per_rank_args[r])` on each rank r at once: the results in rank order. The first rank's
    exception is raised (after every thread ended); a rank still running after `timeout` is an error."""
    group = _Group(world_size)
    results: list = [None] * world_size
    errors: list = [None] * world_size

    def body(rank: int):
        group.local.rank = rank
        try:
            results[rank] = function(*per_rank_args[rank])
        except BaseException as error:  # noqa: BLE001 - reported below, the first rank's first
            errors[rank] = error
            group.barrier.abort()  # the others stop waiting for this rank

    with _lock, _patched(group):
        threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
        if any(t.is_alive() for t in threads):
            group.barrier.abort()
            raise TimeoutError(f"a rank did not finish within {timeout:g} s")
    for error in errors:
        if error is not None:
            raise error
    return results
