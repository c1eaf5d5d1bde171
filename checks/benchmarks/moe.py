"""p08's fused MoE on a GPU, side by side with a loop over the experts and with its floor, in one run.

One Qwen3-30B-A3B-shaped MoE layer (hidden 2048, 128 experts, top-8, expert width 768, `norm_topk_prob`),
random bf16 weights and tokens (so the router spreads the tokens about evenly), at decode batches of 1 to
256 tokens and a prefill of 8k tokens. Each point times, as the median of `triton.testing.do_bench` after one
untimed call (compilation, autotuning):
- block: the implementation's `moe_block` (route, permute, the kernel, unpermute), block_size 16 for
  decode and 128 for the prefill (tiles of 128 rows fed the tensor cores best, measured against 64 and 256;
  16 wastes few rows on the 4 tokens an expert gets at batch 64);
- kernel: its `fused_moe` alone, on a permutation made beforehand;
- loop: the block written as a loop over the experts hit, in plain torch (the kit's own, as HF's
  `Qwen3MoeExperts` does it);
- floor: decode reads every expert hit once, so its floor is their bytes (3 x hidden x width x 2 per expert)
  over the bandwidth of a device copy measured in the same run (bytes read + written over its time); the
  prefill is compute-bound, so its floor is its FLOPs (2 x pairs x 3 x hidden x width) over the bf16 matmul
  rate measured in the same run (an 8192 x 8192 x 2048 `torch.mm`).
"floor / time" is the share of the floor a time reaches (1 is the floor). Targets: the kernel at >= 0.6 of
the floor at decode batch 64 and >= 0.5 of it at the 8k prefill; the block >= 5x the loop at batch 64.

    python -m checks.benchmarks.moe [--impl solutions|mine|DIR]

`./check.sh p08 --bench` runs the same points through `checks/benchmarks/bench.py` (each contender in its own
process).
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F

HIDDEN, EXPERTS, TOP_K, WIDTH = 2048, 128, 8, 768  # Qwen3-30B-A3B's MoE layer
DECODE = (1, 4, 16, 64, 256)  # tokens of a decode step
PREFILL = 8192  # tokens of the prefill point
TARGET_DECODE, TARGET_PREFILL, TARGET_LOOP = 0.6, 0.5, 5.0
TARGET_BATCH = 64


def block_size_for(tokens: int) -> int:
    return 128 if tokens > 1024 else 16


def weights(device):
    """Random Qwen3-30B-A3B-shaped MoE weights (bf16), as `MoEWeights`' fields: (router, gate_up, down)."""
    gen = torch.Generator(device=device).manual_seed(0)
    router = torch.randn(EXPERTS, HIDDEN, device=device, generator=gen).mul_(HIDDEN ** -0.5).to(torch.bfloat16)
    gate_up = torch.randn(EXPERTS, 2 * WIDTH, HIDDEN, device=device, generator=gen, dtype=torch.bfloat16)
    gate_up.mul_(HIDDEN ** -0.5)
    down = torch.randn(EXPERTS, HIDDEN, WIDTH, device=device, generator=gen, dtype=torch.bfloat16).mul_(WIDTH ** -0.5)
    return router, gate_up, down


def tokens(n: int, device) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(n)
    return torch.randn(n, HIDDEN, device=device, generator=gen).to(torch.bfloat16)


def loop_block(x: torch.Tensor, router, gate_up, down) -> torch.Tensor:
    """The block as a loop over the experts hit (HF's way): the baseline the kernel is held against."""
    probs = F.linear(x, router).softmax(dim=-1, dtype=torch.float32)  # [T, E]
    top, ids = probs.topk(TOP_K, dim=-1)  # [T, k] each
    top = (top / top.sum(dim=-1, keepdim=True)).to(x.dtype)
    out = torch.zeros_like(x)
    for expert in ids.unique().tolist():
        rows, slots = torch.where(ids == expert)
        g, u = F.linear(x[rows], gate_up[expert]).chunk(2, dim=-1)
        out.index_add_(0, rows, F.linear(F.silu(g) * u, down[expert]) * top[rows, slots, None])
    return out


def experts_hit(x: torch.Tensor, router) -> int:
    probs = F.linear(x, router).softmax(dim=-1, dtype=torch.float32)
    return int(probs.topk(TOP_K, dim=-1).indices.unique().numel())


def copy_bandwidth(do_bench, device) -> float:
    """Bytes per second of a device copy of 1 GiB (read + written)."""
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() * src.element_size() / (ms / 1e3)


def matmul_rate(do_bench, device) -> float:
    """bf16 FLOP/s of an 8192 x 8192 x 2048 torch.mm."""
    a = torch.randn(8192, 2048, device=device).to(torch.bfloat16)
    b = torch.randn(2048, 8192, device=device).to(torch.bfloat16)
    ms = do_bench(lambda: a @ b, return_mode="median")
    return 2 * 8192 * 8192 * 2048 / (ms / 1e3)


def points() -> list[tuple[str, int]]:
    return [(f"decode {n}", n) for n in DECODE] + [(f"prefill {PREFILL}", PREFILL)]


def time_module(module, do_bench, device) -> list[dict]:
    """The implementation's block and kernel at every point: [{point, block_ms, kernel_ms, error}]."""
    from checks.benchmarks.attention import timed

    router, gate_up, down = weights(device)
    w = module.MoEWeights(router, gate_up, down, TOP_K, True)
    rows = []
    for point, n in points():
        x, size = tokens(n, device), block_size_for(n)
        row = {"point": point, "block_ms": timed(do_bench, lambda: module.moe_block(x, w, size))}
        try:
            _, ids = module.route(x, router, TOP_K, True)
            perm = module.permute(ids, EXPERTS, size)
            row["kernel_ms"] = timed(do_bench, lambda: module.fused_moe(x, gate_up, down, perm, size))
            if n == TARGET_BATCH:  # where the block's time goes besides the kernel
                weights_, _ = module.route(x, router, TOP_K, True)
                rows_ = module.fused_moe(x, gate_up, down, perm, size)
                row["parts_ms"] = {"route": timed(do_bench, lambda: module.route(x, router, TOP_K, True)),
                                   "permute": timed(do_bench, lambda: module.permute(ids, EXPERTS, size)),
                                   "unpermute": timed(do_bench, lambda: module.unpermute(rows_, perm, weights_))}
            if n <= 256:  # the loop's own result, once (bf16 both: a loose sanity bound, not a check)
                expected = loop_block(x, router, gate_up, down).float()
                row["error"] = (module.moe_block(x, w, size).float() - expected).abs().max().item()
        except Exception as error:  # noqa: BLE001 - a learner's kernel that fails here is one cell, not a crash
            print(f"    ({point}: {type(error).__name__}: {str(error).splitlines()[0][:100]})")
            row.setdefault("kernel_ms", float("nan"))
        rows.append(row)
    return rows


def time_baseline(do_bench, device) -> list[dict]:
    """The loop over the experts and the floor at every point: [{point, loop_ms, floor_ms, ...}]."""
    from checks.benchmarks.attention import timed

    router, gate_up, down = weights(device)
    bandwidth, rate = copy_bandwidth(do_bench, device), matmul_rate(do_bench, device)
    expert_bytes = 3 * HIDDEN * WIDTH * gate_up.element_size()
    rows = []
    for point, n in points():
        x = tokens(n, device)
        hit = experts_hit(x, router)
        if n <= 1024:  # decode: read every expert hit once
            floor = hit * expert_bytes / bandwidth * 1e3
        else:  # prefill: compute-bound
            floor = 2 * n * TOP_K * 3 * HIDDEN * WIDTH / rate * 1e3
        rows.append({"point": point, "loop_ms": timed(do_bench, lambda: loop_block(x, router, gate_up, down)),
                     "floor_ms": floor, "experts_hit": hit})
    return rows, {"copy_GBps": bandwidth / 1e9, "matmul_TFLOPs": rate / 1e12}


def report(shown: str, device_name: str, mine: list[dict], base: list[dict], rates: dict) -> list[str]:
    """The table, then the targets: met, or what bounds them (measured)."""
    lines = [f"p08 MoE on {device_name}: {shown}; Qwen3-30B-A3B's layer (hidden {HIDDEN}, {EXPERTS} experts, top-"
             f"{TOP_K}, width {WIDTH}), bf16; copy {rates['copy_GBps']:.0f} GB/s, bf16 matmul "
             f"{rates['matmul_TFLOPs']:.0f} TFLOP/s (both measured here); median ms",
             f"{'point':<14} | {'hit':>4} | {'block':>7} {'kernel':>7} {'loop':>8} {'floor':>7} | "
             f"{'kernel floor/t':>14} {'block floor/t':>13} | {'loop/block':>10} | {'max err':>8}"]
    lines.append("-" * len(lines[-1]))

    def share(floor, ms):
        return floor / ms if ms and ms == ms else float("nan")

    by_point = {}
    for a, b in zip(mine, base):
        k, blk = share(b["floor_ms"], a.get("kernel_ms")), share(b["floor_ms"], a.get("block_ms"))
        speedup = b["loop_ms"] / a["block_ms"] if a.get("block_ms") and a["block_ms"] == a["block_ms"] else float("nan")
        by_point[a["point"]] = (k, blk, speedup, a, b)
        error = f"{a['error']:.1e}" if "error" in a else "-"
        kernel_ms = a.get("kernel_ms", float("nan"))
        lines.append(f"{a['point']:<14} | {b['experts_hit']:>4} | {a['block_ms']:>7.3f} {kernel_ms:>7.3f} "
                     f"{b['loop_ms']:>8.3f} {b['floor_ms']:>7.3f} | {k:>14.2f} {blk:>13.2f} | {speedup:>9.1f}x | "
                     f"{error:>8}")
    decode = by_point.get(f"decode {TARGET_BATCH}")
    prefill = by_point.get(f"prefill {PREFILL}")
    if decode:
        k, blk, speedup, a, b = decode
        verdict = "met" if k >= TARGET_DECODE else "NOT met"
        gbps = b["experts_hit"] * 3 * HIDDEN * WIDTH * 2 / (a["kernel_ms"] / 1e3) / 1e9
        lines.append(f"decode {TARGET_BATCH}: the kernel reaches {k:.2f} of its floor (target {TARGET_DECODE}: "
                     f"{verdict}); it reads the {b['experts_hit']} experts hit at {gbps:.0f} GB/s of the copy's "
                     f"{rates['copy_GBps']:.0f}; the block adds {a['block_ms'] - a['kernel_ms']:.3f} ms of routing, "
                     f"permutation and combine ({blk:.2f} of the floor)")
        if a.get("parts_ms"):
            lines.append(f"decode {TARGET_BATCH}: alone, " + ", ".join(f"{name} {ms:.3f} ms" for name, ms in
                                                                        a["parts_ms"].items())
                         + " (small kernels and the host waiting on sizes: the block's bound, not the kernel)")
        lines.append(f"decode {TARGET_BATCH}: the block is {speedup:.1f}x the loop over experts (target "
                     f"{TARGET_LOOP:g}x: {'met' if speedup >= TARGET_LOOP else 'NOT met'})")
    if prefill:
        k, blk, speedup, a, b = prefill
        tflops = 2 * PREFILL * TOP_K * 3 * HIDDEN * WIDTH / (a["kernel_ms"] / 1e3) / 1e12
        lines.append(f"prefill {PREFILL}: the kernel reaches {k:.2f} of the matmul rate ({tflops:.0f} of "
                     f"{rates['matmul_TFLOPs']:.0f} TFLOP/s; target {TARGET_PREFILL}: "
                     f"{'met' if k >= TARGET_PREFILL else 'NOT met'}); the block {blk:.2f}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impl", default="solutions", help="solutions (default), mine, or a folder")
    args = parser.parse_args()
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        print("moe benchmark: it times compiled kernels, so it needs a CUDA GPU (and TRITON_INTERPRET unset); on a "
              "CPU, ./check.sh p08 checks the kernel in Triton's interpreter.", file=sys.stderr)
        return 2
    from triton.testing import do_bench

    from checks.harness.loader import named
    from checks.harness.loading import Package

    impl = named(args.impl)
    module = Package(str(impl.folder), impl.shown_folder()).load("p08_moe")
    device = torch.device("cuda")
    base, rates = time_baseline(do_bench, device)
    mine = time_module(module, do_bench, device)
    print("\n".join(report(f"{impl.shown_folder()}/p08_moe.py", torch.cuda.get_device_name(), mine, base, rates)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
