"""p03's varlen FlashAttention kernel and p04's paged decode on a GPU, side by side with torch, in one run.

p03, forward only, bf16, D = 128, 16 query heads on 8 kv heads (Qwen3-0.6B's attention), about 16k
tokens per point (16 x 1k, 4 x 4k, 2 x 8k), causal and not:
- the kernel: `flash_attn_varlen` on the packed batch (GQA read in place);
- torch SDPA with the flash backend and with the cuDNN backend (`torch.nn.attention.sdpa_kernel`), on
  `[B, H, T, D]` with K/V expanded to 16 heads (the FLOPs are the same; SDPA's GQA path is not
  available on every backend).
TFLOP/s = 4 * B * H * T^2 * D / time, halved for causal (only half the score matrix is computed).

p04, decode, bf16, D = 128, 16 query heads on 8 kv heads, batch x context = 64 x 4k, 16 x 16k, 256 x 1k,
paged cache in shuffled blocks of 256 (and 16):
- the kernel: `paged_decode` (its own split-K choice);
- dense SDPA decode: one query per sequence against contiguous `[B, 8, S, D]` K/V (`enable_gqa`);
- gather-then-SDPA: K/V gathered out of the paged cache through the block table, then dense SDPA;
- a plain device copy of the same number of bytes (`copy_`), the ceiling for reading them.
Bandwidth = bytes of K and V read (2 * B * S * KVH * D * 2) over the time; for the copy, bytes read +
written. Times are medians of `triton.testing.do_bench` (CUDA events, L2 flushed between runs), after
one untimed call (compilation and autotuning). Each kernel's output is compared with SDPA's once.
Targets: p03 at least SDPA-flash's TFLOP/s at seqlen >= 4k; p04 at least 0.75 of the copy's bandwidth at
64 x 4k and 16 x 16k.

    python -m checks.benchmarks.attention [--impl solutions|mine|DIR] [--only p03|p04]
"""

import argparse
import sys

import torch
import torch.nn.functional as F

H, KVH, D = 16, 8, 128
P03_POINTS = ((16, 1024), (4, 4096), (2, 8192))  # (batch, seqlen): ~16k tokens each
P04_POINTS = ((64, 4096), (16, 16384), (256, 1024))  # (batch, context)
BLOCK_SIZES = (256, 16)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impl", default="solutions", help="solutions (default), mine, or a folder")
    parser.add_argument("--only", choices=("p03", "p04"), help="run one module's half")
    args = parser.parse_args()
    from checks.benchmarks.engine import compiled_gpu_refusal

    refused = compiled_gpu_refusal("attention benchmark", "./check.sh p03 p04 checks the kernels", no_gpu_code=2)
    if refused is not None:
        return refused
    import triton
    from triton.testing import do_bench

    from checks.harness.loader import named

    impl = named(args.impl)
    print(f"attention kernels ({args.impl}) on {torch.cuda.get_device_name()}, "
          f"{torch.cuda.get_device_properties(0).multi_processor_count} SMs; bf16, H = {H}, KVH = {KVH}, D = {D}; "
          f"torch {torch.__version__}, Triton {triton.__version__}")
    if args.only in (None, "p03"):
        bench_p03(impl.load_to_time("p03_flash_attention"), do_bench)
    if args.only in (None, "p04"):
        bench_p04(impl.load_to_time("p04_paged_decode"), do_bench)
    return 0


def timed(do_bench, fn) -> float:
    """Median milliseconds of `fn` (after one untimed call), or NaN when it cannot run here."""
    try:
        fn()
        torch.cuda.synchronize()
        return do_bench(fn, return_mode="median")
    except Exception as error:  # noqa: BLE001 - a backend missing on this GPU/torch is a "n/a" cell
        print(f"    ({getattr(fn, '__name__', 'call')} not available: {type(error).__name__}: "
              f"{str(error).splitlines()[0][:100]})")
        return float("nan")


# ---- p03 -------------------------------------------------------------------------------------------


def bench_p03(module, do_bench) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    print("\np03 · flash_attn_varlen forward vs torch SDPA (TFLOP/s; causal FLOPs counted as half)")
    header = (f"{'B x T':>11} {'causal':>6} | {'kernel':>7} {'SDPA-flash':>10} {'SDPA-cuDNN':>10} | "
              f"{'vs flash':>8} {'vs cuDNN':>8} | {'max err vs SDPA':>15}")
    print(header)
    print("-" * len(header))
    device = torch.device("cuda")
    summary = []
    for B, T in P03_POINTS:
        gen = torch.Generator(device=device).manual_seed(T)
        q = torch.randn(B * T, H, D, device=device, generator=gen).to(torch.bfloat16)  # packed [total, H, D]
        k = torch.randn(B * T, KVH, D, device=device, generator=gen).to(torch.bfloat16)
        v = torch.randn(B * T, KVH, D, device=device, generator=gen).to(torch.bfloat16)
        cu = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=device)
        q4 = q.view(B, T, H, D).transpose(1, 2)  # [B, H, T, D] views for SDPA
        k4 = k.view(B, T, KVH, D).repeat_interleave(H // KVH, dim=2).transpose(1, 2).contiguous()
        v4 = v.view(B, T, KVH, D).repeat_interleave(H // KVH, dim=2).transpose(1, 2).contiguous()
        q4 = q4.contiguous()
        for causal in (True, False):
            def kernel():
                return module.flash_attn_varlen(q, k, v, cu, cu, T, T, causal=causal)

            def sdpa_flash():
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return F.scaled_dot_product_attention(q4, k4, v4, is_causal=causal)

            def sdpa_cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(q4, k4, v4, is_causal=causal)

            ms = {name: timed(do_bench, fn) for name, fn in (("kernel", kernel), ("flash", sdpa_flash),
                                                           ("cudnn", sdpa_cudnn))}
            flops = 4 * B * H * T * T * D / (2 if causal else 1)
            tflops = {name: flops / (t * 1e-3) / 1e12 for name, t in ms.items()}
            reference = sdpa_flash() if ms["flash"] == ms["flash"] else F.scaled_dot_product_attention(
                q4.float(), k4.float(), v4.float(), is_causal=causal)
            error = (kernel().float() - reference.transpose(1, 2).reshape(B * T, H, D).float()).abs().max().item()
            print(f"{B:>3} x {T:<5} {str(causal):>6} | {tflops['kernel']:>7.1f} {tflops['flash']:>10.1f} "
                  f"{tflops['cudnn']:>10.1f} | {tflops['kernel'] / tflops['flash']:>8.2f} "
                  f"{tflops['kernel'] / tflops['cudnn']:>8.2f} | {error:>15.2e}")
            summary.append((T, causal, tflops["kernel"] / tflops["flash"]))
    worst = min((ratio for T, causal, ratio in summary if T >= 4096), default=float("nan"))
    print(f"at seqlen >= 4k the kernel reaches {worst:.2f} of SDPA-flash's TFLOP/s at worst (target >= 1.00): "
          f"{'met' if worst >= 1.0 else 'NOT met'}")


# ---- p04 -------------------------------------------------------------------------------------------


def paged(k: torch.Tensor, v: torch.Tensor, block_size: int, gen: torch.Generator):
    """K/V `[B, S, KVH, D]` scattered into the same shuffled blocks: (k_cache, v_cache `[num_blocks,
    block_size, KVH, D]`, block_table `[B, S / block_size]` int32)."""
    B, S = k.shape[:2]
    blocks = B * (S // block_size)
    order = torch.randperm(blocks, device=k.device, generator=gen)  # logical block i -> physical order[i]
    k_cache = torch.empty(blocks, block_size, KVH, D, dtype=k.dtype, device=k.device)
    v_cache = torch.empty_like(k_cache)
    k_cache[order] = k.reshape(blocks, block_size, KVH, D)
    v_cache[order] = v.reshape(blocks, block_size, KVH, D)
    return k_cache, v_cache, order.view(B, S // block_size).to(torch.int32)


def bench_p04(module, do_bench) -> None:
    print("\np04 · paged_decode vs dense SDPA decode, gather-then-SDPA and a device copy (TB/s of K/V read; "
          "copy: read + written)")
    header = (f"{'B x S':>12} {'block':>5} | {'kernel':>6} {'dense SDPA':>10} {'gather+SDPA':>11} {'copy':>6} | "
              f"{'vs copy':>7} {'vs dense':>8} {'vs gather':>9} | {'max err':>8}")
    print(header)
    print("-" * len(header))
    device = torch.device("cuda")
    summary = {}
    for B, S in P04_POINTS:
        gen = torch.Generator(device=device).manual_seed(S)
        q = torch.randn(B, H, D, device=device, generator=gen).to(torch.bfloat16)
        k = torch.randn(B, S, KVH, D, device=device, generator=gen).to(torch.bfloat16)
        v = torch.randn(B, S, KVH, D, device=device, generator=gen).to(torch.bfloat16)
        seqlens = torch.full((B,), S, dtype=torch.int32, device=device)
        kv_bytes = 2 * k.numel() * k.element_size()  # K and V, each read once
        k_dense, v_dense = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()  # [B, KVH, S, D]
        q4 = q[:, :, None, :]  # [B, H, 1, D]

        def dense_sdpa():
            return F.scaled_dot_product_attention(q4, k_dense, v_dense, enable_gqa=True)

        source = torch.empty(kv_bytes // 2, dtype=torch.bfloat16, device=device)  # kv_bytes bytes
        target = torch.empty_like(source)

        def copy():
            target.copy_(source)

        t_dense, t_copy = timed(do_bench, dense_sdpa), timed(do_bench, copy)
        expected = dense_sdpa()[:, :, 0].float()  # [B, H, D]
        for block_size in BLOCK_SIZES:
            k_cache, v_cache, table = paged(k, v, block_size, gen)

            def kernel():
                return module.paged_decode(q, k_cache, v_cache, table, seqlens)

            def gather_sdpa():
                blocks = table.long()  # [B, S / block_size]: whole blocks, then [B, S, KVH, D]
                k_gathered = k_cache[blocks].view(B, S, KVH, D).transpose(1, 2)
                v_gathered = v_cache[blocks].view(B, S, KVH, D).transpose(1, 2)
                return F.scaled_dot_product_attention(q4, k_gathered, v_gathered, enable_gqa=True)

            t_kernel, t_gather = timed(do_bench, kernel), timed(do_bench, gather_sdpa)
            error = (kernel().float() - expected).abs().max().item()
            tbs = {name: kv_bytes / (t * 1e-3) / 1e12 for name, t in (("kernel", t_kernel), ("dense", t_dense),
                                                                       ("gather", t_gather))}
            tbs["copy"] = 2 * kv_bytes / (t_copy * 1e-3) / 1e12  # read + written
            print(f"{B:>4} x {S:<5} {block_size:>5} | {tbs['kernel']:>6.2f} {tbs['dense']:>10.2f} "
                  f"{tbs['gather']:>11.2f} {tbs['copy']:>6.2f} | {tbs['kernel'] / tbs['copy']:>7.2f} "
                  f"{tbs['kernel'] / tbs['dense']:>8.2f} {tbs['kernel'] / tbs['gather']:>9.2f} | {error:>8.1e}")
            summary[(B, S, block_size)] = tbs["kernel"] / tbs["copy"]
    for B, S in P04_POINTS[:2]:
        ratio = summary[(B, S, BLOCK_SIZES[0])]
        print(f"{B} x {S}, blocks of {BLOCK_SIZES[0]}: {ratio:.2f} of the copy's bandwidth (target >= 0.75): "
              f"{'met' if ratio >= 0.75 else 'NOT met'}")


if __name__ == "__main__":
    sys.exit(main())
