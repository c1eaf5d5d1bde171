"""Known mistakes in P07 (tensor parallelism), each a patch of `solutions/p07_tensor_parallel.py`.

Ids match the Pitfalls section of `exercises/p07_tensor_parallel.md`.
"""

from checks.harness.mistakes import Broken, Mistake, Rule, Variant, everyday_breakage, replace

MISTAKES = [
    Mistake(
        'column-shard-unchecked',
        'column_shard does not refuse a row count the world size does not divide',
        'Raise ValueError when world_size does not divide the rows: a floor division drops the last rows and no rank holds them.',
        replace('    if n % world_size:\n        raise ValueError(f"{n} rows do not split over {world_size} ranks")\n', ''),
    ),
    Mistake(
        'merged-parts-equal',
        'merged_column_shard cuts the fused matrix into equal parts instead of by part_sizes',
        'Split the fused matrix by part_sizes (torch.split(weight, part_sizes)): q, k and v differ in size whenever there are fewer kv heads than query heads.',
        replace('    parts = torch.split(weight, list(part_sizes), dim=0)\n', '    parts = weight.chunk(len(part_sizes), dim=0)\n'),
    ),
    Mistake(
        "merged-shard-as-one-block",
        "merged_column_shard slices the fused matrix as one block of rows, ignoring part_sizes",
        "Shard each part on its own (torch.split by part_sizes, column_shard of each, stacked): one contiguous block "
        "of the fused rows gives rank 0 only q (or gate) rows and the last rank only v (or up) rows.",
        replace("    parts = torch.split(weight, list(part_sizes), dim=0)\n    return torch.cat([column_shard(part, rank, world_size) for part in parts])\n",
                "    return column_shard(weight, rank, world_size)\n"),
    ),
    Mistake(
        "qkv-contiguous-slice",
        "the fused qkv sliced as one block of rows, not part by part",
        "Shard q, k and v each on its own and stack the rank's blocks: a contiguous slice of the fused matrix gives rank 0 all the q heads and rank 1 the k and v ones.",
        replace("qkv_proj=merged_column_shard(qkv, [H * D, KVH * D, KVH * D], rank, world_size)", "qkv_proj=column_shard(qkv, rank, world_size)"),
    ),
    Mistake(
        "gate-up-contiguous-slice",
        "the fused gate/up sliced as one block of rows",
        "gate and up are two parts: each rank needs its gate rows and the matching up rows, stacked; a contiguous slice gives rank 0 only gate and rank 1 only up.",
        replace("gate_up_proj=merged_column_shard(gate_up, [I, I], rank, world_size)", "gate_up_proj=column_shard(gate_up, rank, world_size)"),
    ),
    Mistake(
        "heads-not-divided",
        "the shard keeps the model's head counts instead of the rank's",
        "A rank runs H / tp query heads and KVH / tp kv heads: set num_heads and num_kv_heads to the rank's share, or the attention splits its q/k/v wrongly.",
        replace("num_heads=H // world_size, num_kv_heads=KVH // world_size", "num_heads=H, num_kv_heads=KVH"),
    ),
    Mistake(
        "kv-heads-not-divided",
        "the shard divides the query heads by the world size but keeps the model's kv heads",
        "num_kv_heads is the rank's share too, KVH / tp: the rank's qkv_proj holds KVH / tp kv heads, and the "
        "attention splits its rows by that count.",
        replace("num_heads=H // world_size, num_kv_heads=KVH // world_size", "num_heads=H // world_size, num_kv_heads=KVH"),
    ),
    Mistake(
        "kvh-not-checked",
        "only the query heads are checked to divide by the world size",
        "Check KVH % tp too: with 2 kv heads on 4 ranks a rank would get half a head (its k rows cut through one), which no attention can use.",
        replace("if H % world_size or KVH % world_size:", "if H % world_size:"),
    ),
    Mistake(
        "heads-compared-not-divided",
        "shard_layer refuses only fewer heads than ranks, not a head count the ranks do not divide",
        "tp must divide H and KVH: 6 heads over 4 ranks are more heads than ranks, yet each rank would hold 1.5 of them.",
        replace("if H % world_size or KVH % world_size:", "if H < world_size or KVH < world_size:"),
    ),
    Mistake(
        "head-counts-as-floats",
        "shard_layer divides the head counts with / (floats) instead of //",
        "H / tp is a float (4 / 2 is 2.0): it equals the count, but a float splits no tensor and sizes no view. Use "
        "H // tp and KVH // tp, which the divisibility check makes exact.",
        replace("num_heads=H // world_size, num_kv_heads=KVH // world_size",
                "num_heads=H / world_size, num_kv_heads=KVH / world_size"),
    ),
    Mistake(
        "gate-up-fused-up-first",
        "shard_layer fuses up before gate, so each rank's gate_up_proj holds its up rows first",
        "Fuse gate first, then up (torch.cat([gate_proj, up_proj])): the layer takes the first half of the rank's "
        "fused output as gate, which SiLU takes, and the second as up.",
        replace("    gate_up = torch.cat([layer.gate_proj, layer.up_proj])  # [2*I, hidden]\n",
                "    gate_up = torch.cat([layer.up_proj, layer.gate_proj])  # [2*I, hidden]\n"),
    ),
    Mistake(
        'gate-up-swapped',
        "the rank's fused gate/up output split as (up, gate)",
        "The shard stacks the rank's gate rows first, then its up rows: the first half is gate, which SiLU takes; the second is up.",
        replace('    gate, up = gate_up.chunk(2, dim=-1)  # [T, Ir] each\n', '    up, gate = gate_up.chunk(2, dim=-1)  # [T, Ir] each\n'),
    ),
    Mistake(
        'row-shard-start-not-scaled',
        "row_shard starts rank r's columns at r instead of r * n / tp",
        "Rank r's block of columns starts at r * (n / tp): the columns r .. r + n/tp - 1 overlap the next rank's and miss its own.",
        replace('    return weight[:, rank * size : (rank + 1) * size].contiguous().clone()\n', '    return weight[:, rank : rank + size].contiguous().clone()\n'),
    ),
    Mistake(
        "o-proj-by-rows",
        "o_proj sharded by rows (column-parallel) instead of by columns",
        "o_proj reads the heads: rank r needs the columns of its heads (row_shard), so its product is a partial sum of the whole hidden state.",
        replace("o_proj=row_shard(layer.o_proj, rank, world_size)", "o_proj=column_shard(layer.o_proj, rank, world_size)"),
    ),
    Mistake(
        "all-reduce-after-column",
        "an all_reduce after the column-parallel gate/up projection",
        "A column-parallel output needs no communication: each rank holds different features. Summing them mixes one rank's features into another's.",
        replace("    gate, up = gate_up.chunk(2, dim=-1)  # [T, Ir] each\n", "    dist.all_reduce(gate_up)\n    gate, up = gate_up.chunk(2, dim=-1)  # [T, Ir] each\n"),
    ),
    Mistake(
        'attention-reads-unnormed',
        'the attention reads the hidden state before the input norm',
        "Norm first: the attention takes rms_norm(hidden, input_layernorm), as m04's decoder layer does; the residual keeps the un-normed one.",
        replace('    attended = attention_forward(_Attention(w), normed, cos, sin, cache)', '    attended = attention_forward(_Attention(w), hidden, cos, sin, cache)'),
    ),
    Mistake(
        "no-reduce-after-o-proj",
        "the attention's partial sums used without the all_reduce after o_proj",
        "After a row-parallel projection each rank holds only its heads' share of the output: all_reduce it before the residual add.",
        replace("    dist.all_reduce(attended)\n", ""),
    ),
    Mistake(
        "no-reduce-after-down",
        "the MLP's partial sums used without the all_reduce after down_proj",
        "down_proj is row-parallel: its output is a partial sum until an all_reduce adds the ranks' shares.",
        replace("    dist.all_reduce(mlp_out)\n", ""),
    ),
    Mistake(
        "mlp-residual-before-reduce",
        "the MLP's residual added on every rank before the all_reduce after down_proj",
        "all_reduce down_proj's partial sums first, then add the residual once: added before, it is summed tp times.",
        replace("    mlp_out = (torch.nn.functional.silu(gate) * up) @ w.down_proj.T  # [T, hidden], this rank's features' part\n"
                "    dist.all_reduce(mlp_out)\n    return hidden + mlp_out\n",
                "    out = hidden + (torch.nn.functional.silu(gate) * up) @ w.down_proj.T\n"
                "    dist.all_reduce(out)\n    return out\n"),
    ),
    Mistake(
        "residual-before-reduce",
        "the residual added on every rank before the all_reduce",
        "all_reduce the partial sums first, then add the residual once: added before, it is summed tp times.",
        replace(
            "    dist.all_reduce(attended)\n    normed, hidden = add_rms_norm(attended, hidden, w.post_attention_layernorm, w.eps)\n",
            "    hidden = attended + hidden\n    dist.all_reduce(hidden)\n    normed = rms_norm(hidden, w.post_attention_layernorm, w.eps)\n",
        ),
    ),
    Mistake(
        'norm-before-reduce',
        "the attention's partial sums added to the residual and normed before the all_reduce",
        "all_reduce o_proj's output first, then add the residual and norm: a norm of one rank's partial sum is not the norm of the whole, and the residual is summed tp times.",
        replace('    dist.all_reduce(attended)\n    normed, hidden = add_rms_norm(attended, hidden, w.post_attention_layernorm, w.eps)\n', '    normed, hidden = add_rms_norm(attended, hidden, w.post_attention_layernorm, w.eps)\n    dist.all_reduce(hidden)\n'),
    ),
    Mistake(
        'mlp-residual-from-normed',
        "the layer's output adds the MLP to the normed hidden state instead of the residual stream",
        'The residual is the hidden state before the post-attention norm (what add_rms_norm returns second): return hidden + mlp_out, not normed + mlp_out.',
        replace('    return hidden + mlp_out\n', '    return normed + mlp_out\n'),
    ),
    Mistake(
        'embedding-not-sharded',
        'shard_model gives every rank the whole embedding instead of its block of the vocabulary',
        "Each rank holds V / tp rows of the embedding (column_shard of embed_tokens): the vocab-parallel lookup and the LM head expect the rank's block.",
        replace('    return TPWeights(column_shard(model.embed_tokens, rank, world_size),\n', '    return TPWeights(model.embed_tokens,\n'),
    ),
    Mistake(
        'embedding-not-reduced',
        "the vocab-parallel embedding returns the rank's masked lookup without the all_reduce",
        "Each rank knows only the ids in its block (the rest are zero rows): all_reduce the lookups so every rank holds every token's embedding.",
        replace('    dist.all_reduce(out)\n    return out\n', '    return out\n'),
    ),
    Mistake(
        "embedding-not-masked",
        "ids outside the rank's vocabulary block not zeroed before the all_reduce",
        "An id another rank holds looks up row 0 here; zero those rows, or every rank adds its row 0 into the sum.",
        replace("    out = embed_shard[local] * mine[:, None].to(embed_shard.dtype)  # [T, hidden]\n", "    out = embed_shard[local]  # [T, hidden]\n"),
    ),
    Mistake(
        "embedding-block-at-zero",
        "every rank's vocabulary block taken to start at id 0",
        "Rank r's block starts at id r * Vr: subtract that from the ids (and mask the ids outside it), or every rank "
        "but rank 0 looks up the wrong rows.",
        replace("    start = dist.get_rank() * rows\n", "    start = 0\n"),
    ),
    Mistake(
        'all-logits-ignored',
        "tp_model_forward returns every position's logits even without all_logits",
        "Without all_logits keep only the last position ([1, V]): that is what a generation step samples from, and the contract's shape.",
        replace('    if not all_logits:\n        hidden = hidden[-1:]\n', ''),
    ),
    Mistake(
        "shard-model-layers-generator",
        "shard_model gives TPWeights.layers as a generator, not a list of layer shards",
        "Shard every layer in shard_model itself, into a list (`[shard_layer(layer, rank, world_size) for layer in "
        "model.layers]`): a generator shards nothing until it is walked, can be walked only once, and has no len().",
        replace("                     [shard_layer(layer, rank, world_size) for layer in model.layers],",
                "                     (shard_layer(layer, rank, world_size) for layer in model.layers),"),
    ),
    Mistake(
        "last-row-only-without-caches",
        "tp_model_forward keeps only the last position when all_logits is False and no caches are given, and every "
        "position with caches",
        "Whether the caller wants every position's logits is all_logits' to say, not whether caches were passed: a "
        "chunked prompt's last chunk, called with its caches, wants its last row only ([1, V]).",
        replace("    if not all_logits:\n        hidden = hidden[-1:]\n",
                "    if not all_logits and caches is None:\n        hidden = hidden[-1:]\n"),
    ),
    Mistake(
        'final-norm-skipped',
        "tp_model_forward feeds the LM head the last layer's output without the final RMSNorm",
        "Apply model.norm (rms_norm with the final weight) to the hidden state before parallel_lm_head, as m04's model_forward does.",
        replace('    return parallel_lm_head(rms_norm(hidden, model.norm, model.eps), model.embed_tokens)\n', '    return parallel_lm_head(hidden, model.embed_tokens)\n'),
    ),
    Mistake(
        'positions-from-zero',
        "tp_model_forward numbers every call's tokens from position 0, whatever the caches hold",
        "A call after others continues the sequence: its first token's position is the number of tokens the caches already hold (len(caches[0])).",
        replace('    past = 0 if caches is None else len(caches[0])\n', '    past = 0\n'),
    ),
    Mistake(
        'lm-head-slice-on-other-ranks',
        'parallel_lm_head returns its own slice on the ranks other than 0',
        'Only rank 0 gathers the whole logits; every other rank sends its slice and returns None, as the contract says.',
        replace('        dist.gather(logits, None, dst=0)\n        return None\n', '        dist.gather(logits, None, dst=0)\n        return logits\n'),
    ),
    Mistake(
        'gather-slices-aliased',
        "the gather's slices are one tensor listed tp times, so every slice holds the same rank's logits",
        "Make tp distinct tensors ([torch.empty_like(logits) for _ in range(tp)]): [t] * tp is one tensor tp times, and gather writes every rank's slice into it.",
        replace('    slices = [torch.empty_like(logits) for _ in range(world_size)]\n', '    slices = [torch.empty_like(logits)] * world_size\n'),
    ),
    Mistake(
        "gather-out-of-order",
        "the gathered logit slices concatenated in reverse rank order",
        "Rank r holds vocabulary ids r*Vr .. (r+1)*Vr - 1: concatenate the slices in rank order, rank 0's first.",
        replace("    return torch.cat(slices, dim=-1)", "    return torch.cat(slices[::-1], dim=-1)"),
    ),
    Mistake(
        'one-cache-for-all-layers',
        'tp_generate_greedy gives every layer the same KVCache',
        'Each layer stores its own keys and values: make one KVCache per layer ([KVCache() for _ in layers]); [KVCache()] * L is one object L times.',
        replace('    caches = [KVCache() for _ in model.layers]\n', '    caches = [KVCache()] * len(model.layers)\n'),
    ),
    Mistake(
        'greedy-prefill-without-caches',
        'tp_generate_greedy runs the prompt without the caches, so the decode steps see none of it',
        "Pass the caches to the prompt's forward as well: the decode steps attend to the prompt's keys and values only if the prefill stored them.",
        replace('    logits = tp_model_forward(model, prompt_ids, caches)\n', '    logits = tp_model_forward(model, prompt_ids)\n'),
    ),
    Mistake(
        "token-not-broadcast",
        "only rank 0 knows the chosen token; the other ranks feed back a placeholder",
        "Every rank must run the next step on the same token: broadcast rank 0's choice before feeding it back.",
        replace("        dist.broadcast(token, src=0)\n", ""),
    ),
]

VARIANTS = [
    Variant(
        "lm-head-all-gather",
        "the LM head's slices collected with all_gather on every rank (rank 0 still the only one to return them)",
        replace(
            "    if dist.get_rank() != 0:\n        dist.gather(logits, None, dst=0)\n        return None\n"
            "    slices = [torch.empty_like(logits) for _ in range(world_size)]\n    dist.gather(logits, slices, dst=0)\n",
            "    slices = [torch.empty_like(logits) for _ in range(world_size)]\n    dist.all_gather(slices, logits)\n"
            "    if dist.get_rank() != 0:\n        return None\n",
        ),
    ),
    Variant(
        "embedding-masked-fill",
        "the embedding's foreign rows zeroed with masked_fill instead of a multiplication",
        replace("    out = embed_shard[local] * mine[:, None].to(embed_shard.dtype)  # [T, hidden]\n",
                "    out = embed_shard[local].masked_fill(~mine[:, None], 0)  # [T, hidden]\n"),
    ),
]

BROKEN = [
    *everyday_breakage("    normed = rms_norm(hidden, w.input_layernorm, w.eps)\n    attended", "tp_decoder_layer"),
    Broken("rank-one-raises", replace(
        "    normed = rms_norm(hidden, w.input_layernorm, w.eps)\n    attended",
        "    if dist.get_rank() == 1:\n        raise RuntimeError('rank 1 gives up')\n"
        "    normed = rms_norm(hidden, w.input_layernorm, w.eps)\n    attended"), "rank 1: `tp_decoder_layer` raised"),
    Broken("rank-one-hangs", replace(
        "    normed = rms_norm(hidden, w.input_layernorm, w.eps)\n    attended",
        "    while dist.get_rank() == 1:\n        __import__('time').sleep(0.01)\n"
        "    normed = rms_norm(hidden, w.input_layernorm, w.eps)\n    attended"), "waited for it"),
]

# The contract's rules, one per function, in the order the functions build on each other (checks/test_p07_tensor_
# parallel.py: `rule` on a failure, `RULE_OF` for a check that stands for one): where a learner's failures break
# several, the report names the first here, the lowest function that breaks its contract (a wrong shard breaks every
# function that uses it).
RULE_RANKING = "layers"
RULES = [
    Rule("column-shard",
         "column_shard gives rank r the rows [r * n / tp, (r + 1) * n / tp) of the weight, as a tensor of its own, "
         "and raises ValueError when tp does not divide the rows",
         "slice weight[r * n // tp : (r + 1) * n // tp] after checking n % tp == 0, and return a copy"),
    Rule("row-shard",
         "row_shard gives rank r the columns [r * n / tp, (r + 1) * n / tp) of the weight, as a tensor of its own; "
         "it raises ValueError when tp does not divide the columns n (the rows stay whole, whatever their number)",
         "slice weight[:, r * n // tp : (r + 1) * n // tp] and return a copy"),
    Rule("merged-shard-part-by-part",
         "merged_column_shard shards each part of a fused matrix (part_sizes: q, k, v or gate, up) on its own and "
         "concatenates the rank's slices in the parts' order; a part the world size does not divide raises ValueError",
         "weight.split(part_sizes), column_shard each part, torch.cat the results"),
    Rule("shard-layer",
         "shard_layer gives each rank its q, k and v heads (part by part), its gate and up features, the o_proj and "
         "down_proj columns that match them, the norms whole, and the head counts H / tp and KVH / tp; it raises "
         "ValueError when tp does not divide H, KVH or the intermediate size",
         "column-shard the fused projections with merged_column_shard, row-shard o_proj and down_proj, divide "
         "both head counts"),
    Rule("shard-model",
         "shard_model shards every layer with shard_layer and gives rank r the embedding rows of its vocabulary "
         "block, keeping the final norm whole; it raises ValueError when tp does not divide the vocabulary",
         "column_shard the embedding (it refuses a vocabulary tp does not divide); shard_layer each layer"),
    Rule("embedding-masked-and-reduced",
         "vocab_parallel_embedding looks up the ids in the rank's block [start, start + Vr) at id - start, gives "
         "zeros for every other id, and all_reduces the sum over the ranks",
         "mask = (ids >= start) & (ids < start + Vr); look up (ids - start) * mask, zero the rows outside, "
         "dist.all_reduce"),
    Rule("lm-head-gathered",
         "parallel_lm_head computes the rank's [T, Vr] logits, gathers every rank's slice to rank 0 and "
         "concatenates them along the vocabulary in rank order; the other ranks return None",
         "dist.gather into a list of tp distinct tensors on rank 0, torch.cat(slices, dim=-1)"),
    Rule("layer-reduces-partial-sums",
         "tp_decoder_layer is HF's decoder layer on the rank's heads and features: o_proj's and down_proj's "
         "outputs are partial sums, all_reduced (summed) before each residual add, with the input and post-"
         "attention norms where HF has them, and attention over every key its cache holds",
         "all_reduce right after o_proj and right after down_proj, then add_rms_norm as on one rank"),
    Rule("two-all-reduces-a-layer",
         "a decoder layer makes exactly two collectives (all_reduce after o_proj and after down_proj); the model "
         "adds one for the embedding and one gather for the LM head; every rank makes the same ones in the same "
         "order, whatever its data",
         "do not reduce anything else (the column-parallel outputs are the rank's own), and skip none on a rank "
         "(a rank whose block holds every id still all_reduces its embedding)"),
    Rule("model-forward",
         "tp_model_forward is HF's model: the embedding, every layer at the positions that follow what its cache "
         "holds, the final norm, the LM head; without all_logits, only the last position's logits",
         "positions from caches[0]'s length; final_norm before parallel_lm_head; logits[-1:] unless all_logits"),
    Rule("caches-per-layer-and-rank",
         "every rank keeps one KVCache per layer with its own KVH / tp kv heads, appended chunk by chunk; "
         "tp_generate_greedy makes new ones, empty, at every call",
         "make [KVCache() for _ in layers] on every rank (in tp_generate_greedy, at every call, never kept on the "
         "shards) and pass caches[i] to layer i"),
    Rule("greedy-broadcasts",
         "tp_generate_greedy prefills the prompt into the caches, then feeds one new token per step; rank 0's "
         "argmax is broadcast so every rank feeds the same token, and every rank returns the max_new_tokens tokens",
         "after each forward, dist.broadcast the chosen token from rank 0 and feed only it"),
]
