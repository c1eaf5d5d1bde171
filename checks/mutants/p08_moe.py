"""Known mistakes in P08 (mixture of experts), each a patch of `solutions/p08_moe.py`.

Ids match the Pitfalls section of `exercises/p08_moe.md`. softmax-after-topk weighs the k exactly as
renormalised-when-off does (a softmax over the k sums to 1): only the tie check tells them apart, so the
renormalisation mistakes come first, and the report names renormalised-when-off where both fit.
"""

from checks.harness.mistakes import Broken, Mistake, Variant, everyday_breakage, replace

SOFTMAX_AND_TOPK = ("    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]: float32 even for bf16 input\n"
                    "    weights, expert_ids = torch.topk(probs, top_k, dim=-1)  # [T, k] each, largest first\n")
RENORMALISE = "    if norm_topk_prob:\n"
SCALED = "    scaled = rows[real].float() * weights.reshape(-1)[pairs].float()[:, None]  # [T*k, hidden]\n"
EP_START = "    R = dist.get_world_size()\n    Er = shard.gate_up_proj.shape[0]\n"

MISTAKES = [
    Mistake(
        "renormalised-when-off",
        "the k weights renormalised to sum to 1 even when norm_topk_prob is False",
        "Divide by the k probabilities' sum only when norm_topk_prob is set; otherwise a token's weights are its "
        "experts' softmax probabilities as they are, summing to less than 1.",
        replace(RENORMALISE, "    if True:\n"),
    ),
    Mistake(
        "not-renormalised-when-on",
        "the k weights left unnormalised when norm_topk_prob is True",
        "With norm_topk_prob (Qwen3-MoE's setting) divide the k kept probabilities by their sum, in float32, "
        "before casting them back to the input's dtype.",
        replace(RENORMALISE, "    if False:\n"),
    ),
    Mistake(
        "softmax-after-topk",
        "the top k chosen on the logits, and the softmax taken over those k only",
        "Softmax over all E experts first, then keep the k largest. Over the k alone the weights always sum to 1: "
        "the same as renormalising, so it only shows when norm_topk_prob is False (Qwen3-MoE's config has it True).",
        replace(SOFTMAX_AND_TOPK,
                "    top_logits, expert_ids = torch.topk(logits, top_k, dim=-1)  # [T, k] each\n"
                "    weights = torch.softmax(top_logits, dim=-1, dtype=torch.float32)\n"),
    ),
    Mistake(
        "router-in-input-dtype",
        "the router's softmax computed in the input's dtype (bf16), not float32",
        "Pass dtype=torch.float32 to the softmax (HF does): in bf16 two experts whose probabilities differ by less "
        "than an ulp round to a tie, and torch.topk may keep the wrong one.",
        replace(SOFTMAX_AND_TOPK,
                "    probs = torch.softmax(logits, dim=-1)  # [T, E] in hidden's dtype\n"
                "    weights, expert_ids = torch.topk(probs, top_k, dim=-1)  # [T, k] each, largest first\n"),
    ),
    Mistake(
        "gate-up-swapped",
        "the up rows used as the gate and the gate rows as up",
        "gate_up_proj[e] holds I gate rows, then I up rows (HF's Qwen3MoeExperts): SiLU goes on the first half, "
        "and the second half multiplies it.",
        replace("        acc = acc * tl.sigmoid(acc) * acc_up  # SiLU(gate) * up, in fp32\n",
                "        acc = acc_up * tl.sigmoid(acc_up) * acc  # SiLU(up) * gate\n"),
    ),
    Mistake(
        "weight-applied-twice",
        "each expert output multiplied by its routing weight before the combine, and again in it",
        "Weight an expert's output once: in the kernel (vLLM can, with MUL_ROUTED_WEIGHT) or when the k outputs are "
        "summed back per token, not both.",
        replace("    rows = fused_moe(x, w.gate_up_proj, w.down_proj, perm, block_size)  # [P, hidden]\n",
                "    rows = fused_moe(x, w.gate_up_proj, w.down_proj, perm, block_size)  # [P, hidden]\n"
                "    rows = rows * torch.cat([weights.reshape(-1), weights.new_zeros(1)])[perm.order][:, None]\n"),
    ),
    Mistake(
        "weight-never-applied",
        "the k expert outputs summed without their routing weights",
        "out[t] = sum over the slots j of weights[t, j] times pair t*k + j's row: the plain sum gives every chosen "
        "expert a weight of 1.",
        replace(SCALED, "    scaled = rows[real].float()  # [T*k, hidden]\n"),
    ),
    Mistake(
        "block-edge-dropped",
        "the last row of every block left out by the kernel (a bound of block_size - 1)",
        "A block holds rows 0 .. block_size - 1: a mask or range that stops one short loses the last row of each "
        "full block. A block that is not full hides it (its last row is padding), so test counts that are "
        "exact multiples of block_size.",
        replace("    real = pair < num_pairs  # padding rows compute on zeros and store nothing\n",
                "    real = (pair < num_pairs) & (tl.arange(0, BLOCK_SIZE) < BLOCK_SIZE - 1)\n"),
    ),
    Mistake(
        "block-edge-duplicated",
        "the padding rows of an expert's last block repeat its last pair instead of holding T*k",
        "Pad each group with T*k, which no pair has, so the kernel and the combine skip those rows; a copy of the "
        "group's last pair is computed again and added into its token once for each padding row.",
        replace("    order[starts[expert_of] + within] = sorted_pairs\n",
                "    order[starts[expert_of] + within] = sorted_pairs\n"
                "    for e in torch.nonzero(counts).flatten().tolist():  # pad with the group's last pair\n"
                "        last = int(starts[e] + counts[e] - 1)\n"
                "        order[last + 1 : int(ends[e])] = order[last]\n"),
    ),
    Mistake(
        "offset-off-by-one",
        "offsets shifted one place: offsets[e] is where expert e's rows end, not where they start",
        "offsets has E + 1 entries: offsets[0] = 0, offsets[e + 1] = offsets[e] + expert e's padded size, "
        "offsets[E] = P. The inclusive cumulative sum belongs one place later.",
        replace("    offsets = torch.cat([ends.new_zeros(1), ends])  # [E + 1]\n",
                "    offsets = torch.cat([ends, ends[-1:]])  # [E + 1]\n"),
    ),
    Mistake(
        "wrong-rank-experts",
        "each rank's experts start at its rank number, not at rank * E / R",
        "Rank r owns the contiguous experts r*Er .. (r+1)*Er - 1 (Er = E / R): its first_expert is r*Er, and a "
        "pair goes to the rank expert // Er.",
        replace("    first = rank * Er\n", "    first = rank\n"),
    ),
]

VARIANTS = [
    Variant(
        "reference-loop-over-tokens",
        "moe_reference as a loop over tokens, each summing its k experts' weighted outputs",
        replace(
            "    for expert in range(w.gate_up_proj.shape[0]):\n"
            "        tokens, slots = torch.where(expert_ids == expert)  # [n] each: the pairs that chose this expert\n"
            "        if tokens.numel() == 0:\n"
            "            continue\n"
            "        y = _expert_mlp(hidden[tokens], w.gate_up_proj[expert], w.down_proj[expert])  # [n, hidden]\n"
            "        out.index_add_(0, tokens, y * weights[tokens, slots, None])\n",
            "    for t in range(hidden.shape[0]):\n"
            "        for j in expert_ids[t].argsort().tolist():  # experts ascending, as HF adds them\n"
            "            e = int(expert_ids[t, j])\n"
            "            y = _expert_mlp(hidden[t : t + 1], w.gate_up_proj[e], w.down_proj[e])  # [1, hidden]\n"
            "            out[t] += (y * weights[t, j])[0]\n"),
    ),
    Variant(
        "unpermute-gather",
        "unpermute by each pair's row position (a gather and a weighted sum over the k slots), not index_add",
        replace(
            "    pairs = perm.order[real]  # [T*k]\n" + SCALED
            + "    out = torch.zeros(T, rows.shape[1], dtype=torch.float32, device=rows.device)\n"
            "    out.index_add_(0, pairs // k, scaled)\n"
            "    return out.to(rows.dtype)\n",
            "    position = torch.empty(T * k, dtype=torch.int64, device=rows.device)\n"
            "    position[perm.order[real]] = torch.nonzero(real).flatten()  # [T*k]: the row of each pair\n"
            "    picked = rows[position].float().view(T, k, rows.shape[1])  # [T, k, hidden]\n"
            "    return (picked * weights.float()[:, :, None]).sum(1).to(rows.dtype)\n"),
    ),
    Variant(
        "permute-counting-sort",
        "permute by a counting sort: each expert's pairs found in turn and written at its offset",
        replace(
            "    sorted_pairs = torch.argsort(flat, stable=True)  # [T*k]: grouped by expert, pair order kept within\n"
            "    expert_of = flat[sorted_pairs]  # [T*k], ascending\n"
            "    first_of = torch.cumsum(counts, 0) - counts  # [E]: where each expert's pairs start in sorted_pairs\n"
            "    within = torch.arange(T * k, device=flat.device) - first_of[expert_of]  # [T*k]: rank inside the group\n"
            "    order = torch.full((P,), T * k, dtype=torch.int64, device=flat.device)\n"
            "    order[starts[expert_of] + within] = sorted_pairs\n",
            "    order = torch.full((P,), T * k, dtype=torch.int64, device=flat.device)\n"
            "    for e in range(num_experts):\n"
            "        pairs = torch.nonzero(flat == e).flatten()  # ascending\n"
            "        order[int(starts[e]) : int(starts[e]) + pairs.numel()] = pairs\n"),
    ),
]

BROKEN = [
    *everyday_breakage("    shape = hidden.shape", "moe_block"),
    Broken("rank-hangs", replace(EP_START, "    while dist.get_rank() == 1:\n        __import__('time').sleep(0.01)\n"
                                           + EP_START), "waited for it"),
]
