"""M02 · Thinker attention: QK-norm + GQA + a KV cache.

One Qwen3 attention layer for a single sequence, written so that the same code serves a whole prefill,
a prefill split into chunks, and token-by-token decode, with identical rows in all three. The order of
operations follows Hugging Face's `Qwen3Attention` (projections -> per-head RMSNorm of q and k -> RoPE
-> cache -> causal GQA attention -> o_proj); the cache is a plain list of chunks, the simplest form of
the KV cache that vLLM-style engines page into fixed-size blocks.

Names: T new tokens in this call, past = tokens already in the cache, S = past + T, H query heads,
KVH key/value heads (H % KVH == 0), D head dim.

Run `./check.sh m02` to check this file.
"""

import torch


class KVCache:
    """The keys and values of one layer for one sequence, as a list of chunks (given complete).

    `k[i]` and `v[i]` are the `[t_i, KVH, D]` keys (already normalised and rotated) and values (raw)
    of the i-th call; `len(cache)` is the number of tokens held, `sum(t_i)`.
    """

    def __init__(self) -> None:
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    def __len__(self) -> int:
        return sum(chunk.shape[0] for chunk in self.k)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one call's keys and values, each `[t, KVH, D]`."""
        self.k.append(k)
        self.v.append(v)


def _head_rms_norm(t: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # t: [T, heads, D]; each head is normalised over its own D values, all heads share weight [D].
    t32 = t.to(torch.float32)
    normed = t32 * torch.rsqrt(t32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * normed.to(t.dtype)


def _rotate_half(t: torch.Tensor) -> torch.Tensor:
    first, second = t.chunk(2, dim=-1)  # half-split (NeoX) convention, not interleaved pairs
    return torch.cat((-second, first), dim=-1)


def _apply_rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # t: [T, heads, D]; cos, sin: [T, D] -> [T, 1, D], broadcast over heads
    return t * cos[:, None, :] + _rotate_half(t) * sin[:, None, :]


def attention_forward(
    w, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None = None
) -> torch.Tensor:
    """Causal GQA self-attention over the cached tokens and T new ones.

    Args:
        w: the layer's weights, any object with attributes `q_proj [H*D, hidden]`,
            `k_proj [KVH*D, hidden]`, `v_proj [KVH*D, hidden]`, `o_proj [hidden, H*D]`, `q_norm [D]`,
            `k_norm [D]`, `eps` (float), `num_heads` (H), `num_kv_heads` (KVH), `head_dim` (D).
        x: `[T, hidden]` the new tokens only, same dtype as the weights.
        cos, sin: `[T, D]` RoPE tables for the new tokens' absolute positions `past .. past+T-1`.
        cache: `None` for a plain prefill; otherwise a `KVCache` holding `past` tokens, to which this
            call appends its T rotated keys and raw values, each `[T, KVH, D]` (never expanded to H).

    Returns:
        `[T, hidden]` in `x.dtype`. New token i sits at absolute position `past + i` and attends to keys
        `0 .. past + i`. Scores, softmax and the weighted sum of values run in fp32.

    The inputs `w`, `x`, `cos`, `sin` and the chunks already in `cache` are not modified.
    """
    T = x.shape[0]
    H, KVH, D = w.num_heads, w.num_kv_heads, w.head_dim
    q = (x @ w.q_proj.T).view(T, H, D)  # [T, H*D] -> [T, H, D]: head h owns columns h*D .. h*D+D-1
    k = (x @ w.k_proj.T).view(T, KVH, D)  # [T, KVH, D]
    v = (x @ w.v_proj.T).view(T, KVH, D)  # [T, KVH, D]

    q = _head_rms_norm(q, w.q_norm, w.eps)  # QK-norm comes before RoPE; v is never normalised
    k = _head_rms_norm(k, w.k_norm, w.eps)
    q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)

    past = 0 if cache is None else len(cache)  # read before the append, or the mask shifts by T
    if cache is None:
        keys, values = k, v
    else:
        cache.append(k, v)
        keys, values = torch.cat(cache.k), torch.cat(cache.v)  # [S, KVH, D]
    S = past + T

    group = H // KVH  # query head h reads kv head h // group
    keys = keys.repeat_interleave(group, dim=1)  # [S, KVH, D] -> [S, H, D]
    values = values.repeat_interleave(group, dim=1)

    scores = torch.einsum("thd,shd->hts", q.float(), keys.float()) * D**-0.5  # [H, T, S]
    query_pos = torch.arange(past, S, device=x.device)[:, None]  # [T, 1] absolute positions
    key_pos = torch.arange(S, device=x.device)[None, :]  # [1, S]
    scores = scores.masked_fill(key_pos > query_pos, float("-inf"))  # [T, S] mask broadcasts over H
    probs = scores.softmax(dim=-1)  # over keys; every row sees at least key 0
    out = torch.einsum("hts,shd->thd", probs, values.float()).to(x.dtype)  # [T, H, D]
    return out.reshape(T, H * D) @ w.o_proj.T  # [T, H*D] -> [T, hidden]
