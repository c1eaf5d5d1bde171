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
    m_new = torch.maximum(m, scores.amax(dim=-1))
    # A row that has seen only -inf: shift by 0 there, so exp(-inf - shift) is 0 rather than NaN.
    shift = m_new.masked_fill(m_new == float("-inf"), 0.0)
    alpha = torch.exp(m - shift)  # exp(m_old - m_new) <= 1: moves the old sums onto the new max
    p = torch.exp(scores - shift[..., None])  # [*rows, n]
    sum_exp = alpha * sum_exp + p.sum(dim=-1)
    acc = alpha[..., None] * acc + p @ values  # [*rows, n] @ [n, Dv] -> [*rows, Dv]
    return m_new, sum_exp, acc


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
    m = torch.full((), float("-inf"), dtype=scores.dtype, device=scores.device)
    sum_exp = torch.zeros((), dtype=scores.dtype, device=scores.device)
    acc = torch.zeros(values.shape[-1], dtype=scores.dtype, device=scores.device)
    for start in range(0, scores.shape[0], block_size):
        block = slice(start, start + block_size)
        m, sum_exp, acc = online_softmax_step(m, sum_exp, acc, scores[block], values[block])
    return acc / sum_exp


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
    Tq, H, D = q.shape
    Tk, KVH = k.shape[:2]
    scale = D**-0.5 if softmax_scale is None else softmax_scale
    kv_head = torch.arange(H, device=q.device) // (H // KVH)  # [H]: the kv head each query head reads
    diagonal = Tk - Tq  # bottom-right alignment: query i sees keys j <= i + diagonal
    out = torch.empty(Tq, H, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(H, Tq, dtype=torch.float32, device=q.device)
    for q0 in range(0, Tq, block_q):
        q_tile = q[q0 : q0 + block_q].float().transpose(0, 1)  # [H, bq, D]
        rows = q_tile.shape[1]
        m = torch.full((H, rows), float("-inf"), device=q.device)
        sum_exp = torch.zeros(H, rows, device=q.device)
        acc = torch.zeros(H, rows, D, device=q.device)
        # Causal: keys after the tile's last visible one are masked for every row, so skip them.
        stop = min(Tk, q0 + rows + diagonal) if causal else Tk
        for k0 in range(0, max(stop, 0), block_k):
            k_tile = k[k0 : k0 + block_k, kv_head].float().transpose(0, 1)  # [bk, H, D] -> [H, bk, D]
            v_tile = v[k0 : k0 + block_k, kv_head].float().transpose(0, 1)
            scores = q_tile @ k_tile.transpose(1, 2) * scale  # [H, bq, bk]
            if causal:
                query_pos = torch.arange(q0, q0 + rows, device=q.device)[:, None]  # [bq, 1]
                key_pos = torch.arange(k0, k0 + k_tile.shape[1], device=q.device)[None, :]  # [1, bk]
                scores = scores.masked_fill(key_pos > query_pos + diagonal, float("-inf"))
            m, sum_exp, acc = online_softmax_step(m, sum_exp, acc, scores, v_tile)
        out[q0 : q0 + rows] = (acc / sum_exp.clamp_min(1e-30)[..., None]).transpose(0, 1)  # sum_exp == 0: acc is 0 too
        lse[:, q0 : q0 + rows] = m + torch.log(sum_exp)
    return out.to(q.dtype), lse


# ---- the Triton kernel -------------------------------------------------------------------------------

LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * log2(e)), and exp2 is the GPU's native instruction
LN2 = tl.constexpr(0.6931471805599453)  # ln(2), a log2 back to a natural log (a constexpr: kernels read it)


def _configs():
    if os.environ.get("TRITON_INTERPRET") == "1":  # the CPU interpreter: one tile shape, no tuning runs
        return [triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=1)]
    # (query rows, keys per tile, warps, pipeline stages), timed once per head dim, mask and dtype: tiles
    # of 128 rows keep Hopper's and Ampere's tensor cores busy; the last fits D = 256 in shared memory.
    shapes = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (64, 32, 4, 2)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in shapes]


@triton.jit
def _attend_keys(acc, l_i, m_i, q_tile, k_ptrs, v_ptrs, key_start, key_stop, offs_m, offs_n, seqlen_k, diagonal,
                 qk_scale, stride_kt, stride_vt,
                 BLOCK_N: tl.constexpr,
                 MASKED: tl.constexpr,  # False: every key of every tile is visible to every row, no mask needed
                 CAUSAL: tl.constexpr):
    for start_n in range(key_start, key_stop, BLOCK_N):
        keys = start_n + offs_n  # [BLOCK_N] key positions in the sequence
        if MASKED:
            k_tile = tl.load(k_ptrs + start_n * stride_kt, mask=(keys < seqlen_k)[:, None], other=0.0)
        else:
            k_tile = tl.load(k_ptrs + start_n * stride_kt)  # [BLOCK_N, D]
        s = tl.dot(q_tile, tl.trans(k_tile)) * qk_scale  # [BLOCK_M, BLOCK_N] fp32, in log2 units
        if MASKED:
            visible = (keys < seqlen_k)[None, :]
            if CAUSAL:
                visible = visible & (keys[None, :] <= offs_m[:, None] + diagonal)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet: no NaN
        alpha = tl.exp2(m_i - shift)  # rescales the old l and acc to the new max
        p = tl.exp2(s - shift[:, None])
        l_i = alpha * l_i + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if MASKED:
            v_tile = tl.load(v_ptrs + start_n * stride_vt, mask=(keys < seqlen_k)[:, None], other=0.0)
        else:
            v_tile = tl.load(v_ptrs + start_n * stride_vt)
        acc = tl.dot(p.to(v_tile.dtype), v_tile, acc)  # P in the input dtype for the tensor cores, fp32 sum
        m_i = m_new
    return acc, l_i, m_i


@triton.autotune(configs=_configs(), key=["HEAD_DIM", "CAUSAL"])
@triton.jit
def _flash_attn_varlen_kernel(
    q, k, v, out, lse,  # q, out [total_q, H, D]; k, v [total_k, KVH, D]; lse [H, total_q] fp32
    cu_seqlens_q, cu_seqlens_k,  # [B + 1] int32: sequence b owns rows cu[b] .. cu[b+1]-1
    qk_scale,  # softmax_scale * log2(e): scores come out ready for exp2
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    total_q,  # lse's row length
    GROUP: tl.constexpr,  # H // KVH query heads per kv head
    HEAD_DIM: tl.constexpr,  # D, a power of two >= 16 (tl.dot's minimum)
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query rows per program
    BLOCK_N: tl.constexpr,  # keys per tile
):
    # Grid (query tiles, H, B). Tiles run last-first: under a causal mask the last tiles of a sequence
    # see the most keys, and starting them first leaves short work for the end of the launch.
    block_m = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q + seq)
    q_end = tl.load(cu_seqlens_q + seq + 1)
    k_start = tl.load(cu_seqlens_k + seq)
    k_end = tl.load(cu_seqlens_k + seq + 1)
    seqlen_q = q_end - q_start
    seqlen_k = k_end - k_start
    start_m = block_m * BLOCK_M
    if start_m >= seqlen_q:  # this sequence is shorter than the longest one
        return
    kv_head = head // GROUP

    offs_m = start_m + tl.arange(0, BLOCK_M)  # [BLOCK_M] query positions in the sequence
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q_rows = q_start.to(tl.int64) + offs_m
    q_tile = tl.load(q + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                     mask=(offs_m < seqlen_q)[:, None], other=0.0)  # [BLOCK_M, D]
    k_ptrs = k + (k_start.to(tl.int64) + offs_n)[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :]
    v_ptrs = v + (k_start.to(tl.int64) + offs_n)[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max, log2 units
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(s - m)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)  # running sum of exp2(s - m) * v

    # Keys [0, full_end): whole tiles that every row of this program sees; [full_end, key_end): the
    # tiles that need a mask (the causal diagonal, and the sequence's last, partial tile).
    if CAUSAL:
        diagonal = seqlen_k - seqlen_q  # bottom-right: query i sees keys j <= i + diagonal
        full_end = tl.maximum(start_m + diagonal + 1, 0) // BLOCK_N * BLOCK_N  # what the first row sees
        key_end = tl.minimum(seqlen_k, start_m + BLOCK_M + diagonal)  # what the last row sees
    else:
        diagonal = 0
        full_end = seqlen_k // BLOCK_N * BLOCK_N
        key_end = seqlen_k
    acc, l_i, m_i = _attend_keys(acc, l_i, m_i, q_tile, k_ptrs, v_ptrs, 0, full_end, offs_m, offs_n, seqlen_k,
                                 diagonal, qk_scale, stride_kt, stride_vt, BLOCK_N, False, CAUSAL)
    acc, l_i, m_i = _attend_keys(acc, l_i, m_i, q_tile, k_ptrs, v_ptrs, full_end, key_end, offs_m, offs_n,
                                 seqlen_k, diagonal, qk_scale, stride_kt, stride_vt, BLOCK_N, True, CAUSAL)

    in_sequence = offs_m < seqlen_q
    o_tile = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a row that saw no key: acc = 0, output 0
    tl.store(out + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             o_tile.to(out.dtype.element_ty), mask=in_sequence[:, None])
    lse_row = (m_i + tl.log2(l_i)) * LN2  # log2 units back to a natural log; -inf where nothing was seen
    tl.store(lse + head * total_q + q_rows, lse_row, mask=in_sequence)


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
    total_q, H, D = q.shape
    KVH = k.shape[1]
    assert q.dtype in (torch.float16, torch.bfloat16), "the kernel takes float16 or bfloat16 (tensor cores)"
    assert k.dtype == v.dtype == q.dtype and k.shape == v.shape and k.shape[2] == D
    assert H % KVH == 0, "H must be a multiple of KVH"
    assert D in (16, 32, 64, 128, 256), "head dim must be a power of two from 16 to 256"
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1, "the head dim must be contiguous"
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
    assert cu_seqlens_q.shape == cu_seqlens_k.shape and cu_seqlens_q.dim() == 1
    B = cu_seqlens_q.shape[0] - 1
    scale = D**-0.5 if softmax_scale is None else softmax_scale
    out = torch.empty(total_q, H, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(H, total_q, dtype=torch.float32, device=q.device)
    if total_q > 0 and B > 0 and max_seqlen_q > 0:
        grid = lambda meta: (triton.cdiv(max_seqlen_q, meta["BLOCK_M"]), H, B)  # noqa: E731
        _flash_attn_varlen_kernel[grid](
            q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, scale * LOG2E,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
            total_q, GROUP=H // KVH, HEAD_DIM=D, CAUSAL=causal,
        )
    return (out, lse) if return_lse else out

