"""`./check.sh p03 --bench` (and p04, p06, p08, p09): your kernel or engine timed on a GPU against the reference
and torch, in one run, printed as ratios.

The kit never imports a learner's code into its own process: each contender is timed by a subprocess,
`python -m checks.benchmarks.bench --time MODULE --folder DIR`, which imports the folder as a package of
its own (`checks/harness/loading.py`, as the checks' workers do), times its kernel or engine on fixed
inputs and prints the timings as one line of JSON; `--torch` times torch's own instead. Every process
draws the same inputs from the same seeds. A ratio is the other's time over yours: above 1, yours is
faster.

- p03: `flash_attn_varlen` forward, bf16, 16 query heads on 8 kv heads, D = 128, 16 x 1k, 4 x 4k and 2 x 8k
  tokens, causal and not (checks/benchmarks/attention.py's points); torch: SDPA's flash backend on K/V
  expanded to 16 heads. The error column is the largest difference from torch's output.
- p04: `paged_decode`, bf16, 64 x 4k, 16 x 16k and 256 x 1k keys in shuffled blocks of 256; torch: dense
  SDPA decode on contiguous K/V (`enable_gqa`).
- p08: `moe_block` and `fused_moe` on Qwen3-30B-A3B's MoE layer, bf16, decode batches 1-256 and an 8k prefill,
  beside a loop over the experts and the floor (the experts' bytes over a measured copy's bandwidth, or the
  FLOPs over a measured matmul rate): checks/benchmarks/moe.py, which also runs alone.
- p06: `LLM.generate` of 64 prompts x 128 random tokens, 128 new tokens each (greedy, no stop token), with
  `EngineConfig()`, on Qwen3-0.6B's shapes with random bf16 weights (checks/benchmarks/engine.py); torch:
  HF's `Qwen3ForCausalLM.generate` (SDPA attention, bf16) on the same weights and prompts.
- p09: `OverlapLLM.generate` on p06's workload, the same weights and prompts; torch: HF's `generate` as for p06.
Kernels: the median of `triton.testing.do_bench` after one untimed call. Engines: one warm-up
`generate`, then the wall time of one. The full benchmarks: `python -m checks.benchmarks.attention`,
`python -m checks.benchmarks.engine` and `python -m checks.benchmarks.overlap`.
"""

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

BENCHES = {"p03": "p03_flash_attention", "p04": "p04_paged_decode", "p06": "p06_engine", "p08": "p08_moe",
           "p09": "p09_overlap"}
WHAT = {"p03": "flash_attn_varlen", "p04": "paged_decode", "p06": "LLM.generate", "p08": "moe_block / fused_moe",
        "p09": "OverlapLLM.generate"}
TORCH = {"p03": "torch SDPA (flash)", "p04": "torch SDPA decode", "p06": "HF generate (SDPA)",
         "p08": "a loop over the experts", "p09": "HF generate (SDPA)"}
LIMITS = {"p03": 300, "p04": 300, "p06": 600, "p08": 300, "p09": 600}  # seconds one timing process may take
MARK = "kvlab-bench-json: "  # the line of a timing process's output that holds its results
DEVICE = "cuda"
P06_PROMPTS, P06_LEN, P06_NEW, P06_SHOWN = 64, 128, 128, 16  # P06_SHOWN: first tokens compared


# ---- the kit's side: ./check.sh MODULE --bench ------------------------------------------------------


def bench(targets: list[str], label: str) -> int:
    """Time each of `targets` (module ids or stems) of implementation `label` on this machine's GPU."""
    import torch

    from checks.harness.loader import ROOT, LoadError, named

    ids = []
    for name in targets:
        found = next((i for i, stem in BENCHES.items() if name.lower().removesuffix(".py") in (i, stem)), None)
        if found is None:
            print(f"./check.sh --bench: no benchmark for {name!r} (there is one for {', '.join(BENCHES)})",
                  file=sys.stderr)
            return 2
        ids.append(found)
    if not ids:
        print(f"./check.sh --bench: which module? e.g. ./check.sh p03 --bench (one of {', '.join(BENCHES)})",
              file=sys.stderr)
        return 2
    try:
        impl = named(label)
    except LoadError as error:
        print(f"./check.sh: {error}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        print(f"./check.sh {' '.join(ids)} --bench: a benchmark needs a CUDA GPU and there is none here; on a CPU, "
              f"./check.sh {' '.join(ids)} checks the code in Triton's interpreter.")
        return 0
    reference = (ROOT / "solutions").resolve()
    status = 0
    for module_id in ids:
        mine = measure(module_id, impl.folder, impl.shown_folder())
        theirs = mine if impl.folder.resolve() == reference else measure(module_id, reference, "solutions")
        baseline = measure(module_id, None, "torch")
        shown = f"{impl.shown_folder()}/{BENCHES[module_id]}.py"
        printer = {"p06": print_engine, "p08": print_moe, "p09": print_engine}.get(module_id, print_kernel)
        printer(module_id, shown, mine, theirs, baseline)
        timed_all = isinstance(mine, dict) and all(row.get("ms", row.get("block_ms")) is not None
                                                   for row in mine["rows"])
        status |= 0 if timed_all else 1  # yours could not be timed (not written yet, or it failed)
    return status


def measure(module_id: str, folder: Path | None, shown: str):
    """Run one timing process: its results (a dict), or a one-line reason it gave none."""
    from checks.harness.loader import ROOT

    command = [sys.executable, "-m", "checks.benchmarks.bench", "--time", module_id]
    command += ["--folder", str(folder), "--shown", shown] if folder is not None else ["--torch"]
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=LIMITS[module_id])
    except subprocess.TimeoutExpired:
        return f"{shown}: did not finish in {LIMITS[module_id]} s"
    results = None
    for line in done.stdout.splitlines():
        if line.startswith(MARK):
            results = json.loads(line[len(MARK):])
        elif line.strip():
            print(f"  [{shown}] {line}")  # what the process printed: a kernel that could not run, a learner's print
    if done.returncode != 0 or results is None:
        last = (done.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]
        return f"{shown}: the timing process exited with status {done.returncode}: {last[:300]}"
    return results


def ratio(other: float | None, mine: float | None) -> str:
    if not other or not mine or math.isnan(other) or math.isnan(mine):
        return "n/a"
    return f"{other / mine:.2f}x"


def cell(value, fmt: str) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)


def reasons(*results) -> list:
    for r in results:
        if not isinstance(r, dict):
            print(f"  not timed: {r}")
    return [r["rows"] if isinstance(r, dict) else None for r in results]


def print_kernel(module_id, shown, mine, theirs, baseline) -> None:
    device = next((r["device"] for r in (mine, theirs, baseline) if isinstance(r, dict)), "the GPU")
    print(f"{module_id} --bench · {WHAT[module_id]} of {shown} on {device}, against the reference (solutions/) and "
          f"{TORCH[module_id]}; median ms, each contender in its own process; ratio = their time / yours")
    rows_mine, rows_ref, rows_torch = reasons(mine, theirs, baseline)
    points = [r["point"] for r in rows_mine or rows_ref or rows_torch or []]
    header = (f"{'point':<22} | {'yours':>8} {'reference':>9} {'torch':>8} | {'vs reference':>12} {'vs torch':>8} | "
              f"{'max err vs torch':>16}")
    print(header)
    print("-" * len(header))
    worst_ref = worst_torch = None
    for i, point in enumerate(points):
        a, b, c = (rows[i] if rows else {} for rows in (rows_mine, rows_ref, rows_torch))
        ms_a, ms_b, ms_c = a.get("ms"), b.get("ms"), c.get("ms")
        print(f"{point:<22} | {cell(ms_a, '.3f'):>8} {cell(ms_b, '.3f'):>9} {cell(ms_c, '.3f'):>8} | "
              f"{ratio(ms_b, ms_a):>12} {ratio(ms_c, ms_a):>8} | {cell(a.get('error'), '.1e'):>16}")
        if ratio(ms_b, ms_a) != "n/a":
            worst_ref = min(worst_ref or math.inf, ms_b / ms_a)
        if ratio(ms_c, ms_a) != "n/a":
            worst_torch = min(worst_torch or math.inf, ms_c / ms_a)
    if worst_ref is not None or worst_torch is not None:
        print(f"at worst yours runs at {cell(worst_ref, '.2f')}x the reference's speed and {cell(worst_torch, '.2f')}x "
              f"torch's")


def print_engine(module_id, shown, mine, theirs, baseline) -> None:
    device = next((r["device"] for r in (mine, theirs, baseline) if isinstance(r, dict)), "the GPU")
    print(f"{module_id} --bench · {WHAT[module_id]} of {shown} on {device}: {P06_PROMPTS} prompts x {P06_LEN} random "
          f"tokens, {P06_NEW} new each (greedy), Qwen3-0.6B's shapes, random bf16 weights; against the reference "
          f"(solutions/) and {TORCH[module_id]}; each in its own process; ratio = their time / yours")
    rows_mine, rows_ref, rows_torch = reasons(mine, theirs, baseline)
    a, b, c = (rows[0] if rows else {} for rows in (rows_mine, rows_ref, rows_torch))
    same_title = f"same first {P06_SHOWN} tokens as yours"
    header = f"{'':<10} | {'seconds':>8} | {'tokens/s':>9} | {'yours vs it':>11} | {same_title:>28}"
    print(header)
    print("-" * len(header))
    for name, row in (("yours", a), ("reference", b), ("HF", c)):
        ms = row.get("ms")
        same = "n/a"
        if a.get("tokens") and row.get("tokens"):
            same = f"{sum(x == y for x, y in zip(a['tokens'], row['tokens']))} of {len(a['tokens'])} prompts"
        rate = ms and P06_PROMPTS * P06_NEW / (ms / 1e3)
        print(f"{name:<10} | {cell(ms and ms / 1e3, '.2f'):>8} | {cell(rate, '.0f'):>9} | "
              f"{ratio(ms, a.get('ms')) if name != 'yours' else '':>11} | {same if name != 'yours' else '':>28}")
    print(f"(greedy bf16 runs part at near-ties, so a few prompts may differ from HF's without a bug; "
          f"./check.sh {module_id} checks the tokens)")


def print_moe(module_id, shown, mine, theirs, baseline) -> None:
    from checks.benchmarks.moe import report

    rows_mine, rows_ref, rows_torch = reasons(mine, theirs, baseline)
    if not rows_mine or not rows_torch:
        return
    device = next(r["device"] for r in (mine, baseline) if isinstance(r, dict))
    print("\n".join(report(shown, device, rows_mine, rows_torch, rows_torch[0]["rates"])))
    if rows_ref and theirs is not mine:
        print("the reference's block: " + ", ".join(f"{r['point']} {cell(r['block_ms'], '.3f')} ms" for r in rows_ref))


# ---- the timing process: python -m checks.benchmarks.bench --time MODULE (--folder DIR | --torch) ---


def time_p03(module) -> list[dict]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    from checks.benchmarks.attention import KVH, P03_POINTS, D, H, timed

    device, rows = torch.device(DEVICE), []
    for B, T in P03_POINTS:  # the inputs of attention.py's bench_p03
        gen = torch.Generator(device=device).manual_seed(T)
        q = torch.randn(B * T, H, D, device=device, generator=gen).to(torch.bfloat16)
        k = torch.randn(B * T, KVH, D, device=device, generator=gen).to(torch.bfloat16)
        v = torch.randn(B * T, KVH, D, device=device, generator=gen).to(torch.bfloat16)
        cu = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=device)
        q4 = q.view(B, T, H, D).transpose(1, 2).contiguous()  # [B, H, T, D]
        k4 = k.view(B, T, KVH, D).repeat_interleave(H // KVH, dim=2).transpose(1, 2).contiguous()
        v4 = v.view(B, T, KVH, D).repeat_interleave(H // KVH, dim=2).transpose(1, 2).contiguous()
        for causal in (True, False):
            def sdpa_flash():
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return F.scaled_dot_product_attention(q4, k4, v4, is_causal=causal)

            def kernel():
                return module.flash_attn_varlen(q, k, v, cu, cu, T, T, causal=causal)

            point = f"{B} x {T} {'causal' if causal else 'full'}"
            if module is None:
                rows.append({"point": point, "ms": finite(timed(do_bench, sdpa_flash))})
                continue
            ms = finite(timed(do_bench, kernel))
            error = None
            if ms is not None:
                expected = F.scaled_dot_product_attention(q4, k4, v4, is_causal=causal)
                error = (kernel().float() - expected.transpose(1, 2).reshape(B * T, H, D).float()).abs().max().item()
            rows.append({"point": point, "ms": ms, "error": error})
    return rows


def time_p04(module) -> list[dict]:
    import torch
    import torch.nn.functional as F
    from triton.testing import do_bench

    from checks.benchmarks.attention import KVH, P04_POINTS, D, H, paged, timed

    device, rows = torch.device(DEVICE), []
    for B, S in P04_POINTS:  # the inputs of attention.py's bench_p04
        gen = torch.Generator(device=device).manual_seed(S)
        q = torch.randn(B, H, D, device=device, generator=gen).to(torch.bfloat16)
        k = torch.randn(B, S, KVH, D, device=device, generator=gen).to(torch.bfloat16)
        v = torch.randn(B, S, KVH, D, device=device, generator=gen).to(torch.bfloat16)
        k_dense, v_dense = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()  # [B, KVH, S, D]

        def dense_sdpa():
            return F.scaled_dot_product_attention(q[:, :, None, :], k_dense, v_dense, enable_gqa=True)

        point = f"{B} x {S}, blocks 256"
        if module is None:
            rows.append({"point": point, "ms": finite(timed(do_bench, dense_sdpa))})
            continue
        k_cache, v_cache, table = paged(k, v, 256, gen)
        seqlens = torch.full((B,), S, dtype=torch.int32, device=device)

        def kernel():
            return module.paged_decode(q, k_cache, v_cache, table, seqlens)

        ms = finite(timed(do_bench, kernel))
        error = None
        if ms is not None:
            error = (kernel().float() - dense_sdpa()[:, :, 0].float()).abs().max().item()
        rows.append({"point": point, "ms": ms, "error": error})
    return rows


def time_p06(module) -> list[dict]:
    return time_engine(module, "LLM")


def time_p09(module) -> list[dict]:
    return time_engine(module, "OverlapLLM")


def time_engine(module, engine: str) -> list[dict]:
    """The engine class `engine` of `module` (HF's `generate` when module is None) on P06's prompts."""
    import torch

    from checks.benchmarks.engine import hf_generate, hf_model, random_weights, seconds

    device = torch.device(DEVICE)
    w = random_weights(device)
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, w.embed_tokens.shape[0], (P06_PROMPTS, P06_LEN), generator=gen)
    warmup = torch.randint(0, w.embed_tokens.shape[0], (P06_PROMPTS, P06_LEN), generator=gen)
    if module is None:
        model = hf_model(w)
        hf_generate(model, warmup.to(device), 2)
        elapsed, out = seconds(lambda: hf_generate(model, prompts.to(device), P06_NEW))
        tokens = out.tolist()
    else:
        llm = getattr(module, engine)(w, module.EngineConfig())
        llm.generate(warmup[:8].tolist(), module.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        greedy = module.SamplingParams(temperature=0.0, max_tokens=P06_NEW, ignore_eos=True)
        elapsed, tokens = seconds(lambda: llm.generate(prompts.tolist(), greedy))
    return [{"point": f"{P06_PROMPTS} x {P06_LEN} -> {P06_NEW}", "ms": elapsed * 1e3,
             "tokens": [list(t[:P06_SHOWN]) for t in tokens]}]


def time_p08(module) -> list[dict]:
    import torch
    from triton.testing import do_bench

    from checks.benchmarks.moe import time_baseline, time_module

    device = torch.device(DEVICE)
    if module is None:
        rows, rates = time_baseline(do_bench, device)
        return [{**row, "rates": rates} for row in rows]
    return time_module(module, do_bench, device)


def finite(ms: float) -> float | None:
    return None if ms is None or math.isnan(ms) else ms


TIMERS = {"p03": time_p03, "p04": time_p04, "p06": time_p06, "p08": time_p08, "p09": time_p09}


def main() -> int:
    parser = argparse.ArgumentParser(description="one contender's timings, as one line of JSON (for --bench)")
    parser.add_argument("--time", choices=sorted(BENCHES), required=True)
    parser.add_argument("--folder", help="the implementation folder to import and time")
    parser.add_argument("--shown", default="", help="how reports name the folder")
    parser.add_argument("--torch", action="store_true", help="time torch's own instead")
    args = parser.parse_args()
    import torch

    from checks.harness.loading import LoadError, Package

    if not torch.cuda.is_available():
        print("no CUDA GPU here", file=sys.stderr)
        return 2
    module = None
    if not args.torch:
        try:
            module = Package(args.folder, args.shown or args.folder).load(BENCHES[args.time])
        except LoadError as error:
            print(error, file=sys.stderr)
            return 1
    rows = TIMERS[args.time](module)
    print(MARK + json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
