"""P05 · Continuous batching: the scheduler that decides what every step of the engine computes.

An engine serves many requests at once. Each step it runs the model once, over a batch the scheduler
picks: either a prefill step (prompt tokens of sequences that are new, or were preempted, or are in the
middle of a chunked prompt) or a decode step (one token for each running sequence) — never both. A
step's work is bounded twice: at most `max_num_seqs` sequences and at most `max_num_batched_tokens`
new tokens (the token budget). Sequences join and leave the batch between any two steps: that is
continuous batching. This file is pure Python on top of your p01 `BlockManager`: it moves sequences
between the `waiting` and `running` queues, hands out blocks, takes them back when the cache is full
(preemption by recomputation) and when a request is done. It follows nano-vllm's scheduler
(`nanovllm/engine/scheduler.py`) in its chunked-prefill form.

Names: a step's budget is `max_num_batched_tokens` new tokens; a sequence's computed tokens are those
whose K/V is in the cache (its cached prefix included); a chunk is the part of a prompt one step computes.

Run `./check.sh p05` to check this file.
"""

from collections import deque

# Your own block manager, from this folder (the stub keeps this import for you).
from .p01_block_manager import BlockManager, Sequence

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


class Request(Sequence):
    """One request as the scheduler tracks it: a p01 `Sequence` plus the request's state (given complete).

    `token_ids` holds the prompt, then every token sampled since. `num_prompt_tokens` is the prompt's
    length. `num_computed_tokens`: how many leading tokens have their K/V in the cache (the cached
    prefix `allocate` found, then every chunk computed since); 0 while the request has no blocks.
    `num_scheduled_tokens`: how many tokens the current step computes for it (a chunk, the whole rest
    of its prompt, or 1 in a decode step). `status` is WAITING, RUNNING or FINISHED.
    """

    def __init__(self, request_id: int, prompt_ids, block_size: int, max_tokens: int, ignore_eos: bool = False):
        super().__init__(prompt_ids, block_size)
        self.request_id = request_id
        self.num_prompt_tokens = len(self.token_ids)
        self.max_tokens = max_tokens
        self.ignore_eos = ignore_eos
        self.status = WAITING
        self.num_computed_tokens = 0
        self.num_scheduled_tokens = 0

    @property
    def completion_token_ids(self) -> list[int]:
        """The tokens sampled so far (after the prompt)."""
        return self.token_ids[self.num_prompt_tokens :]


class Scheduler:
    """nano-vllm's policy over a p01 `BlockManager`: prefill first, then decode with preemption.

    The state (laid out by `__init__`; the checks read it):
    - `block_manager`: your p01 `BlockManager(num_blocks, block_size)`.
    - `waiting`: requests without a complete prefill, served from the left: new ones join on the right,
      preempted ones come back on the left. A request being prefilled in chunks stays at the left until
      its prompt is complete.
    - `running`: requests whose prompt is computed, decoded from the left, in the order they started.
    - `max_num_seqs`, `max_num_batched_tokens`, `eos_token_id` (-1: no stop token): the limits.

    A running request always holds exactly one token without a cache slot: the last one, sampled by the
    previous step. The decode step that computes its K/V gives it its slot first.
    """

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 eos_token_id: int = -1) -> None:
        self.block_manager = BlockManager(num_blocks, block_size)
        self.waiting: deque[Request] = deque()
        self.running: deque[Request] = deque()
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_id = eos_token_id

    def add(self, request_id: int, prompt_ids, max_tokens: int, ignore_eos: bool = False) -> Request:
        """Queue a new request on the right of `waiting` and return it (`prompt_ids`: any sequence of
        token ids, which the request copies). A request that could not fit the whole cache alone (its
        prompt and every completion token but the last need a slot, though a stop token may end it
        sooner) is refused with a ValueError: it would be preempted forever. So is an empty prompt, or
        `max_tokens` below 1 (a request that asks for no token)."""
        request = Request(request_id, prompt_ids, self.block_manager.block_size, max_tokens, ignore_eos)
        block_size = self.block_manager.block_size
        needed = (request.num_prompt_tokens + max_tokens - 1 + block_size - 1) // block_size
        if request.num_prompt_tokens == 0 or max_tokens < 1 or needed > len(self.block_manager.blocks):
            raise ValueError(f"request {request_id}: a prompt of {request.num_prompt_tokens} tokens and "
                             f"max_tokens {max_tokens} cannot be served by {len(self.block_manager.blocks)} "
                             f"blocks of {block_size}")
        self.waiting.append(request)
        return request

    def is_finished(self) -> bool:
        """True when no request is waiting or running."""
        return not self.waiting and not self.running

    def schedule(self) -> tuple[list[Request], bool]:
        """Pick the next step's batch: `(requests, is_prefill)`, requests in batch order.

        Prefill, when `waiting` is not empty: take requests from the left of `waiting` while fewer than
        `max_num_seqs` are taken and budget is left. A request without blocks gets them first
        (`allocate`; when `can_allocate` says no, the step ends there) and starts with its cached prefix
        computed. Its cost is its tokens minus its computed ones. Only the FIRST request of the step may
        be cut to the budget that is left (a chunk); a later one that does not fit whole ends the step
        and stays first in `waiting`, blocks and all. A request whose prompt (all its tokens) is complete
        after this step moves to the right of `running`. Sets `num_scheduled_tokens`.

        Decode, when no request was prefilled: take requests from the left of `running` (at most
        `max_num_seqs` decoded; a request it preempts takes no seat). Each needs a slot for its last
        token (`BlockManager.append`, which takes the token: take it off `token_ids` and append it back
        through the manager). While it cannot have one (`can_append`), preempt the NEWEST running request
        (the right end of `running`: the one that started last, whatever its tokens left), or, when none
        is left, the request itself (it then gets no step). The decoded requests go back to the left of
        `running`, in order. Sets `num_scheduled_tokens` to 1.

        Returns `([], False)` when nothing can run (no request at all).
        """
        raise NotImplementedError("Scheduler.schedule (mine/p05_scheduler.py) is not written yet")

    def preempt(self, request: Request) -> None:
        """Take a running request out: free its blocks (its K/V is lost and recomputed later, possibly
        through the prefix cache), set `num_computed_tokens` and `num_scheduled_tokens` back to 0 and its
        `status` back to WAITING, and put it on the LEFT of `waiting`, so it is the first to come back.
        It leaves `running` alone: the caller has taken the request off it (the decode loop's
        `running.pop()`), or takes it off itself."""
        raise NotImplementedError("Scheduler.preempt (mine/p05_scheduler.py) is not written yet")

    def postprocess(self, requests: list[Request], token_ids: list[int]) -> list[Request]:
        """Apply one step's results: `token_ids[i]` was sampled from the last position `requests[i]`
        computed (`requests` as `schedule` returned them).

        Each request's computed count grows by its scheduled tokens. A request whose tokens are not all
        computed yet (a chunk of its prompt) discards its token. Otherwise the token is appended to
        `token_ids` (its slot comes with the next decode step), and the request finishes when the token
        is `eos_token_id` (unless `ignore_eos`) or when it has `max_tokens` completion tokens: then its
        status is FINISHED, its blocks are freed and it leaves `running`.

        Returns the requests that finished in this step, in batch order: a list, empty when none did
        (an empty batch too).
        """
        raise NotImplementedError("Scheduler.postprocess (mine/p05_scheduler.py) is not written yet")
