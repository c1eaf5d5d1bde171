"""Known mistakes in P03 (FlashAttention), each a patch of `solutions/p03_flash_attention.py`.

Ids match the Pitfalls section of `exercises/p03_flash_attention.md`. A mistake a learner can make in
more than one of the three steps is patched into each of them, so the report names it wherever it is.
"""

from checks.harness.mistakes import Broken, Mistake, Variant, chain, everyday_breakage, replace

_KERNEL_SUM = "        l_i = alpha * l_i + tl.sum(p, 1)\n"
_KERNEL_RESCALE = "        acc = acc * alpha[:, None]\n"

MISTAKES = [
    Mistake(
        "no-rescale",
        "the running sum and output kept as they are when a block raises the max",
        "When the max grows from m_old to m_new, multiply the old sum and the old output by exp(m_old - m_new) "
        "before adding the new block: they were computed against the old max.",
        chain(
            replace("    sum_exp = alpha * sum_exp + p.sum(dim=-1)\n    acc = alpha[..., None] * acc + p @ values",
                    "    sum_exp = sum_exp + p.sum(dim=-1)\n    acc = acc + p @ values"),
            replace(_KERNEL_SUM + _KERNEL_RESCALE, "        l_i = l_i + tl.sum(p, 1)\n"),
        ),
    ),
    Mistake(
        "rescale-l-not-acc",
        "the running sum rescaled when the max grows, but not the unnormalised output",
        "The output accumulator is a sum of exp(s - m) * v: it needs the same exp(m_old - m_new) factor as the sum.",
        chain(
            replace("acc = alpha[..., None] * acc + p @ values", "acc = acc + p @ values"),
            replace(_KERNEL_RESCALE, ""),
        ),
    ),
    Mistake(
        "max-init-zero",
        "the running max starts at 0 instead of -inf",
        "Start m at -inf: from 0, a row whose scores are all far below 0 underflows exp(s - 0) to 0 and divides 0 by 0.",
        chain(
            replace('m = torch.full((), float("-inf"), dtype=scores.dtype, device=scores.device)',
                    "m = torch.zeros((), dtype=scores.dtype, device=scores.device)"),
            replace('m = torch.full((H, rows), float("-inf"), device=q.device)', "m = torch.zeros(H, rows, device=q.device)"),
            replace('m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)', "m_i = tl.zeros([BLOCK_M], tl.float32)"),
        ),
    ),
    Mistake(
        "causal-top-left",
        "the causal mask aligned top-left (query i sees keys j <= i) when there are more keys than queries",
        "With a cached prefix the queries are the last seqlen_q tokens: query i sees keys j <= i + seqlen_k - seqlen_q.",
        chain(
            replace("    diagonal = Tk - Tq  # bottom-right", "    diagonal = 0  # bottom-right"),
            replace("        diagonal = seqlen_k - seqlen_q  # bottom-right", "        diagonal = 0  # bottom-right"),
        ),
    ),
    Mistake(
        "cu-seqlens-bleed",
        "keys counted from the start of the packed batch: sequences see the keys of the sequences before them",
        "Sequence b's keys are rows cu_seqlens_k[b] .. cu_seqlens_k[b+1]-1: offset every key pointer by cu_seqlens_k[b].",
        replace("k_start = tl.load(cu_seqlens_k + seq)", "k_start = tl.load(cu_seqlens_k)"),
    ),
    Mistake(
        "gqa-modulo",
        "query head h reads kv head h % KVH instead of h // (H / KVH)",
        "Consecutive query heads share a kv head: head h reads kv head h // (H // KVH).",
        chain(
            replace("torch.arange(H, device=q.device) // (H // KVH)", "torch.arange(H, device=q.device) % KVH"),
            replace("kv_head = head // GROUP", "kv_head = head % (tl.num_programs(1) // GROUP)"),
        ),
    ),
    Mistake(
        "lse-units-mixed",
        "the LSE adds the running max in log2 units to the natural log of the sum",
        "With exp2 and a log2(e)-scaled score, m and log2(sum) are both in log2 units: lse = (m + log2(sum)) * ln(2).",
        replace("lse_row = (m_i + tl.log2(l_i)) * LN2", "lse_row = m_i + tl.log(l_i)"),
    ),
    Mistake(
        "no-scale",
        "the kernel given log2(e) without the softmax scale",
        "The scores are q . k * softmax_scale (D ** -0.5 by default); the kernel works in log2 units, so pass scale * log2(e).",
        replace("q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, scale * LOG2E,", "q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, LOG2E,"),
    ),
]

VARIANTS = [
    Variant(
        "natural-exp",
        "exp and log in base e with the plain softmax scale (no log2(e) folded in)",
        chain(
            replace("alpha = tl.exp2(m_i - shift)", "alpha = tl.exp(m_i - shift)"),
            replace("p = tl.exp2(s - shift[:, None])", "p = tl.exp(s - shift[:, None])"),
            replace("lse_row = (m_i + tl.log2(l_i)) * LN2", "lse_row = m_i + tl.log(l_i)"),
            replace("cu_seqlens_q, cu_seqlens_k, scale * LOG2E,", "cu_seqlens_q, cu_seqlens_k, scale,"),
        ),
    ),
    Variant(
        "every-tile-masked",
        "one masked loop over every key tile (no unmasked fast path)",
        replace("BLOCK_N, False, CAUSAL)", "BLOCK_N, True, CAUSAL)"),
    ),
]

BROKEN = [
    *everyday_breakage("    B = cu_seqlens_q.shape[0] - 1", "flash_attn_varlen"),
    Broken("wrong-shape", replace("return (out, lse) if return_lse else out", "return (out, lse) if return_lse else out[:, 0]"),
           "returned shape"),
    Broken("nan", replace("o_tile = acc / tl.where(", "o_tile = float('nan') * acc / tl.where("), "NaN"),
    Broken("arange-not-power-of-two", replace("offs_n = tl.arange(0, BLOCK_N)", "offs_n = tl.arange(0, BLOCK_N - 1)"),
           "power of 2"),
    # the whole [H, Tq, Tk] score matrix made (and thrown away): the check that watches tensor sizes, which
    # runs in the worker with the learner's code, must see it
    Broken("builds-the-score-matrix",
           replace("    diagonal = Tk - Tq  # bottom-right alignment",
                   "    torch.einsum('qhd,khd->hqk', q.float(), k.float().repeat_interleave(H // KVH, dim=1))\n"
                   "    diagonal = Tk - Tq  # bottom-right alignment"),
           "the whole [H, Tq, Tk] fp32 score matrix"),
    Broken("import-error", replace("import torch\n", "import torch\nimport kvlab_no_such_module\n"), "ModuleNotFoundError"),
]
