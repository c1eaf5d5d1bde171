"""Known mistakes in P05 (continuous-batching scheduler), each a patch of `solutions/p05_scheduler.py`.

Ids match the Pitfalls section of `exercises/p05_scheduler.md`, in its order.
"""

from checks.harness.mistakes import Broken, Mistake, Rule, Variant, append, chain, everyday_breakage, replace

# A prefill step that also decodes: after the prefill part, the requests that were running before the step get
# their decode step in the same batch (the seats the prefill left), through the decode part of `schedule` itself.
_MIXED = '''
_prefill_then_maybe_decode = Scheduler.schedule


def _schedule_mixed(self):
    before = list(self.running)
    batch, is_prefill = _prefill_then_maybe_decode(self)
    if not is_prefill or len(batch) >= self.max_num_seqs or not before:
        return batch, is_prefill
    started = [r for r in self.running if all(r is not b for b in before)]
    waiting, self.waiting, self.running = self.waiting, deque(), deque(before)
    seats, self.max_num_seqs = self.max_num_seqs, self.max_num_seqs - len(batch)
    decoded, _ = _prefill_then_maybe_decode(self)  # nothing waits now: the decode part runs
    self.max_num_seqs = seats
    self.waiting.extend(waiting)  # those it preempted first, then the ones that waited
    self.running.extend(started)
    return batch + decoded, True


Scheduler.schedule = _schedule_mixed
'''

MISTAKES = [
    Mistake(
        'new-request-joins-left',
        'add puts a new request on the left of waiting, ahead of the older ones',
        'Requests are served in arrival order: add appends on the right; only a preempted request goes back on the left.',
        replace('        self.waiting.append(request)\n        return request\n', '        self.waiting.appendleft(request)\n        return request\n'),
    ),
    Mistake(
        'is-finished-ignores-running',
        'is_finished is True once nothing waits, while requests still run',
        'The scheduler is finished only when no request waits AND none runs: check both queues.',
        replace('        return not self.waiting and not self.running\n', '        return not self.waiting\n'),
    ),
    Mistake(
        "is-finished-when-either-empty",
        "is_finished is True once either queue is empty (or for and)",
        "The scheduler is finished only when no request waits AND none runs: `not self.waiting and not "
        "self.running`. With `or` it is finished before the first step (nothing runs yet) and whenever nothing waits.",
        replace("        return not self.waiting and not self.running\n",
                "        return not self.waiting or not self.running\n"),
    ),
    Mistake(
        "add-slot-for-max-tokens-1",
        "add counts a slot for the one token of a max_tokens-1 request",
        "The last completion token never needs a slot, and with max_tokens 1 it is the only one: count "
        "`prompt + max_tokens - 1` tokens, so a prompt that fills the whole cache exactly is accepted.",
        replace("        needed = (request.num_prompt_tokens + max_tokens - 1 + block_size - 1) // block_size\n",
                "        needed = (request.num_prompt_tokens + max(max_tokens - 1, 1) + block_size - 1) // block_size\n"),
    ),
    Mistake(
        "idle-schedule-returns-none",
        "schedule returns None, not ([], False), when no request waits or runs",
        "An idle step is still a step: let schedule fall through to its decode part, which returns the empty batch "
        "and False (`return scheduled, False`), so a caller can unpack it as always.",
        replace("        scheduled: list[Request] = []\n        budget = self.max_num_batched_tokens\n",
                "        if not self.waiting and not self.running:\n            return None\n"
                "        scheduled: list[Request] = []\n        budget = self.max_num_batched_tokens\n"),
    ),
    Mistake(
        "empty-postprocess-returns-none",
        "postprocess returns None, not [], for an empty batch",
        "postprocess returns the list of the requests the step finished, an empty list when it finished none, an "
        "empty step too: drop the early return and let the loop run over nothing.",
        replace("        finished = []\n        for request, token in zip(",
                "        if not requests:\n            return None\n        finished = []\n"
                "        for request, token in zip("),
    ),
    Mistake(
        "preempt-oldest",
        "decode preempts the oldest running request instead of the newest",
        "When a request needs a block and none is free, give up the request at the right end of `running` "
        "(`running.pop()`): it started last, so the least work is lost and the oldest requests finish first.",
        replace("self.preempt(self.running.pop())  # the newest", "self.preempt(self.running.popleft())  # the newest"),
    ),
    Mistake(
        "preempt-most-tokens-left",
        "decode preempts the running request furthest from its max_tokens instead of the newest",
        "The newest running request is the one that started last, the right end of `running` "
        "(`running.pop()`), whatever its tokens left: running is kept in start order so that this end is it.",
        replace("                self.preempt(self.running.pop())  # the newest request gives its blocks back\n",
                "                victim = max(reversed(self.running),\n"
                "                             key=lambda r: r.max_tokens - len(r.completion_token_ids))\n"
                "                self.running.remove(victim)\n"
                "                self.preempt(victim)\n"),
    ),
    Mistake(
        "preempt-spares-finishing",
        "decode spares a newest request this step would finish and preempts an older one",
        "The newest running request is the victim even when this step would give it its last token: it holds its "
        "blocks until postprocess frees them, and the request that needs a slot needs it now. Take `running.pop()`.",
        replace("                self.preempt(self.running.pop())  # the newest request gives its blocks back\n",
                "                going = [r for r in self.running if len(r.completion_token_ids) + 1 < r.max_tokens]\n"
                "                victim = going[-1] if going else self.running[-1]\n"
                "                self.running.remove(victim)\n"
                "                self.preempt(victim)\n"),
    ),
    Mistake(
        "preempt-skips-prefix-sharers",
        "decode preempts the newest request that shares no block with the one that needs a slot",
        "Preempt the newest running request even when it shares a cached block with the request that needs a slot: "
        "its own blocks are freed all the same (a shared one just loses a reference).",
        replace("                self.preempt(self.running.pop())  # the newest request gives its blocks back\n",
                "                mine = set(request.block_table)\n"
                "                apart = [r for r in self.running if not mine & set(r.block_table)]\n"
                "                victim = apart[-1] if apart else self.running[-1]\n"
                "                self.running.remove(victim)\n"
                "                self.preempt(victim)\n"),
    ),
    Mistake(
        "preempt-self-first",
        "a request that finds no free block preempts itself instead of the newest other request",
        "While the request cannot have a slot, preempt the newest running request and try again; only when "
        "no other running request is left does it preempt itself.",
        replace("while not manager.can_append(request) and self.running:\n"
                "                self.preempt(self.running.pop())",
                "while False:\n"
                "                self.preempt(self.running.pop())"),
    ),
    Mistake(
        "preempted-to-back",
        "a preempted request rejoins waiting on the right, behind the new requests",
        "Put a preempted request on the LEFT of `waiting` (`appendleft`): it was already running and must come "
        "back before any request that has not started.",
        replace("self.waiting.appendleft(request)", "self.waiting.append(request)"),
    ),
    Mistake(
        'self-preempt-loses-token',
        'a request that preempts itself leaves without the token popped for its slot',
        'Put the token back on token_ids before a request preempts itself: it was sampled, it is part of the completion, and the recomputation must include it.',
        replace('                request.token_ids.append(token)\n', ''),
    ),
    Mistake(
        "preempt-keeps-computed",
        "preemption frees the blocks but leaves num_computed_tokens as it was",
        "A preempted request's K/V is gone with its blocks: set `num_computed_tokens` to 0 in `preempt`; the "
        "next allocation sets it to the cached prefix it finds.",
        replace("        self.block_manager.free(request)\n        request.num_computed_tokens = 0\n",
                "        self.block_manager.free(request)\n"),
    ),
    Mistake(
        "preempt-keeps-status",
        "preemption puts the request back in waiting but leaves its status RUNNING",
        "A preempted request waits again: set its `status` back to WAITING in `preempt`, with its computed and "
        "scheduled tokens back to 0. Whatever counts the running requests by their status (an engine's "
        "statistics, a server's progress report) must not count one that holds no blocks.",
        replace("        request.num_scheduled_tokens = 0\n        request.status = WAITING\n",
                "        request.num_scheduled_tokens = 0\n"),
    ),
    Mistake(
        "preempt-drops-completion",
        "preemption drops the request's completion tokens: it is recomputed from its prompt alone",
        "Keep a preempted request's `token_ids` whole: the tokens it sampled are part of its answer, and its "
        "recompute computes them too (`len(request)` tokens, less what the prefix cache still holds).",
        replace("        request.num_computed_tokens = 0\n        request.num_scheduled_tokens = 0\n",
                "        del request.token_ids[request.num_prompt_tokens :]\n"
                "        request.num_computed_tokens = 0\n        request.num_scheduled_tokens = 0\n"),
    ),
    Mistake(
        'cost-counts-prompt-only',
        "a request's prefill cost counts its prompt only, not the completion tokens a preempted request must recompute",
        'A waiting request costs every token it has minus those computed (len(request) - num_computed_tokens): after a preemption its completion tokens must be computed again too.',
        replace('            cost = len(request) - request.num_computed_tokens  # cached tokens cost nothing\n', '            cost = request.num_prompt_tokens - request.num_computed_tokens  # cached tokens cost nothing\n'),
    ),
    Mistake(
        "cached-tokens-cost",
        "the cached prefix is counted (and computed again): a new request starts with 0 computed tokens",
        "After `allocate`, a request's computed tokens are its `num_cached_tokens`; its cost, and its "
        "num_scheduled_tokens, are only the tokens after them.",
        replace("request.num_computed_tokens = request.num_cached_tokens", "request.num_computed_tokens = 0"),
    ),
    Mistake(
        'budget-charges-whole-length',
        "a scheduled request takes its whole length from the step's token budget, not the tokens it computes",
        'A request costs the tokens this step computes (num_scheduled_tokens): its cached prefix and earlier chunks are not computed again, so they take no budget.',
        replace('            budget -= request.num_scheduled_tokens\n', '            budget -= len(request)\n'),
    ),
    Mistake(
        "readmitted-later-chunked",
        "a preempted request coming back second in a step is cut to the budget left",
        "The later-request rule holds for every request, a preempted one coming back too: one that does not fit "
        "the budget left whole ends the step and leads the next one.",
        replace("            if scheduled and cost > budget:\n",
                "            if scheduled and cost > budget and not request.completion_token_ids:\n"),
    ),
    Mistake(
        "chunk-later-request",
        "a later request that does not fit the budget left is chunked too",
        "Only the first request of a step may be cut to the budget; a later one that does not fit whole ends "
        "the step and leads the next one (where it is first, and may be chunked).",
        replace("            if scheduled and cost > budget:\n"
                "                break  # only the first request is chunked; this one leads the next step\n", ""),
    ),
    Mistake(
        "deferred-request-in-batch",
        "a later request that does not fit the budget left ends the step, but is put in its batch first",
        "Test whether a later request fits before taking it: one that does not fit whole ends the step and is not "
        "in its batch (it would be there with no token to compute).",
        chain(replace("            if scheduled and cost > budget:\n",
                      "            scheduled.append(request)\n            if len(scheduled) > 1 and cost > budget:\n"),
              replace("            scheduled.append(request)\n            if request.num_scheduled_tokens < cost:\n",
                      "            if request.num_scheduled_tokens < cost:\n")),
    ),
    Mistake(
        "prefill-preempts-for-room",
        "the prefill loop preempts running requests to make room for a waiting one",
        "Only a decode step preempts. When the first waiting request cannot get its blocks (can_allocate says no), "
        "the prefill loop ends the step there; the running requests keep theirs.",
        replace("                if not manager.can_allocate(request):\n                    break\n",
                "                while not manager.can_allocate(request) and self.running:\n"
                "                    self.preempt(self.running.pop())\n"
                "                if not manager.can_allocate(request):\n                    break\n"),
    ),
    Mistake(
        "budget-exceeded-by-first",
        "the first request of a step is scheduled whole, even past the token budget",
        "Cut the first request to the budget: `num_scheduled_tokens = min(cost, budget)`; a prompt longer than "
        "the budget is prefilled in chunks over several steps.",
        replace("request.num_scheduled_tokens = min(cost, budget)",
                "request.num_scheduled_tokens = cost if not scheduled else min(cost, budget)"),
    ),
    Mistake(
        "running-before-prompt-done",
        "a chunked request moves to running after its first chunk",
        "A request whose prompt is not complete after this step stays first in `waiting`; it moves to the right "
        "of `running` only in the step that computes the rest of its prompt.",
        replace("            if request.num_scheduled_tokens < cost:\n"
                "                break  # a chunk: the budget is spent\n",
                "            if request.num_scheduled_tokens < cost:\n"
                "                self.running.append(self.waiting.popleft())\n"
                "                request.status = RUNNING\n"
                "                break  # a chunk: the budget is spent\n"),
    ),
    Mistake(
        "chunk-token-kept",
        "postprocess appends the token sampled after a chunk of a prompt",
        "A token sampled after a chunk comes from the middle of the prompt and means nothing: when "
        "num_computed_tokens is still below len(request), skip the request (its computed count has grown).",
        replace("continue  # a chunk: the prompt goes on next step", "pass  # a chunk: the prompt goes on next step"),
    ),
    Mistake(
        "recompute-chunk-by-prompt",
        "postprocess counts a request complete once its prompt is computed: a preempted request recomputed in "
        "chunks keeps a token sampled after a chunk",
        "A request still has tokens to compute while `num_computed_tokens < len(request)`, not `num_prompt_tokens`: "
        "a preempted request recomputes its completion tokens too, and the token sampled after any chunk of that "
        "recompute is thrown away.",
        replace("if request.num_computed_tokens < len(request):",
                "if request.num_computed_tokens < request.num_prompt_tokens:"),
    ),
    Mistake(
        "scheduled-not-reset",
        "postprocess leaves num_scheduled_tokens at the step's value",
        "Once `postprocess` has added a request's `num_scheduled_tokens` to its computed tokens, set it back to 0, "
        "for every request of the step, finished ones included: between steps no token is scheduled, and whatever "
        "sums the scheduled tokens of the requests (an engine's statistics) must not count a step that is over.",
        replace("            request.num_scheduled_tokens = 0\n            if request.num_computed_tokens < len(request):",
                "            if request.num_computed_tokens < len(request):"),
    ),
    Mistake(
        'prefill-step-when-waiting',
        'schedule returns an empty prefill step when requests wait but the first cannot be allocated',
        'A step is a prefill step only if it scheduled something: when nothing waiting fits, decode the running requests instead (they free blocks as they finish).',
        replace('        if scheduled:\n            return scheduled, True\n', '        if self.waiting:\n            return scheduled, True\n'),
    ),
    Mistake(
        "allocation-failure-returns",
        "schedule returns the prefill step as soon as the first waiting request cannot get its blocks, an empty one "
        "when nothing was prefilled",
        "When can_allocate says no, end the prefill loop (break), do not return from it: a step that prefilled "
        "nothing goes on to the decode half, whose running requests free blocks as they finish.",
        replace("                if not manager.can_allocate(request):\n                    break\n",
                "                if not manager.can_allocate(request):\n                    return scheduled, True\n"),
    ),
    Mistake(
        "prefill-and-decode-mixed",
        "a prefill step also decodes the running requests",
        "When anything was prefilled, return `(prefilled, True)` at once: a step is either prefill or decode, "
        "and the running requests are decoded in the next step that has nothing to prefill.",
        append(_MIXED),
    ),
    Mistake(
        "seq-cap-ignored",
        "max_num_seqs is not applied to a prefill step",
        "Stop taking requests from `waiting` once `max_num_seqs` are in the step, as the decode part does.",
        replace("while self.waiting and len(scheduled) < self.max_num_seqs and budget > 0:",
                "while self.waiting and budget > 0:"),
    ),
    Mistake(
        'decode-token-left-on-ids',
        'a decode step reads the sampled token without popping it, so append adds it a second time',
        'Pop the last token before appending it (token_ids.pop()): postprocess already put it on token_ids, and BlockManager.append adds it again with its slot.',
        replace('            token = request.token_ids.pop()  # sampled last step, still without a slot\n', '            token = request.token_ids[-1]  # sampled last step, still without a slot\n'),
    ),
    Mistake(
        "decode-token-never-popped",
        "a decode step reads the sampled token without popping it, and puts nothing back when it preempts itself",
        "Pop the last token before appending it (token_ids.pop()): postprocess already put it on token_ids, and "
        "BlockManager.append adds it again with its slot. (A request that then preempts itself gets it back.)",
        chain(replace("            token = request.token_ids.pop()  # sampled last step, still without a slot\n",
                      "            token = request.token_ids[-1]  # sampled last step, still without a slot\n"),
              replace("                request.token_ids.append(token)\n                self.preempt(request)",
                      "                self.preempt(request)")),
    ),
    Mistake(
        "preempts-while-no-free-block",
        "a decode step preempts while the free list is empty, even when the request's last block has room",
        "Preempt only while the request cannot have its slot (`not manager.can_append(request)`): a request whose "
        "last block has room needs no free block, and an empty free list alone is no reason to preempt anyone.",
        replace("            while not manager.can_append(request) and self.running:\n",
                "            while not manager.free_block_ids and self.running:\n"),
    ),
    Mistake(
        'decode-seq-cap-off-by-one',
        'a decode step takes max_num_seqs + 1 requests',
        'Stop adding requests to a decode step once it holds max_num_seqs (`<`, not `<=`).',
        replace('        while self.running and len(scheduled) < self.max_num_seqs:\n', '        while self.running and len(scheduled) <= self.max_num_seqs:\n'),
    ),
    Mistake(
        "decode-capped-by-budget",
        "a decode step stops at max_num_batched_tokens requests",
        "The token budget bounds a prefill step only; a decode step takes running requests up to "
        "`max_num_seqs`, one token each, however small the budget.",
        chain(replace("while self.running and len(scheduled) < self.max_num_seqs:",
                      "while self.running and len(scheduled) < self.max_num_seqs and budget > 0:"),
              replace("                request.num_scheduled_tokens = 1\n",
                      "                request.num_scheduled_tokens = 1\n                budget -= 1\n")),
    ),
    Mistake(
        "preempted-take-seats",
        "a decode step counts the requests it preempts against max_num_seqs",
        "max_num_seqs bounds the requests a decode step runs: a request it preempts leaves the step without a "
        "seat, so loop while `len(scheduled) < max_num_seqs`, whatever was preempted on the way.",
        chain(replace("        while self.running and len(scheduled) < self.max_num_seqs:\n",
                      "        seats = 0\n        while self.running and len(scheduled) + seats < self.max_num_seqs:\n"),
              replace("                self.preempt(self.running.pop())  # the newest request gives its blocks back\n",
                      "                self.preempt(self.running.pop())  # the newest request gives its blocks back\n"
                      "                seats += 1\n")),
    ),
    Mistake(
        'prefilled-status-not-running',
        'a request whose prompt is complete joins running with its status still WAITING',
        'Set status to RUNNING when a request moves from waiting to running: the status says which queue it is in.',
        replace('            request.status = RUNNING\n', ''),
    ),
    Mistake(
        'prefilled-joins-left',
        'a request whose prompt is complete joins running on the left, ahead of the older ones',
        'running is in start order: a request that finishes its prompt joins it on the right (append), so the newest is the last, the one a decode preempts first.',
        replace('            self.running.append(request)\n', '            self.running.appendleft(request)\n'),
    ),
    Mistake(
        "decode-order-reversed",
        "the decoded requests go back to running in reverse order",
        "`deque.extendleft` adds items one by one to the left, reversing them: pass `reversed(scheduled)` so "
        "`running` keeps the order the requests started in.",
        replace("self.running.extendleft(reversed(scheduled))", "self.running.extendleft(scheduled)"),
    ),
    Mistake(
        "ignore-eos-ignored",
        "a request stops on eos even with ignore_eos",
        "Finish on `eos_token_id` only when the request's `ignore_eos` is False; such a request runs to "
        "max_tokens whatever it samples.",
        replace("stop = not request.ignore_eos and token == self.eos_token_id", "stop = token == self.eos_token_id"),
    ),
    Mistake(
        "max-tokens-off-by-one",
        "a request finishes one token late, with max_tokens + 1 completion tokens",
        "Finish as soon as the request has `max_tokens` completion tokens (the token just appended included): "
        "`len(completion_token_ids) >= max_tokens`.",
        replace("len(request.completion_token_ids) >= request.max_tokens", "len(request.completion_token_ids) > request.max_tokens"),
    ),
    Mistake(
        'finished-stays-running',
        'a finished request is freed but stays in running',
        'postprocess removes a finished request from running (and frees its blocks): left there, the next decode step schedules it again.',
        replace('                self.running.remove(request)\n', ''),
    ),
    Mistake(
        "finished-not-freed",
        "a finished request leaves running but keeps its blocks",
        "Free a finished request's blocks (`block_manager.free`) when it finishes: nothing else ever will, and "
        "the cache fills up with the K/V of requests that are done.",
        replace("                request.status = FINISHED\n                self.block_manager.free(request)\n",
                "                request.status = FINISHED\n"),
    ),
]

VARIANTS = [
    Variant(
        "decode-loop-as-nano-vllm",
        "nano-vllm's decode loop: preempt the newest while there is one, else the request itself, with while/else",
        replace(
            "            while not manager.can_append(request) and self.running:\n"
            "                self.preempt(self.running.pop())  # the newest request gives its blocks back\n"
            "            if manager.can_append(request):\n"
            "                manager.append(request, token)\n"
            "                request.num_scheduled_tokens = 1\n"
            "                scheduled.append(request)\n"
            "            else:\n"
            "                request.token_ids.append(token)\n"
            "                self.preempt(request)  # alone and still no room: it waits for the cache to empty\n",
            "            while not manager.can_append(request):\n"
            "                if self.running:\n"
            "                    self.preempt(self.running.pop())\n"
            "                else:\n"
            "                    request.token_ids.append(token)\n"
            "                    self.preempt(request)\n"
            "                    break\n"
            "            else:\n"
            "                manager.append(request, token)\n"
            "                request.num_scheduled_tokens = 1\n"
            "                scheduled.append(request)\n",
        ),
    ),
]

BROKEN = [
    *[b for b in everyday_breakage("        budget = self.max_num_batched_tokens", "schedule")
      if b.id != "missing-function"],  # the checks reach `schedule` as a method, not a module name
    Broken("missing-class", replace("class Scheduler:", "class Scheduler2:"), "has no `Scheduler`"),
    Broken("batch-of-ids", replace("            return scheduled, True\n",
                                   "            return [r.request_id for r in scheduled], True\n"),
           "not one of the requests"),
    Broken("no-is-prefill", replace("        return scheduled, False\n", "        return scheduled\n"),
           "expected a (requests, is_prefill) pair"),
]

# The contract's rules, as the checks tell them broken (checks/test_p05_scheduler.py: `Driver.fail(..., rule)`): the
# report names the rule where no mistake above reproduces a learner's outputs. From the most specific to the most
# general: where failures break several, the report names the one most checks break, then the first here.
RULES = [
    Rule("decode-takes-a-slot",
         "a decode step gives each request's last token (sampled by the previous step) its cache slot: the token "
         "comes off token_ids and goes back through BlockManager.append, which opens a new block when it needs one",
         "in the decode part of schedule, pop the last token, make room while can_append says no, then "
         "block_manager.append(request, token)"),
    Rule("preempt-the-newest",
         "when a decode step finds no slot for a request, it preempts the newest running request (the right end of "
         "running), again and again while there is still no slot, and the request itself only when no other is left",
         "`while not can_append(request) and self.running: self.preempt(self.running.pop())`, then preempt the "
         "request itself if there is still no slot"),
    Rule("preempt-resets",
         "preempt frees the request's blocks and sets its num_computed_tokens and num_scheduled_tokens to 0 and its "
         "status to WAITING, keeps its token_ids whole and leaves running alone (its caller takes the request off): "
         "its K/V is gone, all its tokens are recomputed",
         "in preempt: block_manager.free(request), then reset those three fields; a request that preempts itself "
         "gets back the token its decode step took off"),
    Rule("preempted-come-back-first",
         "a preempted request goes to the LEFT of waiting, ahead of the requests that never ran",
         "waiting.appendleft(request) in preempt"),
    Rule("cached-prefix-is-computed",
         "a request that gets its blocks starts with its cached prefix computed (num_computed_tokens = "
         "num_cached_tokens): the prefix cache's tokens cost nothing; one that holds its blocks already (a chunked "
         "prompt) keeps the progress it has",
         "right after block_manager.allocate(request), and only then, set num_computed_tokens from "
         "num_cached_tokens"),
    Rule("cost-is-what-is-not-computed",
         "a prefill computes len(token_ids) - num_computed_tokens tokens: every token not yet in the cache, the "
         "completion tokens of a preempted request included, and nothing twice",
         "schedule min(len(request) - request.num_computed_tokens, budget left) tokens for it"),
    Rule("only-the-first-is-chunked",
         "only the first request of a prefill step may be cut to the budget left (a chunk); a later one that does "
         "not fit whole ends the step and leads the next one, first in waiting with the blocks it got",
         "when the batch already holds a request and this one's cost exceeds the budget left, stop the step"),
    Rule("a-chunk-stays-first",
         "a request whose tokens are not all computed after the step (a chunk) stays first in waiting with status "
         "WAITING, its num_computed_tokens grown by the chunk, and the token sampled after it is thrown away",
         "move a request to running only when its scheduled tokens complete it; in postprocess, skip the token "
         "while num_computed_tokens < len(request)"),
    Rule("complete-prompt-runs",
         "a request whose tokens are all computed after the step leaves waiting for the right end of running, "
         "status RUNNING, in that same step",
         "when num_scheduled_tokens covers the whole cost, waiting.popleft(), set RUNNING, running.append"),
    Rule("waiting-in-order",
         "waiting is served from the left in its order: new requests join on the right, and a prefill step takes "
         "its first request, then the next",
         "add appends on the right; the prefill loop always looks at waiting[0]"),
    Rule("running-in-start-order",
         "running keeps the order its requests started in: a decode step takes them from the left and puts the "
         "decoded ones back on the left in the same order; a request whose prompt completes joins on the right",
         "`self.running.extendleft(reversed(scheduled))` after a decode step; running.append for a new one"),
    Rule("prefill-before-decode",
         "a step is a prefill whenever the first waiting request can get its blocks and the budget; it is a decode "
         "step only when no request could be prefilled",
         "build the prefill batch first and return it when it is not empty; otherwise decode"),
    Rule("prefill-fills-the-step",
         "a prefill step goes on taking waiting requests while fewer than max_num_seqs are taken, budget is left "
         "and the next request gets its blocks and fits whole in the budget left; it ends where one does not, and "
         "preempts nobody",
         "stop the prefill loop only on one of those conditions, never on another"),
    Rule("decode-takes-the-running",
         "a decode step takes requests from the left of running until it has max_num_seqs of them or none is "
         "left; the token budget does not bound it",
         "loop `while self.running and len(scheduled) < self.max_num_seqs`"),
    Rule("token-budget",
         "a prefill step computes at most max_num_batched_tokens tokens, the first request cut to what is left, "
         "and every request in a batch computes at least one token",
         "subtract each request's num_scheduled_tokens from the budget left and stop when it is spent"),
    Rule("seq-cap",
         "no step, prefill or decode, holds more than max_num_seqs requests",
         "check len(scheduled) < max_num_seqs before taking each request"),
    Rule("one-kind-a-step",
         "a step is either prefill (requests from waiting) or decode (one token for each request from running), "
         "never both, and holds a request at most once",
         "return the prefill batch as soon as it is not empty; a decode step schedules exactly 1 token each"),
    Rule("finish-on-eos-or-max-tokens",
         "a request finishes when its new token is eos_token_id (unless ignore_eos) or when it has max_tokens "
         "completion tokens (its prompt not counted); postprocess returns those requests in batch order",
         "after appending the token: `token == eos and not ignore_eos or len(completion_token_ids) >= max_tokens`"),
    Rule("finished-leaves",
         "a finished request has status FINISHED, its blocks freed and is in neither queue; postprocess handles "
         "every request of the batch, in its order, and returns the finished ones in that order",
         "in postprocess, walking the batch in order, for a finished request: set FINISHED, "
         "block_manager.free(request), running.remove"),
    Rule("postprocess-appends-the-token",
         "postprocess appends exactly the token sampled for each request whose tokens are all computed, to its "
         "token_ids only (its slot comes with the next decode step), and nothing else touches token_ids",
         "request.token_ids.append(int(token)) once (not through the block manager), after num_computed_tokens has "
         "grown by the step"),
    Rule("computed-grows-by-the-step",
         "postprocess adds each request's num_scheduled_tokens to its num_computed_tokens",
         "num_computed_tokens += num_scheduled_tokens for every request of the step, chunks included"),
    Rule("scheduled-back-to-zero",
         "postprocess sets every request's num_scheduled_tokens back to 0, and a request a step leaves out keeps 0",
         "reset it right after adding it to num_computed_tokens; set it in schedule only for a request the step "
         "takes"),
    Rule("status-follows-queue",
         "a request in waiting has status WAITING, one in running RUNNING, a finished one FINISHED",
         "set status wherever a request changes queue: schedule (to RUNNING), preempt (WAITING), postprocess "
         "(FINISHED)"),
    Rule("empty-steps",
         "schedule() with no request waiting or running returns ([], False), and postprocess of an empty batch "
         "returns an empty list: an idle step is a step like any other",
         "return `scheduled, False` from schedule with scheduled empty, and postprocess's `finished` list, empty, "
         "rather than returning early"),
    Rule("is-finished",
         "is_finished() is True exactly when no request waits or runs",
         "`return not self.waiting and not self.running`"),
    Rule("add-refuses",
         "add raises ValueError for a request that could never fit the whole cache alone (its prompt and every "
         "completion token but the last need a slot), an empty prompt or max_tokens < 1, and accepts every other",
         "compare ceil((prompt + max_tokens - 1) / block_size) with the number of blocks of the whole cache"),
    Rule("blocks-accounted",
         "every block is free or used, a used block's ref_count is the number of requests holding it, no request "
         "holds a free block, and blocks are freed in the order the BlockManager frees them",
         "hand out and take back blocks only through allocate, append and free, once per request"),
]
