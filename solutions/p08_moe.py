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
    E = router_weight.shape[0]
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k {top_k} must be between 1 and the number of experts, {E}")
    logits = F.linear(hidden, router_weight)  # [T, E] in hidden's dtype
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]: float32 even for bf16 input
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)  # [T, k] each, largest first
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(hidden.dtype), expert_ids


def _expert_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One expert's SwiGLU MLP on rows `x` `[n, hidden]`: `gate_up` `[2*I, hidden]`, `down` `[hidden, I]`."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)  # [n, I] each: the gate rows come first
    return F.linear(F.silu(gate) * up, down)  # [n, hidden]


def moe_reference(hidden: torch.Tensor, w: MoEWeights) -> torch.Tensor:
    """The sparse MoE block written plainly: route, then a loop over the experts in ascending order, each
    on the tokens that chose it, its output times the token's weight added into the token's row
    (`index_add_`, as Hugging Face's `Qwen3MoeExperts`). Every step in hidden's dtype.

    `hidden` `[T, hidden]`; `w` a `MoEWeights` (or any object with its attributes). Returns `[T, hidden]`.
    """
    weights, expert_ids = route(hidden, w.router, w.top_k, w.norm_topk_prob)
    out = torch.zeros_like(hidden)
    for expert in range(w.gate_up_proj.shape[0]):
        tokens, slots = torch.where(expert_ids == expert)  # [n] each: the pairs that chose this expert
        if tokens.numel() == 0:
            continue
        y = _expert_mlp(hidden[tokens], w.gate_up_proj[expert], w.down_proj[expert])  # [n, hidden]
        out.index_add_(0, tokens, y * weights[tokens, slots, None])
    return out


def permute(expert_ids: torch.Tensor, num_experts: int, block_size: int) -> Permutation:
    """Sort the (token, slot) pairs by expert and pad each expert's group to whole blocks (vLLM's
    `moe_align_block_size`).

    `expert_ids` `[T, k]` int64 (values 0 .. E-1, E = `num_experts`; not modified): pair t*k + j is token
    t's j-th expert. Returns a `Permutation`: the pairs grouped by expert in ascending expert order, each
    group in ascending pair index and padded with the value T*k up to a multiple of `block_size`; an
    expert with no pair gets no rows. All its tensors are int64 on expert_ids' device.
    """
    T, k = expert_ids.shape
    flat = expert_ids.reshape(-1)  # [T*k]: pair p's expert
    counts = torch.bincount(flat, minlength=num_experts)  # [E]
    padded = (counts + block_size - 1) // block_size * block_size  # [E]: whole blocks, 0 for an idle expert
    ends = torch.cumsum(padded, 0)  # [E]: where each expert's rows end
    starts = ends - padded  # [E]
    P = int(ends[-1])
    sorted_pairs = torch.argsort(flat, stable=True)  # [T*k]: grouped by expert, pair order kept within
    expert_of = flat[sorted_pairs]  # [T*k], ascending
    first_of = torch.cumsum(counts, 0) - counts  # [E]: where each expert's pairs start in sorted_pairs
    within = torch.arange(T * k, device=flat.device) - first_of[expert_of]  # [T*k]: rank inside the group
    order = torch.full((P,), T * k, dtype=torch.int64, device=flat.device)
    order[starts[expert_of] + within] = sorted_pairs
    block_expert = torch.repeat_interleave(torch.arange(num_experts, device=flat.device), padded // block_size)
    offsets = torch.cat([ends.new_zeros(1), ends])  # [E + 1]
    return Permutation(order, block_expert, counts, offsets)


def unpermute(rows: torch.Tensor, perm: Permutation, weights: torch.Tensor) -> torch.Tensor:
    """Put the experts' outputs back in token order: `out[t] = sum_j weights[t, j] * rows[row of pair t*k + j]`.

    `rows` `[P, hidden]` (row i is the output for pair `perm.order[i]`; padding rows are ignored, whatever
    they hold), `weights` `[T, k]`. The sum is taken in float32 and rounded once. Returns `[T, hidden]` in
    rows' dtype. No input is modified.
    """
    T, k = weights.shape
    real = perm.order < T * k  # [P]: the rows that hold a pair
    pairs = perm.order[real]  # [T*k]
    scaled = rows[real].float() * weights.reshape(-1)[pairs].float()[:, None]  # [T*k, hidden]
    out = torch.zeros(T, rows.shape[1], dtype=torch.float32, device=rows.device)
    out.index_add_(0, pairs // k, scaled)
    return out.to(rows.dtype)


# ---- the Triton kernels -------------------------------------------------------------------------------


def _configs():
    if os.environ.get("TRITON_INTERPRET") == "1":  # the CPU interpreter: one tile shape, no tuning runs; wide
        # tiles, since each step of the loop costs the interpreter far more than the arithmetic in it
        return [triton.Config({"BLOCK_N": 128, "BLOCK_K": 128}, num_warps=4, num_stages=1)]
    # (output columns per program, reduction tile, warps, stages), timed once per shape and dtype
    shapes = [(64, 64, 4, 3), (128, 64, 4, 3), (64, 128, 4, 3), (128, 128, 8, 2), (32, 64, 4, 4),
              (128, 64, 8, 4), (256, 64, 8, 3), (256, 64, 8, 4), (256, 32, 8, 4)]  # the wide ones: a prefill's
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": kk}, num_warps=w, num_stages=s) for n, kk, w, s in shapes]


@triton.autotune(configs=_configs(), key=["N", "K", "BLOCK_SIZE", "GATED"])
@triton.jit
def _expert_gemm_kernel(
    x_ptr,  # GATED: hidden [T, hidden]; else the activations [P, I], one row per permuted row
    w_ptr,  # GATED: gate_up_proj [E, 2*I, hidden]; else down_proj [E, hidden, I]
    out_ptr,  # GATED: the activations [P, I]; else the expert outputs [P, hidden]
    order_ptr,  # [P] int64: the pair of each row, num_pairs for padding
    block_expert_ptr,  # [P // BLOCK_SIZE] int64
    num_pairs,  # T*k: a pair index this large is padding
    top_k,  # k: pair p is token p // k
    stride_xm, stride_we, stride_wn, stride_om,  # the row strides (the last dims are contiguous)
    N,  # output columns: I (GATED) or hidden
    K,  # the reduction: hidden (GATED) or I
    BLOCK_SIZE: tl.constexpr,  # rows per block, all of one expert (a power of two >= 16)
    GATED: tl.constexpr,  # True: SiLU(x @ gate.T) * (x @ up.T); False: x @ down.T
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no tf32 on the GPU), else the tensor cores' default
    BLOCK_N: tl.constexpr,  # output columns per program
    BLOCK_K: tl.constexpr,  # reduction tile
):
    """Grid (P // BLOCK_SIZE, cdiv(N, BLOCK_N)): one block of rows times one expert's weight tile."""
    block = tl.program_id(0)
    col = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output columns
    rows = block.to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)  # [BLOCK_SIZE] permuted rows
    pair = tl.load(order_ptr + rows)  # [BLOCK_SIZE]
    real = pair < num_pairs  # padding rows compute on zeros and store nothing
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    x_rows = (pair // top_k) if GATED else rows  # the token's row of hidden, or the row's own activations
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert * stride_we
    acc = tl.zeros([BLOCK_SIZE, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_SIZE, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k  # [BLOCK_K]
        x = tl.load(x_ptr + x_rows[:, None] * stride_xm + kk[None, :], mask=real[:, None] & (kk < K)[None, :],
                    other=0.0)  # [BLOCK_SIZE, BLOCK_K]
        w_mask = (kk < K)[:, None] & (col < N)[None, :]
        w = tl.load(w_base + col[None, :] * stride_wn + kk[:, None], mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
        if GATED:  # the up rows sit N rows below the gate rows
            w_up = tl.load(w_base + (col[None, :] + N) * stride_wn + kk[:, None], mask=w_mask, other=0.0)
            acc_up = tl.dot(x, w_up, acc_up, input_precision=DOT_PRECISION)
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up  # SiLU(gate) * up, in fp32
    tl.store(out_ptr + rows[:, None] * stride_om + col[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=real[:, None] & (col < N)[None, :])


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
    T = hidden.shape[0]
    E, two_I, H = gate_up_proj.shape
    I = two_I // 2  # noqa: E741 - the expert's intermediate size, as the docs name it
    P = perm.order.shape[0]
    k = 1 if T == 0 else perm.counts.sum().item() // T  # every token has k pairs
    assert block_size >= 16 and block_size & (block_size - 1) == 0, "block_size must be a power of two >= 16"
    assert P % block_size == 0 and perm.block_expert.shape[0] == P // block_size, "perm is for another block_size"
    assert hidden.stride(1) == 1 and gate_up_proj.is_contiguous() and down_proj.is_contiguous()
    assert down_proj.shape == (E, H, I), f"down_proj {list(down_proj.shape)} must be [{E}, {H}, {I}]"
    precision = "ieee" if hidden.dtype == torch.float32 else "tf32"
    act = torch.zeros(P, I, dtype=hidden.dtype, device=hidden.device)  # SiLU(gate) * up of every row
    rows = torch.zeros(P, H, dtype=hidden.dtype, device=hidden.device)
    if P == 0:
        return rows
    blocks = P // block_size
    _expert_gemm_kernel[lambda meta: (blocks, triton.cdiv(I, meta["BLOCK_N"]))](
        hidden, gate_up_proj, act, perm.order, perm.block_expert, T * k, k,
        hidden.stride(0), gate_up_proj.stride(0), gate_up_proj.stride(1), act.stride(0), I, H,
        BLOCK_SIZE=block_size, GATED=True, DOT_PRECISION=precision)
    _expert_gemm_kernel[lambda meta: (blocks, triton.cdiv(H, meta["BLOCK_N"]))](
        act, down_proj, rows, perm.order, perm.block_expert, T * k, k,
        act.stride(0), down_proj.stride(0), down_proj.stride(1), rows.stride(0), H, I,
        BLOCK_SIZE=block_size, GATED=False, DOT_PRECISION=precision)
    return rows


def moe_block(hidden: torch.Tensor, w: MoEWeights, block_size: int = 16) -> torch.Tensor:
    """The sparse MoE block the engine's way: `route` -> `permute` -> `fused_moe` -> `unpermute`.

    `hidden` `[T, hidden]` or `[B, S, hidden]` (float32 or bfloat16, not modified), `w` a `MoEWeights`.
    Returns hidden's shape and dtype: Hugging Face's `Qwen3MoeSparseMoeBlock` output, which is also what
    the Qwen3-Omni Thinker's `Qwen3OmniMoeThinkerTextSparseMoeBlock` computes (the same router, experts and
    combine).
    """
    shape = hidden.shape
    x = hidden.reshape(-1, shape[-1])  # [T, hidden]
    weights, expert_ids = route(x, w.router, w.top_k, w.norm_topk_prob)
    perm = permute(expert_ids, w.gate_up_proj.shape[0], block_size)
    rows = fused_moe(x, w.gate_up_proj, w.down_proj, perm, block_size)  # [P, hidden]
    return unpermute(rows, perm, weights).reshape(shape)


# ---- experts over ranks ---------------------------------------------------------------------------------


def shard_experts(w: MoEWeights, rank: int, world_size: int) -> EPShard:
    """Rank `rank`'s `EPShard` of `w`: experts `rank*Er .. (rank+1)*Er - 1` (Er = E / world_size) of
    gate_up_proj and down_proj (new tensors, not views), the router whole.

    Raises `ValueError` naming both numbers when world_size does not divide E. `w` is not modified.
    """
    E = w.gate_up_proj.shape[0]
    if E % world_size:
        raise ValueError(f"{E} experts do not split over {world_size} ranks")
    Er = E // world_size
    first = rank * Er
    return EPShard(w.router, w.gate_up_proj[first : first + Er].clone(), w.down_proj[first : first + Er].clone(),
                   first, E, w.top_k, w.norm_topk_prob)


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
    R = dist.get_world_size()
    Er = shard.gate_up_proj.shape[0]
    weights, expert_ids = route(hidden, shard.router, shard.top_k, shard.norm_topk_prob)  # [T_r, k] each
    T, k = expert_ids.shape
    flat = expert_ids.reshape(-1)  # [T*k]
    sent = torch.argsort(flat, stable=True)  # [T*k]: the pairs sorted by expert, so grouped by owner rank
    per_expert = torch.bincount(flat, minlength=shard.num_experts)  # [E]: Er entries for each owner, in order
    received_per_expert = torch.empty_like(per_expert)  # [R*Er]: from each rank, its pairs for my experts
    dist.all_to_all_single(received_per_expert, per_expert)
    send_sizes = per_expert.view(R, Er).sum(1).tolist()  # [R] rows to each rank
    receive_sizes = received_per_expert.view(R, Er).sum(1).tolist()  # [R] rows from each rank
    x = hidden[sent // k]  # [T*k, hidden]: each pair's token row, in sent order
    received = hidden.new_empty(sum(receive_sizes), hidden.shape[1])
    dist.all_to_all_single(received, x, receive_sizes, send_sizes)
    # rows from rank s arrive grouped by my local expert: s's counts say how many for each
    local_ids = torch.repeat_interleave(torch.arange(Er, device=hidden.device).repeat(R), received_per_expert)
    perm = permute(local_ids[:, None], Er, block_size)  # each received row is a token with k = 1
    rows = fused_moe(received, shard.gate_up_proj, shard.down_proj, perm, block_size)
    results = unpermute(rows, perm, torch.ones_like(local_ids, dtype=hidden.dtype)[:, None])  # received order
    back = hidden.new_empty(T * k, hidden.shape[1])
    dist.all_to_all_single(back, results, send_sizes, receive_sizes)
    mine = torch.empty_like(back)
    mine[sent] = back  # [T*k, hidden]: pair p's expert output at row p
    out = (mine.view(T, k, hidden.shape[1]).float() * weights.float()[:, :, None]).sum(1)  # [T_r, hidden]
    return out.to(hidden.dtype)
