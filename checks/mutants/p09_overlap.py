"""Known mistakes in P09 (the overlapped engine and its fused kernels), each a patch of `solutions/p09_overlap.py`.

Ids match the Pitfalls section of `exercises/p09_overlap.md`.
"""

from checks.harness.mistakes import Mistake, Rule, Variant, chain, everyday_breakage, replace

RESIDUAL_STORE = ("    tl.store(residual_ptr + row * stride_residual + cols, total.to(residual_ptr.dtype.element_ty), "
                  "mask=mask)\n")
SKIP_ROW = ("            if not step.sampled[b] or request.status == FINISHED:\n"
            "                continue  # a chunk's row, or the wasted row of a request that finished a step ago\n")
STOPS = "            if (not request.ignore_eos and token == eos) or count >= request.max_tokens:\n"

MISTAKES = [
    Mistake(
        "residual-not-written-back",
        "the fused norm returns the normed sum but leaves `residual` as it was",
        "The kernel must store x + residual (rounded to the residual's dtype) back into `residual`: the caller "
        "carries no other copy of the stream, and the next sub-layer adds its output to it.",
        replace(RESIDUAL_STORE, ""),
    ),
    Mistake(
        "future-token-from-the-next-row",
        "a placeholder -1 - b read back as row b + 1 of the previous step's tokens",
        "Placeholder -1 - b stands for row b of the step before: index its tokens with -1 - id (-1 -> row 0). One "
        "off, every decode row reads the next request's token (the last row its own) as its input.",
        replace("            ids = torch.where(ids < 0, previous[(-1 - ids).clamp(min=0)], ids)\n",
                "            ids = torch.where(ids < 0, previous[(-ids).clamp(min=0, max=previous.numel() - 1)], ids)\n"),
    ),
    Mistake(
        "overlap-token-emitted",
        "a request that finished at step n also keeps the token its wasted row drew at step n+1",
        "Step n+1 was scheduled before step n's tokens were known: a request that finished at step n has a row in "
        "it whose token means nothing. Skip rows of finished requests when resolving, and drop the placeholder "
        "appended after the last token.",
        chain(
            replace(SKIP_ROW, "            if not step.sampled[b]:\n                continue  # a chunk's row\n"),
            replace(STOPS, "            if request.status != FINISHED and ((not request.ignore_eos and token == eos)"
                           " or count >= request.max_tokens):\n"),
            replace("                del request.token_ids[position + 1 :]  # the next step's placeholder: never "
                    "emitted\n", ""),
        ),
    ),
    Mistake(
        "blocks-freed-a-step-early",
        "a finished request's blocks freed when its last token arrives, while the step in flight still reads them",
        "A request that finished at step n has a (wasted) row in step n+1, launched already: its blocks go back "
        "only when step n+1 is resolved (keep them on that step's list), not the moment step n's tokens arrive.",
        replace("                if following is not None and any(r is request for r in following.requests):\n",
                "                if False:\n"),
    ),
    Mistake(
        "metadata-reused",
        "the decode metadata built once and reused by later steps of the same batch size",
        "Every step needs its own positions, slots, context lengths and block tables (each request has one more "
        "token): build them for every step, and only the input tokens wait for the device. A CUDA graph reuses "
        "its buffers, not their contents.",
        replace("        meta = decode_metadata(requests)\n",
                "        if getattr(self, '_meta', None) is None or len(self._meta.positions) != len(requests):\n"
                "            self._meta = decode_metadata(requests)\n"
                "        meta = self._meta\n"),
    ),
    Mistake(
        "no-wait-before-preemption",
        "the next step scheduled while a step is in flight even when it must preempt",
        "A preempted request gives its blocks back at once, and the step in flight may be reading them (and its "
        "token may finish a request that is now waiting): when the running requests could open more blocks than "
        "are free, resolve the step in flight before scheduling.",
        chain(
            replace("        return opening > len(manager.free_block_ids)\n", "        return False\n"),
            # ... and a request that finishes after it was preempted leaves whichever queue holds it (else this
            # mistake is a crash, not a wrong result)
            replace("                self.scheduler.running.remove(request)\n",
                    "                queue = self.scheduler.running if request in self.scheduler.running else "
                    "self.scheduler.waiting\n"
                    "                queue.remove(request)\n"),
        ),
    ),
    Mistake(
        "placeholder-block-not-rehashed",
        "a block that a placeholder filled stays hashed with the placeholder after the real token arrives",
        "The block manager hashes a block when its last slot is given, and in an overlapped step that slot's token "
        "is still a placeholder: hash the block again (and move its cache entry) when the token is resolved, or "
        "the prefix cache can never serve it.",
        replace("            self._reseal(request, position)\n", ""),
    ),
    Mistake(
        "graph-noise-not-drawn",
        "the graph's noise buffer not refilled before a replay, so every step reuses the noise it already holds",
        "A recorded graph reads its noise from a static buffer: fill it before every replay that samples (the "
        "batch's rows from the engine's generator, then each seeded row from its own), or every step draws with "
        "the same noise (at first all ones: the argmax) and seeded requests lose their own draws.",
        replace("        if plain and any(t > 0 for t in temperature):", "        if False:"),
        needs="cuda",
    ),
]

VARIANTS = [
    Variant(
        "add-norm-of-the-rounded-sum",
        "the fused norm normalises the sum rounded to the input's dtype (HF's rounding), not the fp32 sum",
        replace("    variance = tl.sum(total * total, axis=0) / N\n",
                "    total = total.to(residual_ptr.dtype.element_ty).to(tl.float32)\n"
                "    variance = tl.sum(total * total, axis=0) / N\n"),
    ),
    Variant(
        "silu-rounded-first",
        "fused_silu_mul rounds silu(gate) to the input's dtype before the product (m04's rounding)",
        replace("(gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty)",
                "((gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty).to(tl.float32) * up)"
                ".to(out_ptr.dtype.element_ty)"),
    ),
]

BROKEN = [
    *everyday_breakage("    out = torch.empty(T, N, dtype=x.dtype, device=x.device)", "fused_add_rms_norm"),
]

# The contract's rules, in the order the parts build on each other (checks/test_p09_overlap.py: `RULE_OF`, and the
# counters p06's checks read): where failures break several, the report names the first here.
RULE_RANKING = "layers"
RULES = [
    Rule("fused-add-rms-norm",
         "fused_add_rms_norm returns RMSNorm(x + residual) times the weight, the sum in fp32, and leaves x + residual, "
         "rounded to its dtype, in `residual` itself",
         "load both rows in fp32, store their sum into residual's row, normalise that fp32 sum, store the result"),
    Rule("fused-silu-mul",
         "fused_silu_mul gives silu(gate) * up for each row, the gate being the first half of the row and up the "
         "second, computed in fp32 and rounded once",
         "read columns 0 .. I-1 as the gate and I .. 2I-1 as up; return [T, I]"),
    Rule("no-token-after-finish",
         "a request that finished at step n emits nothing more: the token its row drew in step n+1 (launched before "
         "the host knew) is thrown away",
         "when a step is resolved, skip the rows of requests already finished, and cut the placeholder that follows "
         "a request's last token"),
    Rule("blocks-outlive-their-steps",
         "a finished request's blocks stay held while a launched step still reads them and are freed once, when "
         "that step is resolved; at the end every block is free",
         "free at once only what no step in flight reads; put the rest on the in-flight step's list and free it "
         "when that step resolves"),
    Rule("prefix-cache-sees-real-tokens",
         "a block filled while one of its tokens was still a placeholder is hashed again with the real token once "
         "it arrives, so the prefix cache serves it to a later prompt",
         "when a token is applied at the last slot of a block, recompute that block's hash from its real tokens"),
    Rule("stats-count-once",
         "LLM.stats counts each thing once, as p06's engine does, and `waits` the steps resolved before the next "
         "one was scheduled (before a step that may preempt)",
         "count in step what the step did; resolve the step in flight first, and count it, when the next decode may "
         "open more blocks than are free"),
    Rule("tokens-of-the-synchronous-engine",
         "greedy and seeded requests get exactly the tokens p06's synchronous engine gives: each decode row reads "
         "the token its own request drew in the step before, on the device, through metadata built for this step",
         "build each step's metadata afresh from the requests; map placeholder -1 - b to row b of the step before"),
]
