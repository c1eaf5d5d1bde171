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
    raise NotImplementedError("attention_forward (mine/m02_thinker_attention.py) is not written yet")
