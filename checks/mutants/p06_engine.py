"""Known mistakes in P06 (the engine), each a patch of `solutions/p06_engine.py`.

Ids match the Pitfalls section of `exercises/p06_engine.md`.
"""

from checks.harness.mistakes import Broken, Mistake, Rule, Variant, chain, everyday_breakage, replace

MISTAKES = [
    Mistake(
        'model-len-without-max-tokens',
        'generate checks the prompt alone against max_model_len, not the prompt with its max_tokens',
        'A request needs room for its prompt and every token it may generate: refuse it when len(prompt) + max_tokens > max_model_len.',
        replace('            if len(prompt) + p.max_tokens > self.config.max_model_len:\n', '            if len(prompt) > self.config.max_model_len:\n'),
    ),
    Mistake(
        "model-len-for-the-longest",
        "generate checks the longest prompt with the largest max_tokens against max_model_len, not each request",
        "Each request is held to max_model_len with its own max_tokens: a long prompt that asks for few tokens and a "
        "short one that asks for many may both fit, though the longest with the most would not.",
        replace("            if len(prompt) + p.max_tokens > self.config.max_model_len:\n",
                "            if max(map(len, prompts)) + max(q.max_tokens for q in params) > self.config.max_model_len:\n"),
    ),
    Mistake(
        "one-params-list-broadcast",
        "generate repeats a list of one SamplingParams for every prompt instead of refusing it",
        "A list gives one params per prompt: a list of 1 for 3 prompts is a list of the wrong length (ValueError); "
        "one object for every prompt is passed alone, not in a list.",
        replace("        params = sampling_params if isinstance(sampling_params, (list, tuple)) else "
                "[sampling_params] * len(prompts)\n",
                "        params = sampling_params if isinstance(sampling_params, (list, tuple)) else "
                "[sampling_params] * len(prompts)\n        if len(params) == 1:\n"
                "            params = list(params) * len(prompts)\n"),
    ),
    Mistake(
        'unservable-prompt-left-out',
        "generate leaves out a prompt the cache can never hold (it catches add's ValueError) instead of refusing",
        "Let the ValueError of Scheduler.add reach the caller: a prompt left out makes the outputs one short, and "
        "every later one answers the prompt before it.",
        chain(replace("        manager = self.scheduler.block_manager  # what p05's add refuses (the whole cache could "
                      "never hold it),\n", "        manager = self.scheduler.block_manager\n"),
              replace("            if not len(prompt) or p.max_tokens < 1 or needed > len(manager.blocks):\n",
                      "            if False:  # (no check of its own: add's refusal is caught below)\n"),
              replace("            request = self.scheduler.add(self._next_id, list(prompt), p.max_tokens, "
                      "p.ignore_eos)\n",
                      "            try:\n"
                      "                request = self.scheduler.add(self._next_id, list(prompt), p.max_tokens, "
                      "p.ignore_eos)\n"
                      "            except ValueError:  # the cache cannot hold it: serve the others\n"
                      "                self._next_id += 1\n"
                      "                continue\n")),
    ),
    Mistake(
        'outputs-include-prompt',
        "generate returns each request's prompt and completion instead of the completion alone",
        'generate returns the generated tokens only: completion_token_ids, not token_ids.',
        replace('        return [list(request.completion_token_ids) for request in requests]\n', '        return [list(request.token_ids) for request in requests]\n'),
    ),
    Mistake(
        "outputs-of-every-call",
        "generate returns the completions of every request the engine has served, earlier calls' too",
        "Return one list per prompt of this call, in its order: keep the requests this call added, not a list on the "
        "engine that grows from call to call.",
        chain(replace("        while not self.scheduler.is_finished():\n            self.step()\n",
                      "        self.served = [*getattr(self, 'served', []), *requests]  # every request, every call\n"
                      "        while not self.scheduler.is_finished():\n            self.step()\n"),
              replace("        return [list(request.completion_token_ids) for request in requests]\n",
                      "        return [list(request.completion_token_ids) for request in self.served]\n")),
    ),
    Mistake(
        'ignore-eos-not-passed',
        "generate does not pass a request's ignore_eos to the scheduler",
        'Pass SamplingParams.ignore_eos to Scheduler.add: without it every request stops at the stop token.',
        replace('            request = self.scheduler.add(self._next_id, list(prompt), p.max_tokens, p.ignore_eos)\n', '            request = self.scheduler.add(self._next_id, list(prompt), p.max_tokens)\n'),
    ),
    Mistake(
        "temperature-multiplied",
        "the logits multiplied by the temperature instead of divided",
        "A temperature below 1 sharpens the distribution: divide the logits by it (0.5 doubles every gap).",
        replace("scaled = logits.float() / torch.where(", "scaled = logits.float() * torch.where("),
    ),
    Mistake(
        "temperature-zero-sampled",
        "temperature 0 sampled as if it were 1 instead of taking the argmax",
        "Temperature 0 is the limit of sharper and sharper distributions: the argmax, with no draw at all.",
        chain(
            replace("    return torch.where((temperature > 0)[:, None], probs, greedy)", "    return probs"),
            replace("        if all(float(p.temperature) <= 0 for p in params):  # decided on the host: no wait for the GPU\n"
                    "            return logits.argmax(dim=-1)\n", ""),
        ),
    ),
    Mistake(
        'greedy-by-first-row',
        'the whole batch taken greedily when its first row has temperature 0',
        'Take the all-argmax shortcut only when EVERY row is greedy: a row with temperature > 0 samples at its own temperature, whatever the rows before it ask.',
        replace('        if all(float(p.temperature) <= 0 for p in params):  # decided on the host: no wait for the GPU\n', '        if float(params[0].temperature) <= 0:  # decided on the host: no wait for the GPU\n'),
    ),
    Mistake(
        'masks-only-when-top-k',
        'the masks run only when some row asks for top-k, so top-p alone is ignored',
        'Sort and mask when any row asks for top-k OR top-p (top_p < 1): a row with only top-p needs the sorted cumulative sum too.',
        replace('    if bool((top_k > 0).any() | (top_p < 1).any()):', '    if bool((top_k > 0).any()):'),
    ),
    Mistake(
        "masks-only-when-both",
        "the masks run only when some row asks for top-k AND some row for top-p (& for |)",
        "Sort and mask when any row asks for top-k OR any row for top-p: a batch that asks for only one of them "
        "needs that one's mask all the same.",
        replace('    if bool((top_k > 0).any() | (top_p < 1).any()):', '    if bool((top_k > 0).any() & (top_p < 1).any()):'),
    ),
    Mistake(
        "top-k-drops-ties",
        "top-k keeps exactly k tokens, dropping those tied with the k-th largest logit",
        "Keep every token whose logit is at least the k-th largest: with a tie at that value, more than k stay "
        "(compare with the k-th value, not the k positions torch.topk picks).",
        replace('        scaled = scaled.masked_fill(scaled < kth, float("-inf"))',
                "        order = scaled.argsort(dim=-1, descending=True, stable=True)\n"
                "        place = torch.empty_like(order).scatter_(1, order, torch.arange(V).expand(B, V).contiguous())\n"
                '        scaled = scaled.masked_fill(place >= k[:, None], float("-inf"))'),
    ),
    Mistake(
        "top-k-drops-the-kth",
        "top-k drops the tokens equal to the k-th largest logit, keeping fewer than k",
        "Drop only the tokens BELOW the k-th largest logit (`<`, not `<=`): the k-th token and every token tied with "
        "it stay. With `<=` even a row that asks for no top-k (k = V, the k-th value is the smallest) loses the "
        "tokens tied at its smallest logit.",
        replace('        scaled = scaled.masked_fill(scaled < kth, float("-inf"))',
                '        scaled = scaled.masked_fill(scaled <= kth, float("-inf"))'),
    ),
    Mistake(
        "top-k-keeps-one-more",
        "top-k reads its threshold at sorted position k instead of k - 1, keeping k + 1 tokens",
        "The k-th largest logit sits at index k - 1 of the descending sort: read it there, or one token too many stays.",
        replace("gather(1, (k - 1)[:, None])", "gather(1, k[:, None].clamp(max=V - 1))"),
    ),
    Mistake(
        "top-p-drops-the-crossing-token",
        "top-p keeps only the tokens whose running sum, their own included, stays within p",
        "Keep a token while the mass BEFORE it is below p: the token that crosses p is kept, so the kept mass reaches p.",
        replace("before = ordered.cumsum(dim=-1) - ordered", "before = ordered.cumsum(dim=-1)"),
    ),
    Mistake(
        "top-p-keeps-the-token-at-p",
        "top-p keeps a token whose predecessors already hold exactly p",
        "Drop a token once the mass before it reaches p (>=, not >): when the more likely tokens sum to exactly p, "
        "the kept mass is p already.",
        replace("(before >= top_p.float()[:, None])", "(before > top_p.float()[:, None])"),
    ),
    Mistake(
        "top-p-not-renormalised",
        "the probabilities top-k and top-p keep are not divided by their sum again",
        "After masking, divide the kept probabilities by their sum: `probabilities` returns a distribution (rows sum "
        "to 1), and the kept tokens' shares are what a sampler and the checks read.",
        replace("        probs = probs / probs.sum(dim=-1, keepdim=True)\n", ""),
    ),
    Mistake(
        'top-p-mask-in-sorted-order',
        "top-p's drop mask, computed in sorted order, applied to the vocabulary without mapping it back",
        "The cumulative sums are in sorted order: scatter the drop mask back through the sort's indices before masking the vocabulary.",
        replace('        drop = torch.zeros_like(probs).scatter(1, order, (before >= top_p.float()[:, None]).float()).bool()\n', '        drop = before >= top_p.float()[:, None]\n'),
    ),
    Mistake(
        "top-p-before-top-k",
        "top-p measured on the whole distribution instead of the one top-k left",
        "Apply top-k first, take the softmax of what it keeps, and measure top-p's mass on that distribution.",
        chain(
            replace("        scaled = scaled.masked_fill(scaled < kth, float(\"-inf\"))\n        probs = scaled.softmax(dim=-1)\n",
                    "        probs = scaled.softmax(dim=-1)\n"),
            replace("        probs = probs.masked_fill(drop, 0.0)\n",
                    "        probs = probs.masked_fill(drop | (scaled < kth), 0.0)\n"),
        ),
    ),
    Mistake(
        "noise-multiplied",
        "the race run as argmax(probs * noise), which is not a draw from probs",
        "Divide: noise / probs is an exponential of rate probs, and the smallest of those wins with probability probs.",
        replace("return (probs / noise).argmax(dim=-1)", "return (probs * noise).argmax(dim=-1)"),
    ),
    Mistake(
        "chunk-draws",
        "a chunk's row draws from the request's generator although its token is thrown away",
        "Draw only for a request whose prompt is complete this step: a seeded request must not depend on chunking.",
        replace("rows = [b for b, done in enumerate(complete) if done]", "rows = list(range(len(requests)))"),
    ),
    Mistake(
        "seed-generator-per-params",
        "one generator per SamplingParams object with a seed, shared by every request that object serves",
        "Make the generator per request, when the request is added: one params object given for several prompts "
        "serves several requests, and each draws from a generator of its own seeded with that seed.",
        chain(replace("        requests = []\n        for prompt, p in zip(prompts, params):\n",
                      "        requests = []\n        by_params: dict = {}\n        for prompt, p in zip(prompts, params):\n"),
              replace("                self._generators[request.request_id] = torch.Generator(self.generator.device)"
                      ".manual_seed(p.seed)\n",
                      "                if id(p) not in by_params:\n"
                      "                    by_params[id(p)] = torch.Generator(self.generator.device).manual_seed(p.seed)\n"
                      "                self._generators[request.request_id] = by_params[id(p)]\n")),
    ),
    Mistake(
        "top-k-one-as-greedy",
        "a batch whose rows are greedy or keep one token (top_k 1) takes the argmax shortcut and draws no noise",
        "Only temperature 0 is greedy: a top_k of 1 keeps every token tied at the top and draws between them, and "
        "its step draws the engine's noise like any sampled step. Take the argmax shortcut only when every row's "
        "temperature is 0.",
        replace("        if all(float(p.temperature) <= 0 for p in params):  # decided on the host: no wait for the GPU\n",
                "        if all(float(p.temperature) <= 0 or int(p.top_k) == 1 for p in params):\n"),
    ),
    Mistake(
        "seed-generator-by-index",
        "a seeded request's generator kept under its prompt's index in the call, not its request id",
        "Key the generator by the request id, as the params are: from the second generate call on an engine the "
        "ids no longer start at 0, and a seeded request would find no generator (or another's).",
        chain(replace("        for prompt, p in zip(prompts, params):\n            request = self.scheduler.add(",
                      "        for index, (prompt, p) in enumerate(zip(prompts, params)):\n"
                      "            request = self.scheduler.add("),
              replace("                self._generators[request.request_id] = torch.Generator(self.generator.device)"
                      ".manual_seed(p.seed)\n",
                      "                self._generators[index] = torch.Generator(self.generator.device).manual_seed(p.seed)\n")),
    ),
    Mistake(
        'seed-reseeds-shared-generator',
        "a seeded request reseeds the engine's shared generator instead of getting one of its own",
        "Give each seeded request its own torch.Generator, seeded once: reseeding the shared one restarts it at every step and drags every unseeded request's draws along.",
        replace('                self._generators[request.request_id] = torch.Generator(self.generator.device).manual_seed(p.seed)\n', '                self._generators[request.request_id] = self.generator.manual_seed(p.seed)\n'),
    ),
    Mistake(
        'seed-zero-unseeded',
        'a request with seed 0 is treated as unseeded (`if p.seed:`)',
        '0 is a seed like any other: test `p.seed is not None`, or a request with seed 0 draws from the shared generator and its tokens depend on the batch.',
        replace('            if p.seed is not None:\n', '            if p.seed:\n'),
    ),
    Mistake(
        'seeded-noise-fills-batch',
        "a seeded request's generator fills the whole batch's noise instead of its own row",
        "Redraw only the seeded request's row (noise[b].exponential_(generator=own)): filling every row consumes its generator B times a step and gives the other rows its draws.",
        replace('                noise[b].exponential_(generator=own)\n', '                noise.exponential_(generator=own)\n'),
    ),
    Mistake(
        "seeded-generator-restarted",
        "a seeded request's generator started again from its seed at every step",
        "Seed a request's generator once, when generate queues it, and keep drawing from it: started again each step, "
        "it draws the same noise for every token.",
        replace("            if own is not None:  # a seeded request: its draws come from its own generator only\n"
                "                noise[b].exponential_(generator=own)\n",
                "            if own is not None:  # a seeded request: its draws come from its own generator only\n"
                "                own.manual_seed(self._params[request.request_id].seed)\n"
                "                noise[b].exponential_(generator=own)\n"),
    ),
    Mistake(
        "noise-from-global-generator",
        "the noise of requests without a seed drawn from torch's global generator, not the engine's `generator`",
        "Draw the batch's noise with generator=self.generator: torch's global one is shared with everything else in "
        "the process, so two engines made alike sample differently.",
        replace("        noise = torch.empty_like(probs).exponential_(generator=self.generator)  # [B, V] Exp(1)\n",
                "        noise = torch.empty_like(probs).exponential_()  # [B, V] Exp(1)\n"),
    ),
    Mistake(
        "tokens-out-counts-chunks",
        "stats['tokens_out'] counts every row of a step, a chunk's too, not the tokens sampled",
        "Count the rows that drew a token (the requests whose prompt is complete after the step): a chunk's row "
        "samples nothing, so it adds nothing to tokens_out.",
        replace('self.stats["tokens_out"] += len(rows)', 'self.stats["tokens_out"] += len(requests)'),
    ),
    Mistake(
        'chunked-prefills-counts-cached',
        "stats['chunked_prefills'] counts a step where a request computes less than its whole length, a cached prefix's rest or a last chunk included",
        'A chunked prefill is a step that leaves some prompt incomplete: num_computed_tokens + num_scheduled_tokens < len(request), not num_scheduled_tokens < len(request).',
        replace('                r.num_computed_tokens + r.num_scheduled_tokens < len(r) for r in requests)\n', '                r.num_scheduled_tokens < len(r) for r in requests)\n'),
    ),
    Mistake(
        'decode-steps-counts-requests',
        "stats['decode_steps'] grows by the batch size instead of by one per decode step",
        'A step is one step, whatever its batch: add 1 to decode_steps per decode step (tokens_out counts the tokens).',
        replace('            self.stats["decode_steps"] += 1\n', '            self.stats["decode_steps"] += len(requests)\n'),
    ),
    Mistake(
        "preemptions-counted-while-waiting",
        "stats['preemptions'] counts a preempted request again at every step it still waits",
        "Count a request when a step's schedule sends it from running back to waiting (it was running before the "
        "step), once: a preempted request that waits several steps is still one preemption.",
        replace("sum(id(r) in running_before for r in self.scheduler.waiting)",
                "sum(len(r) > r.num_prompt_tokens for r in self.scheduler.waiting)"),
    ),
    Mistake(
        "preemptions-counted-for-seats",
        "stats['preemptions'] counts the running requests a decode step leaves out, not the ones sent back",
        "A decode step takes max_num_seqs of the running requests; the others stay running, not preempted. Count "
        "the requests this step's schedule moved from running to waiting.",
        replace("sum(id(r) in running_before for r in self.scheduler.waiting)",
                "(0 if is_prefill else len(running_before) - len(requests))"),
    ),
    Mistake(
        "generator-left-unseeded",
        "the engine's generator is made without manual_seed(0)",
        "__init__ seeds the engine's generator with 0: a request without a seed, alone in a new engine, draws what "
        "a request with seed 0 draws, and every run of the engine is the same.",
        replace("self.generator = torch.Generator(device).manual_seed(0)", "self.generator = torch.Generator(device)"),
    ),
    Mistake(
        "prefill-steps-skip-chunks",
        "stats['prefill_steps'] counts only the prefill steps that leave no prompt incomplete",
        "Every prefill step counts once in prefill_steps, a chunk's too; chunked_prefills counts the chunked ones "
        "again, apart (it is a subset, not the other half).",
        replace('            self.stats["prefill_steps"] += 1\n',
                '            self.stats["prefill_steps"] += all(r.num_computed_tokens + r.num_scheduled_tokens >= len(r) '
                'for r in requests)\n'),
    ),
    Mistake(
        "cached-tokens-per-block",
        "stats['cached_tokens'] counts each cached block once per step, not for each request it serves",
        "The counter is the prompt tokens the prefix cache served: a block that serves three requests of a step "
        "served its tokens three times. Add each admitted request's num_cached_tokens.",
        replace("            self.stats[\"cached_tokens\"] += sum(r.num_cached_tokens for r in requests\n"
                "                                               if r.num_computed_tokens == r.num_cached_tokens)\n",
                "            served = {b for r in requests if r.num_computed_tokens == r.num_cached_tokens\n"
                "                      for b in r.block_table[: r.num_cached_tokens // r.block_size]}\n"
                "            self.stats[\"cached_tokens\"] += len(served) * self.config.block_size\n"),
    ),
    Mistake(
        "cached-tokens-every-chunk",
        "stats['cached_tokens'] adds a request's cached prefix again at every chunk of its prompt",
        "Count the prefix cache's tokens once per request, in its first prefill step (num_computed_tokens == "
        "num_cached_tokens): a later chunk was not served by the cache.",
        replace("            self.stats[\"cached_tokens\"] += sum(r.num_cached_tokens for r in requests\n"
                "                                               if r.num_computed_tokens == r.num_cached_tokens)\n",
                "            self.stats[\"cached_tokens\"] += sum(r.num_cached_tokens for r in requests)\n"),
    ),
    Mistake(
        "chunk-recomputes-earlier-chunks",
        "a chunk's metadata built with num_cached_tokens = the prefix cache's hit, so every chunk recomputes the ones before",
        "Give p01's Sequence num_cached_tokens = r.num_computed_tokens: the earlier chunks' keys are in the cache, and a "
        "chunk computes and stores only its own tokens.",
        replace("r.block_table, num_cached_tokens=r.num_computed_tokens) for r in requests]",
                "r.block_table, num_cached_tokens=r.num_cached_tokens) for r in requests]"),
    ),
    Mistake(
        "graph-padding-rows-returned",
        "decode through a graph returns every row of the captured output, the padding rows' too",
        "A replay computes the graph's rows, padding included; return the first B of them, one per request, as the "
        "eager path does.",
        replace("        return self._logits(self._outputs[size][:B])\n",
                "        return self._logits(self._outputs[size])\n"),
        needs="cuda",
    ),
    Mistake(
        "graph-padding-stored",
        "the decode graph's padding rows given slot 0, so they store keys and values into block 0",
        "Fill the graph's slot buffer with -1 before copying the batch's slots in: a padding row with slot -1 "
        "stores nothing, with slot 0 it overwrites the first token of whichever request holds block 0.",
        replace('buffers["slot_mapping"].fill_(-1)[:B]', 'buffers["slot_mapping"].fill_(0)[:B]'),
        needs="cuda",
    ),
    Mistake(
        "graph-padding-slots-left",
        "the decode graph's slot buffer not filled again, so a padding row keeps the slot a larger step left in it",
        "Fill the whole slot buffer with -1 at every replay, then copy the batch's slots in: after a step of 4 "
        "through the graph of 4, a step of 3 leaves row 3 holding the fourth request's slot, and the replay stores "
        "the padding row's key and value over that request's token.",
        replace('buffers["slot_mapping"].fill_(-1)[:B]', 'buffers["slot_mapping"][:B]'),
        needs="cuda",
    ),
    Mistake(
        "prefill-positions-from-row-numbers",
        "the prefill's positions are the step's rows 0..T-1 instead of each token's position in its request",
        "Pass p01's `meta.positions` to the model: each request's tokens count from where its chunk starts "
        "(num_computed_tokens), and a second request of the step starts again from its own.",
        replace("        hidden = self._forward(meta.input_ids, meta.positions, meta.slot_mapping,",
                "        positions = torch.arange(len(meta.input_ids), device=device)\n"
                "        hidden = self._forward(meta.input_ids, positions, meta.slot_mapping,"),
    ),
    Mistake(
        "rope-positions-from-zero",
        "RoPE angles from the step's rows 0..T-1 instead of the tokens' positions",
        "Rotate by p01's `positions`: a chunk starts at num_computed_tokens, a decode token sits at len(seq) - 1.",
        replace("cos, sin = rope_cos_sin(positions, self.inv_freq,",
                "cos, sin = rope_cos_sin(torch.arange(positions.shape[0], device=positions.device), self.inv_freq,"),
    ),
    Mistake(
        "flash-despite-cache",
        "flash_attn_varlen over the new tokens even when part of the sequence is in the cache",
        "When the metadata has block tables, keys before this step's tokens live only in the cache: use paged_prefill.",
        replace("if meta.block_tables is None:  # nothing cached", "if True:  # nothing cached"),
    ),
    Mistake(
        "one-cache-for-all-layers",
        "every layer stores into and reads layer 0's cache",
        "Each layer has its own keys and values: layer l stores into and reads k_caches[l], v_caches[l].",
        replace("        for index, layer in enumerate(model.layers):\n            q, k, v = before(",
                "        for layer in model.layers:\n            index = 0\n            q, k, v = before("),
    ),
    Mistake(
        'paged-prefill-lengths-of-new-tokens',
        "paged_prefill given each chunk's new-token count as its sequence's whole length",
        "seqlens_k are the whole lengths, cached tokens included (from cu_seqlens_k): with the new tokens' counts the chunk attends to the first keys of its sequence, not to all it has.",
        replace('        seqlens_k = (meta.cu_seqlens_k[1:] - meta.cu_seqlens_k[:-1]).to(torch.int32)  # [B] whole lengths\n', '        seqlens_k = (meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]).to(torch.int32)  # [B] whole lengths\n'),
    ),
    Mistake(
        'logits-in-model-dtype',
        "the runner returns the logits in the model's dtype instead of float32",
        "Return float32 logits ([B, V] .float()): the sampler's softmax and the masks' thresholds need them, and the contract says float32.",
        replace('            return (normed @ model.embed_tokens.T).float()  # [B, V]\n', '            return normed @ model.embed_tokens.T  # [B, V]\n'),
    ),
    Mistake(
        "first-row-logits",
        "the logits of each chunk's first token instead of its last",
        "The next token is predicted by the last computed position: row cu_seqlens_q[b + 1] - 1 of the step.",
        replace("last = meta.cu_seqlens_q[1:].long() - 1", "last = meta.cu_seqlens_q[:-1].long()"),
    ),
    Mistake(
        "kv-stored-after-attention",
        "each layer attends before it stores the new tokens' keys and values",
        "Store first, then attend: store_kvcache writes this step's keys and values into the cache, and the "
        "attention reads them back from there (a token attends to itself and to the chunk's earlier tokens).",
        replace("            store_kvcache(k, v, self.k_caches[index], self.v_caches[index], slot_mapping)\n"
                "            hidden = after(attend(index, q, k, v), hidden,",
                "            attended = attend(index, q, k, v)\n"
                "            store_kvcache(k, v, self.k_caches[index], self.v_caches[index], slot_mapping)\n"
                "            hidden = after(attended, hidden,"),
    ),
    Mistake(
        "decode-not-stored",
        "the decode step attends without storing its token's keys and values",
        "store_kvcache comes before paged_decode in every layer: the new token attends to itself too.",
        replace("        return self._forward(input_ids, positions, slot_mapping, lambda index, q, k, v: paged_decode(",
                "        return self._forward(input_ids, positions, torch.full_like(slot_mapping, -1), "
                "lambda index, q, k, v: paged_decode("),
    ),
    Mistake(
        "tp-no-reduce-after-o-proj",
        "on a rank of a tensor-parallel engine, o_proj's output used without its all_reduce",
        "A rank's o_proj reads only its heads: its output is a partial sum, which dist.all_reduce completes before the residual add (p07's row-parallel rule).",
        replace("    if reduce:\n        dist.all_reduce(projected)\n", ""),
        needs="no-cuda",
    ),
    Mistake(
        "tp-no-reduce-after-down",
        "on a rank of a tensor-parallel engine, down_proj's output used without its all_reduce",
        "down_proj reads the rank's share of the MLP's features: all_reduce its output before the second residual add.",
        replace("    if reduce:\n        dist.all_reduce(mlp_out)\n", ""),
        needs="no-cuda",
    ),
    Mistake(
        "tp-logits-of-rank-zero-only",
        "rank 0 samples from its own slice of the vocabulary, without the other ranks' logits",
        "A rank holds V / tp rows of the tied embedding: the logits need parallel_lm_head, which gathers every rank's slice to rank 0.",
        replace("        logits = parallel_lm_head(normed, model.embed_tokens)  # [B, V] on rank 0, None elsewhere\n",
                "        logits = normed @ model.embed_tokens.T if dist.get_rank() == 0 else None  # [B, V/tp]\n"),
        needs="no-cuda",
    ),
]

VARIANTS = [
    Variant(
        "gumbel-max",
        "the draw as argmax(log probs + Gumbel noise), with the Gumbel noise -log(Exp(1))",
        replace("return (probs / noise).argmax(dim=-1)", "return (probs.log() - noise.log()).argmax(dim=-1)"),
    ),
]

BROKEN = [
    *everyday_breakage("    B, V = logits.shape", "probabilities"),
    Broken("wrong-dtype", replace("    return (probs / noise).argmax(dim=-1)", "    return (probs / noise).argmax(dim=-1).int()"),
           "int32"),
    Broken("tp-rank-one-raises", replace(
        "        logits = parallel_lm_head(normed, model.embed_tokens)  # [B, V] on rank 0, None elsewhere\n",
        "        if dist.get_rank() == 1:\n            raise RuntimeError('rank 1 gives up')\n"
        "        logits = parallel_lm_head(normed, model.embed_tokens)  # [B, V] on rank 0, None elsewhere\n"),
        "rank 1: RuntimeError: rank 1 gives up"),
    Broken("tp-rank-one-hangs", replace(
        "        logits = parallel_lm_head(normed, model.embed_tokens)  # [B, V] on rank 0, None elsewhere\n",
        "        while dist.get_rank() == 1:\n            __import__('time').sleep(0.01)\n"
        "        logits = parallel_lm_head(normed, model.embed_tokens)  # [B, V] on rank 0, None elsewhere\n"),
        "did not return within"),
]

# The contract's rules, as the checks tell them broken (checks/test_p06_engine.py: `rule` on a failure, `RULE_OF` for
# a check that stands for one): the report names the rule where no mistake above reproduces a learner's outputs.
# In the order the parts build on each other: the sampler's functions, the runner, then the engine's loop (its
# draws, counters and outputs, whose checks the runner's mistakes break too): where failures break several, the
# report names the first here.
RULE_RANKING = "layers"
RULES = [
    Rule("greedy-one-hot",
         "a row with temperature 0 is one-hot at its largest logit, whatever the other rows ask for",
         "in probabilities, put 1.0 at each temperature-0 row's argmax and 0 elsewhere; decide the all-greedy "
         "shortcut in _sample only when every row has temperature 0"),
    Rule("temperature-divides",
         "probabilities are the softmax of logits / temperature, row by row: two tokens a row keeps stand in the "
         "ratio exp((logit_i - logit_j) / temperature)",
         "divide each row's logits by its own temperature (a float) before the softmax"),
    Rule("top-k-keeps-ties",
         "top-k keeps every token whose logit is at least the k-th largest of its row (ties with the k-th all "
         "kept), and top_k 0 keeps all",
         "read the k-th largest value at sorted position k - 1 and drop only the tokens strictly below it"),
    Rule("top-p-smallest-set",
         "top-p keeps the most likely tokens, most likely first, while the mass of those before a token is below p "
         "(the token that crosses p is kept; one whose predecessors hold exactly p is not), measured on the "
         "distribution top-k left, and mapped back to the vocabulary's order",
         "sort the top-k softmax, drop where cumsum - probs >= p, scatter the mask back through the sort's order"),
    Rule("renormalised",
         "the probabilities the masks keep are divided by their sum: every row sums to 1",
         "after masking, probs / probs.sum(-1, keepdim=True)"),
    Rule("probabilities-by-definition",
         "probabilities gives each row its own distribution: temperature, then top-k, then top-p, renormalised",
         "compare your rows one by one with the definition on the page (exercises/p06_engine.md › Computation)"),
    Rule("exponential-race",
         "sample returns argmax(probs / noise) in every row, so a token of probability 0 is never chosen",
         "divide, do not multiply, and take the argmax over the vocabulary"),
    Rule("runner-computes-the-model",
         "the runner's prefill and decode compute m04's model on the paged cache: each token at its position, its "
         "K/V stored in its slot, attention over everything cached before it, and the float32 logits of each "
         "request's last computed token",
         "check the metadata of one step by hand (positions, slot_mapping, cu_seqlens, block tables, context "
         "lengths) against exercises/p06_engine.md › Shape trace"),
    Rule("seeded-own-generator",
         "a request with a seed (0 included) draws its row's noise from a generator of its own, seeded once and "
         "carried across its steps; every other row draws from the engine's generator; a chunk's row draws nothing",
         "make the generator in generate when the request is added; in _sample fill only that request's row "
         "from it"),
    Rule("sampled-by-its-params",
         "step draws each request's token from probabilities(logits, temperature, top_k, top_p) with the values its "
         "SamplingParams hold (a temperature or top_p below 1 stays a float), by the race with Exp(1) noise",
         "in _sample, build float tensors of the temperatures and top_ps and an int64 one of the top_ks, then "
         "sample(probabilities(...), noise) with noise drawn by exponential_()"),
    Rule("stats-count-once",
         "LLM.stats counts each thing once: a step is one prefill or one decode step, a preemption once per "
         "request sent back, a cached prefix once per admission, a chunked prefill once per step that leaves a "
         "prompt incomplete, a token out once per token sampled",
         "in step, add to each counter once for what this step did (compare the queues before and after schedule)"),
    Rule("eos-unless-ignored",
         "a request stops at eos_token_id unless its SamplingParams say ignore_eos, then it runs to max_tokens",
         "pass each request's ignore_eos to Scheduler.add"),
    Rule("refuses-over-max-model-len",
         "generate raises ValueError before serving anything when a prompt with its max_tokens is longer than "
         "max_model_len (exactly max_model_len fits), or when the whole cache could never hold it",
         "compare len(prompt) + max_tokens > max_model_len for every request before adding any, and let the "
         "ValueError of p05's add (a request the cache cannot hold) reach the caller"),
    Rule("one-params-per-prompt",
         "generate takes one object with SamplingParams' attributes for every prompt, or a list of exactly one per "
         "prompt: a list of another length raises ValueError before anything runs",
         "broadcast a single params object to every prompt; compare a list's length with the prompts' first"),
    Rule("generate-returns-completions",
         "generate returns one list per prompt, in the prompts' order: that request's completion tokens (its stop "
         "token included), each drawn for it in the step that completed its tokens, never its prompt",
         "keep the requests in a list as you add them and return list(request.completion_token_ids) for each"),
    Rule("ranks-agree",
         "with tensor_parallel_size > 1 the engine gives the tokens of one rank: every rank runs the same steps "
         "on its shard, with p07's collectives",
         "check p07 first (./check.sh p07); then compare one step's logits on two ranks with one"),
]
