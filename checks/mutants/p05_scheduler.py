"""Known mistakes in P05 (continuous-batching scheduler), each a patch of `solutions/p05_scheduler.py`.

Ids match the Pitfalls section of `exercises/p05_scheduler.md`, in its order.
"""

from checks.harness.mistakes import Broken, Mistake, Variant, append, chain, everyday_breakage, replace

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
        "preempt-oldest",
        "decode preempts the oldest running request instead of the newest",
        "When a request needs a block and none is free, give up the request at the right end of `running` "
        "(`running.pop()`): it started last, so the least work is lost and the oldest requests finish first.",
        replace("self.preempt(self.running.pop())  # the newest", "self.preempt(self.running.popleft())  # the newest"),
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
        "chunk-later-request",
        "a later request that does not fit the budget left is chunked too",
        "Only the first request of a step may be cut to the budget; a later one that does not fit whole ends "
        "the step and leads the next one (where it is first, and may be chunked).",
        replace("            if scheduled and cost > budget:\n"
                "                break  # only the first request is chunked; this one leads the next step\n", ""),
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
