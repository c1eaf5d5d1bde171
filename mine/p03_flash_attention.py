"""P03 · FlashAttention: online softmax, tiled attention, and a Triton varlen kernel.

Naive attention for one head computes S = QK^T * scale ([Tq, Tk]), P = softmax(S) row by row, then
O = PV. On a GPU each of S and P makes a round trip through HBM: O(Tq * Tk) bytes written and read back,
which for long prompts costs far more time than the arithmetic. FlashAttention never forms S: it
walks the keys tile by tile, keeps a tile of scores in on-chip memory, and folds each tile into three
running quantities per query row with the online softmax — the running max m, the running sum
l = sum exp(s - m) and the unnormalised output acc = sum exp(s - m) v. When a new tile raises the max,
the old l and acc are multiplied by exp(m_old - m_new); this is exact, not an approximation, because
exp(s - m_new) = exp(s - m_old) * exp(m_old - m_new). At the end O = acc / l and the log-sum-exp of
the row's scores is m + log(l).

Three steps, each checked on its own: `online_softmax_step` / `online_softmax` (one row, block by
block), `tiled_attention` (the same idea on tiles of queries and keys, in PyTorch), and
`flash_attn_varlen`, a Triton kernel with flash-attn's varlen interface: sequences of different
lengths packed back to back and located by `cu_seqlens`, grouped-query heads, causal masking aligned
bottom-right (the prefix-cache case, where a sequence has more keys than queries), and the LSE.

Ideas from: Milakov & Gimelshein, "Online normalizer calculation for softmax" (2018); Dao et al.,
"FlashAttention" (2022) and "FlashAttention-2" (2023); the Triton fused-attention tutorial.

Names: T/Tq/Tk tokens (queries/keys) of one sequence, B sequences, H query heads, KVH key/value heads
(H % KVH == 0; query head h reads kv head h // (H // KVH)), D head dim.

Run `./check.sh p03` to check this file.
"""

import os

import torch
import triton
import triton.language as tl


def online_softmax_step(m, sum_exp, acc, scores, values):
    """Fold one block of scores (and their values) into the running state of an online softmax.

    Args:
        m: `[*rows]` running max of the scores seen so far (`-inf` before the first block).
        sum_exp: `[*rows]` running sum of `exp(s - m)` over those scores (0 before the first block).
        acc: `[*rows, Dv]` running sum of `exp(s - m) * v`, the output before dividing by sum_exp.
        scores: `[*rows, n]` this block's scores (`-inf` for a masked key).
        values: `[n, Dv]`, or `[*batch, n, Dv]` broadcasting with `scores` under `torch.matmul`
            (e.g. scores `[H, R, n]` with values `[H, n, Dv]`): the values of this block's keys.

    Returns:
        `(m, sum_exp, acc)` after the block, same shapes and dtype. When the block raises the max, the old
        `sum_exp` and `acc` are rescaled by `exp(m_old - m_new)`. A row that has seen only `-inf` scores keeps
        `m = -inf`, `sum_exp = 0`, `acc = 0` (no NaN). After the last block, the softmax-weighted sum of the
        values is `acc / sum_exp` and the log-sum-exp of all the scores is `m + log(sum_exp)`.

    The inputs are not modified.
    """
    raise NotImplementedError("online_softmax_step (mine/p03_flash_attention.py) is not written yet")


def online_softmax(scores, values, block_size):
    """`softmax(scores) @ values` for one row, visiting the scores `block_size` at a time.

    Args:
        scores: `[S]` one row of scores, S >= 1, at least one of them finite.
        values: `[S, Dv]`.
        block_size: how many scores each step sees (the last block may be shorter).

    Returns:
        `[Dv]` in the dtype of `scores`. Never materialises more than one block of `exp(scores)`, and
        stays finite for scores of any magnitude (all near -300, or all near +300: exp overflows in fp32).
    """
    raise NotImplementedError("online_softmax (mine/p03_flash_attention.py) is not written yet")


def tiled_attention(q, k, v, block_q, block_k, softmax_scale=None, causal=True):
    """Attention for one sequence, one tile of queries against one tile of keys at a time.

    Args:
        q: `[Tq, H, D]`.
        k, v: `[Tk, KVH, D]`, same dtype as q; query head h reads kv head h // (H // KVH).
        block_q, block_k: tile sizes (any positive ints; they need not divide Tq or Tk).
        softmax_scale: multiplies the scores; `None` means `D ** -0.5`.
        causal: query i sees keys j <= i + (Tk - Tq) (aligned bottom-right: the last query sees the
            last key), else all keys.

    Returns:
        `(out [Tq, H, D] in q.dtype, lse [H, Tq] float32)`, computed in float32: out is the softmax-
        weighted sum of the visible values and lse the natural log-sum-exp of the scaled scores. A query
        that sees no key gets out = 0 and lse = -inf. No tensor half the size of the `[H, Tq, Tk]` score
        matrix (or larger) is ever created.

    The inputs are not modified.
    """
    raise NotImplementedError("tiled_attention (mine/p03_flash_attention.py) is not written yet")
LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * log2(e)), and exp2 is the GPU's native instruction

LN2 = tl.constexpr(0.6931471805599453)  # ln(2), a log2 back to a natural log (a constexpr: kernels read it)


def flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                      causal=True, return_lse=False):
    """FlashAttention forward over a batch of packed variable-length sequences (a Triton kernel).

    Args:
        q: `[total_q, H, D]` float16 or bfloat16; the queries of all sequences, back to back.
        k, v: `[total_k, KVH, D]`, q's dtype; query head h reads kv head h // (H // KVH).
            The last dim must be contiguous; other strides are free (views into a fused qkv buffer work).
        cu_seqlens_q, cu_seqlens_k: `[B + 1]` int32 on q's device, cumulative lengths starting at 0:
            sequence b owns q rows `cu_seqlens_q[b] .. cu_seqlens_q[b+1]-1` and the matching k/v rows.
        max_seqlen_q: the longest query length (sizes the launch grid).
        max_seqlen_k: the longest key length (flash-attn's interface has it; this kernel needs no more
            than each sequence's own length).
        softmax_scale: multiplies the scores; `None` means `D ** -0.5`.
        causal: query i of a sequence sees keys j <= i + (seqlen_k - seqlen_q) (bottom-right alignment,
            as flash-attn does); else every key of its own sequence.
        return_lse: also return the log-sum-exp.

    Returns:
        `out [total_q, H, D]` in q's dtype; with `return_lse`, `(out, lse)` where `lse [H, total_q]`
        float32 is the natural log of the sum of exp(scaled score) over the visible keys. A query that
        sees no key (causal, more queries than keys) gets out = 0 and lse = -inf.

    Constraints: D is a power of two from 16 to 256. The inputs are not modified.
    """
    raise NotImplementedError("flash_attn_varlen (mine/p03_flash_attention.py) is not written yet")
