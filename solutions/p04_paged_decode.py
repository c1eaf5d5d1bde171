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


def _configs():
    if os.environ.get("TRITON_INTERPRET") == "1":  # the CPU interpreter: one tile size, no tuning runs
        return [triton.Config({"BLOCK_N": 64}, num_warps=4, num_stages=1)]
    # (keys per tile, warps, pipeline stages), timed once per head dim, tile rows, block size and path:
    # decode reads every K/V byte once, so deep pipelines of modest tiles keep enough bytes in flight.
    shapes = [(64, 4, 3), (64, 4, 4), (128, 4, 3), (32, 4, 4)]
    return [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s) for n, w, s in shapes]


@triton.autotune(configs=_configs(), key=["HEAD_DIM", "BLOCK_M", "BLOCK_SIZE", "CAUSAL", "SPLIT"])
@triton.jit
def _paged_attention_kernel(
    q, k_cache, v_cache, out,  # q, out [total_q, H, D]; caches [num_blocks, BLOCK_SIZE, KVH, D]
    part_out, part_lse,  # SPLIT only: [total_q, H, num_splits, D] and [total_q, H, num_splits] fp32
    block_table, cu_seqlens_q, seqlens_k,  # [B, max_blocks] int32, [B + 1] int32, [B] int32
    qk_scale,  # softmax_scale * log2(e)
    num_splits,  # key ranges per (tile, sequence, kv head)
    stride_qt, stride_qh, stride_ot, stride_oh, stride_table,
    stride_slot, stride_cache_head,  # cache strides of one slot and one kv head (blocks are back to back)
    GROUP: tl.constexpr,  # H // KVH query heads per kv head, all in this program's tile
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block, a power of two
    CAUSAL: tl.constexpr,
    SPLIT: tl.constexpr,  # True: write partials for the merge kernel; False: write the output directly
    BLOCK_M: tl.constexpr,  # rows per tile: BLOCK_M // GROUP query positions x GROUP heads
    BLOCK_N: tl.constexpr,  # keys per tile
):
    m_tile = tl.program_id(0) // num_splits
    split = tl.program_id(0) % num_splits
    kv_head = tl.program_id(1)
    seq = tl.program_id(2)
    POSITIONS = BLOCK_M // GROUP  # query positions per tile
    q_start = tl.load(cu_seqlens_q + seq)
    seqlen_q = tl.load(cu_seqlens_q + seq + 1) - q_start
    seqlen_k = tl.load(seqlens_k + seq)
    first_pos = m_tile * POSITIONS
    if first_pos >= seqlen_q:
        return

    rows = tl.arange(0, BLOCK_M)
    pos = first_pos + rows // GROUP  # [BLOCK_M] query position of each row
    head = kv_head * GROUP + rows % GROUP  # [BLOCK_M] query head of each row: the GROUP heads of kv_head
    row_ok = (rows < POSITIONS * GROUP) & (pos < seqlen_q)
    offs_d = tl.arange(0, HEAD_DIM)
    q_rows = q_start.to(tl.int64) + pos
    q_tile = tl.load(q + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                     mask=row_ok[:, None], other=0.0)  # [BLOCK_M, D]

    # The keys this tile may see, cut into num_splits ranges of whole tiles; this program takes one.
    diagonal = seqlen_k - seqlen_q  # bottom-right causal: position i sees keys j <= i + diagonal
    if CAUSAL:
        key_end = tl.minimum(seqlen_k, first_pos + POSITIONS + diagonal)
    else:
        key_end = seqlen_k
    key_end = tl.maximum(key_end, 0)
    per_split = tl.cdiv(tl.cdiv(key_end, num_splits), BLOCK_N) * BLOCK_N
    key_start = split * per_split
    key_stop = tl.minimum(key_end, key_start + per_split)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max, log2 units
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    table_row = block_table + seq.to(tl.int64) * stride_table
    for start_n in range(key_start, key_stop, BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N] logical key positions
        key_ok = keys < seqlen_k  # never touch a slot (or a -1 table entry) past the sequence's end
        block_ids = tl.load(table_row + keys // BLOCK_SIZE, mask=key_ok, other=0)  # physical block of each key
        slots = block_ids.to(tl.int64) * BLOCK_SIZE + keys % BLOCK_SIZE  # its row in the flat cache
        kv_offsets = slots[:, None] * stride_slot + kv_head * stride_cache_head + offs_d[None, :]
        k_tile = tl.load(k_cache + kv_offsets, mask=key_ok[:, None], other=0.0)  # [BLOCK_N, D]
        s = tl.dot(q_tile, tl.trans(k_tile)) * qk_scale  # [BLOCK_M, BLOCK_N] fp32, log2 units
        visible = key_ok[None, :]
        if CAUSAL:
            visible = visible & (keys[None, :] <= pos[:, None] + diagonal)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - shift)
        p = tl.exp2(s - shift[:, None])
        l_i = alpha * l_i + tl.sum(p, 1)
        v_tile = tl.load(v_cache + kv_offsets, mask=key_ok[:, None], other=0.0)
        acc = tl.dot(p.to(v_tile.dtype), v_tile, acc * alpha[:, None])
        m_i = m_new

    o_tile = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # no visible key (an empty split): 0
    if SPLIT:
        part = (q_rows * (tl.num_programs(1) * GROUP) + head) * num_splits + split  # [BLOCK_M]
        tl.store(part_lse + part, m_i + tl.log2(l_i), mask=row_ok)  # log2 units; -inf for an empty split
        tl.store(part_out + part[:, None] * HEAD_DIM + offs_d[None, :], o_tile, mask=row_ok[:, None])
    else:
        tl.store(out + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 o_tile.to(out.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _merge_splits_kernel(
    part_out, part_lse, out,  # [total_q, H, num_splits, D] fp32, [total_q, H, num_splits] fp32, [total_q, H, D]
    num_splits, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr,
    SPLITS: tl.constexpr,  # num_splits rounded up to a power of two
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS)
    in_range = splits < num_splits
    part = (token.to(tl.int64) * tl.num_programs(1) + head) * num_splits + splits  # [SPLITS]
    lse = tl.load(part_lse + part, mask=in_range, other=float("-inf"))  # log2 of each split's softmax sum
    lse_max = tl.max(lse, 0)
    shift = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # every split empty (no keys): output 0
    weights = tl.exp2(lse - shift)  # split s's share of the whole softmax sum, up to a common factor
    offs_d = tl.arange(0, HEAD_DIM)
    parts = tl.load(part_out + part[:, None] * HEAD_DIM + offs_d[None, :], mask=in_range[:, None], other=0.0)
    total = tl.sum(weights, 0)
    merged = tl.sum(weights[:, None] * parts, 0) / tl.where(total > 0, total, 1.0)  # [D]
    tl.store(out + token * stride_ot + head * stride_oh + offs_d, merged.to(out.dtype.element_ty))


@functools.lru_cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _split_count(programs: int, max_keys: int, device: torch.device) -> int:
    """Splits per (tile, sequence, kv head): about 8 programs per SM, so the launch runs in several waves
    and the last one is short; never a split under MIN_KEYS_PER_SPLIT keys. The CPU interpreter counts as
    one SM, so a small batch with a long context takes the split path there too."""
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 1
    wanted = triton.cdiv(8 * sms, programs)
    return max(1, min(wanted, max_keys // MIN_KEYS_PER_SPLIT, MAX_SPLITS))


def _paged_attention(q, k_cache, v_cache, block_table, cu_seqlens_q, seqlens_k, max_seqlen_q, softmax_scale,
                     causal, num_splits):
    total_q, H, D = q.shape
    num_blocks, block_size, KVH = k_cache.shape[:3]
    B = cu_seqlens_q.shape[0] - 1
    assert q.dtype in (torch.float16, torch.bfloat16), "the kernel takes float16 or bfloat16 (tensor cores)"
    assert k_cache.dtype == v_cache.dtype == q.dtype and k_cache.shape == v_cache.shape
    assert k_cache.shape[3] == D and H % KVH == 0
    assert D in (16, 32, 64, 128, 256), "head dim must be a power of two from 16 to 256"
    assert block_size & (block_size - 1) == 0, "block_size must be a power of two"
    assert q.stride(-1) == 1 and k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    assert k_cache.stride(0) == block_size * k_cache.stride(1), "blocks must lie back to back (flat slots)"
    assert block_table.dtype == seqlens_k.dtype == cu_seqlens_q.dtype == torch.int32
    assert block_table.dim() == 2 and block_table.shape[0] == B and seqlens_k.shape == (B,)
    assert block_table.stride(1) == 1
    group = H // KVH
    block_m = max(16, triton.next_power_of_2(group)) if max_seqlen_q == 1 else max(64, triton.next_power_of_2(group))
    m_tiles = triton.cdiv(max_seqlen_q, block_m // group)
    if num_splits is None:
        num_splits = _split_count(m_tiles * B * KVH, block_table.shape[1] * block_size, q.device)
    assert 1 <= num_splits <= MAX_SPLITS
    out = torch.empty(total_q, H, D, dtype=q.dtype, device=q.device)
    if total_q == 0 or B == 0:
        return out
    split = num_splits > 1
    part_out = torch.empty(total_q, H, num_splits, D, dtype=torch.float32, device=q.device) if split else out
    part_lse = torch.empty(total_q, H, num_splits, dtype=torch.float32, device=q.device) if split else out
    scale = D**-0.5 if softmax_scale is None else softmax_scale
    _paged_attention_kernel[(m_tiles * num_splits, KVH, B)](
        q, k_cache, v_cache, out, part_out, part_lse, block_table, cu_seqlens_q, seqlens_k, scale * LOG2E, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_table.stride(0),
        k_cache.stride(1), k_cache.stride(2),
        GROUP=group, HEAD_DIM=D, BLOCK_SIZE=block_size, CAUSAL=causal, SPLIT=split, BLOCK_M=block_m,
    )
    if split:
        _merge_splits_kernel[(total_q, H)](part_out, part_lse, out, num_splits, out.stride(0), out.stride(1),
                                           HEAD_DIM=D, SPLITS=triton.next_power_of_2(num_splits))
    return out


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
    B = q.shape[0]
    cu_seqlens_q = torch.arange(B + 1, dtype=torch.int32, device=q.device)  # one query per sequence
    return _paged_attention(q, k_cache, v_cache, block_table, cu_seqlens_q, cache_seqlens, 1, softmax_scale,
                            False, num_splits)


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
    return _paged_attention(q, k_cache, v_cache, block_table, cu_seqlens_q, cache_seqlens, max_seqlen_q,
                            softmax_scale, True, num_splits)
