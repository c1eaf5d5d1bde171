"""The store_kvcache kernel's achieved bandwidth on a GPU, against a plain device copy and `index_copy_`.

For 64, 4096 and 65536 tokens with KVH*D = 1024 in bf16 (Qwen3-0.6B: KVH = 8, D = 128), K and V are
slices of one fused qkv output (as in the model) and go to random distinct slots of a paged cache with
blocks of 256 slots. Each contender moves the same rows:
- the kernel (`store_kvcache` from solutions/, or --impl DIR): reads K, V and the slot ids, writes K, V;
- a plain device copy (`copy_` between two contiguous buffers of the same size as K and V together):
  the same bytes with no scatter and no stride, the HBM ceiling a scatter can hope for;
- `index_copy_` of K and of V into the cache rows (int64 slot ids, no -1): PyTorch's own scatter.
Bandwidth = bytes read + bytes written, over the median time of `triton.testing.do_bench` (CUDA events,
L2 flushed between runs); for the kernel also on the device alone (`do_bench_cudagraph`: one call replayed
from a CUDA graph, without Python's launch overhead). Targets: at 65536 tokens at least 0.9 of the
copy's bandwidth; at 64 tokens a few microseconds (launch-bound).

    python -m checks.benchmarks.store_kvcache [--impl solutions|mine|DIR]
"""

import argparse
import os
import sys

import torch

TOKENS = (64, 4096, 65536)
KVH, D, H = 8, 128, 16  # Qwen3-0.6B: ROW = KVH * D = 1024 values per token; the qkv row is (H + 2*KVH) * D
BLOCK_SIZE = 256


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impl", default="solutions", help="solutions (default), mine, or a folder")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("store_kvcache benchmark: no CUDA GPU here (torch.cuda.is_available() is False). It measures the "
              "compiled kernel's bandwidth, so it needs a GPU; on a CPU, ./check.sh p02 checks the kernel in "
              "Triton's interpreter instead.", file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("store_kvcache benchmark: TRITON_INTERPRET=1 is set, so the kernel would run in the interpreter; "
              "unset it to measure the compiled kernel.", file=sys.stderr)
        return 2
    import triton
    from triton.testing import do_bench, do_bench_cudagraph

    from checks.harness.loader import named

    module = named(args.impl).load_to_time("p02_store_kvcache")
    device = torch.device("cuda")
    print(f"store_kvcache ({args.impl}) on {torch.cuda.get_device_name()}: bf16, KVH*D = {KVH * D}, K/V sliced "
          f"from a fused qkv, block size {BLOCK_SIZE}; torch {torch.__version__}, Triton {triton.__version__}")
    header = (f"{'tokens':>7} {'MiB moved':>10} | {'kernel µs':>10} {'GB/s':>7} | {'copy µs':>9} {'GB/s':>7} | "
              f"{'index_copy_ µs':>15} {'GB/s':>7} | {'vs copy':>7} {'vs index_copy_':>14}")
    print(header)
    print("-" * len(header))
    results = {}
    for n in TOKENS:
        results[n] = measure(module, n, device, do_bench, do_bench_cudagraph)
        r = results[n]
        print(f"{n:>7} {r['bytes'] / 2**20:>10.1f} | {r['kernel'] * 1e3:>10.2f} {gbs(r, 'kernel'):>7.0f} | "
              f"{r['copy'] * 1e3:>9.2f} {gbs(r, 'copy'):>7.0f} | {r['index_copy'] * 1e3:>15.2f} "
              f"{gbs(r, 'index_copy'):>7.0f} | {gbs(r, 'kernel') / gbs(r, 'copy'):>7.2f} "
              f"{gbs(r, 'kernel') / gbs(r, 'index_copy'):>14.2f}")
    big, small = results[TOKENS[-1]], results[TOKENS[0]]
    ratio = gbs(big, "kernel") / gbs(big, "copy")
    print(f"\nat {TOKENS[-1]} tokens the kernel reaches {ratio:.2f} of the copy's bandwidth (target >= 0.90): "
          f"{'met' if ratio >= 0.9 else 'NOT met'}")
    print(f"at {TOKENS[0]} tokens one call takes {small['kernel'] * 1e3:.1f} µs from Python (the launch dominates) "
          f"and {small['kernel_graph'] * 1e3:.1f} µs on the device (CUDA graph); target: launch-bound, a few µs")
    print("device-only (CUDA graph) kernel times: "
          + ", ".join(f"{n} tokens {r['kernel_graph'] * 1e3:.1f} µs ({gbs(r, 'kernel_graph'):.0f} GB/s)"
                      for n, r in results.items()))
    return 0


def measure(module, n: int, device: torch.device, do_bench, do_bench_cudagraph) -> dict:
    gen = torch.Generator(device=device).manual_seed(n)
    row = KVH * D
    qkv = torch.randn(n, (H + 2 * KVH) * D, device=device, generator=gen).to(torch.bfloat16)
    key = qkv[:, H * D : (H + KVH) * D].view(n, KVH, D)  # [n, KVH, D], token stride (H + 2*KVH) * D
    value = qkv[:, (H + KVH) * D :].view(n, KVH, D)
    num_blocks = -(-2 * n // BLOCK_SIZE)  # twice the slots needed: the writes land scattered
    k_cache = torch.zeros(num_blocks, BLOCK_SIZE, KVH, D, dtype=torch.bfloat16, device=device)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device=device, generator=gen)[:n]
    slot_mapping = slots.to(torch.int32)

    module.store_kvcache(key, value, k_cache, v_cache, slot_mapping)  # compile, and check the result once
    k_rows, v_rows = k_cache.view(-1, row), v_cache.view(-1, row)  # [slots, ROW] views of the caches
    k_src, v_src = key.view(n, row), value.view(n, row)  # [n, ROW] views, still strided like the qkv rows
    assert torch.equal(k_rows[slots], k_src) and torch.equal(v_rows[slots], v_src), \
        "store_kvcache wrote the wrong rows: run ./check.sh p02 first"
    copy_src = torch.empty(2 * n, row, dtype=key.dtype, device=device)  # K and V rows' bytes, contiguous
    copy_dst = torch.empty_like(copy_src)

    def kernel():
        module.store_kvcache(key, value, k_cache, v_cache, slot_mapping)

    def copy():  # the same bytes, contiguous to contiguous: no scatter, no stride
        copy_dst.copy_(copy_src)

    def index_copy():
        k_rows.index_copy_(0, slots, k_src)
        v_rows.index_copy_(0, slots, v_src)

    rows_bytes = 2 * n * row * key.element_size()  # K and V rows, each read once and written once
    return {
        "bytes": 2 * rows_bytes + n * slot_mapping.element_size(),
        "kernel": do_bench(kernel, return_mode="median"),
        "kernel_graph": do_bench_cudagraph(kernel, return_mode="median"),
        "copy": do_bench(copy, return_mode="median"),
        "index_copy": do_bench(index_copy, return_mode="median"),
    }


def gbs(result: dict, name: str) -> float:
    return result["bytes"] / (result[name] * 1e-3) / 1e9


if __name__ == "__main__":
    sys.exit(main())
