"""P04 · Paged attention in Triton: decode with split-K, and prefill through a block table.

A paged KV cache stores each sequence's keys and values in fixed-size blocks scattered over one pool,
`[num_blocks, block_size, KVH, D]`; the sequence's block table lists its blocks in order, so logical
key j lives in physical block `block_table[j // block_size]`, at offset `j % block_size` — flat slot
`block * block_size + offset`, the address p01 hands out and p02 writes to. The naive way to attend
over it gathers each sequence's keys into a contiguous `[S, KVH, D]` copy first (`k_cache[slots]`) and
runs ordinary attention: every byte of K and V crosses HBM three times (read, write the copy, read it
again). The kernel here reads each K/V tile once, straight through the block table.

Decode is the memory-bound case: one new query per sequence, and the whole history to read. Two
choices keep the reads at full speed:
- Grouped heads. The H/KVH query heads that share a kv head run in one program, as rows of one tile,
  so each K/V tile is loaded once for all of them (it would otherwise be loaded H/KVH times).
- Split-K (flash-decoding). A small batch has too few (sequence, kv head) pairs to fill a GPU, so each
  sequence's keys are cut into `num_splits` ranges handled by separate programs. Each writes its
  partial output and the log-sum-exp of its scores; a second kernel merges them exactly, weighting
  split s by exp(lse_s - max lse) — the same rescaling the online softmax does within one program.

Prefill through the block table (a prefix-cache hit: the cached prefix plus the just-stored new tokens,
so there are more keys than queries) is the same kernel with several query positions per tile and the
causal mask aligned bottom-right, as in p03.

Ideas from: Kwon et al., "Efficient Memory Management for LLM Serving with PagedAttention" (vLLM, 2023);
Dao et al., "Flash-Decoding for long-context inference" (2023); nano-vllm's attention layer.

Names: B sequences, H query heads, KVH kv heads (query head h reads kv head h // (H // KVH)), D head
dim, block_size tokens per cache block, S keys of a sequence (its `cache_seqlens` entry).

Run `./check.sh p04` to check this file.
"""

import functools
import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # exp(x) = exp2(x * log2(e)); exp2 is the GPU's native instruction

MIN_KEYS_PER_SPLIT = 256  # a split shorter than this spends more on its own start-up and merge than it saves

MAX_SPLITS = 64


def paged_decode(q, k_cache, v_cache, block_table, cache_seqlens, softmax_scale=None, num_splits=None):
    """Decode attention: one new query per sequence against its keys in a paged KV cache (Triton).

    Args:
        q: `[B, H, D]` float16 or bfloat16, the new token of each sequence.
        k_cache, v_cache: `[num_blocks, block_size, KVH, D]`, q's dtype; block_size a power of two
            (16 to 256 in practice); query head h reads kv head h // (H // KVH).
        block_table: `[B, max_blocks]` int32: sequence b's keys 0 .. cache_seqlens[b]-1 lie in blocks
            `block_table[b, 0], block_table[b, 1], ...` in order. Entries past the last needed block
            may be -1 and are never read, nor is any slot past a sequence's length.
        cache_seqlens: `[B]` int32, keys per sequence, counting the new token's own (already stored);
            0 (a padding row) gives an output of zeros.
        softmax_scale: multiplies the scores; `None` means `D ** -0.5`.
        num_splits: split-K ranges per sequence (1 = no split; the result is the same either way).
            `None` picks enough splits to fill the device (a small batch with a long context splits).

    Returns:
        `[B, H, D]` in q's dtype: for each sequence and head, the softmax over its S keys of
        `q . k * scale`, applied to the values.

    Constraints: D is a power of two from 16 to 256. The inputs are not modified.
    """
    raise NotImplementedError("paged_decode (mine/p04_paged_decode.py) is not written yet")


def paged_prefill(q, k_cache, v_cache, block_table, cu_seqlens_q, cache_seqlens, max_seqlen_q, softmax_scale=None,
                  num_splits=None):
    """Causal prefill attention reading K/V through a block table (the prefix-cache hit path, Triton).

    The new tokens' keys and values are already in the cache (stored by p02's kernel), after the
    sequence's cached prefix: sequence b has `cache_seqlens[b]` keys and its last `seqlen_q` of them
    belong to its new tokens.

    Args:
        q: `[total_q, H, D]` float16 or bfloat16: the new tokens of all sequences, back to back.
        k_cache, v_cache, block_table, softmax_scale, num_splits: as in `paged_decode`.
        cu_seqlens_q: `[B + 1]` int32, cumulative query lengths from 0 (sequence b owns q rows
            `cu_seqlens_q[b] .. cu_seqlens_q[b+1]-1`).
        cache_seqlens: `[B]` int32 keys per sequence (cached prefix + new tokens), each >= its query
            length.
        max_seqlen_q: the longest query length.

    Returns:
        `[total_q, H, D]` in q's dtype: query i of sequence b sees keys j <= i + cache_seqlens[b] -
        seqlen_q(b) (causal, aligned bottom-right).

    Constraints as in `paged_decode`. The inputs are not modified.
    """
    raise NotImplementedError("paged_prefill (mine/p04_paged_decode.py) is not written yet")
