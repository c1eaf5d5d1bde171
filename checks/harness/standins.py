"""The reference's cache and attention kernels (p02–p04) computed by PyTorch, for the catalogue's own code on a CPU.

An engine mutant (p06, p09) runs a whole engine, in a worker for its checks and again in the checks' process for
each replay that names a mistake; on a CPU the reference's Triton kernels under the interpreter take most of that
time (tens of milliseconds a launch, about fifty launches an engine run). Where the kernel is not the module the
mutant patches, the same launch computed here gives the same values (scores and sums in float32, the
probabilities rounded to the inputs' dtype before they weight the values, as the kernels' P @ V does) in a small
part of the time. Only the catalogue's code runs through these (`loader.STOOD_IN`): the learner's kernels, the
reference run as a submission, and a kernel module's own mutants run as written, in the interpreter or compiled on
a GPU; a launch on a GPU tensor goes to the original kernel.

Each stand-in takes the launch's own arguments (the tensors it writes among them) and writes what the kernel
writes; `checks/selftests/test_standins.py` holds them to the interpreted kernels on random launches.
"""

import math
import sys
import types

import torch

LOG2E = math.log2(math.e)  # the kernels take softmax_scale * log2(e) and work in exp2


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool):
    """One sequence: q `[Tq, H, D]`, k, v `[Tk, KVH, D]` -> (out `[Tq, H, D]` float32, lse `[H, Tq]` float32, the
    natural log; -inf and an output of 0 for a query that sees no key). Causal aligned bottom-right. (Not the
    oracles' float64 `naive_attention`: this one rounds as the kernels do, and runs in the worker, which has no
    pytest to import that module with.)"""
    Tq, H, _ = q.shape
    Tk, KVH = k.shape[:2]
    keys = k.float().repeat_interleave(H // KVH, dim=1)  # [Tk, H, D]: query head h reads kv head h // group
    values = v.repeat_interleave(H // KVH, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * scale  # [H, Tq, Tk]
    if causal:
        seen = torch.arange(Tk)[None, :] <= torch.arange(Tq)[:, None] + (Tk - Tq)  # [Tq, Tk]
        scores = scores.masked_fill(~seen, float("-inf"))
    top = scores.amax(dim=-1, keepdim=True) if Tk else scores.new_full((H, Tq, 1), float("-inf"))
    shift = top.masked_fill(top == float("-inf"), 0.0)  # [H, Tq, 1]: a row with no visible key stays 0
    p = torch.exp(scores - shift)
    total = p.sum(dim=-1)  # [H, Tq]
    acc = torch.einsum("hqk,khd->qhd", p.to(v.dtype).float(), values.float())  # P in the inputs' dtype
    out = acc / total.masked_fill(total == 0, 1.0).T[:, :, None]
    return out, torch.log(total) + shift[..., 0]


def store(key, key_token_stride, value, value_token_stride, k_cache, v_cache, cache_slot_stride, slot_mapping,
          ROW, **_):
    """store_kvcache_kernel: row slot_mapping[t] of each cache gets token t's ROW values (-1: none)."""
    keep = slot_mapping != -1
    slots = slot_mapping[keep].long()
    k_cache.view(-1, ROW)[slots] = key[keep].reshape(-1, ROW)
    v_cache.view(-1, ROW)[slots] = value[keep].reshape(-1, ROW)


def flash(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, qk_scale, *_, CAUSAL, **__):
    """_flash_attn_varlen_kernel: each packed sequence's output rows and its lse `[H, total_q]`."""
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(bounds_q) - 1):
        rows, keys = slice(bounds_q[b], bounds_q[b + 1]), slice(bounds_k[b], bounds_k[b + 1])
        if rows.stop > rows.start:
            o, s = attend(q[rows], k[keys], v[keys], qk_scale / LOG2E, CAUSAL)
            out[rows] = o.to(out.dtype)
            lse[:, rows] = s


def paged(q, k_cache, v_cache, out, part_out, part_lse, block_table, cu_seqlens_q, seqlens_k, qk_scale, *_,
          BLOCK_SIZE, CAUSAL, **__):
    """_paged_attention_kernel: each sequence's keys read through its block table, its rows written to `out`
    directly (with SPLIT too: the merge launch after it then writes nothing)."""
    bounds, lengths = cu_seqlens_q.tolist(), seqlens_k.tolist()
    flat_k = k_cache.reshape(-1, *k_cache.shape[2:])  # [num_blocks * block_size, KVH, D]: row s is slot s
    flat_v = v_cache.reshape(-1, *v_cache.shape[2:])
    for b in range(len(bounds) - 1):
        rows = slice(bounds[b], bounds[b + 1])
        if rows.stop == rows.start:
            continue
        keys = torch.arange(lengths[b])
        slots = block_table[b, keys // BLOCK_SIZE].long() * BLOCK_SIZE + keys % BLOCK_SIZE  # [S]
        o, _ = attend(q[rows], flat_k[slots], flat_v[slots], qk_scale / LOG2E, CAUSAL)
        out[rows] = o.to(out.dtype)


def merged(*_, **__):
    """_merge_splits_kernel: nothing left to do (`paged` wrote the output)."""


KERNELS = {  # module -> {the global its functions launch: the stand-in}
    "p02_store_kvcache": {"store_kvcache_kernel": store},
    "p03_flash_attention": {"_flash_attn_varlen_kernel": flash},
    "p04_paged_decode": {"_paged_attention_kernel": paged, "_merge_splits_kernel": merged},
}


class Launch:
    """Stands for a kernel object: `kernel[grid](*args)` computes with `compute` when the first tensor is on the
    CPU, and launches the original kernel otherwise."""

    def __init__(self, original, compute):
        self.original, self.compute = original, compute

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            if args[0].device.type != "cpu":
                return self.original[grid](*args, **kwargs)
            with torch.no_grad():
                self.compute(*args, **kwargs)

        return launch


def use_standins(module: types.ModuleType, own: str) -> None:
    """Route the launches of the kernel modules `module`'s package has imported, all but `own`'s (the module the
    replay is about), through the stand-ins."""
    package = module.__name__.rsplit(".", 1)[0]
    for stem, kernels in KERNELS.items():
        sibling = sys.modules.get(f"{package}.{stem}")
        if stem == own or sibling is None:
            continue
        for name, compute in kernels.items():
            original = getattr(sibling, name, None)
            if original is not None and not isinstance(original, Launch):
                setattr(sibling, name, Launch(original, compute))
