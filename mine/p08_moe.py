"""P08 · Mixture of experts: Qwen3-MoE's sparse block, tokens sorted by expert, a fused Triton kernel, and
experts spread over ranks.

A sparse MoE layer replaces the one MLP of a decoder layer with E small SwiGLU MLPs (the experts) and a
router. The router scores every token against every expert (one matrix product, a softmax in float32),
keeps the k best experts of each token and their probabilities (renormalised over the k when the model
says so); the token's output is the weighted sum of its k experts' outputs. Each token touches only k of
the E experts, so the layer has E times the parameters of one MLP for about k MLPs' worth of work.

Written as a loop over experts (Hugging Face's way) that is E small matrix products on gathered rows. An
engine instead sorts the (token, slot) pairs by expert once, pads each expert's group up to a multiple of
`block_size`, and launches one kernel in which every program multiplies one block of rows by the one
expert that owns the block: the gate/up product, SiLU(gate) * up, then the down product, accumulated in
fp32. The results are put back in token order and weighted. Expert parallelism spreads the experts over
ranks: each rank keeps its own tokens, sends every (token, slot) pair to the rank that owns the expert,
computes what it receives, and sends the results back (two `all_to_all`s, after one that exchanges the
counts).

Ideas from: Shazeer et al., "Outrageously Large Neural Networks: The Sparsely-Gated Mixture-of-Experts
Layer" (2017); Lepikhin et al., "GShard" (2020) for experts over devices; vLLM's `fused_moe` and
`moe_align_block_size` (`vllm/model_executor/layers/fused_moe/`) for the sorted, padded blocks; Hugging
Face's `Qwen3MoeSparseMoeBlock` for the semantics.

Names: T tokens, E experts, k = top_k experts per token, I an expert's intermediate size
(`moe_intermediate_size`), hidden the model width; a pair is (token t, slot j), numbered t*k + j; P the
rows of the permuted, padded layout (a multiple of block_size); r this rank, R ranks, Er = E / R.

Run `./check.sh p08` to check this file.
"""

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
import triton
import triton.language as tl


@dataclass(eq=False)  # compared by identity: == on tensors is elementwise
class MoEWeights:
    """One sparse MoE block's weights (given complete), in Hugging Face's `Qwen3MoeExperts` layout."""

    router: torch.Tensor  # [E, hidden]: the router's (the "gate" linear's) weight
    gate_up_proj: torch.Tensor  # [E, 2*I, hidden]: expert e's gate rows, then its up rows
    down_proj: torch.Tensor  # [E, hidden, I]
    top_k: int  # k, experts per token
    norm_topk_prob: bool  # renormalise the k kept probabilities to sum to 1


@dataclass(eq=False)
class Permutation:
    """The (token, slot) pairs sorted by expert and padded to whole blocks (given complete).

    Expert e's rows are `order[offsets[e] : offsets[e + 1]]`: its pairs in ascending pair index, then the
    padding value T*k up to a multiple of block_size. An expert without pairs has no rows.
    """

    order: torch.Tensor  # [P] int64: the pair index t*k + j of each row, or T*k for a padding row
    block_expert: torch.Tensor  # [P // block_size] int64: the expert of each block of rows
    counts: torch.Tensor  # [E] int64: the pairs routed to each expert
    offsets: torch.Tensor  # [E + 1] int64: where each expert's rows start; offsets[E] = P


@dataclass(eq=False)
class EPShard:
    """One rank's share of a MoE block under expert parallelism (given complete): the router whole, and
    the experts `first_expert .. first_expert + Er - 1`."""

    router: torch.Tensor  # [E, hidden], the same on every rank
    gate_up_proj: torch.Tensor  # [Er, 2*I, hidden]: this rank's experts only
    down_proj: torch.Tensor  # [Er, hidden, I]
    first_expert: int  # the global id of this rank's first expert (r * Er)
    num_experts: int  # E, all ranks' experts
    top_k: int
    norm_topk_prob: bool


def route(hidden: torch.Tensor, router_weight: torch.Tensor, top_k: int,
          norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's k experts and their weights, as Hugging Face's `Qwen3MoeTopKRouter` computes them.

    The logits `hidden @ router_weight.T` are computed in hidden's dtype; the softmax over the E experts
    in float32 (whatever hidden's dtype); `torch.topk` on those float32 probabilities keeps the k largest,
    largest first, and breaks ties as `torch.topk` does (equal logits tie, and so do probabilities that
    underflow to 0); with `norm_topk_prob` the k are divided by their sum (in float32). `hidden` `[T, hidden]`
    and `router_weight` `[E, hidden]` are not modified.

    Returns `(weights [T, k] in hidden's dtype, expert_ids [T, k] int64)`. Raises `ValueError` naming
    both numbers unless 1 <= top_k <= E.
    """
    raise NotImplementedError("route (mine/p08_moe.py) is not written yet")


def moe_reference(hidden: torch.Tensor, w: MoEWeights) -> torch.Tensor:
    """The sparse MoE block written plainly: route, then a loop over the experts in ascending order, each
    on the tokens that chose it, its output times the token's weight added into the token's row
    (`index_add_`, as Hugging Face's `Qwen3MoeExperts`). Every step in hidden's dtype.

    `hidden` `[T, hidden]`; `w` a `MoEWeights` (or any object with its attributes). Returns `[T, hidden]`.
    """
    raise NotImplementedError("moe_reference (mine/p08_moe.py) is not written yet")


def permute(expert_ids: torch.Tensor, num_experts: int, block_size: int) -> Permutation:
    """Sort the (token, slot) pairs by expert and pad each expert's group to whole blocks (vLLM's
    `moe_align_block_size`).

    `expert_ids` `[T, k]` int64 (values 0 .. E-1, E = `num_experts`; not modified): pair t*k + j is token
    t's j-th expert. Returns a `Permutation`: the pairs grouped by expert in ascending expert order, each
    group in ascending pair index and padded with the value T*k up to a multiple of `block_size`; an
    expert with no pair gets no rows. All its tensors are int64 on expert_ids' device.
    """
    raise NotImplementedError("permute (mine/p08_moe.py) is not written yet")


def unpermute(rows: torch.Tensor, perm: Permutation, weights: torch.Tensor) -> torch.Tensor:
    """Put the experts' outputs back in token order: `out[t] = sum_j weights[t, j] * rows[row of pair t*k + j]`.

    `rows` `[P, hidden]` (row i is the output for pair `perm.order[i]`; padding rows are ignored, whatever
    they hold), `weights` `[T, k]`. The sum is taken in float32 and rounded once. Returns `[T, hidden]` in
    rows' dtype. No input is modified.
    """
    raise NotImplementedError("unpermute (mine/p08_moe.py) is not written yet")


def fused_moe(hidden: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, perm: Permutation,
              block_size: int) -> torch.Tensor:
    """Every permuted row's expert output, unweighted: two launches of one Triton kernel.

    Args:
        hidden: `[T, hidden]` float32 or bfloat16, last dim contiguous.
        gate_up_proj: `[E, 2*I, hidden]`, hidden's dtype and device, contiguous.
        down_proj: `[E, hidden, I]`, likewise.
        perm: the `permute` of the routed expert ids with this `block_size` (tensors on hidden's device).
        block_size: rows per block, a power of two >= 16 (tl.dot's smallest tile).

    Row i of the result `[P, hidden]` (hidden's dtype) is expert `block_expert[i // block_size]`'s SwiGLU
    MLP of token `order[i] // k`: the gate/up product and SiLU(gate) * up in one launch (stored in hidden's
    dtype, `[P, I]`), the down product in a second; each product accumulates in fp32. Padding rows may hold
    anything. No input is modified.
    """
    raise NotImplementedError("fused_moe (mine/p08_moe.py) is not written yet")


def moe_block(hidden: torch.Tensor, w: MoEWeights, block_size: int = 16) -> torch.Tensor:
    """The sparse MoE block the engine's way: `route` -> `permute` -> `fused_moe` -> `unpermute`.

    `hidden` `[T, hidden]` or `[B, S, hidden]` (float32 or bfloat16, not modified), `w` a `MoEWeights`.
    Returns hidden's shape and dtype: Hugging Face's `Qwen3MoeSparseMoeBlock` output, which is also what
    the Qwen3-Omni Thinker's `Qwen3OmniMoeThinkerTextSparseMoeBlock` computes (the same router, experts and
    combine).
    """
    raise NotImplementedError("moe_block (mine/p08_moe.py) is not written yet")


def shard_experts(w: MoEWeights, rank: int, world_size: int) -> EPShard:
    """Rank `rank`'s `EPShard` of `w`: experts `rank*Er .. (rank+1)*Er - 1` (Er = E / world_size) of
    gate_up_proj and down_proj (new tensors, not views), the router whole.

    Raises `ValueError` naming both numbers when world_size does not divide E. `w` is not modified.
    """
    raise NotImplementedError("shard_experts (mine/p08_moe.py) is not written yet")


def expert_parallel_moe(hidden: torch.Tensor, shard: EPShard, block_size: int = 16) -> torch.Tensor:
    """The sparse MoE block on this rank's own tokens, the experts spread over the ranks.

    Each rank routes its tokens `hidden` `[T_r, hidden]` (T_r may differ from rank to rank, 0 included)
    with the whole router, and sends every (token, slot) pair to the rank that owns its expert (expert e
    lives on rank e // Er), in three `all_to_all_single` calls: the pair counts per expert (so the owner
    knows which of its experts each received row is for), the token rows, and, after the owner ran
    `permute` and `fused_moe` on what it received, the results back in the order they came. The sender
    weights them and adds each token's k results, as `unpermute` does.

    Returns `[T_r, hidden]` in hidden's dtype: this rank's rows of the one-rank `moe_block`.
    """
    raise NotImplementedError("expert_parallel_moe (mine/p08_moe.py) is not written yet")
