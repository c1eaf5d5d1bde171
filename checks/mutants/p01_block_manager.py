"""Known mistakes in P01 (paged KV block manager), each a patch of `solutions/p01_block_manager.py`.

Ids match the Pitfalls section of `exercises/p01_block_manager.md`.
"""

from checks.harness.mistakes import Broken, Mistake, Variant, chain, everyday_breakage, replace

MISTAKES = [
    Mistake(
        "new-block-off-by-one",
        "a new block opened when the last block holds 1 token instead of when it is full",
        "Before appending, the token needs a new block exactly when len(seq) % block_size == 0 (nano-vllm's `== 1` is tested after the token is in).",
        replace("return len(seq) % self.block_size == 0  # the last block is full", "return len(seq) % self.block_size == 1  # the last block is full"),
    ),
    Mistake(
        "last-block-from-cache",
        "the last block taken from the cache too",
        "Never look up a sequence's last block: when every block is cached nothing is left to compute, and the step has no token to sample from.",
        replace("if full and j < seq.num_blocks - 1 else -1", "if full else -1"),
    ),
    Mistake(
        "hash-not-chained",
        "a block hashed from its own tokens only",
        "Pass the previous block's hash as prefix_hash: the same tokens at another depth, after other tokens, hold other keys and values.",
        chain(
            replace("block_hash = self.hash_block(tokens, prefix_hash) if full else -1", "block_hash = self.hash_block(tokens) if full else -1"),
            replace("self._seal(self.blocks[seq.block_table[j]], tokens, self.hash_block(tokens, prefix_hash))", "self._seal(self.blocks[seq.block_table[j]], tokens, self.hash_block(tokens))"),
        ),
    ),
    Mistake(
        "ref-count-not-decremented",
        "free releases a block only when its last owner leaves, without counting down shared ones",
        "Subtract 1 from every block's ref_count in free, and release it when the count reaches 0: a shared block otherwise never comes back.",
        replace(
            "            block.ref_count -= 1\n            if block.ref_count == 0:\n",
            "            if block.ref_count == 1:\n                block.ref_count = 0\n",
        ),
    ),
    Mistake(
        "stale-hash-entry",
        "a freed block's cache entry kept when the block is taken for other tokens",
        "When a free block is taken for new tokens, delete the hash_to_block_id entry that points at it: its slots are about to be overwritten.",
        replace(
            "        if self.hash_to_block_id.get(block.hash) == block_id:\n            del self.hash_to_block_id[block.hash]\n",
            "",
        ),
    ),
    Mistake(
        "taken-block-keeps-hash",
        "a block taken from the free list for new tokens keeps the hash and token ids it had",
        "A block taken for new tokens (by allocate or append) starts over: besides dropping its cache entry, set "
        "its hash to -1 and its token_ids to [] until it is full again, or a partial block claims the old prefix.",
        replace("        block.ref_count, block.hash, block.token_ids = 1, -1, []\n", "        block.ref_count = 1\n"),
    ),
    Mistake(
        "no-token-check",
        "a cache hit accepted on the hash alone",
        "Compare the cached block's token_ids with the new block's before sharing it: two different blocks can have the same hash.",
        replace("hitting = hitting and found != -1 and self.blocks[found].token_ids == tokens", "hitting = hitting and found != -1"),
    ),
    Mistake(
        "hits-after-a-miss",
        "the lookup goes on after a miss, so a later block can be a hit",
        "From the first miss on, every block is new: keep one flag that stays False once a block misses.",
        replace("hitting = hitting and found != -1 and", "hitting = found != -1 and"),
    ),
    Mistake(
        "free-in-forward-order",
        "free walks the block table first block first",
        "Free a sequence's blocks last to first: the free list is reused from the left, so the tail goes first and the shared prefix stays cached longest.",
        replace("for block_id in reversed(seq.block_table):", "for block_id in seq.block_table:"),
    ),
    Mistake(
        "cu-seqlens-without-zero",
        "cu_seqlens that start at the first sequence's length, not at 0",
        "cu_seqlens has B + 1 entries: 0, then the running totals. Sequence i's tokens are cu_seqlens[i] .. cu_seqlens[i + 1] - 1.",
        chain(
            replace("cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32)", "cu_seqlens_q=torch.tensor(cu_q[1:], dtype=torch.int32)"),
            replace("cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32)", "cu_seqlens_k=torch.tensor(cu_k[1:], dtype=torch.int32)"),
        ),
    ),
    Mistake(
        "positions-from-zero",
        "prefill positions counted from 0 instead of from the cached prefix",
        "A sequence with a cached prefix computes tokens num_cached_tokens .. len - 1: those are their positions (RoPE rotates by them).",
        replace("positions += range(start, len(seq))", "positions += range(len(seq) - start)"),
    ),
    Mistake(
        "slots-for-cached-tokens",
        "the slot mapping lists every token, cached ones included",
        "Only new tokens are computed and stored: slot_mapping has one entry per input id, from num_cached_tokens on.",
        replace("slots += [slot_of(seq, p) for p in range(start, len(seq))]", "slots += [slot_of(seq, p) for p in range(len(seq))]"),
    ),
    Mistake(
        "block-tables-padded-with-zero",
        "short block tables padded with 0",
        "Pad with -1: block 0 is a real block, and a kernel that reads past a table's end would read someone else's keys.",
        replace("rows = [seq.block_table + [-1] * (width - len(seq.block_table)) for seq in seqs]", "rows = [seq.block_table + [0] * (width - len(seq.block_table)) for seq in seqs]"),
    ),
    Mistake(
        "decode-position-is-length",
        "a decode token's position taken as len(seq) instead of len(seq) - 1",
        "The token being decoded is already in the sequence: its position is len(seq) - 1, and the context (len(seq) tokens) includes it.",
        replace("last = [len(seq) - 1 for seq in seqs]", "last = [len(seq) for seq in seqs]"),
    ),
    Mistake(
        "can-allocate-floor",
        "can_allocate counts len // block_size blocks, forgetting the partial last one",
        "A sequence of len tokens needs ceil(len / block_size) blocks (seq.num_blocks): 9 tokens in blocks of 4 need 3.",
        replace("return len(self.free_block_ids) >= seq.num_blocks", "return len(self.free_block_ids) >= len(seq) // self.block_size"),
    ),
    Mistake(
        "can-allocate-strict",
        "can_allocate asks for more free blocks than needed (> instead of >=)",
        "Exactly as many free blocks as the sequence needs is enough: the comparison is >=.",
        replace("return len(self.free_block_ids) >= seq.num_blocks", "return len(self.free_block_ids) > seq.num_blocks"),
    ),
    Mistake(
        "free-keeps-table",
        "free releases the blocks but leaves them in the sequence's block table",
        "After free the sequence holds no block: empty its block_table, so a preempted sequence starts again from nothing.",
        replace("        seq.block_table.clear()\n", ""),
    ),
    Mistake(
        "free-keeps-cached-count",
        "free leaves num_cached_tokens as it was",
        "Set num_cached_tokens to 0 in free: the next allocate counts the hits it finds then, from 0.",
        replace("        seq.num_cached_tokens = 0\n", ""),
    ),
    Mistake(
        "partial-block-sealed",
        "a partial block given its tokens (and hash -1) and entered in the cache",
        "Only a full block gets a hash, its token_ids and a cache entry; a partial one keeps hash -1 and [] until an append fills it.",
        replace("                if full:\n                    self._seal(block, tokens, block_hash)\n",
                "                self._seal(block, tokens, block_hash)\n"),
    ),
    Mistake(
        "hash-by-depth",
        "a block's hash chained to its index in the sequence instead of the previous block's hash",
        "Chain the previous block's hash: the index says where a block sits, not what came before it.",
        chain(
            replace("block_hash = self.hash_block(tokens, prefix_hash) if full else -1", "block_hash = self.hash_block(tokens, j) if full else -1"),
            replace("self._seal(self.blocks[seq.block_table[j]], tokens, self.hash_block(tokens, prefix_hash))", "self._seal(self.blocks[seq.block_table[j]], tokens, self.hash_block(tokens, j))"),
        ),
    ),
    Mistake(
        "take-drops-any-entry",
        "taking a free block deletes the cache entry of its hash even when the entry points at another block",
        "Delete the entry only when hash_to_block_id[block.hash] is this block: a newer block with the same content may own it now.",
        replace("        if self.hash_to_block_id.get(block.hash) == block_id:\n", "        if block.hash in self.hash_to_block_id:\n"),
    ),
]

VARIANTS = [
    Variant(
        "slots-block-by-block",
        "the slot mapping built block by block, as nano-vllm's model runner does",
        replace(
            "        slots += [slot_of(seq, p) for p in range(start, len(seq))]\n",
            "        for j in range(start // seq.block_size, seq.num_blocks):\n"
            "            first = seq.block_table[j] * seq.block_size\n"
            "            slots += range(first, first + len(seq.block(j)))\n",
        ),
    ),
    Variant(
        "append-framing-after",
        "nano-vllm's framing: whether a block opens is asked as if the token were already in (len + 1) % block_size == 1",
        replace("return len(seq) % self.block_size == 0  # the last block is full", "return (len(seq) + 1) % self.block_size == 1 % self.block_size  # the last block is full"),
    ),
]

BROKEN = [
    *everyday_breakage("        for block_id in reversed(seq.block_table):", "decode_metadata"),
    Broken("wrong-type", replace("        return len(self.free_block_ids) >= seq.num_blocks", "        return int(len(self.free_block_ids) >= seq.num_blocks)"), "expected a bool"),
]
