"""Known mistakes in P04 (paged attention), each a patch of `solutions/p04_paged_decode.py`.

Ids match the Pitfalls section of `exercises/p04_paged_decode.md`. Every mutant reads only memory the
cache really has (the Triton interpreter has no bounds checks: a wild read ends the whole process).
"""

from checks.harness.mistakes import Broken, Mistake, Variant, chain, everyday_breakage, replace

MISTAKES = [
    Mistake(
        "seqlen-off-by-one",
        "one key fewer than cache_seqlens: the token just stored is left out",
        "cache_seqlens[b] already counts the new token (stored before attention runs): read keys 0 .. cache_seqlens[b]-1.",
        replace("seqlen_k = tl.load(seqlens_k + seq)", "seqlen_k = tl.load(seqlens_k + seq) - 1"),
    ),
    Mistake(
        "read-past-end",
        "keys read up to the end of the sequence's last block instead of cache_seqlens",
        "Mask every key position >= cache_seqlens[b], in the loads and in the scores: the rest of the last block is "
        "stale (or another sequence's future) data.",
        replace("key_ok = keys < seqlen_k  #", "key_ok = keys < tl.cdiv(seqlen_k, BLOCK_SIZE) * BLOCK_SIZE  #"),
    ),
    Mistake(
        "block-id-as-slot",
        "the physical block number used as a slot number (block + offset instead of block * block_size + offset)",
        "A block holds block_size slots: key j is at slot block_table[j // block_size] * block_size + j % block_size.",
        replace("slots = block_ids.to(tl.int64) * BLOCK_SIZE + keys % BLOCK_SIZE",
                "slots = block_ids.to(tl.int64) + keys % BLOCK_SIZE"),
    ),
    Mistake(
        "block-table-ignored",
        "logical block i read from physical block i (the block table never consulted)",
        "Blocks are handed out in any order: look up block_table[b, j // block_size] for every key j.",
        replace("block_ids = tl.load(table_row + keys // BLOCK_SIZE, mask=key_ok, other=0)",
                "block_ids = tl.where(key_ok, keys // BLOCK_SIZE, 0)"),
    ),
    Mistake(
        "gqa-modulo",
        "query head h read kv head h % KVH instead of h // (H / KVH)",
        "The heads sharing kv head g are g * (H // KVH) .. g * (H // KVH) + H // KVH - 1: consecutive, not strided.",
        replace("head = kv_head * GROUP + rows % GROUP", "head = kv_head + (rows % GROUP) * tl.num_programs(1)"),
    ),
    Mistake(
        "split-merge-no-lse",
        "split-K partial outputs averaged instead of weighted by their softmax sums (exp of their LSEs)",
        "Each split's output is normalised by its own sum: merge with weights exp(lse_s - max lse), divided by their sum.",
        replace("weights = tl.exp2(lse - shift)", 'weights = tl.where(lse > float("-inf"), 1.0, 0.0)'),
    ),
    Mistake(
        "no-scale",
        "softmax_scale ignored: the scores are never multiplied by D ** -0.5",
        "With softmax_scale None the scale is D ** -0.5; pass scale * log2(e) to the kernel, never log2(e) alone.",
        replace("        q, k_cache, v_cache, out, part_out, part_lse, block_table, cu_seqlens_q, seqlens_k, scale * LOG2E, num_splits,",
                "        q, k_cache, v_cache, out, part_out, part_lse, block_table, cu_seqlens_q, seqlens_k, LOG2E, num_splits,"),
    ),
]

VARIANTS = [
    Variant(
        "natural-log-merge",
        "split LSEs stored as natural logs and merged with exp",
        chain(
            replace("tl.store(part_lse + part, m_i + tl.log2(l_i), mask=row_ok)",
                    "tl.store(part_lse + part, (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=row_ok)"),
            replace("weights = tl.exp2(lse - shift)", "weights = tl.exp(lse - shift)"),
        ),
    ),
]

BROKEN = [
    *everyday_breakage("    group = H // KVH", "paged_decode"),
    Broken("wrong-shape", replace("    return out\n\n\ndef paged_decode(", "    return out[:, 0]\n\n\ndef paged_decode("),
           "returned shape"),
    Broken("nan", replace("o_tile = acc / tl.where(", "o_tile = float('nan') * acc / tl.where("), "NaN"),
    Broken("import-error", replace("import torch\n", "import torch\nimport kvlab_no_such_module\n"), "ModuleNotFoundError"),
]
