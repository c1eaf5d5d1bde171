"""Oracles for the attention kernels (p03, p04): attention by its definition in float64, torch SDPA, and
flash-attn where it is installed.

The definition, for one sequence: scores = q . k * scale for every (query, key) pair, -inf where the
causal mask hides the key, softmax over the keys, weighted sum of the values. Query head h reads kv
head h // (H // KVH). Causal is aligned bottom-right: with Tq queries and Tk keys, query i sees keys
j <= i + (Tk - Tq), so the last query sees the last key (a prefix-cache hit has Tk > Tq). A query that
sees no key gets output 0 and log-sum-exp -inf. Everything runs in float64 on the very (rounded)
inputs the kernel gets, so the expected values carry no rounding of their own.
"""

import pytest
import torch
import torch.nn.functional as F


def naive_attention(q, k, v, scale=None, causal=True):
    """q `[Tq, H, D]`, k, v `[Tk, KVH, D]` -> (out `[Tq, H, D]`, lse `[H, Tq]`), both float64."""
    Tq, H, D = q.shape
    Tk, KVH = k.shape[:2]
    scale = D**-0.5 if scale is None else scale
    keys = k.double().repeat_interleave(H // KVH, dim=1)  # [Tk, H, D]
    values = v.double().repeat_interleave(H // KVH, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * scale  # [H, Tq, Tk]
    if causal:
        query_pos = torch.arange(Tq, device=q.device)[:, None]
        key_pos = torch.arange(Tk, device=q.device)[None, :]
        scores = scores.masked_fill(key_pos > query_pos + (Tk - Tq), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # -inf for a row with no visible key
    probs = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0)[..., None])  # 0 on such a row
    return torch.einsum("hqk,khd->qhd", probs, values), lse


def naive_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=None, causal=True):
    """Packed sequences (flash-attn's varlen layout) -> (out `[total_q, H, D]`, lse `[H, total_q]`) float64."""
    outs, lses = [], []
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        out, lse = naive_attention(q[cq[b] : cq[b + 1]], k[ck[b] : ck[b + 1]], v[ck[b] : ck[b + 1]], scale, causal)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, dim=1)


def gather_paged(cache, block_table_row, length):
    """The first `length` tokens of one sequence from a paged cache `[num_blocks, block_size, KVH, D]`:
    key j is in block `block_table_row[j // block_size]` at offset `j % block_size` -> `[length, KVH, D]`."""
    block_size = cache.shape[1]
    positions = torch.arange(length, device=cache.device)
    blocks = block_table_row.long()[positions // block_size]
    return cache.flatten(0, 1)[blocks * block_size + positions % block_size]


def naive_paged(q, k_cache, v_cache, block_table, cu_seqlens_q, cache_seqlens, scale=None, causal=True):
    """Gather each sequence's keys and values, then attention by the definition -> `[total_q, H, D]` float64."""
    outs = []
    cq = cu_seqlens_q.tolist()
    for b, length in enumerate(cache_seqlens.tolist()):
        k = gather_paged(k_cache, block_table[b], length)
        v = gather_paged(v_cache, block_table[b], length)
        outs.append(naive_attention(q[cq[b] : cq[b + 1]], k, v, scale, causal)[0])
    return torch.cat(outs)


def sdpa_attention(q, k, v, scale=None, causal=True):
    """torch's `scaled_dot_product_attention` in q's dtype for one sequence -> `[Tq, H, D]`. The causal
    mask is a boolean matrix aligned bottom-right (SDPA's own is_causal aligns top-left). Every query must
    see at least one key (SDPA gives NaN for a row with none)."""
    Tq, H, D = q.shape
    Tk, KVH = k.shape[:2]
    mask = None
    if causal:
        query_pos = torch.arange(Tq, device=q.device)[:, None]
        mask = torch.arange(Tk, device=q.device)[None, :] <= query_pos + (Tk - Tq)  # True = visible
    keys = k.repeat_interleave(H // KVH, dim=1).transpose(0, 1)  # [H, Tk, D]
    values = v.repeat_interleave(H // KVH, dim=1).transpose(0, 1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)  # [Tq, H, D]


def flash_attn_or_skip():
    """flash-attn's module, or skip the check: it is an optional oracle (a CUDA build, GPUs only)."""
    if not torch.cuda.is_available():
        pytest.skip("flash-attn not installed (it needs an NVIDIA GPU; no GPU here)")
    try:
        import flash_attn
    except ImportError:
        pytest.skip("flash-attn not installed (pip install flash-attn to add it as an oracle)")
    return flash_attn
