"""Known mistakes in P02 (store_kvcache), each a patch of `solutions/p02_store_kvcache.py`.

Ids match the Pitfalls section of `exercises/p02_store_kvcache.md`. Where a mistake has a PyTorch form
too, the patch makes it in both versions, so the report names it whichever version the learner got wrong.
Every write a mutant makes lands inside the buffers the checks surround the caches with.
"""

from checks.harness.mistakes import Broken, Mistake, Variant, chain, everyday_breakage, replace

MISTAKES = [
    Mistake(
        "minus-one-not-skipped",
        "tokens with slot -1 stored anyway",
        "Skip a token whose slot is -1 (a padding row): return early in the kernel; in PyTorch, index -1 silently means the last slot.",
        chain(
            replace("    if slot == -1:\n        return\n", ""),
            replace("    keep = slot_mapping != -1  # [N]: padding rows (slot -1) store nothing\n", "    keep = slot_mapping == slot_mapping  # [N]\n"),
        ),
    ),
    Mistake(
        "contiguous-stride-assumed",
        "the keys and values read as if tokens were ROW elements apart",
        "Pass key.stride(0) and value.stride(0) to the kernel: K and V sliced from a fused qkv output have a token stride wider than KVH*D.",
        replace("key, key.stride(0), value, value.stride(0),", "key, ROW, value, ROW,"),
    ),
    Mistake(
        "k-written-to-v",
        "the keys stored in the value cache",
        "The value cache gets `value`: check the second store (a copy-paste of the first one is the usual cause).",
        chain(
            replace("tl.store(v_cache_ptr + slot * cache_slot_stride + lanes, value, mask=inside)", "tl.store(v_cache_ptr + slot * cache_slot_stride + lanes, key, mask=inside)"),
            replace("v_rows[slots] = value[keep].reshape(-1, KVH * D)", "v_rows[slots] = key[keep].reshape(-1, KVH * D)"),
        ),
    ),
    Mistake(
        "slot-as-block-id",
        "the slot used as a block id (offset slot * block_size * ROW)",
        "A slot is already block_id * block_size + offset: slot s starts s * KVH*D elements in, k_cache.stride(1) apart, not stride(0).",
        replace("k_cache, v_cache, k_cache.stride(1), slot_mapping,", "k_cache, v_cache, k_cache.stride(0), slot_mapping,"),
    ),
]

VARIANTS = [
    Variant(
        "index-copy",
        "the PyTorch version with index_copy_ instead of an indexed assignment",
        chain(
            replace("k_rows[slots] = key[keep].reshape(-1, KVH * D)", "k_rows.index_copy_(0, slots, key[keep].reshape(-1, KVH * D))"),
            replace("v_rows[slots] = value[keep].reshape(-1, KVH * D)", "v_rows.index_copy_(0, slots, value[keep].reshape(-1, KVH * D))"),
        ),
    ),
]

BROKEN = [
    *everyday_breakage("    ROW = KVH * D", "store_kvcache"),
    Broken(
        "input-modified",
        replace("    keep = slot_mapping != -1  # [N]: padding rows (slot -1) store nothing\n", "    keep = slot_mapping != -1\n    key.zero_()\n"),
        "changed its input `key` in place",
    ),
]
