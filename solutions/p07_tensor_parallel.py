"""P07 · Tensor parallelism: one Qwen3 model split across ranks, as Megatron-LM and nano-vllm split it.

A model too big for one GPU is cut across `tp` of them, layer by layer. Each rank (one process per GPU,
joined in a `torch.distributed` process group: NCCL on GPUs, gloo on CPUs) holds a slice of every
weight matrix, and the slices are chosen so that a layer needs only two collectives:

- column-parallel (qkv and gate/up): rank r holds a block of the output rows, so it computes its own
  query, key and value heads and its own share of the MLP's intermediate features, with no
  communication. A fused matrix is sliced part by part: the fused qkv of rank r is its q heads, then its
  k heads, then its v heads;
- row-parallel (o_proj and down): rank r holds the input columns that match its heads (or its
  intermediate features), so its product is a partial sum of the full output. One `all_reduce` adds
  the partial sums, after o_proj and again after down_proj, and every rank then holds the whole hidden
  state;
- vocab-parallel embedding and LM head: rank r holds a block of the vocabulary's rows. The embedding
  looks up the ids in its block, zeroes the rest, and an `all_reduce` fills in every row; the LM head
  computes the rank's slice of the logits, and `gather` brings the slices to rank 0 in rank order.

Attention needs no communication at all: with H / tp query heads and KVH / tp kv heads per rank (both
must divide), the heads a rank owns read only the kv heads it owns, and its KV cache holds just those.

Ideas from: Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism" (2019); nano-vllm (`nanovllm/layers/linear.py`, `embed_head.py`).

Names: tp ranks (the world size), r this rank, H / KVH / D the model's heads, kv heads and head size,
Hr = H / tp and KVHr = KVH / tp a rank's share, I the MLP's intermediate size and Ir = I / tp, V the
vocabulary and Vr = V / tp.

Run `./check.sh p07` to check this file.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

# Your own modules, from this folder (the stub keeps these imports for you, hence the noqa).
from .m01_rmsnorm import add_rms_norm, rms_norm  # noqa: F401
from .m02_thinker_attention import KVCache, attention_forward  # noqa: F401
from .m03_rope import inverse_frequencies, rope_cos_sin  # noqa: F401
from .m04_qwen3_model import Qwen3Layer, Qwen3Weights  # noqa: F401


@dataclass(eq=False)  # compared by identity: == on tensors is elementwise
class TPLayer:
    """One rank's shard of a decoder layer (given complete). `[out, in]` layout, as in m04.

    The head counts are this rank's: `num_heads` is Hr and `num_kv_heads` is KVHr.
    """

    qkv_proj: torch.Tensor  # [(Hr + 2*KVHr)*D, hidden]: this rank's q heads, then its k heads, then its v heads
    o_proj: torch.Tensor  # [hidden, Hr*D]: the columns that read this rank's heads
    q_norm: torch.Tensor  # [D], the same on every rank
    k_norm: torch.Tensor  # [D]
    input_layernorm: torch.Tensor  # [hidden]
    post_attention_layernorm: torch.Tensor  # [hidden]
    gate_up_proj: torch.Tensor  # [2*Ir, hidden]: this rank's gate rows, then its up rows
    down_proj: torch.Tensor  # [hidden, Ir]: the columns that read this rank's features
    eps: float
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass(eq=False)
class TPWeights:
    """One rank's shard of the whole model (given complete). `embed_tokens` holds vocabulary rows
    `r*Vr .. (r+1)*Vr - 1`; it is the LM head too (tied)."""

    embed_tokens: torch.Tensor  # [Vr, hidden]
    layers: list[TPLayer]
    norm: torch.Tensor  # [hidden], the same on every rank
    eps: float
    rope_theta: float
    head_dim: int


def column_shard(weight: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s block of rows of `weight` `[n, in]`: rows `rank*n/tp .. (rank+1)*n/tp - 1`.

    Raises `ValueError` when `world_size` does not divide n. Returns a new tensor `[n/tp, in]` (not a
    view of `weight`, which is not modified).
    """
    n = weight.shape[0]
    if n % world_size:
        raise ValueError(f"{n} rows do not split over {world_size} ranks")
    size = n // world_size
    return weight[rank * size : (rank + 1) * size].clone()


def row_shard(weight: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s block of columns of `weight` `[out, n]`: columns `rank*n/tp .. (rank+1)*n/tp - 1`.

    Raises `ValueError` when `world_size` does not divide n. Returns a new contiguous tensor `[out, n/tp]`.
    """
    n = weight.shape[1]
    if n % world_size:
        raise ValueError(f"{n} columns do not split over {world_size} ranks")
    size = n // world_size
    return weight[:, rank * size : (rank + 1) * size].contiguous().clone()


def merged_column_shard(weight: torch.Tensor, part_sizes: list[int], rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s rows of a fused matrix: `weight` `[sum(part_sizes), in]` is parts stacked by rows
    (q, k, v; or gate, up), and each part is column-sharded on its own; the rank's blocks are stacked in
    the parts' order. `part_sizes` may be any sequence of ints (a list, a tuple, a `torch.Size`).

    Raises `ValueError` when `world_size` does not divide a part. Returns a new tensor
    `[sum(part_sizes) / tp, in]`.
    """
    parts = torch.split(weight, list(part_sizes), dim=0)
    return torch.cat([column_shard(part, rank, world_size) for part in parts])


def shard_layer(layer, rank: int, world_size: int) -> TPLayer:
    """Rank `rank`'s `TPLayer` of an m04 `Qwen3Layer` (or any object with its attributes).

    q, k and v are fused (stacked by rows, in that order) and sharded part by part, as are gate and up;
    o_proj and down_proj are row-sharded; the norms are not split (every rank holds them whole). Raises
    `ValueError` unless `world_size` divides H, KVH and I: a rank must own whole heads, and the kv heads
    its query heads read.
    """
    H, KVH, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
    if H % world_size or KVH % world_size:
        raise ValueError(f"{H} query heads and {KVH} kv heads do not split over {world_size} ranks: tp must divide "
                         f"both")
    qkv = torch.cat([layer.q_proj, layer.k_proj, layer.v_proj])  # [(H + 2*KVH)*D, hidden]
    gate_up = torch.cat([layer.gate_proj, layer.up_proj])  # [2*I, hidden]
    I = layer.gate_proj.shape[0]  # noqa: E741 - the MLP's intermediate size, as the docs name it
    return TPLayer(
        qkv_proj=merged_column_shard(qkv, [H * D, KVH * D, KVH * D], rank, world_size),
        o_proj=row_shard(layer.o_proj, rank, world_size),
        q_norm=layer.q_norm, k_norm=layer.k_norm,
        input_layernorm=layer.input_layernorm, post_attention_layernorm=layer.post_attention_layernorm,
        gate_up_proj=merged_column_shard(gate_up, [I, I], rank, world_size),
        down_proj=row_shard(layer.down_proj, rank, world_size),
        eps=layer.eps, num_heads=H // world_size, num_kv_heads=KVH // world_size, head_dim=D,
    )


def shard_model(model, rank: int, world_size: int) -> TPWeights:
    """Rank `rank`'s `TPWeights` of an m04 `Qwen3Weights`: the embedding's vocabulary rows column-sharded
    (V must divide by `world_size`: ValueError otherwise, as `column_shard` raises), every layer by `shard_layer`,
    the final norm whole (not split)."""
    return TPWeights(column_shard(model.embed_tokens, rank, world_size),
                     [shard_layer(layer, rank, world_size) for layer in model.layers],
                     model.norm, model.eps, model.rope_theta, model.head_dim)


class _Attention:
    """A rank's attention weights as m02's `attention_forward` reads them: its heads only."""

    def __init__(self, w):
        q_rows, kv_rows = w.num_heads * w.head_dim, w.num_kv_heads * w.head_dim
        self.q_proj, self.k_proj, self.v_proj = torch.split(w.qkv_proj, [q_rows, kv_rows, kv_rows])
        self.o_proj, self.q_norm, self.k_norm = w.o_proj, w.q_norm, w.k_norm
        self.eps, self.num_heads, self.num_kv_heads, self.head_dim = w.eps, w.num_heads, w.num_kv_heads, w.head_dim


def vocab_parallel_embedding(token_ids: torch.Tensor, embed_shard: torch.Tensor) -> torch.Tensor:
    """The embeddings of `token_ids` `[T]` (int64, any id in 0 .. V-1) from every rank's vocabulary block.

    This rank holds rows `r*Vr .. (r+1)*Vr - 1` (`embed_shard` `[Vr, hidden]`, r = `dist.get_rank()`): it
    looks up the ids in its block, gives zeros for the others, and one `all_reduce` (a sum) fills in each
    row from the rank that holds it. Returns `[T, hidden]`, the same on every rank, in the shard's dtype.
    """
    rows = embed_shard.shape[0]
    start = dist.get_rank() * rows
    mine = (token_ids >= start) & (token_ids < start + rows)  # [T] the ids in this rank's block
    local = torch.where(mine, token_ids - start, 0)  # an id outside looks up row 0 and is zeroed below
    out = embed_shard[local] * mine[:, None].to(embed_shard.dtype)  # [T, hidden]
    dist.all_reduce(out)
    return out


def parallel_lm_head(hidden: torch.Tensor, embed_shard: torch.Tensor) -> torch.Tensor | None:
    """The logits of `hidden` `[T, hidden]` against the tied embedding, computed a vocabulary block per rank.

    Each rank computes its slice `hidden @ embed_shard.T` (`[T, Vr]`); one `gather` to rank 0 collects
    the slices, which rank 0 concatenates in rank order. Returns `[T, V]` on rank 0, `None` elsewhere.
    """
    logits = hidden @ embed_shard.T  # [T, Vr]
    world_size = dist.get_world_size()
    if dist.get_rank() != 0:
        dist.gather(logits, None, dst=0)
        return None
    slices = [torch.empty_like(logits) for _ in range(world_size)]
    dist.gather(logits, slices, dst=0)
    return torch.cat(slices, dim=-1)  # [T, Vr] x tp -> [T, V], rank 0's block first


def tp_decoder_layer(w, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     cache: KVCache | None = None) -> torch.Tensor:
    """One decoder layer on this rank's shard `w` (a `TPLayer` or any object with its attributes).

    As m04's `decoder_layer_forward`, with two collectives: the attention (m02's, on this rank's Hr query
    heads and KVHr kv heads; its `cache`, if given, gains their keys and values only) ends in o_proj,
    whose partial sum one `all_reduce` completes before the residual add; the SwiGLU MLP runs on the
    rank's Ir features (gate and up from the fused `gate_up_proj`, every step in the input's dtype) and
    down_proj's partial sum is completed by a second `all_reduce`, before the second residual add.
    `hidden` `[T, hidden]`, `cos`/`sin` `[T, D]` are the same on every rank and not modified.

    Returns `[T, hidden]`, the same on every rank.
    """
    normed = rms_norm(hidden, w.input_layernorm, w.eps)
    attended = attention_forward(_Attention(w), normed, cos, sin, cache)  # [T, hidden], this rank's heads' part
    dist.all_reduce(attended)
    normed, hidden = add_rms_norm(attended, hidden, w.post_attention_layernorm, w.eps)
    gate_up = normed @ w.gate_up_proj.T  # [T, 2*Ir]: column-parallel, this rank's features, no communication
    gate, up = gate_up.chunk(2, dim=-1)  # [T, Ir] each
    mlp_out = (torch.nn.functional.silu(gate) * up) @ w.down_proj.T  # [T, hidden], this rank's features' part
    dist.all_reduce(mlp_out)
    return hidden + mlp_out


def tp_model_forward(model, token_ids: torch.Tensor, caches: list[KVCache] | None = None,
                     all_logits: bool = False) -> torch.Tensor | None:
    """m04's `model_forward` on this rank's shard `model` (a `TPWeights` or any object with its
    attributes): the vocab-parallel embedding, every `tp_decoder_layer`, the final norm, the vocab-parallel
    LM head. `token_ids` `[T]` and `caches` (one `KVCache` per layer, this rank's kv heads) as in m04.

    Returns the logits (`[T, V]` with `all_logits`, else `[1, V]`) on rank 0 and `None` elsewhere.
    """
    T = token_ids.shape[0]
    past = 0 if caches is None else len(caches[0])
    positions = torch.arange(past, past + T)
    cos, sin = rope_cos_sin(positions, inverse_frequencies(model.head_dim, model.rope_theta), model.norm.dtype)
    hidden = vocab_parallel_embedding(token_ids, model.embed_tokens)  # [T, hidden]
    for index, layer in enumerate(model.layers):
        hidden = tp_decoder_layer(layer, hidden, cos, sin, None if caches is None else caches[index])
    if not all_logits:
        hidden = hidden[-1:]
    return parallel_lm_head(rms_norm(hidden, model.norm, model.eps), model.embed_tokens)


def tp_generate_greedy(model, prompt_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """m04's greedy generation on this rank's shard: prefill `prompt_ids` `[P]` into one new, empty
    `KVCache` per layer (made by this call: nothing of an earlier call on these shards), then decode.
    Rank 0 takes the argmax of its logits and a `broadcast` from rank 0 gives every rank the token to
    feed back, as an int64 tensor (a 16-bit float holds ids exactly only up to 256 or 2048). Returns
    `[max_new_tokens]` int64, the same on every rank.
    """
    caches = [KVCache() for _ in model.layers]
    logits = tp_model_forward(model, prompt_ids, caches)
    tokens = []
    for step in range(max_new_tokens):
        token = logits[-1].argmax().reshape(1) if dist.get_rank() == 0 else torch.zeros(1, dtype=torch.int64)
        dist.broadcast(token, src=0)
        tokens.append(token)
        if step + 1 < max_new_tokens:
            logits = tp_model_forward(model, token, caches)
    return torch.cat(tokens)
