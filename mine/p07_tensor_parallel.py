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
    raise NotImplementedError("column_shard (mine/p07_tensor_parallel.py) is not written yet")


def row_shard(weight: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s block of columns of `weight` `[out, n]`: columns `rank*n/tp .. (rank+1)*n/tp - 1`.

    Raises `ValueError` when `world_size` does not divide n. Returns a new contiguous tensor `[out, n/tp]`.
    """
    raise NotImplementedError("row_shard (mine/p07_tensor_parallel.py) is not written yet")


def merged_column_shard(weight: torch.Tensor, part_sizes: list[int], rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s rows of a fused matrix: `weight` `[sum(part_sizes), in]` is parts stacked by rows
    (q, k, v; or gate, up), and each part is column-sharded on its own; the rank's blocks are stacked in
    the parts' order. `part_sizes` may be any sequence of ints (a list, a tuple, a `torch.Size`).

    Raises `ValueError` when `world_size` does not divide a part. Returns a new tensor
    `[sum(part_sizes) / tp, in]`.
    """
    raise NotImplementedError("merged_column_shard (mine/p07_tensor_parallel.py) is not written yet")


def shard_layer(layer, rank: int, world_size: int) -> TPLayer:
    """Rank `rank`'s `TPLayer` of an m04 `Qwen3Layer` (or any object with its attributes).

    q, k and v are fused (stacked by rows, in that order) and sharded part by part, as are gate and up;
    o_proj and down_proj are row-sharded; the norms are not split (every rank holds them whole). Raises
    `ValueError` unless `world_size` divides H, KVH and I: a rank must own whole heads, and the kv heads
    its query heads read.
    """
    raise NotImplementedError("shard_layer (mine/p07_tensor_parallel.py) is not written yet")


def shard_model(model, rank: int, world_size: int) -> TPWeights:
    """Rank `rank`'s `TPWeights` of an m04 `Qwen3Weights`: the embedding's vocabulary rows column-sharded
    (V must divide by `world_size`: ValueError otherwise, as `column_shard` raises), every layer by `shard_layer`,
    the final norm whole (not split)."""
    raise NotImplementedError("shard_model (mine/p07_tensor_parallel.py) is not written yet")


def vocab_parallel_embedding(token_ids: torch.Tensor, embed_shard: torch.Tensor) -> torch.Tensor:
    """The embeddings of `token_ids` `[T]` (int64, any id in 0 .. V-1) from every rank's vocabulary block.

    This rank holds rows `r*Vr .. (r+1)*Vr - 1` (`embed_shard` `[Vr, hidden]`, r = `dist.get_rank()`): it
    looks up the ids in its block, gives zeros for the others, and one `all_reduce` (a sum) fills in each
    row from the rank that holds it. Returns `[T, hidden]`, the same on every rank, in the shard's dtype.
    """
    raise NotImplementedError("vocab_parallel_embedding (mine/p07_tensor_parallel.py) is not written yet")


def parallel_lm_head(hidden: torch.Tensor, embed_shard: torch.Tensor) -> torch.Tensor | None:
    """The logits of `hidden` `[T, hidden]` against the tied embedding, computed a vocabulary block per rank.

    Each rank computes its slice `hidden @ embed_shard.T` (`[T, Vr]`); one `gather` to rank 0 collects
    the slices, which rank 0 concatenates in rank order. Returns `[T, V]` on rank 0, `None` elsewhere.
    """
    raise NotImplementedError("parallel_lm_head (mine/p07_tensor_parallel.py) is not written yet")


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
    raise NotImplementedError("tp_decoder_layer (mine/p07_tensor_parallel.py) is not written yet")


def tp_model_forward(model, token_ids: torch.Tensor, caches: list[KVCache] | None = None,
                     all_logits: bool = False) -> torch.Tensor | None:
    """m04's `model_forward` on this rank's shard `model` (a `TPWeights` or any object with its
    attributes): the vocab-parallel embedding, every `tp_decoder_layer`, the final norm, the vocab-parallel
    LM head. `token_ids` `[T]` and `caches` (one `KVCache` per layer, this rank's kv heads) as in m04.

    Returns the logits (`[T, V]` with `all_logits`, else `[1, V]`) on rank 0 and `None` elsewhere.
    """
    raise NotImplementedError("tp_model_forward (mine/p07_tensor_parallel.py) is not written yet")


def tp_generate_greedy(model, prompt_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """m04's greedy generation on this rank's shard: prefill `prompt_ids` `[P]` into one new, empty
    `KVCache` per layer (made by this call: nothing of an earlier call on these shards), then decode.
    Rank 0 takes the argmax of its logits and a `broadcast` from rank 0 gives every rank the token to
    feed back, as an int64 tensor (a 16-bit float holds ids exactly only up to 256 or 2048). Returns
    `[max_new_tokens]` int64, the same on every rank.
    """
    raise NotImplementedError("tp_generate_greedy (mine/p07_tensor_parallel.py) is not written yet")
