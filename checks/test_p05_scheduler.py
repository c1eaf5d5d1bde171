"""Checks for P05 · continuous-batching scheduler (mine/p05_scheduler.py).

Oracles: the hand-worked scenarios in toy_cases/p05_scheduler.json; one small deterministic case per rule of the
contract, worked out by hand in its comments; and a plain model of the same policy in this file, with its own
block bookkeeping (a full block is known by the whole prefix it ends: no hashing), run side by side with the
learner's scheduler on random request streams drawn by hypothesis. After every step the learner's state must
equal the model's (the batch, waiting and running in order, the free list, every request's tokens, blocks and
computed tokens) and keep what any correct scheduler keeps (one kind of work a step, the token budget and the
sequence cap, a status that matches the request's queue, free + used = all blocks, a used block's ref count equal
to the requests holding it and no request holding a free one, blocks that cover each request's tokens, a block
shared only by requests with the same prefix up to its end, no finished request holding blocks).

The scheduler sits on the learner's own p01 `BlockManager`; block ids and the free list's order are p01's
contract, so a p01 that passes its checks is assumed here.
"""

import copy
import re
from dataclasses import dataclass, field

import pytest
from hypothesis import strategies as st

from checks.harness.compare import Mismatch
from checks.harness.guard import LearnerError, Remote
from checks.harness.properties import explore
from checks.harness.toys import load_toy

pytestmark = pytest.mark.p05

TOLERANCE_KIND = "exact"  # bookkeeping: ids and counts, compared exactly
# Replays of this module are cheap: a name its failures suggest alone is replayed on the checks a learner passed too,
# and dropped where its mutant gives other outputs there (harness/report.py, contradict)
CHEAP_REPLAYS = True
# What `./check.sh grade` awards: a check's points, shared out over its cases (the module is worth the sum, 37).
POINTS = {
    "test_toy_scenario": 4,
    "test_prefill_comes_before_decode": 1,
    "test_a_step_never_mixes_prefill_and_decode": 2,
    "test_the_token_budget_is_never_exceeded": 2,
    "test_max_num_seqs_caps_every_step": 1,
    "test_a_decode_step_is_bounded_by_max_num_seqs_not_the_token_budget": 1,
    "test_a_cached_prefix_costs_nothing": 2,
    "test_only_the_first_request_of_a_step_is_chunked": 2,
    "test_a_chunk_advances_computed_tokens_and_discards_its_token": 2,
    "test_a_request_runs_only_once_its_prompt_is_complete": 1,
    "test_postprocess_sets_num_scheduled_tokens_back_to_0": 1,
    "test_decode_preempts_the_newest_running_request": 2,
    "test_a_request_preempts_itself_only_when_no_other_is_left": 1,
    "test_preempted_requests_come_back_first_and_are_recomputed": 2,
    "test_a_preempted_request_is_recomputed_in_chunks_with_its_completion_tokens": 2,
    "test_decoded_requests_keep_their_order": 1,
    "test_requests_finish_on_eos_unless_ignore_eos_and_at_max_tokens": 2,
    "test_a_finished_request_gives_its_blocks_back": 1,
    "test_add_refuses_what_the_cache_cannot_hold": 1,
    "test_an_idle_step_schedules_and_finishes_nothing": 1,
    "test_nano_vllm_sizes_match_the_model": 2,
    "test_random_request_streams_match_the_model": 3,
}
CONTRACTS = {}  # results are checked field by field below
TOY = load_toy("p05_scheduler")
# The rule a check stands for, named where its own statement of a case (not the model's) fails: see RULES in
# checks/mutants/p05_scheduler.py. A difference from the model names its rule where it is found (`Driver.fail`).
RULE_OF = {
    "test_prefill_comes_before_decode": "prefill-before-decode",
    "test_a_step_never_mixes_prefill_and_decode": "one-kind-a-step",
    "test_the_token_budget_is_never_exceeded": "token-budget",
    "test_max_num_seqs_caps_every_step": "seq-cap",
    "test_a_decode_step_is_bounded_by_max_num_seqs_not_the_token_budget": "decode-takes-the-running",
    "test_a_cached_prefix_costs_nothing": "cached-prefix-is-computed",
    "test_only_the_first_request_of_a_step_is_chunked": "only-the-first-is-chunked",
    "test_a_chunk_advances_computed_tokens_and_discards_its_token": "a-chunk-stays-first",
    "test_a_request_runs_only_once_its_prompt_is_complete": "complete-prompt-runs",
    "test_postprocess_sets_num_scheduled_tokens_back_to_0": "scheduled-back-to-zero",
    "test_decode_preempts_the_newest_running_request": "preempt-the-newest",
    "test_a_request_preempts_itself_only_when_no_other_is_left": "preempt-the-newest",
    "test_preempted_requests_come_back_first_and_are_recomputed": "preempted-come-back-first",
    "test_a_preempted_request_is_recomputed_in_chunks_with_its_completion_tokens": "cost-is-what-is-not-computed",
    "test_decoded_requests_keep_their_order": "running-in-start-order",
    "test_requests_finish_on_eos_unless_ignore_eos_and_at_max_tokens": "finish-on-eos-or-max-tokens",
    "test_a_finished_request_gives_its_blocks_back": "finished-leaves",
    "test_add_refuses_what_the_cache_cannot_hold": "add-refuses",
    "test_an_idle_step_schedules_and_finishes_nothing": "empty-steps",
}
WAITING, RUNNING, FINISHED = "waiting", "running", "finished"  # the statuses the given Request uses


def letter(request_id: int) -> str:
    """How messages name a request: 0 -> A, 1 -> B, ..."""
    return chr(ord("A") + request_id) if 0 <= request_id < 26 else f"#{request_id}"


def ids(names) -> str:
    return "[" + ", ".join(names) + "]"


def prompt_text(prompt) -> str:
    """A prompt as the steps recall it; one of thousands of tokens by its ends and length; a tuple or a range as
    such."""
    if isinstance(prompt, range):
        return f"range({prompt.start}, {prompt.stop})"
    if isinstance(prompt, tuple):
        return f"({', '.join(map(str, prompt))})"
    if len(prompt) > 16:
        return f"[{', '.join(map(str, prompt[:3]))}, …, {prompt[-1]}] ({len(prompt)} tokens)"
    return ids(map(str, prompt))


def batch_text(batch) -> str:
    return "[" + ", ".join(f"{name} {n}" for name, n in batch) + "]"


def count(n: int, unit: str) -> str:
    """"1 block", "3 blocks": a number with what it counts."""
    return f"{n} {unit}" if n == 1 else f"{n} {unit}s"


LIST_SHOWN = 12  # a longer list (nano-vllm's 64 blocks) is shown from its first difference on


def differing(got: list, want: list) -> str:
    """`got` against `want`, whole when short; when long, from the first position where they differ."""
    if len(got) <= LIST_SHOWN and len(want) <= LIST_SHOWN:
        return f"{got}, expected {want}"
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))

    def tail(values: list) -> str:
        more = ", …" if len(values) > first + LIST_SHOWN else ""
        return "[" + ("…, " if first else "") + ", ".join(map(str, values[first : first + LIST_SHOWN])) + more + "]"

    return (f"{tail(got)} ({len(got)} in all), expected {tail(want)} ({len(want)} in all): they differ from "
            f"position {first} on")


# ---- the model -------------------------------------------------------------------------------------------


class ModelRequest:
    def __init__(self, request_id: int, prompt, max_tokens: int, ignore_eos: bool):
        self.name = letter(request_id)
        self.tokens = list(prompt)
        self.prompt_len = len(self.tokens)
        self.max_tokens, self.ignore_eos = max_tokens, ignore_eos
        self.table: list[int] = []
        self.computed = 0
        self.scheduled = 0
        self.status = WAITING


class ModelCache:
    """p01's bookkeeping in its plainest form: a full block is known by the tuple of every token from the
    sequence's start to the block's end (what a chained hash stands for)."""

    def __init__(self, num_blocks: int, block_size: int):
        self.size = block_size
        self.free = list(range(num_blocks))
        self.refs = [0] * num_blocks
        self.ends: list[tuple | None] = [None] * num_blocks  # the prefix a sealed block ends
        self.cache: dict[tuple, int] = {}  # that prefix -> the block

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.size)

    def take(self) -> int:
        block = self.free.pop(0)
        if self.ends[block] is not None and self.cache.get(self.ends[block]) == block:
            del self.cache[self.ends[block]]  # its slots are about to hold other tokens
        self.ends[block], self.refs[block] = None, 1
        return block

    def seal(self, block: int, prefix: tuple) -> None:
        self.ends[block] = prefix
        self.cache[prefix] = block

    def allocate(self, tokens: list[int], table: list[int] | None = None) -> tuple[list[int], int]:
        """(block table, cached tokens): the longest run of leading full blocks found, never the last block. The
        table is filled as the blocks are taken (`table`, when given), so one that ran out can be given back."""
        n, table, cached, hitting = self.blocks_for(len(tokens)), [] if table is None else table, 0, True
        for j in range(n):
            end = (j + 1) * self.size
            prefix = tuple(tokens[:end]) if end <= len(tokens) else None
            found = self.cache.get(prefix) if hitting and prefix is not None and j < n - 1 else None
            if found is not None:
                if self.refs[found] == 0:
                    self.free.remove(found)
                self.refs[found] += 1
                table.append(found)
                cached = end
                continue
            hitting = False
            table.append(self.take())
            if prefix is not None:
                self.seal(table[-1], prefix)
        return table, cached

    def release(self, table: list[int]) -> None:
        for block in reversed(table):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free.append(block)

    def try_allocate(self, tokens: list[int]) -> None:
        """What an allocate that does not fit leaves behind when it is given back: it takes blocks until none is
        left, then releases them (last first), the full ones sealed and its cache hits' blocks revived."""
        table: list[int] = []
        try:
            self.allocate(tokens, table)
        except IndexError:
            self.release(table)


class Model:
    """The contract's policy, written as plainly as possible, on the model's own blocks."""

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int, budget: int, eos: int):
        self.cache = ModelCache(num_blocks, block_size)
        self.num_blocks, self.size = num_blocks, block_size
        self.max_num_seqs, self.budget, self.eos = max_num_seqs, budget, eos
        self.waiting: list[ModelRequest] = []
        self.running: list[ModelRequest] = []
        self.refused: ModelRequest | None = None  # the waiting request the last prefill loop found no blocks for

    def accepts(self, prompt_len: int, max_tokens: int) -> bool:
        """Whether the request could ever fit the cache alone: its prompt and all completion tokens but the last."""
        return prompt_len > 0 and max_tokens >= 1 and \
            self.cache.blocks_for(prompt_len + max_tokens - 1) <= self.num_blocks

    def add(self, request_id: int, prompt, max_tokens: int, ignore_eos: bool) -> ModelRequest:
        request = ModelRequest(request_id, prompt, max_tokens, ignore_eos)
        self.waiting.append(request)
        return request

    def finished(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self, tried: bool = False) -> tuple[list[ModelRequest], bool]:
        """The step's batch and whether it is a prefill. `tried`: a request can_allocate refuses is allocated all
        the same, and given back when the free list runs out (a learner's loop that tries allocate instead of
        asking can_allocate)."""
        batch, left, self.refused = [], self.budget, None
        while self.waiting and len(batch) < self.max_num_seqs and left > 0:
            head = self.waiting[0]
            if not head.table:
                if len(self.cache.free) < self.cache.blocks_for(len(head.tokens)):
                    self.refused = head
                    if tried:
                        self.cache.try_allocate(head.tokens)
                    break  # no room for it: the step ends here
                head.table, head.computed = self.cache.allocate(head.tokens)
            rest = len(head.tokens) - head.computed
            if batch and rest > left:
                break  # a later request is never cut: it leads the next step
            head.scheduled = min(rest, left)
            left -= head.scheduled
            batch.append(head)
            if head.scheduled < rest:
                break  # the first request, cut to the budget: a chunk
            self.running.append(self.waiting.pop(0))
            head.status = RUNNING
        if batch:
            return batch, True
        while self.running and len(batch) < self.max_num_seqs:
            request = self.running.pop(0)
            opens = (len(request.tokens) - 1) % self.size == 0  # the last token's slot is the first of a block
            while opens and not self.cache.free and self.running:
                self.preempt(self.running.pop())  # the newest running request
            if opens and not self.cache.free:
                self.preempt(request)  # nobody else to take blocks from
                continue
            if opens:
                request.table.append(self.cache.take())
            if len(request.tokens) % self.size == 0:  # the last token fills its block
                self.cache.seal(request.table[-1], tuple(request.tokens))
            request.scheduled = 1
            batch.append(request)
        self.running = batch + self.running
        return batch, False

    def preempt(self, request: ModelRequest) -> None:
        self.cache.release(request.table)
        request.table, request.computed, request.status = [], 0, WAITING
        self.waiting.insert(0, request)

    def postprocess(self, batch: list[ModelRequest], tokens: list[int]) -> list[ModelRequest]:
        done = []
        for request, token in zip(batch, tokens):
            request.computed += request.scheduled
            request.scheduled = 0
            if request.computed < len(request.tokens):
                continue  # a chunk of the prompt
            request.tokens.append(token)
            if (token == self.eos and not request.ignore_eos) or \
                    len(request.tokens) - request.prompt_len == request.max_tokens:
                request.status = FINISHED
                self.cache.release(request.table)
                request.table = []
                self.running.remove(request)
                done.append(request)
        return done


# ---- the learner's scheduler, step by step, beside the model -----------------------------------------------


@dataclass
class Seen:
    """A request as the learner's scheduler holds it."""

    tokens: list[int]
    table: list[int]
    computed: int
    status: object


@dataclass
class Facts:
    """What the model did in the step being checked: which rule a difference breaks depends on it."""

    prefill: bool
    preempted: set[str]  # went from running back to waiting
    allocated: dict[str, int]  # got their blocks: name -> the cached tokens it started with
    chunked: set[str]  # computed part of their tokens
    completed: set[str]  # a prefill that computed all of their tokens
    taken: set[int] = field(default_factory=set)  # blocks it took from the free list (allocations, decode slots)
    finished: set[str] = field(default_factory=set)
    refused: str = ""  # the waiting request the prefill loop found no blocks for (can_allocate said no)
    tried_free: list[int] | None = None  # the free list had the step tried to allocate that one and given it back


class Driver:
    """Runs requests through the learner's scheduler and the model side by side. Every difference is a
    `Mismatch` of one line: which step, what differed, and the steps so far in words."""

    def __init__(self, impl, num_blocks: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 eos_token_id: int = -1, follow_model: bool = True):
        self.limits = (num_blocks, block_size, max_num_seqs, max_num_batched_tokens, eos_token_id)
        self.size, self.max_num_seqs, self.budget = block_size, max_num_seqs, max_num_batched_tokens
        self.follow_model = follow_model
        self.scheduler = impl.Scheduler(num_blocks, block_size, max_num_seqs, max_num_batched_tokens, eos_token_id)
        self.model = Model(num_blocks, block_size, max_num_seqs, max_num_batched_tokens, eos_token_id)
        self.remotes: dict[str, Remote] = {}  # name -> the Request `add` returned
        self.models: dict[str, ModelRequest] = {}
        self.names: dict[int, str] = {}  # id(Remote) -> name
        self.done: set[str] = set()
        self.step_number = 0
        self.history: list[str] = []
        self.holding: set[str] = set()  # waiting requests that held their blocks when the step began
        self.scheduled_tables: dict[str, list[int]] = {}  # the batch's block tables between schedule and postprocess
        self.last_batch: list[tuple[str, int]] = []
        self.before: dict[str, list[str]] = {"waiting": [], "running": []}  # the queues when the step began
        self.free_before: set[int] = set()  # the model's free blocks when the step began
        self.title = ""  # "scenario '...', " for a toy
        self.facts = Facts(True, set(), {}, set(), set())
        self.cached_at_admission: dict[str, int] = {}  # name -> the num_cached_tokens its last allocate set

    # -- what the check does --
    def add(self, request_id: int, prompt, max_tokens: int, ignore_eos: bool = False, as_id: int | None = None) -> None:
        """Add the request named by `request_id` (A for 0, ...), given the scheduler with the id `as_id` when one is
        given (ids are the caller's: several requests may share one)."""
        name = letter(request_id)
        self.history.append(f"add {name} {prompt_text(prompt)} max {max_tokens}" + " ignore_eos" * ignore_eos
                            + (f" (id {as_id})" if as_id is not None else ""))
        refused = not self.model.accepts(len(prompt), max_tokens)
        try:
            remote = self.scheduler.add(request_id if as_id is None else as_id,
                                        prompt if isinstance(prompt, (tuple, range)) else list(prompt),
                                        max_tokens, ignore_eos)  # a tuple or a range as such: any sequence of ids
        except LearnerError as error:
            if refused and "ValueError" in str(error):
                return
            if isinstance(prompt, (tuple, range)):
                error = error.noted(f"add was given the prompt {prompt_text(prompt)}: a prompt is any sequence of "
                                    f"token ids, copied into the request's own list (p01's Sequence does)")
            if "ValueError" in str(error):
                error.rule = "add-refuses"  # a request that fits, refused: a known mistake's refusal is named
                error.identifiable = True
            raise error from None
        if refused:
            why = "it asks for no token" if max_tokens < 1 else "it has no prompt" if not prompt else \
                f"{count(self.limits[0], 'block')} of {self.size} tokens can never hold it" + \
                (" (a stop token may end it sooner, or not: add counts max_tokens)" if self.limits[4] >= 0 and not
                 ignore_eos else "")
            self.fail(f"add({name}, a prompt of {count(len(prompt), 'token')}, max_tokens {max_tokens}) was accepted, "
                      f"but {why}: expected a ValueError", "add-refuses")
        if not isinstance(remote, Remote):
            self.fail(f"add({name}, ...) returned {remote!r}, not a Request: return the Request it queued", "-")
        self.remotes[name] = remote
        self.names[id(remote)] = name
        self.models[name] = self.model.add(request_id, prompt, max_tokens, ignore_eos)

    def step(self, sampled=None, toy: dict | None = None) -> tuple[list[str], bool, list[str]]:
        """One engine step: schedule, then postprocess with `sampled` (a list in batch order, a dict name ->
        token, a function drawing one, or None: token 9 for every request). `toy`: the toy's step, whose batch
        is compared before postprocess. Returns the batch's names, is_prefill and the finished requests."""
        self.step_number += 1
        k = self.step_number
        at = f"{self.title}step {k}"  # a toy's messages name its scenario
        self.before = {"waiting": self.queue("waiting"), "running": self.queue("running")}
        running_before = {r.name for r in self.model.running}
        holding = {r.name for r in self.model.waiting if r.table}
        self.holding = holding
        free_before = set(self.model.cache.free)
        self.free_before = free_before
        before = copy.deepcopy(self.model)  # for a step that tries to allocate a request without room
        expected, expected_prefill = self.model.schedule()
        self.facts = Facts(expected_prefill, {r.name for r in self.model.waiting if r.name in running_before},
                           {r.name: r.computed for r in [*expected, *self.model.waiting]  # a deferred one got them too
                            if expected_prefill and r.table and r.name not in holding},
                           {r.name for r in expected if r.computed + r.scheduled < len(r.tokens)},
                           {r.name for r in expected if expected_prefill and r.computed + r.scheduled == len(r.tokens)},
                           free_before - set(self.model.cache.free),
                           refused=self.model.refused.name if self.model.refused else "")
        self.ever_preempted = getattr(self, "ever_preempted", set()) | self.facts.preempted
        got = self.scheduler.schedule()
        if not isinstance(got, tuple) or len(got) != 2:
            self.fail(f"{at}: schedule() returned {self.shown(got)}, expected a (requests, is_prefill) pair", "-")
        batch, is_prefill = got
        if not isinstance(batch, list | tuple):
            self.fail(f"{at}: schedule() returned {self.shown(batch)} as its requests, expected a list", "-")
        names = [self.name_of(r, f"{at}: schedule()'s batch") for r in batch]
        seen = [(name, self.read(r, "num_scheduled_tokens", name)) for name, r in zip(names, batch)]
        if type(is_prefill) is not bool:
            self.fail(f"{at}: schedule()'s is_prefill is {is_prefill!r}, expected a bool", "-")
        kind = "prefill" if is_prefill else "decode"
        self.history.append(f"step {k}: {kind} {batch_text(seen)}")
        self.last_batch = seen
        if is_prefill and self.before["running"]:  # only a decode step preempts
            sent_back = [name for name in self.queue("waiting") if name in self.before["running"]]
            if sent_back:
                self.fail(f"{at}: the prefill step {batch_text(seen)} sent {ids(sent_back)} from running back to "
                          f"waiting: only a decode step preempts; when the first waiting request cannot get its "
                          f"blocks, the prefill loop ends the step there", "prefill-fills-the-step")
        self.batch_rules(k, seen, is_prefill)
        taken = set(names) | {r.name for r in expected}  # a request the model takes: the batch's comparison tells
        for name in [*self.queue("waiting"), *self.queue("running")]:
            left_out = self.read(self.remotes[name], "num_scheduled_tokens", name) if name not in taken else 0
            if left_out:
                self.fail(f"{at}: {name} is not in the batch {batch_text(seen)}, but its num_scheduled_tokens is "
                          f"{left_out}: a request the step leaves out schedules nothing (set the count only for a "
                          f"request the step takes)", "scheduled-back-to-zero")
        self.expect_blocks_held_rightly(at)
        want = [(r.name, r.scheduled) for r in expected]
        if toy is not None and ([list(b) for b in seen] != toy["batch"] or is_prefill != toy["is_prefill"]):
            self.fail(f"{at}: the batch is {kind} {batch_text(seen)} (request and "
                      f"num_scheduled_tokens), expected {'prefill' if toy['is_prefill'] else 'decode'} "
                      f"{batch_text(toy['batch'])}", self.batch_rule(seen, is_prefill, want, expected_prefill))
        if self.follow_model and (seen != want or is_prefill != expected_prefill):
            refused = self.model.refused if self.facts.refused in names else None
            unrun = self.unrun(names, want)
            self.fail(f"{at}: the batch is {kind} {batch_text(seen)} (request and num_scheduled_tokens), "
                      f"expected {'prefill' if expected_prefill else 'decode'} {batch_text(want)}" + (
                          f": {refused.name} needs {count(self.model.cache.blocks_for(len(refused.tokens)), 'block')}, "
                          f"{len(self.model.cache.free)} free, so can_allocate says no (it counts "
                          f"no cache hit) and the step ends before it" if refused else "") + (
                          f": {unrun[0]} went from waiting to running without its tokens computed (a request leaves "
                          f"waiting only in the step that computes all of them)" if unrun else ""),
                      self.batch_rule(seen, is_prefill, want, expected_prefill))
        tokens = self.tokens_for(names, sampled)
        if tokens:
            self.history[-1] += f" sampled {ids(map(str, tokens))}"
        self.scheduled_tables = {name: self.read(r, "block_table", name) for name, r in zip(names, batch)}
        taken_by_model = {m.name for m in expected}
        for name, r in zip(names, batch):  # schedule leaves token_ids as they were: a decode takes the last one
            if not self.follow_model or name not in taken_by_model:  # off for its slot and puts it back
                continue
            mine, got_tokens = self.models[name].tokens, self.read(r, "token_ids", name)
            if got_tokens != mine:
                self.fail(f"{at}: after schedule (before postprocess), {name}'s token_ids is "
                          f"{differing(got_tokens, mine)}: "
                          + ("a decode step takes the LAST token (the one sampled last) off token_ids, gives it its "
                             "slot and puts it back, so token_ids come out as they went in" if not is_prefill else
                             "a prefill step leaves token_ids as they are"),
                          "decode-takes-a-slot" if not is_prefill else "postprocess-appends-the-token")
            if not is_prefill and len(mine) % self.size == 0:  # its token filled its last block: sealed for the cache
                self.expect_sealed(at, name, self.scheduled_tables[name])
        for name, cached in self.facts.allocated.items() if self.follow_model else ():  # p06 counts what it says
            found = self.read(self.remotes[name], "num_cached_tokens", name)
            if found != cached:
                self.fail(f"{at}: after schedule, {name}'s num_cached_tokens is {found!r}, expected "
                          f"{count(cached, 'cached token')}: allocate sets it to what the prefix cache served, "
                          f"and nothing after it changes it", "cached-prefix-is-computed")
            self.cached_at_admission[name] = cached
        finished = self.scheduler.postprocess(batch, tokens)
        if not isinstance(finished, list | tuple):
            self.fail(f"{at}: postprocess returned {self.shown(finished)}, expected the list of finished requests", "-")
        finished_names = [self.name_of(r, f"{at}: postprocess's finished requests") for r in finished]
        expected_finished = [r.name for r in self.model.postprocess(expected, tokens)]
        self.facts.finished = set(expected_finished)
        if self.facts.refused:  # the same step, had it tried to allocate the request without room and given it back
            tried, _ = before.schedule(tried=True)
            if [r.name for r in tried] == [r.name for r in expected]:
                before.postprocess(tried, tokens)
                self.facts.tried_free = before.cache.free
        if finished_names:
            self.history[-1] += f" finished {ids(finished_names)}"
        if self.follow_model and finished_names != expected_finished:
            self.fail(f"{at}: postprocess returned the finished requests {ids(finished_names)}, "
                      f"expected {ids(expected_finished)}", self.finished_rule(finished_names, expected_finished))
        self.done |= set(finished_names)
        for name in names if self.follow_model else ():  # what allocate set stays until free (or allocate) again
            cached = self.cached_at_admission.get(name) if name not in finished_names else None
            found = self.read(self.remotes[name], "num_cached_tokens", name) if cached is not None else None
            if found != cached:
                self.fail(f"{self.title}after step {k}: {name}'s num_cached_tokens is {found!r}, expected "
                          f"{count(cached, 'cached token')}, as allocate set it: postprocess grows "
                          f"num_computed_tokens, never num_cached_tokens (p06 counts a request's cached prefix from it)",
                          "cached-prefix-is-computed")
        self.check_state(k, finished_names)
        over = self.scheduler.is_finished()
        if over is not self.model.finished():
            left = [*self.queue("waiting"), *self.queue("running")]
            self.fail(f"{self.title}after step {k}: is_finished() is {self.shown(over)}, expected "
                      f"{self.model.finished()}: " + (f"{ids(left)} still wait or run" if left else
                                                       "no request waits or runs"), "is-finished")
        return names, is_prefill, finished_names

    def expect_blocks_held_rightly(self, at: str) -> None:
        """After schedule no free block is in a waiting or running request's table, and a block two requests hold
        holds the same full prefix for both: a block goes back on the free list only through BlockManager.free,
        when no request holds it any more."""
        try:
            free = set(self.scheduler.block_manager.free_block_ids)
        except LearnerError:
            raise
        except Exception as error:  # noqa: BLE001
            raise LearnerError(f"reading block_manager.free_block_ids raised {type(error).__name__}: {error}") from None
        live = {name: self.request(name) for name in [*self.queue("waiting"), *self.queue("running")]}
        note = (f" ({ids(sorted(self.facts.preempted))} preempted in this step: a preemption gives its blocks back "
                f"through BlockManager.free, which frees a shared block only when its ref_count falls to 0)"
                if self.facts.preempted else "")
        for name, seen in live.items():
            held = [block for block in seen.table if block in free]
            if held:
                self.fail(f"{at}: after schedule, block {held[0]} is in block_manager.free_block_ids, but it is in "
                          f"{name}'s block table {seen.table}{note}", "blocks-accounted")
        self.expect_shared_prefixes(f"{at}: after schedule", live, note)

    def expect_shared_prefixes(self, where: str, live: dict, note: str = "") -> None:
        """A block held by several requests (a prefix-cache hit) is full and holds the same tokens for each."""
        owners: dict[int, list[tuple[str, int]]] = {}
        for name, seen in live.items():
            for j, block in enumerate(seen.table):
                owners.setdefault(block, []).append((name, j))
        for block, holders in owners.items():
            prefixes = {(j, tuple(live[name].tokens[: (j + 1) * self.size])) for name, j in holders}
            full = all(len(live[name].tokens) >= (j + 1) * self.size for name, j in holders)
            if len(holders) > 1 and (len(prefixes) > 1 or not full):
                self.fail(f"{where}: block {block} is shared by {ids(name for name, _ in holders)}, which do not have "
                          f"the same full prefix up to its end{note}", "blocks-accounted")

    def run_to_the_end(self, sampled=None, most: int = 60) -> None:
        while not self.model.finished():
            if self.step_number >= most:
                raise RuntimeError("the model did not finish: the check's case is wrong")
            self.step(sampled)
        self.check_finished()

    def expect_sealed(self, at: str, name: str, table: list[int]) -> None:
        """A block a decode token fills is sealed (a hash other than -1), as the model's is: the prefix cache serves
        it."""
        if not table:
            return  # the comparison of its blocks says what is wrong
        try:
            sealed = self.scheduler.block_manager.blocks[table[-1]].hash
        except LearnerError:
            raise
        except Exception as error:  # noqa: BLE001
            raise LearnerError(f"reading block_manager.blocks[{table[-1]}].hash raised {type(error).__name__}: "
                               f"{error}") from None
        if sealed == -1:
            self.fail(f"{at}: {name}'s decode token fills its block {table[-1]}, whose hash is still -1: the token "
                      f"goes back through BlockManager.append, which seals the block it fills so that the prefix "
                      f"cache can serve it to a later request", "decode-takes-a-slot")

    # -- reading the learner's side --
    def shown(self, value) -> str:
        text = repr(value)
        return text if len(text) <= 60 else text[:57] + "..."

    def name_of(self, remote, where: str) -> str:
        name = self.names.get(id(remote)) if isinstance(remote, Remote) else None
        if name is None:  # no mistake is named from it: a replay cannot tell one foreign object from another
            preempted = "waiting" in where and self.facts.preempted
            raise LearnerError(f"{where} holds {self.shown(remote)}, which is not one of the requests add() "
                               f"returned: keep the Request objects add() made and move those, never copies or new "
                               f"ones (their caller holds them)" + (
                                   f"; {ids(sorted(self.facts.preempted))} preempted in this step: preempt resets "
                                   f"the request itself and puts it back on the left of waiting" if preempted else "")
                               + steps_so_far(self.history), rule="preempt-resets" if preempted else "-")
        return name

    def read(self, remote, field: str, name: str):
        try:
            value = getattr(remote, field)
        except LearnerError:
            raise
        except Exception as error:  # noqa: BLE001 - the attributes are the given Request's
            raise LearnerError(f"reading {name}'s `{field}` raised {type(error).__name__}: {error}") from None
        if field in ("token_ids", "block_table"):
            if not isinstance(value, list | tuple):
                self.fail(f"{name}'s {field} is {self.shown(value)}, expected a list", "-")
            return list(value)
        if field in ("num_scheduled_tokens", "num_computed_tokens") and type(value) is not int:
            self.fail(f"{name}'s {field} is {self.shown(value)}, expected an int", "-")
        return value

    def queue(self, field: str) -> list[str]:
        try:
            items = list(getattr(self.scheduler, field))
        except LearnerError:
            raise
        except Exception as error:  # noqa: BLE001
            raise LearnerError(f"reading the scheduler's `{field}` raised {type(error).__name__}: {error}") from None
        return [self.name_of(r, f"after step {self.step_number}: {field}") for r in items]

    def request(self, name: str) -> Seen:
        r = self.remotes[name]
        return Seen(self.read(r, "token_ids", name), self.read(r, "block_table", name),
                    self.read(r, "num_computed_tokens", name), self.read(r, "status", name))

    def blocks(self) -> tuple[list[int], list[int], list[int]]:
        """(free_block_ids in order, used_block_ids sorted, ref_count of each block: read from the manager for
        every block that is not simply free, 0 for a free one, which no request may hold)."""
        try:
            manager = self.scheduler.block_manager
            free, used = list(manager.free_block_ids), sorted(manager.used_block_ids)
            simply_free = set(free) - set(used)  # one read per block is the slow part of a step
            refs = [0 if b in simply_free else block.ref_count for b, block in enumerate(manager.blocks)]
        except LearnerError:
            raise
        except Exception as error:  # noqa: BLE001
            raise LearnerError(f"reading block_manager's free_block_ids, used_block_ids and blocks raised "
                               f"{type(error).__name__}: {error}") from None
        return free, used, refs

    # -- the rules --
    def batch_rules(self, k: int, batch: list[tuple[str, int]], is_prefill: bool) -> None:
        """What any batch keeps, whatever the state: one kind of work, and the caps."""
        at = f"{self.title}step {k}"  # a toy's messages name its scenario
        source = "waiting" if is_prefill else "running"
        strays = [name for name, _ in batch if name not in self.before[source]]
        were = "was" if len(strays) == 1 else "were"
        if strays and is_prefill:
            again = [name for name in dict.fromkeys(strays)
                     if self.request(name).computed < len(self.request(name).tokens) - 1]
            if again:  # a running request has all its tokens but the last computed: this one lost them in the step
                self.fail(f"{at}: the prefill step {batch_text(batch)} preempted {ids(again)}, running before it "
                          f"(computed tokens reset), and took it again: only a decode step preempts; when the "
                          f"first waiting request cannot get its blocks, the prefill loop ends the step there",
                          "prefill-fills-the-step")
            self.fail(f"{at}: the prefill batch {batch_text(batch)} also decodes {ids(strays)}, which {were} "
                      f"running: a step is prefill or decode, never both", "one-kind-a-step")
        unrun = [name for name in strays if name in self.before["waiting"]
                 and 0 < self.request(name).computed == len(self.request(name).tokens) - 1]
        if unrun:  # sent from waiting to running with only its last token left, as if that were a decode's
            seen = self.request(unrun[0])
            self.fail(f"{at}: the decode batch {batch_text(batch)} holds {unrun[0]}, which was waiting with "
                      f"{seen.computed} of its {count(len(seen.tokens), 'token')} computed: a request leaves waiting "
                      f"only in the prefill step that computes all its tokens, the last one too (the prefix cache "
                      f"never serves it)", "a-chunk-stays-first")
        if strays:
            self.fail(f"{at}: the decode batch {batch_text(batch)} holds {ids(strays)}, which {were} not "
                      f"running: a step is prefill or decode, never both", "one-kind-a-step")
        twice = [name for j, (name, _) in enumerate(batch) if name in {other for other, _ in batch[:j]}]
        if twice and is_prefill and twice[0] in self.facts.completed:  # taken whole, yet still first in waiting
            self.fail(f"{at}: {twice[0]} is twice in the batch {batch_text(batch)}: its scheduled tokens complete it, "
                      f"so it leaves waiting for running in the step that takes it, and the loop goes on to the "
                      f"next request", "complete-prompt-runs")
        if twice:
            self.fail(f"{at}: a request is twice in the batch {batch_text(batch)}", "one-kind-a-step")
        if len(batch) > self.max_num_seqs:
            self.fail(f"{at}: {len(batch)} requests in the batch {batch_text(batch)}, over max_num_seqs "
                      f"{self.max_num_seqs}", "seq-cap")
        idle = [name for name, n in batch if n < 1]
        if idle:
            first = next(i for i, (_, n) in enumerate(batch) if n < 1)
            left = self.budget - sum(n for _, n in batch[:first])  # the budget left when the step took it
            rule = "one-kind-a-step" if not is_prefill else "token-budget" if left < 1 else \
                "cost-is-what-is-not-computed"  # budget was left: its cost came out below 1
            name = batch[first][0]
            if rule == "cost-is-what-is-not-computed" and name not in self.holding:  # its blocks came this step:
                computed = self.request(name).computed  # its progress is what allocate found cached, no more
                cached = self.read(self.remotes[name], "num_cached_tokens", name)
                if isinstance(cached, int) and computed > cached:
                    self.fail(f"{at}: the batch {batch_text(batch)} (request and num_scheduled_tokens) schedules no "
                              f"token for {name}, whose num_computed_tokens is {computed} after allocate found "
                              f"{count(cached, 'cached token')}: a request that gets its blocks starts with "
                              f"num_computed_tokens = num_cached_tokens (a count of tokens), and computes the rest",
                              "cached-prefix-is-computed")
            if rule == "cost-is-what-is-not-computed" and first:  # a later request: did it fit what was left?
                idle_one = self.request(batch[first][0])
                cost = len(idle_one.tokens) - idle_one.computed
                if cost > left:
                    self.fail(f"{at}: the batch {batch_text(batch)} (request and num_scheduled_tokens) holds "
                              f"{batch[first][0]} with no token, whose {count(cost, 'token')} to compute pass the "
                              f"{left} of the budget left: a later request that does not fit whole ends the step, "
                              f"out of its batch", "only-the-first-is-chunked")
            self.fail(f"{at}: the batch {batch_text(batch)} (request and num_scheduled_tokens) schedules no token "
                      f"for {ids(idle)}: every request in a batch computes at least 1 token"
                      + f" ({left} of the budget was left)" * (rule == "cost-is-what-is-not-computed"), rule)
        total = sum(n for _, n in batch)
        if is_prefill and total > self.budget:
            self.fail(f"{at}: the prefill batch {batch_text(batch)} computes {total} tokens, over "
                      f"max_num_batched_tokens {self.budget}", "token-budget")
        if not is_prefill and any(n != 1 for _, n in batch):
            self.fail(f"{at}: the decode batch {batch_text(batch)} (request and num_scheduled_tokens) must "
                      f"schedule 1 token per request", "one-kind-a-step")

    def check_state(self, k: int, finished: list[str]) -> None:
        waiting, running = self.queue("waiting"), self.queue("running")
        free, used, refs = self.blocks()
        live = {name: self.request(name) for name in [*waiting, *running]}
        where = f"{self.title}after step {k}"
        n = len(refs)
        if len(set(free)) != len(free) or set(free) & set(used) or set(free) | set(used) != set(range(n)):
            self.fail(f"{where}: block_manager's free_block_ids {free} and used_block_ids {used} are not a partition "
                      f"of its {count(n, 'block')}", "blocks-accounted")
        for name in finished:
            table = self.read(self.remotes[name], "block_table", name)
            if table:
                self.fail(f"{where}: {name} has finished but still holds blocks {table}: free them", "finished-leaves")
        for name in self.done:
            if name in live:
                self.fail(f"{where}: {name} has finished but is still in {'waiting' if name in waiting else 'running'}",
                          "finished-leaves")
        for name, seen in live.items():  # postprocess gives no slot: the token's slot comes with the next decode
            table = self.scheduled_tables.get(name)
            if table is not None and seen.table != table:
                self.fail(f"{where}: postprocess changed {name}'s block_table from {table} to {seen.table}: it only "
                          f"appends the sampled token to token_ids, and the next decode step gives that token its "
                          f"slot", "postprocess-appends-the-token")
        model_live = {r.name: q for q in ("waiting", "running") for r in getattr(self.model, q)}
        for name, queue in model_live.items():  # a request the model still serves, lost from both queues here
            if name not in live and name not in finished and name in self.before["waiting"] + self.before["running"]:
                # a request the model preempted: did preempt run on it (its blocks freed) and then lose it, or not?
                held = self.read(self.remotes[name], "block_table", name) if name in self.facts.preempted else []
                kept = bool(held)
                self.fail(f"{where}: {name} is in neither waiting nor running, but it has not finished (expected in "
                          f"{queue}): a step puts every request it takes back in a queue" + (
                              f"; it still holds blocks {held}, so it was never preempted: a request that finds no "
                              f"slot with no other left to preempt preempts itself" if kept else ""),
                          "running-in-start-order" if name in self.before["running"] and queue == "running"
                          else "complete-prompt-runs" if name in self.facts.completed and queue == "running"
                          else "a-chunk-stays-first" if name in self.facts.chunked and queue == "waiting"
                          else "preempt-the-newest" if kept
                          else "preempted-come-back-first" if name in self.facts.preempted else "waiting-in-order")
        owners: dict[int, list[tuple[str, int]]] = {}
        for name, seen in live.items():
            for j, block in enumerate(seen.table):
                if not 0 <= block < n:
                    self.fail(f"{where}: {name}'s block table {seen.table} holds {block}, which is not a block",
                              "blocks-accounted")
                owners.setdefault(block, []).append((name, j))
        # a preemption whose only miscounted blocks are still held by others gave back its own but not its share
        miscounted = [block for block in range(n) if refs[block] != len(owners.get(block, []))]
        shares_kept = bool(self.facts.preempted) and all(block in owners for block in miscounted)
        for block in range(n):
            holders = ids(name for name, _ in owners.get(block, []))
            if block in free and block in owners:
                self.fail(f"{where}: block {block} is in block_manager.free_block_ids, but it is in the block table "
                          f"of {holders}", "blocks-accounted")
            if refs[block] != len(owners.get(block, [])):
                held = len(owners.get(block, []))
                by = f"the block tables of {count(held, 'waiting or running request')} hold it: {holders}" if held \
                    else "no waiting or running request's block table holds it"
                self.fail(f"{where}: block_manager.blocks[{block}].ref_count is {refs[block]}, but {by}" + (
                    f" ({ids(sorted(self.facts.preempted))} preempted in this step: BlockManager.free lowers a shared "
                    f"block's ref_count by one for each request that lets it go)" if shares_kept else ""),
                          "blocks-accounted" if shares_kept or not self.facts.preempted else "preempt-resets")
        for block, holders in owners.items():
            twice = len({name for name, _ in holders}) < len(holders)
            if twice and {name for name, _ in holders} & self.holding:
                self.fail(f"{where}: block {block} is held twice by {ids(name for name, _ in holders)}: a request "
                          f"that holds its blocks already (a chunk) is not allocated again, and keeps its progress",
                          "cached-prefix-is-computed")
        self.expect_shared_prefixes(where, live)
        for name, seen in live.items():
            queue, status = ("running", RUNNING) if name in running else ("waiting", WAITING)
            if seen.status != status and queue == "running" and name in self.facts.chunked:
                self.fail(f"{where}: {name} is in running with its status {seen.status!r}, but its prompt is not "
                          f"complete (a chunk): a chunk stays first in waiting, and only a request whose tokens are "
                          f"all computed moves to running", "a-chunk-stays-first")
            if seen.status != status:
                self.fail(f"{where}: {name} is in {queue} but its status is {seen.status!r}, expected {status!r}",
                          "preempt-resets" if name in self.facts.preempted else "status-follows-queue")
            if name in running and self.follow_model and name in self.facts.preempted and \
                    model_live.get(name) == "waiting":  # the step's victim (by the model) was never sent back
                self.fail(f"{where}: {name} is still in running, holding blocks {seen.table}, where the step "
                          f"preempts it: the newest running request goes while one finds no slot, the request itself "
                          f"when no other is left (whatever waits)", "preempt-the-newest")
            if name in running and self.follow_model:  # postprocess appends by the computed count: it goes first
                self.expect_computed(where, name, seen.computed)
            if name in running and self.follow_model and seen.tokens != self.models[name].tokens:
                mine = self.models[name].tokens  # a token too many or too few: the blocks it holds follow from them
                self.fail(f"{where}: {name}'s token_ids is {differing(seen.tokens, mine)}",
                          self.tokens_rule(name, seen.tokens, mine))
            if name in running:
                need = -(-(len(seen.tokens) - 1) // self.size)  # every token but the last, sampled last step
                if len(seen.table) != need:
                    self.fail(f"{where}: running {name} has {count(len(seen.tokens), 'token')} in "
                              f"{count(len(seen.table), 'block')} {seen.table}, expected {count(need, 'block')} of "
                              f"{self.size} tokens (a slot for every token but the last, which the step just sampled)",
                              "blocks-accounted" if self.facts.prefill else "decode-takes-a-slot")
            elif seen.table and len(seen.table) != -(-len(seen.tokens) // self.size):
                need = -(-len(seen.tokens) // self.size)
                self.fail(f"{where}: waiting {name} has {count(len(seen.tokens), 'token')} in "
                          f"{count(len(seen.table), 'block')} {seen.table}, expected {count(need, 'block')} of "
                          f"{self.size} tokens (a slot for every token, allocated before its prefill)"
                          + (": it held its blocks before this step and was given more, as if allocated again"
                             if name in self.holding and len(seen.table) > need else ""),
                          "preempt-resets" if name in self.facts.preempted else
                          "cached-prefix-is-computed" if name in self.holding and len(seen.table) > need else
                          "blocks-accounted")
            elif not seen.table and seen.computed != 0:
                self.fail(f"{where}: waiting {name} holds no blocks but has num_computed_tokens {seen.computed}, "
                          f"expected 0 computed tokens (its K/V is gone with its blocks)",
                          "only-the-first-is-chunked" if self.models[name].table and name not in self.facts.preempted
                          else "preempt-resets")
        if not self.follow_model:
            return
        model = self.model
        for field, got, want in (("waiting", waiting, [r.name for r in model.waiting]),
                                 ("running", running, [r.name for r in model.running])):
            if got != want:
                self.fail(f"{where}: {field} is {ids(got)}, expected {ids(want)}",
                          self.queue_rule(field, got, want, free))
        if free != model.cache.free:
            early = [name for name in waiting if not self.models[name].table and name not in self.facts.preempted
                     and live[name].table] if sorted(free) != sorted(model.cache.free) else []
            tried = self.facts.tried_free == free and not early
            self.fail(f"{where}: block_manager.free_block_ids is {differing(free, model.cache.free)}" + (
                f": waiting {early[0]} holds blocks {live[early[0]].table}, but the step did not take it: a prefill "
                f"step checks max_num_seqs and the budget left before it allocates the next request"
                if early else "") + (
                f": as if the step had allocated waiting {self.facts.refused}, which does not fit the free blocks, "
                f"and given them back: ask can_allocate first, and end the step where it says no" if tried else ""),
                "prefill-fills-the-step" if tried else self.free_rule(free, model.cache.free))
        for name, seen in live.items():
            mine = self.models[name]
            self.expect_computed(where, name, seen.computed)  # first: postprocess appends a token or not by it
            if seen.tokens != mine.tokens:
                self.fail(f"{where}: {name}'s token_ids is {differing(seen.tokens, mine.tokens)}",
                          self.tokens_rule(name, seen.tokens, mine.tokens))
            if seen.table != mine.table:
                self.fail(f"{where}: {name}'s block_table is {differing(seen.table, mine.table)}",
                          self.table_rule(name))
            if seen.status != mine.status:
                self.fail(f"{where}: {name}'s status is {seen.status!r}, expected {mine.status!r}",
                          "preempt-resets" if name in self.facts.preempted else "status-follows-queue")
        for name in finished:
            status = self.read(self.remotes[name], "status", name)
            if status != FINISHED:
                self.fail(f"{where}: {name} has finished but its status is {status!r}, expected {FINISHED!r}",
                          "finished-leaves")
            computed = self.read(self.remotes[name], "num_computed_tokens", name)
            if computed != self.models[name].computed:  # its blocks are freed, its count stays as the step left it
                self.fail(f"{where}: finished {name}'s num_computed_tokens is {computed!r}, expected "
                          f"{count(self.models[name].computed, 'computed token')}: postprocess adds the step's "
                          f"tokens to every request of the batch, a finished one's too", "computed-grows-by-the-step")

    def check_finished(self) -> None:
        """At the end: nothing waits or runs, and every request has exactly the model's completion tokens."""
        waiting, running = self.queue("waiting"), self.queue("running")
        if waiting or running:
            self.fail(f"at the end: waiting {ids(waiting)} and running {ids(running)}, expected both empty",
                      "finished-leaves")
        for name, mine in self.models.items():
            tokens = self.read(self.remotes[name], "token_ids", name)
            got, want = tokens[mine.prompt_len :], mine.tokens[mine.prompt_len :]
            if got != want:
                self.fail(f"at the end: {name}'s completion tokens are {got}, expected {want}",
                          "postprocess-appends-the-token")

    # -- helpers --
    def tokens_for(self, names: list[str], sampled) -> list[int]:
        if sampled is None:
            return [9] * len(names)
        if isinstance(sampled, dict):
            return [sampled.get(name, 9) for name in names]
        if callable(sampled):
            return [sampled() for _ in names]
        if len(sampled) != len(names):  # the learner's batch is not the toy's; the model check said why
            self.fail(f"step {self.step_number}: the batch has {count(len(names), 'request')}, the toy samples "
                      f"{count(len(sampled), 'token')}")
        return list(sampled)

    def expect(self, what: str, got, want, unit: str = "", why: str = "") -> None:
        """A rule stated by hand in a check (beside the model's): `what` names the thing, e.g. "after step 2:
        waiting"; a list of request names reads [A, B]; `unit` says what a number counts ("computed token");
        `why` is the rule, said after the values."""
        if got == want:
            return
        because = f" ({why})" if why else ""
        both = [*got, *want] if isinstance(got, list | tuple) and isinstance(want, list) else [0]
        if all(isinstance(x, str) for x in both):  # request names
            self.fail(f"{what} is {ids(got)}, expected {ids(want)}{because}")
        shown = count(want, unit) if unit and isinstance(want, int) else want
        self.fail(f"{what} is {got}, expected {shown}{because}")

    def expect_queues(self, k: int, waiting: list[str], running: list[str]) -> None:
        """Both queues after step `k`, in order, stated by hand in a check."""
        self.expect(f"after step {k}: waiting", self.queue("waiting"), waiting)
        self.expect(f"after step {k}: running", self.queue("running"), running)

    def expect_step(self, k: int, names: list[str], is_prefill: bool, want: list[str], want_prefill: bool) -> None:
        """The kind of step `k` and its requests, stated by hand in a check."""
        if (names, is_prefill) != (want, want_prefill):
            kind, wanted = ("prefill" if is_prefill else "decode"), ("prefill" if want_prefill else "decode")
            self.fail(f"step {k}: the batch is {kind} {ids(names)}, expected {wanted} {ids(want)}")

    def expect_batch(self, k: int, want: list[tuple[str, int]]) -> None:
        """The batch of step `k` (the last one), stated by hand in a check."""
        if self.last_batch != want:
            self.fail(f"step {k}: the batch is {batch_text(self.last_batch)} (request and num_scheduled_tokens), "
                      f"expected {batch_text(want)}")

    def fail(self, text: str, rule: str = "") -> None:
        """Stop the check at a difference; `rule`: the id of the contract's rule it breaks (the catalogue's RULES)."""
        raise Mismatch(text + steps_so_far(self.history), rule)

    # -- which rule a difference from the model breaks (the state was the model's when the step began) --
    def batch_rule(self, seen: list, is_prefill: bool, want: list, want_prefill: bool) -> str:
        names, wanted = [n for n, _ in seen], [n for n, _ in want]
        if want_prefill and wanted[0] in self.facts.chunked and wanted[0] not in names and \
                self.read(self.remotes[wanted[0]], "num_scheduled_tokens", wanted[0]) == want[0][1]:
            return "token-budget"  # the first request was cut to the budget, and then left out of the batch
        if self.unrun(names, want):
            return "a-chunk-stays-first"  # left waiting for running although the step computed none of it
        if is_prefill != want_prefill:
            return "prefill-before-decode"
        if not is_prefill:
            if sorted(names) == sorted(wanted):
                return "running-in-start-order"
            if set(names) & set(self.queue("waiting")):  # decoded, yet sent back in the same step: the loop
                return "preempt-the-newest"  # preempted one request and went on with it (or its victim) as the other
            if self.kept_blocks("waiting", lambda name: name in self.before["running"]) or self.leaked():
                return "preempt-resets"  # a request sent back still holds its blocks, or they went nowhere
            running = self.queue("running")
            if names == wanted[: len(names)] and all(name in running for name in wanted[len(names):]):
                return "decode-takes-the-running"  # the step stopped short: the rest still run, undecoded
            sent_back = {name for name in self.queue("waiting") if name in self.before["running"]}
            if sent_back and not self.facts.preempted:  # it found no room where there was
                # several sent back at once, or the newest alone while a block stayed free after every slot the step
                # took (no slot count can miss there): preempted while there was room (the loop's test), not one slot
                # miscounted
                spare = len(self.free_before) > len(self.facts.taken)
                newest = sent_back == set(self.before["running"][-1:])
                return "preempt-the-newest" if len(sent_back) > 1 or spare and newest else "decode-takes-a-slot"
            return "preempt-the-newest" if self.facts.preempted or set(names) - set(wanted) else \
                "decode-takes-the-running"
        if names and wanted and names[0] == wanted[0] and seen[0] != want[0]:  # the first request's count
            first, cached = names[0], self.facts.allocated.get(names[0], 0)
            if first in self.facts.chunked and want[0][1] == self.budget and seen[0][1] < want[0][1]:
                return "token-budget"  # cut to less than the whole budget, which the model's chunk takes
            if seen[0][1] < want[0][1] and self.queue("waiting")[:1] == [first]:
                return "token-budget"  # cut short and kept as a chunk: it counted a smaller budget than there was
            tokens, table = self.request(first).tokens, self.request(first).table
            if len(table) > -(-len(tokens) // self.size):  # more blocks than its tokens need: given blocks twice;
                # allocated again although it held its blocks (a chunk): its progress is set again too
                return "cached-prefix-is-computed" if first in self.holding else "blocks-accounted"
            if cached and seen[0][1] == want[0][1] + cached:
                return "cached-prefix-is-computed"
            if self.read(self.remotes[first], "num_computed_tokens", first) != self.models[first].computed:
                return "cached-prefix-is-computed"  # its progress set otherwise: from what allocate found, or
                # again although it held its blocks already
            return "cost-is-what-is-not-computed"
        if names == wanted:
            return "only-the-first-is-chunked"  # a later request's count differs
        if names == wanted[: len(names)]:
            return "prefill-fills-the-step"
        if wanted == names[: len(wanted)]:
            name, n = seen[len(wanted)]
            if name == self.facts.refused:  # admitted where can_allocate says no (allocated on its cache hits)
                return "prefill-fills-the-step"
            whole = len(self.models[name].tokens) - self.models[name].computed
            return "only-the-first-is-chunked" if n < whole else "prefill-fills-the-step"
        return "waiting-in-order"

    def unrun(self, names: list[str], want: list) -> list[str]:
        """The requests the model's prefill takes and the learner's leaves out, yet moved from waiting to running."""
        running = self.queue("running")
        return [n for n, _ in want if n not in names and n in self.before["waiting"] and n in running]

    def queue_rule(self, field: str, got: list[str], want: list[str], free: list[int] | None = None) -> str:
        """The rule a queue that differs from the model's breaks; `free`, the manager's free list in order, where read
        (the order the victims of a step gave their blocks back in)."""
        f = self.facts
        twice = [name for i, name in enumerate(got) if name in got[:i]]
        if twice:  # a request queued again where it stood already
            name = twice[0]
            return "a-chunk-stays-first" if name in f.chunked else "preempted-come-back-first" if name in \
                f.preempted else "complete-prompt-runs" if field == "running" else "waiting-in-order"
        if sorted(got) == sorted(want):  # the same requests in another order
            if field == "running":
                return "running-in-start-order"
            i = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            k = len(f.preempted)
            if field == "waiting" and k > 1 and set(got[:k]) == set(want[:k]) == f.preempted:
                # every victim put back first, in another order: taken in another order, unless their blocks came
                # back in the model's order (taken in that order, then queued in another by preempt)
                return "preempted-come-back-first" if free == self.model.cache.free else "preempt-the-newest"
            if want[i] in f.chunked:  # the model's chunk stands first; here another request is ahead of it
                return "a-chunk-stays-first"
            return "preempted-come-back-first" if {got[i], want[i]} & f.preempted else "waiting-in-order"
        extra, missing = set(got) - set(want), set(want) - set(got)
        if field == "waiting":
            for name in sorted(missing):
                if name in f.chunked:
                    return "a-chunk-stays-first"
                if name in f.preempted:  # still running here: never preempted; elsewhere: not put back first
                    return "preempt-the-newest" if name in self.queue("running") else "preempted-come-back-first"
            for name in sorted(extra):
                if name in f.completed:
                    return "complete-prompt-runs"
                if name in f.finished:
                    return "finished-leaves"
                return "preempt-the-newest"
            return "waiting-in-order"
        return "finished-leaves" if extra & f.finished or extra - set(self.before["running"]) - f.completed else \
            "running-in-start-order"

    def expect_computed(self, where: str, name: str, computed) -> None:
        want = self.models[name].computed
        if computed != want:
            self.fail(f"{where}: {name}'s num_computed_tokens is {computed!r}, expected "
                      f"{count(want, 'computed token')}", self.computed_rule(name, computed, want))

    def finished_rule(self, got: list[str], want: list[str]) -> str:
        """Finished otherwise than the model: from tokens that already differ, or by the stop rules."""
        if sorted(got) == sorted(want):
            return "finished-leaves"  # the same requests, in another order than the batch's
        batch = [name for name, _ in self.last_batch]
        after = batch[batch.index(got[-1]) + 1 :] if got and got[-1] in batch else []
        if after and all(self.read(self.remotes[name], "num_computed_tokens", name) != self.models[name].computed
                         for name in after):  # postprocess stopped at a finished request: the rest went untouched
            return "finished-leaves"
        for name in sorted(set(got) ^ set(want)):
            computed = self.read(self.remotes[name], "num_computed_tokens", name)
            if computed != self.models[name].computed:  # postprocess appends, and so finishes, by the computed count
                return self.computed_rule(name, computed, self.models[name].computed)
            tokens = self.read(self.remotes[name], "token_ids", name)
            if tokens != self.models[name].tokens:
                return self.tokens_rule(name, tokens, self.models[name].tokens)
            prompt = self.read(self.remotes[name], "num_prompt_tokens", name)
            if name in self.ever_preempted and prompt != self.models[name].prompt_len:
                return "preempt-resets"  # its completion tokens were counted as prompt after the preemption
        missing = [name for name in want if name not in got]
        if missing and set(got) <= set(want) and all(
                self.read(self.remotes[name], "status", name) == FINISHED for name in missing):
            return "finished-leaves"  # they did finish (status FINISHED), and were left out of the list returned
        return "finish-on-eos-or-max-tokens"

    def leaked(self) -> bool:
        """Whether a block is used that no waiting or running request's block table holds."""
        held = {b for field in ("waiting", "running") for name in self.queue(field)
                for b in self.read(self.remotes[name], "block_table", name)}
        return bool(set(self.blocks()[1]) - held)

    def kept_blocks(self, field: str, which) -> bool:
        """Whether a request of the learner's `field` that `which` accepts holds blocks."""
        return any(which(name) and self.read(self.remotes[name], "block_table", name) for name in self.queue(field))

    def free_rule(self, free: list[int], want: list[int]) -> str:
        f = self.facts
        if sorted(free) != sorted(want):
            if self.kept_blocks("waiting", lambda name: not self.models[name].table and name not in f.preempted):
                # blocks for a request the step did not get to: it went on too far, past the seats or the budget
                return "seq-cap" if len(f.chunked | f.completed) >= self.max_num_seqs else "prefill-fills-the-step"
            freed = set(free) - set(want)  # free here, held in the model: by whom?
            if not f.prefill and freed & f.taken:
                return "decode-takes-a-slot"  # the block the model's decode step opened is still free here
            if any(freed & set(r.table) for r in self.model.waiting if r.name not in f.preempted):
                if set(free[: len(freed)]) == freed:  # still at the front, never taken: the step stopped before it
                    return "prefill-fills-the-step"  # gave the next request its blocks, budget and seats left
                return "only-the-first-is-chunked"  # the request that ended the step keeps the blocks it got
            if f.preempted:
                return "preempt-resets"
            if f.finished:
                return "finished-leaves"
        elif not f.prefill and f.taken and not f.preempted:
            return "decode-takes-a-slot"  # the same blocks in another order: the step's take of a block went elsewhere
        return "blocks-accounted"

    def tokens_rule(self, name: str, got: list[int], want: list[int]) -> str:
        if name in self.facts.preempted:
            return "preempt-resets"
        if name in self.facts.chunked and len(got) > len(want):
            return "a-chunk-stays-first"
        if not self.facts.prefill and len(got) > len(want):
            return "decode-takes-a-slot"
        return "postprocess-appends-the-token"

    def table_rule(self, name: str) -> str:
        if name in self.facts.preempted:
            return "preempt-resets"
        return "blocks-accounted" if self.facts.prefill else "decode-takes-a-slot"

    def computed_rule(self, name: str, got: int, want: int) -> str:
        if name in self.facts.preempted:
            return "preempt-resets"
        cached = self.facts.allocated.get(name, 0)
        return "cached-prefix-is-computed" if cached and got == want - cached else "computed-grows-by-the-step"


HISTORY_CHARACTERS = 300  # the steps a message recalls: the first two (the first requests), then the latest


def steps_so_far(history: list[str]) -> str:
    if not history:
        return ""
    text = "; ".join(history)
    if len(text) > HISTORY_CHARACTERS:
        head, tail = "; ".join(history[:2]), []
        for entry in reversed(history[2:]):
            if len(head) + sum(len(t) + 2 for t in tail) + len(entry) > HISTORY_CHARACTERS:
                break
            tail.insert(0, entry)
        text = head + "; …; " + "; ".join(tail) if tail else head + "; …"
    return f" · steps: {text}"


# a repr such as <kvlab_impl_0.p05_scheduler.Request object at 0x7f…>
OBJECT_REPR = re.compile(r"<(?:\w+\.)*(\w+) object at 0x[0-9a-f]+>")


def with_history(method):
    """A crash of the learner's code inside a step carries the steps so far, in words, on its one line too; one in
    p01's file says that the scheduler reached it through the BlockManager."""

    def run(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except LearnerError as error:
            text = str(error)
            if " · steps: " in text or "did not return within" in text or "hung in an earlier" in text:
                raise
            text = OBJECT_REPR.sub(r"<\1 object>", text)  # the worker's package name and address say nothing
            if "p01_block_manager.py line" in text:
                text += " · in the p01 BlockManager your scheduler calls (./check.sh p01 checks it on its own)"
            raise LearnerError(text + steps_so_far(self.history), error.identifiable, rule=error.rule) from None

    return run


for _name in ("add", "step", "check_finished"):
    setattr(Driver, _name, with_history(getattr(Driver, _name)))


# ---- the toy --------------------------------------------------------------------------------------------


def play_toy(impl, scenario: dict) -> None:
    d = Driver(impl, scenario["num_blocks"], scenario["block_size"], scenario["max_num_seqs"],
               scenario["max_num_batched_tokens"], scenario["eos_token_id"], follow_model=False)
    d.title = f"scenario '{scenario['name']}', "
    prompts = {}
    for step in scenario["steps"]:
        for request in step.get("add", []):
            d.add(request["id"], request["prompt"], request["max_tokens"], request.get("ignore_eos", False))
            prompts[request["name"]] = request["prompt"]
        k = step["step"]
        _, _, finished = d.step(step["sampled"], toy=step)
        where = f"{d.title}after step {k}"
        for field, got, want in (("finished", finished, step["finished"]),
                                 ("waiting", d.queue("waiting"), step["waiting"]),
                                 ("running", d.queue("running"), step["running"])):
            if got != want:
                d.fail(f"{where}: {'the finished requests are' if field == 'finished' else field + ' is'} "
                       f"{ids(got)}, expected {ids(want)}",
                       d.finished_rule(got, want) if field == "finished" else d.queue_rule(field, got, want))
        free = d.blocks()[0]
        if free != step["free"]:
            d.fail(f"{where}: block_manager.free_block_ids is {differing(free, step['free'])}",
                   d.free_rule(free, step["free"]))
        for name, table in step["block_tables"].items():
            seen = d.request(name)
            if seen.table != table:
                d.fail(f"{where}: {name}'s block_table is {seen.table}, expected {table}", d.table_rule(name))
            if seen.computed != step["num_computed_tokens"][name]:
                d.fail(f"{where}: {name}'s num_computed_tokens is {seen.computed}, expected "
                       f"{count(step['num_computed_tokens'][name], 'computed token')}",
                       d.computed_rule(name, seen.computed, step["num_computed_tokens"][name]))
            want = d.models[name].tokens  # the prompt and the tokens the step's sampled list gave it, as the model has
            if seen.tokens != want:
                d.fail(f"{where}: {name}'s token_ids is {differing(seen.tokens, want)}",
                       d.tokens_rule(name, seen.tokens, want))
    for name, want in scenario["completions"].items():
        tokens = d.request(name).tokens
        if tokens[len(prompts[name]) :] != want:
            d.fail(f"{d.title}at the end: {name}'s completion tokens are {tokens[len(prompts[name]):]}, "
                   f"expected {want}", "postprocess-appends-the-token")


@pytest.mark.parametrize("scenario", TOY["scenarios"], ids=lambda s: s["name"])
def test_toy_scenario(impl, scenario):
    """the page's toy scenarios: batch, queues, free list, block tables, computed tokens and token_ids after each
    step"""
    play_toy(impl, scenario)


# ---- one rule, one case ----------------------------------------------------------------------------------


def test_prefill_comes_before_decode(impl):
    """a step with a request waiting is a prefill step: a running request is decoded only when nothing waits"""
    d = Driver(impl, 8, 4, 4, 16)
    d.add(0, [1, 2, 3], 3)
    d.step()  # prefill [A 3]; A runs
    d.add(1, [4, 5], 2)
    names, is_prefill, _ = d.step()  # B waits: prefill [B 2], A is not decoded
    d.expect_step(2, names, is_prefill, ["B"], True)
    names, is_prefill, _ = d.step()  # nothing waits: decode [A 1, B 1]
    d.expect_step(3, names, is_prefill, ["A", "B"], False)
    d.run_to_the_end()


def test_a_step_never_mixes_prefill_and_decode(impl):
    """a prefill step holds no decode, even with budget and seats left over"""
    d = Driver(impl, 8, 4, 4, 6)
    d.add(0, [1, 2], 4)
    d.step()  # prefill [A 2]
    d.add(1, [10, 11, 12, 13, 14, 15, 16, 17], 2)
    d.step()  # B costs 8 > 6: prefill [B 6], a chunk
    names, is_prefill, _ = d.step()  # B's last 2 tokens: 4 tokens and 3 seats are left, but A is not decoded
    d.expect_step(3, names, is_prefill, ["B"], True)
    d.run_to_the_end()


def test_the_token_budget_is_never_exceeded(impl):
    """a prompt longer than max_num_batched_tokens is prefilled in chunks of at most the budget"""
    d = Driver(impl, 8, 4, 4, 4)
    d.add(0, list(range(1, 11)), 1)  # 10 tokens, a budget of 4
    d.add(1, [20, 21, 22], 1)
    for k, want in ((1, [("A", 4)]), (2, [("A", 4)]), (3, [("A", 2)]), (4, [("B", 3)])):
        d.step()  # A in chunks of 4, 4, 2 (B's 3 do not fit the 2 left at step 3), then B
        d.expect_batch(k, want)
    d.check_finished()


def test_max_num_seqs_caps_every_step(impl):
    """no step, prefill or decode, holds more than max_num_seqs requests"""
    d = Driver(impl, 10, 2, 2, 16)
    for i in range(4):  # four that fit the budget: a cap one off and no cap at all take different batches
        d.add(i, [i + 1], 2)
    names, _, _ = d.step()  # prefill: only A and B, 2 seats
    d.expect("step 1: the batch", names, ["A", "B"])
    d.step()  # prefill [C 1, D 1]
    names, _, _ = d.step()  # decode: A and B again, C and D wait their turn in running
    d.expect("step 3: the batch", names, ["A", "B"])
    d.run_to_the_end()
    d = Driver(impl, 10, 4, 1, 4)  # 1 seat, a budget of 4: a chunked prompt's later chunks take the seat too
    d.add(0, list(range(1, 11)), 1)
    d.add(1, [20, 21], 1)
    d.step()  # prefill [A 4]: A gets its blocks
    d.step()  # prefill [A 4]: A holds its blocks
    names, _, _ = d.step()  # prefill [A 2]: budget is left for B, but not a seat
    d.expect("step 3: the batch", names, ["A"])
    d.run_to_the_end()


def test_a_decode_step_is_bounded_by_max_num_seqs_not_the_token_budget(impl):
    """a decode step takes every running request up to max_num_seqs, even more of them than the token budget, and
    the requests it preempts take no seat"""
    d = Driver(impl, 4, 4, 4, 2)  # a budget of 2 tokens, 4 seats
    for i in range(3):
        d.add(i, [i + 1], 2)
    d.step()  # prefill [A 1, B 1]: the budget is spent
    d.step()  # prefill [C 1]
    d.step()  # decode: 3 requests, 3 tokens over a budget of 2, which bounds prefill steps only
    d.expect_batch(3, [("A", 1), ("B", 1), ("C", 1)])
    d.check_finished()
    d = Driver(impl, 4, 2, 2, 16)  # 4 blocks of 2, 2 seats
    for i in range(4):
        d.add(i, [2 * i + 1, 2 * i + 2], 3)
    d.step()  # prefill [A 2, B 2]
    d.step()  # prefill [C 2, D 2]: no block is free
    d.step()  # decode: A preempts D, B preempts C; the 2 seats are A's and B's, whatever was preempted for them
    d.expect_batch(3, [("A", 1), ("B", 1)])
    d.expect_queues(3, waiting=["C", "D"], running=["A", "B"])
    d.run_to_the_end()


def test_a_cached_prefix_costs_nothing(impl):
    """a request's cached prefix counts as computed: only the tokens after it cost budget, and a cached block it
    shares takes no free block"""
    d = Driver(impl, 8, 4, 4, 6)
    d.add(0, [1, 2, 3, 4, 5], 2)
    d.step()  # prefill [A 5]: block 0 = [1, 2, 3, 4] is cached
    d.add(1, [1, 2, 3, 4, 6, 7], 1)
    d.add(2, [8, 8], 1)
    d.step()  # B hits block 0: 4 computed, costs 2; C costs 2: prefill [B 2, C 2] in a budget of 6
    d.expect_batch(2, [("B", 2), ("C", 2)])
    d.run_to_the_end()
    d = Driver(impl, 6, 2, 4, 16)  # every block taken in one step: A 2, B 1 beside A's first (a hit), C 3
    d.add(0, [1, 2, 3], 3)
    d.add(1, [1, 2, 4], 3)
    d.add(2, [5, 6, 7, 8, 9], 3)
    d.step()  # prefill [A 3, B 1, C 5]: can_allocate counts the free blocks after B's hit
    d.expect_batch(1, [("A", 3), ("B", 1), ("C", 5)])
    d.run_to_the_end()


def test_only_the_first_request_of_a_step_is_chunked(impl):
    """a later request that does not fit the budget left ends the step, and stays first in waiting with its blocks"""
    d = Driver(impl, 10, 4, 4, 8)
    d.add(0, [1, 2, 3, 4, 5], 1)
    d.add(1, [11, 12, 13, 14, 15, 16], 1)
    d.add(2, [21, 22], 1)
    d.step()  # A costs 5; B is allocated, costs 6 > 3 left: the step ends, C is not even allocated
    d.expect_batch(1, [("A", 5)])
    d.expect("after step 1: waiting", d.queue("waiting"), ["B", "C"])
    d.expect("after step 1: the number of blocks B holds", len(d.request("B").table), 2, "block",
             "B keeps the blocks it was given before it ended the step")
    d.expect("after step 1: C's block_table", d.request("C").table, [], why="the step ended at B, before C")
    d.step()  # prefill [B 6, C 2]
    d.expect_batch(2, [("B", 6), ("C", 2)])
    d.check_finished()
    d = Driver(impl, 5, 2, 4, 3)  # the page's preemption scenario under a budget of 3: B and C come back with their
    d.add(0, [1, 2, 3], 3)  # completion tokens, and C, second in its step, does not fit what B left: it ends the
    d.add(1, [4, 5, 6], 3)  # step as a new request would, not cut to a chunk
    d.add(2, [7], 4)
    d.run_to_the_end()


def test_a_chunk_advances_computed_tokens_and_discards_its_token(impl):
    """after a chunk num_computed_tokens grows by the chunk and the token sampled after it is not appended"""
    d = Driver(impl, 4, 2, 4, 1)  # a budget of 1: every step is a one-token chunk until the prompt's last token
    d.add(0, [1, 2, 3], 2)
    d.step([60])  # [A 1] and [A 1]: chunks, their tokens discarded
    d.step([61])
    d.expect("after step 2: A's token_ids", d.request("A").tokens, [1, 2, 3],
             why="a one-token chunk is still a chunk: its token is discarded")
    d.run_to_the_end()  # [A 1] completes the prompt, then a decode step
    d = Driver(impl, 8, 4, 4, 3, eos_token_id=50)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    d.add(0, prompt, 2)
    d.step([50])  # prefill [A 3]: 50 is thrown away, and though it is the stop token A does not stop
    seen = d.request("A")
    d.expect("after step 1: A's token_ids", seen.tokens, prompt, why="the token sampled after a chunk is discarded")
    d.expect("after step 1: A's num_computed_tokens", seen.computed, 3, "computed token")
    d.step([-1])  # [A 3]: 6 computed; p06's engine hands a chunk -1 (no draw), a token postprocess applies all the same
    d.expect("after step 2: A's num_computed_tokens", d.request("A").computed, 6, "computed token",
             "a chunk's token is discarded whatever it is (p06's engine gives -1), but its tokens are computed")
    d.step([52])  # [A 1]: the prompt is complete, 52 is A's first completion token
    seen = d.request("A")
    d.expect("after step 3: A's token_ids", seen.tokens, prompt + [52], why="the prompt is complete: 52 is kept")
    d.expect("after step 3: A's num_computed_tokens", seen.computed, 7, "computed token")
    d.run_to_the_end()


def test_a_request_runs_only_once_its_prompt_is_complete(impl):
    """a request prefilled in chunks stays first in waiting until its last chunk, then moves to running"""
    d = Driver(impl, 8, 4, 4, 4)
    d.add(0, [1, 2, 3, 4, 5, 6], 2)
    d.add(1, [7, 8], 2)
    d.step()  # prefill [A 4], a chunk: A stays in waiting, first
    d.expect_queues(1, waiting=["A", "B"], running=[])
    d.step()  # prefill [A 2, B 2]: both complete
    d.expect_queues(2, waiting=[], running=["A", "B"])
    d.run_to_the_end()


def test_postprocess_sets_num_scheduled_tokens_back_to_0(impl):
    """after postprocess every request of the step has num_scheduled_tokens 0: a chunk's, a finished one's, a running
    one's"""
    d = Driver(impl, 8, 4, 4, 4)
    d.add(0, [7], 1)
    d.add(1, [1, 2, 3, 4, 5, 6], 2)
    # prefill [A 1], A finishes (first: a reset for complete requests only shows as such); prefill [B 4], a chunk;
    # prefill [B 2], B runs; decode [B 1], B finishes
    for k in (1, 2, 3, 4):
        names, _, _ = d.step()
        for name in names:
            d.expect(f"after step {k}: {name}'s num_scheduled_tokens", d.read(d.remotes[name], "num_scheduled_tokens",
                     name), 0, "scheduled token", "postprocess sets it back to 0 once the step is applied")
    d.check_finished()


def test_decode_preempts_the_newest_running_request(impl):
    """a request that needs a block when none is free takes it from the newest running request (the right end)"""
    d = Driver(impl, 4, 2, 4, 16)
    d.add(0, [1, 2], 3)  # A and B: their next token opens a new block; B has the most tokens left
    d.add(1, [3, 4], 7)
    d.add(2, [5], 6)  # C and D: their next token fits in their block; D, the newest, has the fewest left, and this
    d.add(3, [6], 2)  # step would finish it: the newest is the one that started last, not the one with most left,
    # nor the newest one the step would not finish
    d.step()  # prefill all four: 4 blocks, none free
    d.add(4, [7, 8, 9], 1)  # E waits: no block is free for it
    d.step()  # decode: A preempts D (the newest), B preempts C; both go back to waiting, C first, ahead of E
    d.expect_batch(2, [("A", 1), ("B", 1)])
    d.expect("after step 2: waiting", d.queue("waiting"), ["C", "D", "E"])
    d.run_to_the_end()
    d = Driver(impl, 6, 2, 4, 16)  # the newest shares its first block with the request that needs one: still it
    d.add(0, [7], 5)
    d.add(1, [1, 2, 3], 5)
    d.add(2, [8], 5)
    d.add(3, [1, 2, 5], 5)  # D hits B's block [1, 2]: one block is left free after step 1
    d.step()  # prefill [A 1, B 3, C 1, D 1]
    d.step()  # decode [A, B, C, D]: every token fits in its block
    d.step()  # decode: A takes the free block; B needs one and D, the newest, gives its own back (the shared one
    # stays B's); C finds none and preempts itself
    d.expect_batch(3, [("A", 1), ("B", 1)])
    d.expect_queues(3, waiting=["C", "D"], running=["A", "B"])
    d.run_to_the_end()


def test_a_request_preempts_itself_only_when_no_other_is_left(impl):
    """when no other request is running to take a block from, the request itself is preempted and gets no step"""
    d = Driver(impl, 3, 2, 4, 16)
    d.add(0, [1, 2], 3)
    d.add(1, [3, 4], 2)
    d.step()  # prefill [A 2, B 2]: 1 block free
    d.step()  # decode: A takes the free block; B needs one, nobody else runs: B preempts itself
    d.expect_batch(2, [("A", 1)])
    d.expect_queues(2, waiting=["B"], running=["A"])
    d.step()  # B's 3 tokens need 2 blocks, 1 is free: the prefill ends at once; A decodes (and finishes)
    d.expect_batch(3, [("A", 1)])
    d.step()  # B comes back: [3, 4] is still cached, so it costs 1
    d.expect_batch(4, [("B", 1)])
    d.run_to_the_end()


def test_preempted_requests_come_back_first_and_are_recomputed(impl):
    """a preempted request goes first in waiting, with no blocks, 0 computed and its status waiting, and is recomputed
    (cache hits too)"""
    d = Driver(impl, 4, 2, 4, 16)
    d.add(0, [1, 2], 5)
    d.add(1, [3], 5)
    d.step()  # prefill [A 2, B 1]: 2 blocks free
    d.add(2, [9, 9, 9, 9, 9], 1)  # C: 3 blocks, it cannot be allocated while A and B run
    d.step()  # C does not fit: decode [A 1, B 1], A takes a block
    d.step()  # decode [A 1, B 1], B takes the last block
    d.step()  # decode: A needs a block, preempts B, which goes in FRONT of C
    d.expect("after step 4: waiting", d.queue("waiting"), ["B", "C"])
    seen = d.request("B")
    d.expect("after step 4: B's block_table", seen.table, [], why="preempt frees its blocks")
    d.expect("after step 4: B's num_computed_tokens", seen.computed, 0, "computed token")
    d.expect("after step 4: B's status", seen.status, WAITING)
    d.step()  # B needs 2 blocks, 1 free: decode [A 1], and A finishes
    d.step()  # B again: its first block [3, b1] is still cached: 2 computed, it costs 2
    d.expect_batch(6, [("B", 2)])
    d.run_to_the_end()
    # preempt resets its fields whatever the request's state: here one the step has just scheduled (an engine
    # that gives up a step preempts its requests before postprocess)
    d = Driver(impl, 4, 2, 1, 16)  # one seat: B waits behind A
    d.add(0, [1, 2, 3], 2)
    d.add(1, [4, 5], 2)
    batch, _ = d.scheduler.schedule()  # prefill [A 3]
    d.scheduler.preempt(batch[0])
    scheduled = d.read(d.remotes["A"], "num_scheduled_tokens", "A")
    if scheduled != 0:
        d.fail(f"preempt(A), called after schedule() gave A 3 tokens, left A's num_scheduled_tokens {scheduled}, "
               f"expected 0: preempt resets it with num_computed_tokens and the status", "preempt-resets")
    table = d.read(d.remotes["A"], "block_table", "A")
    if table:
        d.fail(f"preempt(A), called after schedule() gave A its blocks and 3 tokens (none computed yet), left A's "
               f"block_table {table}, expected []: preempt frees the request's blocks whatever it has computed "
               f"(blocks taken this step hold nothing yet, but are still the request's)", "preempt-resets")
    waiting = d.queue("waiting")
    if waiting != ["A", "B"]:  # before its first token too: a preempted request comes back first
        d.fail(f"preempt(A), called after schedule() prefilled A (no token sampled yet), left waiting {ids(waiting)}, "
               f"expected [A, B]: a preempted request goes to the left of waiting, whether or not it has completion "
               f"tokens", "preempted-come-back-first")
    try:  # ... and postprocess of that step: A computed nothing (0 scheduled tokens), so its token is discarded
        finished = list(d.scheduler.postprocess(batch, [9]))
    except LearnerError as error:
        raise error.noted("postprocess of a step whose request preempt() took back after schedule(): its "
                          "num_scheduled_tokens is 0, so its token is discarded") from None
    seen = d.request("A")
    if finished or seen.tokens != [1, 2, 3] or seen.computed != 0:
        d.fail(f"postprocess of the step A was preempted from (after schedule(), before postprocess) returned "
               f"{[d.name_of(r, 'finished') for r in finished]} and left A with tokens {seen.tokens} and "
               f"{count(seen.computed, 'computed token')}, expected [], [1, 2, 3] and 0: A's num_scheduled_tokens is "
               f"0, so its tokens are not all computed, and the token sampled for it is discarded",
               "postprocess-appends-the-token")
    expect_preempted_from_outside(impl)
    expect_postprocess_past_a_preempted_row(impl)


def expect_postprocess_past_a_preempted_row(impl) -> None:
    """postprocess of a prefill step of three requests whose middle one `preempt` took back after `schedule`: that
    row computed nothing and its token is discarded; the rows after it are applied as any other."""
    d = Driver(impl, 10, 4, 4, 16)
    prompts = {"A": [1, 2, 3], "B": [5, 6], "C": [7]}
    for i, prompt in enumerate(prompts.values()):
        d.add(i, prompt, 4)
    batch, _ = d.scheduler.schedule()  # prefill [A 3, B 2, C 1]
    d.scheduler.preempt(batch[1])  # B, the middle row (it stays in running: only the three requests are read)
    try:
        d.scheduler.postprocess(batch, [30, 31, 32])
    except LearnerError as error:
        raise error.noted("postprocess of a prefill step [A 3, B 2, C 1] whose B preempt() took back after "
                          "schedule(): B's num_scheduled_tokens is 0, so its token is discarded") from None
    want = {"A": ([1, 2, 3, 30], 3), "B": ([5, 6], 0), "C": ([7, 32], 1)}
    got = {name: (d.request(name).tokens, d.request(name).computed) for name in want}
    wrong = [name for name in want if got[name] != want[name]]
    if wrong:
        said = "; ".join(f"{name} has tokens {got[name][0]} and {count(got[name][1], 'computed token')}, expected "
                         f"{want[name][0]} and {want[name][1]}" for name in wrong)
        d.fail(f"postprocess of a prefill step [A 3, B 2, C 1] whose middle request B preempt() took back after "
               f"schedule(), with tokens [30, 31, 32]: {said}: B computed nothing, so its token is discarded, and "
               f"every row is handled on its own, the rows after B too",
               "postprocess-appends-the-token" if "B" in wrong else "finished-leaves")


def expect_preempted_from_outside(impl) -> None:
    """`preempt` called by its caller (an engine that gives up a step) on a request a decode step has just scheduled:
    its tokens stay whole; on a running request while a chunked prompt waits: it goes first, ahead of the chunk, and
    the next step computes it alone (the chunk, not first, is not cut to the budget left)."""
    d = Driver(impl, 10, 4, 4, 16)
    d.add(0, [1, 2, 3], 4)
    d.add(1, [5, 6], 4)
    d.step()  # prefill [A 3, B 2]
    batch, _ = d.scheduler.schedule()  # decode [A 1, B 1]
    d.scheduler.preempt(batch[0])
    tokens = d.read(d.remotes["A"], "token_ids", "A")
    if tokens != d.models["A"].tokens:
        d.fail(f"preempt(A), called after schedule() gave A a decode step, left A's token_ids {tokens}, expected "
               f"{d.models['A'].tokens}: preempt keeps every token (the step's token is computed again with the "
               f"rest)", "preempt-resets")
    d = Driver(impl, 10, 4, 4, 6)
    d.add(0, [1, 2, 3], 4)
    d.step()  # prefill [A 3]
    d.add(1, list(range(10, 20)), 2)
    d.step()  # prefill [B 6], a chunk: B stays first in waiting with its blocks
    d.scheduler.preempt(d.remotes["A"])  # A stays in running: its caller takes it off
    running = d.queue("running")
    if running != ["A"]:
        d.fail(f"preempt(A) of running A left running {ids(running)}, expected [A]: preempt leaves running alone, its "
               f"caller takes the request off (as the decode loop's running.pop() does)", "preempt-resets")
    waiting = d.queue("waiting")
    if waiting[:2] != ["A", "B"]:
        d.fail(f"preempt(A) of running A, while B's prompt waits half computed (6 of 10), left waiting {ids(waiting)}, "
               f"expected [A, B]: preempt puts a request on the left of waiting, ahead of a chunk too",
               "preempted-come-back-first")
    batch, _ = d.scheduler.schedule()
    got = [(d.name_of(r, "the batch"), d.read(r, "num_scheduled_tokens", d.name_of(r, "the batch"))) for r in batch]
    if got != [("A", 4)]:
        d.fail(f"after preempt(A) put A ahead of B's chunk, the next prefill step is {batch_text(got)}, expected "
               f"[A 4]: A's 4 tokens leave 2 of the budget of 6, and B, no longer first, is not cut to them (it waits "
               f"for a step it fits whole, or leads)", "only-the-first-is-chunked")


def test_a_preempted_request_is_recomputed_in_chunks_with_its_completion_tokens(impl):
    """a preempted request whose tokens (prompt and completion) exceed the budget is recomputed in chunks: each
    chunk advances num_computed_tokens, its token is discarded even past the prompt, and the completion is kept"""
    d = Driver(impl, 2, 4, 4, 2)  # 2 blocks of 4, a budget of 2
    d.add(0, [1, 2, 3], 3)
    d.add(1, [4], 4)
    d.step({"A": 90})  # prefill [A 2], a chunk: 90 is thrown away
    d.step({"A": 11, "B": 21})  # prefill [A 1, B 1]: both blocks in use
    d.step({"A": 12, "B": 22})  # decode [A 1, B 1]
    d.step({"A": 13})  # decode: A's token 12 opens a block: A preempts B; A finishes, its blocks are free again
    d.expect("after step 4: B's token_ids", d.request("B").tokens, [4, 21, 22], why="preemption keeps the completion")
    d.step({"B": 99})  # B's 3 tokens (a prompt of 1) cost 3 > 2: prefill [B 2], a chunk that ends past the prompt
    d.expect_batch(5, [("B", 2)])
    seen = d.request("B")
    d.expect("after step 5: B's token_ids", seen.tokens, [4, 21, 22],
             why="2 of B's 3 tokens are computed: the token sampled after a chunk is thrown away, past the prompt too")
    d.expect("after step 5: B's num_computed_tokens", seen.computed, 2, "computed token")
    d.expect_queues(5, waiting=["B"], running=[])
    d.step({"B": 23})  # prefill [B 1]: all 3 tokens are computed again, 23 is B's third completion token
    d.expect_batch(6, [("B", 1)])
    d.expect("after step 6: B's token_ids", d.request("B").tokens, [4, 21, 22, 23])
    d.run_to_the_end()


def test_decoded_requests_keep_their_order(impl):
    """decoded requests go back to the left of running in their order, ahead of those the step left out"""
    d = Driver(impl, 8, 4, 2, 16)
    for i in range(3):
        d.add(i, [i + 1], 3)
    d.step()  # prefill [A 1, B 1] (2 seats)
    d.step()  # prefill [C 1]
    d.step()  # decode [A 1, B 1]; C, left out, stays behind them
    d.expect("after step 3: running", d.queue("running"), ["A", "B", "C"])
    d.run_to_the_end()


def test_requests_finish_on_eos_unless_ignore_eos_and_at_max_tokens(impl):
    """a request finishes on the eos token it samples (unless ignore_eos) or with exactly max_tokens completion
    tokens"""
    eos = 151645  # Qwen3's <|im_end|>: a token id is an int to compare with ==, past the small ints Python shares
    d = Driver(impl, 8, 4, 4, 16, eos_token_id=eos)
    d.add(0, [eos, 1], 3)  # a prompt may hold the stop token: only a sampled one stops the request
    d.add(1, [2], 3, ignore_eos=True)
    d.add(2, [3], 2)
    _, _, finished = d.step({"A": 5, "B": eos, "C": 6})  # B samples eos but ignores it
    d.expect("step 1: the list of finished requests", finished, [])
    _, _, finished = d.step({"A": eos, "B": eos, "C": 7})  # A stops on eos; C has its 2 tokens
    d.expect("step 2: the list of finished requests", finished, ["A", "C"])
    _, _, finished = d.step({"B": 8})  # B's third token: max_tokens
    d.expect("step 3: the list of finished requests", finished, ["B"])
    d.check_finished()
    d.expect("at the end: B's completion tokens", d.request("B").tokens[1:], [eos, eos, 8])


def test_a_finished_request_gives_its_blocks_back(impl):
    """a finished request's blocks go back to the free list (last first) and it leaves running"""
    d = Driver(impl, 4, 2, 4, 16)
    d.add(0, [1, 2, 3], 2)
    d.step()  # prefill [A 3]: blocks 0 and 1
    d.step()  # decode: A's second token finishes it: blocks 1, 0 go back, after 2 and 3
    d.expect("after step 2: block_manager.free_block_ids", d.blocks()[0], [2, 3, 1, 0])
    d.add(1, [1, 2, 4], 1)
    d.step()  # B revives the cached block 0
    d.expect_batch(3, [("B", 1)])
    d.check_finished()


def test_add_refuses_what_the_cache_cannot_hold(impl):
    """add refuses a request the whole cache could never hold, max_tokens 0 or -1 and an empty prompt, and accepts
    one that fits exactly, a prompt given as a tuple or a range, and one whose id a waiting request has (each served
    as a request of its own)"""
    d = Driver(impl, 3, 2, 4, 16)
    d.add(0, [1, 2, 3, 4, 5, 6, 7], 1)  # 4 blocks for the prompt alone: refused
    d.add(1, [1, 2], 6)  # 2 + 6 - 1 tokens need 4 blocks: refused
    d.add(3, [1, 2], 0)  # no token asked for: refused
    d.add(5, [1, 2], -1)  # fewer than none: refused too (below 1, not only 0)
    d.add(4, [], 2)  # no prompt: refused
    d.add(2, (1, 2, 3), 4)  # 3 + 4 - 1 = 6 tokens: 3 blocks (the completions share the prompt's last), accepted
    d.add(6, range(1, 7), 1)  # the whole cache for the prompt, and its one token needs no slot: accepted
    d.run_to_the_end()
    d = Driver(impl, 2, 4, 4, 16, eos_token_id=0)  # one that may stop early is held to its max_tokens all the same
    d.add(0, [1, 2, 3, 4, 5, 6], 10)  # 6 + 10 - 1 = 15 tokens: 4 blocks of 4, and the cache has 2: refused
    d.add(1, [1, 2, 3, 4, 5], 4)  # 5 + 4 - 1 = 8 tokens: 2 blocks, accepted
    d.run_to_the_end()
    scheduler = impl.Scheduler(3, 2, 4, 16)
    scheduler.add(0, [1, 2], 2)
    try:  # the ids are the caller's: the scheduler never reads them, and refuses nothing for one
        scheduler.add(0, [3, 4], 2)
    except LearnerError as error:
        if "ValueError" not in str(error):
            raise
        said = error.noted("add refused a request whose id 0 a waiting request has too: the ids are the caller's, "
                           "and add refuses only a request the whole cache could never hold, an empty prompt or "
                           "max_tokens below 1")
        said.rule, said.identifiable = "add-refuses", True
        raise said from None
    expect_twins_kept_apart(impl)
    expect_twins_preempted_apart(impl)


def expect_twins_preempted_apart(impl) -> None:
    """Preemption among requests of one id: the newest running request is the victim though it shares the decoding
    request's id, and a victim goes back first in waiting though a waiting request has its id."""
    scheduler = impl.Scheduler(4, 2, 4, 16)
    first, second = scheduler.add(7, [1, 2, 3], 3), scheduler.add(7, [4, 5, 6], 3)
    for tokens in ([10, 11], [20, 21]):  # prefill [A 3, B 3]: every block taken; decode [A 1, B 1]: no new block
        batch, _ = scheduler.schedule()
        scheduler.postprocess(batch, tokens[: len(batch)])
    batch, _ = scheduler.schedule()  # A's token 20 needs a block: B, the newest, is preempted
    shown = ["the first" if r is first else "the second" if r is second else "another" for r in batch]
    if len(batch) != 1 or batch[0] is not first:
        raise Mismatch(f"two requests with the id 7 (prompts [1, 2, 3] and [4, 5, 6], blocks of 2, 4 blocks): in step "
                       f"3 the first needs a block, and the decode step holds {shown}, expected the first alone: the "
                       f"newest running request is preempted (the second), whatever its id", "preempt-the-newest")
    scheduler = impl.Scheduler(4, 2, 4, 16)
    x, y, z = scheduler.add(0, [1, 2, 3], 3), scheduler.add(1, [4, 5, 6], 3), scheduler.add(1, [7, 8, 9], 3)
    for tokens in ([10, 11], [20, 21], [30]):  # prefill [X, Y] (Z waits for blocks); decode [X, Y]; X preempts Y
        batch, _ = scheduler.schedule()
        scheduler.postprocess(batch, tokens[: len(batch)])
    waiting = ["Y" if r is y else "Z" if r is z else "X" if r is x else "another" for r in scheduler.waiting]
    if waiting != ["Y", "Z"]:
        raise Mismatch(f"X (id 0), Y and Z (both id 1; Z waits for blocks): after step 3, where X needs a block and "
                       f"Y is preempted, waiting is {ids(waiting)}, expected [Y, Z]: a preempted request goes back "
                       f"on the left of waiting, though a waiting request has its id (the ids are the caller's)",
                       "preempted-come-back-first")


def expect_twins_kept_apart(impl) -> None:
    """Two requests of one id: both are served, the one that finishes first leaves running alone, and two that
    finish in one step are both returned."""
    scheduler = impl.Scheduler(8, 2, 4, 16)
    pair = scheduler.add(5, [1, 2], 1), scheduler.add(5, [3, 4], 1)
    batch, _ = scheduler.schedule()  # prefill [A 2, B 2]: both finish on their one token
    finished = list(scheduler.postprocess(batch, [9] * len(batch)))
    if len(finished) != 2 or any(a is not b for a, b in zip(finished, pair)):
        shown = ["the first" if r is pair[0] else "the second" if r is pair[1] else "another" for r in finished]
        raise Mismatch(f"two requests with the id 5 (prompts [1, 2] and [3, 4], max_tokens 1) finished in one step, "
                       f"and postprocess returned {shown or 'none'}, expected both in batch order: it returns every "
                       f"request that finished, each one object, whatever their ids (the ids are the caller's)",
                       "finished-leaves")
    scheduler = impl.Scheduler(8, 2, 4, 16)
    first, second = scheduler.add(7, [1, 2, 3], 2), scheduler.add(7, [4, 5, 6], 3)
    for step, tokens in ((1, [9, 9]), (2, [9, 9])):  # prefill [A 3, B 3]; decode [A 1, B 1]: A has its 2 tokens
        batch, _ = scheduler.schedule()
        scheduler.postprocess(batch, tokens[: len(batch)])
    running = list(scheduler.running)
    if len(running) != 1 or running[0] is not second:
        shown = ["the first" if r is first else "the second" if r is second else "another" for r in running]
        raise Mismatch(f"two requests with the id 7 (prompts [1, 2, 3] max 2 and [4, 5, 6] max 3): after step 2, "
                       f"where the first finished, running holds {shown or 'none'}, expected the second: postprocess "
                       f"takes the finished request itself out of running (running.remove(request)), not every "
                       f"request with its id (the ids are the caller's)", "running-in-start-order")


def idle_step(d: "Driver", when: str) -> None:
    """schedule() with no request, and postprocess of the empty batch it returns: nothing to run, nothing finished."""
    d.step_number += 1
    try:
        got = d.scheduler.schedule()
    except LearnerError as error:  # an idle step refused: it is a step like any other, and breaks that rule
        raise idle_refused(error, d, when, "schedule()") from None
    if got != ([], False):
        d.fail(f"step {d.step_number} ({when}): schedule() returned {d.shown(got)}, expected ([], False): nothing "
               f"waits or runs", "empty-steps")
    try:
        finished = d.scheduler.postprocess([], [])
    except LearnerError as error:
        raise idle_refused(error, d, when, "postprocess([], [])") from None
    if finished is not None and not isinstance(finished, list | tuple):  # a generator, a set: the type says it
        d.fail(f"step {d.step_number} ({when}): postprocess([], []) returned {d.shown(finished)}, expected the list "
               f"of finished requests", "-")
    if finished != []:
        d.fail(f"step {d.step_number} ({when}): postprocess([], []) returned {d.shown(finished)}, expected [] (the "
               f"requests an empty step finished: none)", "empty-steps")
    d.history.append(f"step {d.step_number}: idle")


def idle_refused(error: LearnerError, d: "Driver", when: str, call: str) -> LearnerError:
    """A learner's error in an idle step's `call`: said with the step, and, where the code refused the step (raised
    an error of its own, not a slip such as a TypeError, a crash or a time-out), breaking empty-steps."""
    said = error.noted(f"step {d.step_number} ({when}): {call} with nothing to run must return as any step does")
    if re.search(r" raised (ValueError|RuntimeError|AssertionError|Exception)\b", str(error)) and not error.crash:
        said.rule = "empty-steps"
    return said


def test_an_idle_step_schedules_and_finishes_nothing(impl):
    """a scheduler with no request schedules nothing, ([], False), and postprocess of that empty step finishes nothing,
    [], before any request and after the last one finished"""
    d = Driver(impl, 3, 2, 4, 16)
    idle_step(d, "no request yet")
    d.add(0, [1, 2, 3], 2)
    d.run_to_the_end()
    idle_step(d, "every request finished")


def test_nano_vllm_sizes_match_the_model(impl):
    """nano-vllm's sizes (blocks of 256, a budget of 16384 tokens, 512 seats): prompts of thousands of tokens share
    a prefix, and a decode opens a block, as the model does them"""
    d = Driver(impl, 64, 256, 512, 16384)
    a = list(range(1, 2561))  # 2560 tokens: 10 full blocks
    d.add(0, a, 2)
    d.add(1, a[:2000] + list(range(5000, 5300)), 2)  # A's first 7 full blocks (1792 tokens) are cached
    d.add(2, list(range(9000, 9700)), 2)
    d.step()  # prefill [A 2560, B 508, C 700]
    d.expect_batch(1, [("A", 2560), ("B", 508), ("C", 700)])
    d.step()  # decode all three (A's token 2561 opens its 11th block); each has its 2 tokens
    d.expect_batch(2, [("A", 1), ("B", 1), ("C", 1)])
    d.check_finished()


# ---- random request streams (hypothesis) ---------------------------------------------------------------------

# num_blocks, block_size, max_num_seqs, max_num_batched_tokens, longest prompt: a small cache and 4 seats (preemption,
# of the newest of several), and a budget under the prompts' length with 2 seats (chunks, the seat cap)
STREAM_CONFIGS = {"bs2-6blocks-4seats": (6, 2, 4, 6, 5), "bs3-8blocks-budget4": (8, 3, 2, 4, 10)}
SHARED_IDS = {"bs3-8blocks-budget4"}  # its requests that arrive before one step share an id: ids are the caller's
EOS = 0
MAX_EXAMPLES = 25


def streams(longest: int):
    """2-5 requests over the vocabulary {1, 2} (shared prefixes are common), each arriving before one of the
    first steps; the sampled tokens come from {0 = eos, 1, 2, 3, 4}, used in turn."""
    request = st.tuples(st.lists(st.integers(1, 2), min_size=1, max_size=longest), st.integers(1, 5),
                        st.booleans(), st.integers(0, 4))
    return st.tuples(st.lists(request, min_size=2, max_size=5),
                     st.lists(st.integers(0, 4), min_size=1, max_size=12))


def play_stream(impl, config: tuple, stream, shared_ids: bool = False) -> None:
    num_blocks, block_size, max_num_seqs, budget, _ = config
    requests, samples = stream
    d = Driver(impl, num_blocks, block_size, max_num_seqs, budget, EOS)
    capacity = num_blocks * block_size
    arrivals = sorted(range(len(requests)), key=lambda i: requests[i][3])  # stable: ids in order
    turn = [0]

    def sample() -> int:
        token = samples[turn[0] % len(samples)]
        turn[0] += 1
        return token

    step = 0
    while arrivals or not d.model.finished():
        while arrivals and requests[arrivals[0]][3] <= step:
            i = arrivals.pop(0)
            prompt, max_tokens, ignore_eos, _ = requests[i]
            d.add(i, prompt, min(max_tokens, capacity - len(prompt) + 1), ignore_eos,  # one the cache can hold
                  as_id=requests[i][3] if shared_ids else None)
        step += 1
        if d.model.finished():
            idle_step(d, "nothing to run until the next arrival")
            continue
        if step > 100:
            raise RuntimeError("the model did not finish: the stream is too long")
        d.step(sample)
    d.check_finished()


@pytest.mark.parametrize("config", STREAM_CONFIGS)
def test_random_request_streams_match_the_model(impl, seed, config):
    """random request streams (arrivals, shared prefixes, preemption, chunks, eos) keep the rules and match the model"""
    explore(impl, seed, streams(STREAM_CONFIGS[config][4]),
            lambda stream: play_stream(impl, STREAM_CONFIGS[config], stream, config in SHARED_IDS), MAX_EXAMPLES,
            "requests", "scheduler")
