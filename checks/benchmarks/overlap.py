"""The overlapped engine (p09) on a GPU: throughput against p06's engine and Hugging Face's `generate`, and
how much of the host's time the overlap hides, in one run.

The model and weights are those of `checks.benchmarks.engine`: Qwen3-0.6B's shapes, random bf16 weights
drawn on the GPU. Every engine runs with CUDA graphs, after a small warm-up `generate`.

(a) engine.py's (a): 64 prompts of 256 random tokens, 256 new tokens each, greedy, no stop token,
    `EngineConfig()`'s limits: output tokens per second of `OverlapLLM.generate` and of HF's batched
    `generate` on the same weights, and how many sequences give HF's tokens. Target: p09 >= 20x HF.
(b) nano-vllm's bench.py (engine.py's (b), the same requests and limits): output tokens per second of p06's
    `LLM` and p09's `OverlapLLM` from the same folder, one after the other. Target: p09 / p06 >= 2.
    p06's decode steps are timed as engine.py times them. For p09, every step `OverlapLLM._launch` starts
    is timed by CUDA events recorded before and after the call, so each lies on the GPU's timeline: a
    decode step's time runs from the end of the launch before it to its own end, and holds its busy time
    (its own start to end) and the idle gap before it (the GPU waiting for the host). A step's floor is
    the bytes it must read, the weights plus the K and V of every key of its batch, over the bandwidth of
    a device copy measured in this run. Targets: decode floor / time >= 0.6 over all decode steps, and
    host time not hidden (the mean idle gap per decode step) <= 0.3 ms. Where a target is missed, what
    bounds it is measured: the recorded decode step replayed with nothing to attend (it still reads the
    weights and samples) against the attention's reads, the steps that waited for the step in flight
    (`stats['waits']`), and the prefill steps' share of the wall time.

    python -m checks.benchmarks.overlap [--impl solutions|mine|DIR] [--only a|b]
"""

import argparse
import statistics
import sys
import time
from functools import partial

import torch

from checks.benchmarks.engine import (
    A_NEW,
    A_PROMPT_LEN,
    A_PROMPTS,
    B_MAX,
    B_MIN,
    B_REQUESTS,
    DecodeSteps,
    compiled_gpu_refusal,
    copy_bandwidth,
    engine_config,
    fixed_cost,
    hf_generate,
    hf_model,
    kv_bytes_per_token,
    nano_vllm_workload,
    print_fixed,
    print_floor,
    random_weights,
    release,
    seconds,
    synchronize,
    weight_bytes,
)

B_LIMITS = {"block_size": 256, "max_num_batched_tokens": 16384, "max_num_seqs": B_REQUESTS, "max_model_len": 4096}
TARGET_HF, TARGET_P06, TARGET_FLOOR, TARGET_HOST_MS = 20.0, 2.0, 0.6, 0.3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impl", default="solutions", help="solutions (default), mine, or a folder")
    parser.add_argument("--only", choices=("a", "b"), action="append", help="run only these parts")
    args = parser.parse_args()
    refused = compiled_gpu_refusal("overlap benchmark", "./check.sh p09 checks the overlapped engine")
    if refused is not None:
        return refused
    import triton

    from checks.harness.loader import named

    impl = named(args.impl)
    p06 = impl.load_to_time("p06_engine")  # first: p09's `from .p06_engine import ...` then reuses this module
    p09 = impl.load_to_time("p09_overlap")
    device, start = torch.device("cuda"), time.perf_counter()
    w = random_weights(device)
    bandwidth = copy_bandwidth(device)
    print(f"overlapped engine ({args.impl}) on {torch.cuda.get_device_name()}; torch {torch.__version__}, Triton "
          f"{triton.__version__}; Qwen3-0.6B's shapes, random bf16 weights: {weight_bytes(w) / 1e9:.3f} GB read by "
          f"a decode step, {kv_bytes_per_token(w) / 1024:.0f} KiB of K/V per token; device copy "
          f"{bandwidth / 1e12:.2f} TB/s (read + written)")
    parts, summary = args.only or ["a", "b"], {}
    if "a" in parts:
        summary["a"] = part_a(p09, w, hf_model(w), bandwidth)
        release()  # HF's model
    if "b" in parts:
        summary["b"] = part_b(p06, p09, w, bandwidth)
    report(summary, time.perf_counter() - start)
    return 0


# ---- timing the overlapped engine's launches ----------------------------------------------------------------


def cuda_event():
    """The clock of launches and replays, looked up at each call: an event recorded in the GPU's stream."""
    return torch.cuda.Event(enable_timing=True)


class Launches:
    """Records every step `llm` launches: its batch, whether it is a prefill, the keys a decode step reads
    (each sequence's length, summed, before the launch), whether it came after a wait (`stats['waits']`
    grew since the launch before), and events before and after `OverlapLLM._launch`. It wraps `_launch` on
    the instance; `close()` puts the class's method back and reads the events."""

    def __init__(self, llm) -> None:
        self.llm, self.records, self.rows, launch = llm, [], [], llm._launch
        self._waits = llm.stats.get("waits", 0)  # the count at the launch before

        def timed_launch(requests, is_prefill):
            keys = 0 if is_prefill else sum(len(r) for r in requests)  # a decode row reads its whole context
            waits = llm.stats.get("waits", 0)
            start, end = cuda_event(), cuda_event()
            start.record()
            launched = launch(requests, is_prefill)
            end.record()
            self.records.append((len(requests), bool(is_prefill), keys, waits != self._waits, start, end))
            self._waits = waits
            return launched

        llm._launch = timed_launch

    def close(self) -> None:
        """Fill `rows`, the launches on the GPU's timeline, in seconds: `busy` a launch's start to its end, `gap`
        the end of the launch before to its start (the first launch has none: 0)."""
        del self.llm._launch
        self.llm = None
        synchronize()
        self.rows, before = [], None
        for batch, prefill, keys, waited, start, end in self.records:
            gap = 0.0 if before is None else before.elapsed_time(start) * 1e-3
            self.rows.append({"batch": batch, "prefill": prefill, "keys": keys, "waited": waited,
                              "busy": start.elapsed_time(end) * 1e-3, "gap": gap})
            before = end


def timeline(rows: list[dict], w, bandwidth: float) -> dict | None:
    """Decode floor / time over the decode launches (time = idle gap + busy), the idle gaps, the prefills'
    time, and medians at the largest batch. None when no decode step was launched."""
    decodes = [r for r in rows if not r["prefill"]]
    if not decodes:
        return None
    wb, kv = weight_bytes(w), kv_bytes_per_token(w)
    floors = [(wb + r["keys"] * kv) / bandwidth for r in decodes]
    gaps, steps = [r["gap"] for r in decodes], [r["gap"] + r["busy"] for r in decodes]
    top = max(r["batch"] for r in decodes)
    at_top = [(f, r) for f, r in zip(floors, decodes) if r["batch"] == top]
    waited = [r["gap"] for r in decodes if r["waited"]] or [0.0]
    others = [r["gap"] for r in decodes if not r["waited"]] or [0.0]
    return {
        "steps": len(decodes), "batches": (min(r["batch"] for r in decodes), top), "time": sum(steps),
        "busy": sum(r["busy"] for r in decodes), "idle": sum(gaps), "floor": sum(floors),
        "ratio": sum(floors) / sum(steps), "weights_floor": wb / bandwidth,
        "gap_mean": statistics.mean(gaps), "gap_median": statistics.median(gaps), "gap_max": max(gaps),
        "waited": sum(r["waited"] for r in decodes), "waited_gap": statistics.mean(waited),
        "unwaited_gap": statistics.mean(others),
        "prefill": sum(r["gap"] + r["busy"] for r in rows if r["prefill"]),
        "top": top, "top_steps": len(at_top),
        "top_step": statistics.median(r["gap"] + r["busy"] for _, r in at_top),
        "top_busy": statistics.median(r["busy"] for _, r in at_top),
        "top_gap": statistics.median(r["gap"] for _, r in at_top),
        "top_floor": statistics.median(f for f, _ in at_top),
        "top_context": statistics.median(r["keys"] / r["batch"] for _, r in at_top),
    }


def timed_generate(llm, prompts, params, timer) -> tuple:
    """(wall seconds, outputs, `timer(llm)` closed, the stats of this call alone) of one `llm.generate`."""
    before, recording = dict(llm.stats), timer(llm)
    elapsed, outputs = seconds(partial(llm.generate, prompts, params))
    recording.close()
    return elapsed, outputs, recording, {k: v - before.get(k, 0) for k, v in llm.stats.items()}


def counted(stats: dict) -> str:
    kinds = ("prefill_steps", "decode_steps", "preemptions", "waits")
    return ", ".join(f"{stats[k]} {k.replace('_', ' ')}" for k in kinds if k in stats)


def print_timeline(what: str, f: dict | None, stats: dict) -> None:
    if f is None:
        print(f"  {what}: no decode step went through OverlapLLM._launch, so none was timed ({counted(stats)})")
        return
    low, high = f["batches"]
    print(f"  {what}: {f['steps']} decode steps (batch {low}..{high}) took {f['time']:.3f} s of the GPU's timeline, "
          f"{f['busy']:.3f} s busy in their launches and {f['idle']:.3f} s idle before them; floor {f['floor']:.3f} s "
          f"-> floor / time {f['ratio']:.2f} ({counted(stats)})")
    print(f"    host time not hidden: {f['gap_mean'] * 1e3:.3f} ms idle per decode step (median "
          f"{f['gap_median'] * 1e3:.3f}, largest {f['gap_max'] * 1e3:.2f}); {f['waited']} decode steps came after a "
          f"wait, {f['waited_gap'] * 1e3:.3f} ms idle before each, the others {f['unwaited_gap'] * 1e3:.3f} ms")
    print(f"    at batch {f['top']} ({f['top_steps']} steps, median context {f['top_context']:.0f}): median step "
          f"{f['top_step'] * 1e3:.2f} ms, busy {f['top_busy'] * 1e3:.2f} ms, idle {f['top_gap'] * 1e3:.3f} ms, floor "
          f"{f['top_floor'] * 1e3:.2f} ms ({f['top_floor'] / f['top_step']:.2f} of the step)")


def empty_replay(llm, batch: int) -> tuple[int, float] | None:
    """(the recorded batch size, the GPU seconds of one replay): the smallest recorded decode step of at least
    `batch` rows, replayed with nothing to attend and nothing stored (median of 10). It still reads every
    weight, and samples. None, with a note, where the engine keeps no `graphs` and `_buffers`."""
    try:
        graphs, buffers = getattr(llm, "graphs", None), getattr(llm, "_buffers", None)
        size = min((s for s in (graphs or {}) if s >= batch), default=None)
        if size is None or buffers is None:
            print(f"  (no recorded decode step of {batch} rows in the engine's `graphs` and `_buffers`: the step "
                  f"with nothing to attend was not measured)")
            return None
        buffers["slot_mapping"].fill_(-1)  # store nothing
        buffers["context_lens"].zero_()  # read no keys
        times = []
        for _ in range(10):
            start, end = cuda_event(), cuda_event()
            start.record()
            graphs[size].replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
        return size, statistics.median(times)
    except Exception as error:  # noqa: BLE001 - a diagnostic only
        print(f"  (the step with nothing to attend was not measured: {type(error).__name__}: {str(error)[:100]})")
        return None


# ---- (a) against HF ------------------------------------------------------------------------------------------


def part_a(p09, w, hf, bandwidth: float) -> dict:
    device, vocab = w.embed_tokens.device, w.embed_tokens.shape[0]
    gen = torch.Generator().manual_seed(1)  # engine.py's (a): the same prompts
    prompts = torch.randint(0, vocab, (A_PROMPTS, A_PROMPT_LEN), generator=gen)
    warmup = torch.randint(0, vocab, (A_PROMPTS, A_PROMPT_LEN), generator=gen)
    greedy = p09.SamplingParams(temperature=0.0, max_tokens=A_NEW, ignore_eos=True)
    tokens = A_PROMPTS * A_NEW
    llm = p09.OverlapLLM(w, engine_config(p09))
    llm.generate(warmup[:8].tolist(), p09.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    t_engine, out_engine, launches, stats = timed_generate(llm, prompts.tolist(), greedy, Launches)
    del llm
    release()
    hf_generate(hf, warmup.to(device), 2)
    t_hf, out_hf = seconds(partial(hf_generate, hf, prompts.to(device), A_NEW))
    agree = [next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), A_NEW) for x, y in zip(out_engine, out_hf)]
    f = timeline(launches.rows, w, bandwidth)
    print(f"\n(a) {A_PROMPTS} prompts x {A_PROMPT_LEN} random tokens in, {A_NEW} out (greedy, no stop token), each "
          f"after a warm-up run: OverlapLLM {tokens / t_engine:.0f} output tokens/s ({t_engine:.2f} s), HF generate "
          f"{tokens / t_hf:.0f} ({t_hf:.2f} s): p09 / HF {t_hf / t_engine:.1f}x")
    print(f"  tokens equal to HF's: all {A_NEW} in {agree.count(A_NEW)} of {A_PROMPTS} sequences; median first "
          f"difference at token {statistics.median(agree):.0f} (greedy bf16 runs part at near-ties)")
    print_timeline("OverlapLLM's decode steps", f, stats)
    return {"p09": tokens / t_engine, "hf": tokens / t_hf, "ratio": t_hf / t_engine, "floor": f,
            "hf_step": t_hf / A_NEW}


# ---- (b) nano-vllm's bench, p06 beside p09 -------------------------------------------------------------------


def part_b(p06, p09, w, bandwidth: float) -> dict:
    prompts, params = nano_vllm_workload(p06)
    tokens = sum(p.max_tokens for p in params)
    print(f"\n(b) nano-vllm's bench: {B_REQUESTS} requests, prompts of {B_MIN}..{B_MAX} random tokens "
          f"({sum(map(len, prompts))} in all), {B_MIN}..{B_MAX} out ({tokens} in all), temperature 0.6, ignore_eos; "
          f"{', '.join(f'{k} {v}' for k, v in B_LIMITS.items())}; CUDA graphs")
    results = {}
    for name, build, timer in (("p06", p06.LLM, DecodeSteps), ("p09", p09.OverlapLLM, Launches)):
        t_start, llm = seconds(partial(build, w, engine_config(p06, cuda_graphs=True, **B_LIMITS)))
        llm.generate([prompts[0][:B_MIN]] * 2, p06.SamplingParams(temperature=0.6, max_tokens=4, ignore_eos=True))
        elapsed, outputs, steps, stats = timed_generate(llm, prompts, params, timer)
        assert [len(o) for o in outputs] == [p.max_tokens for p in params]
        print(f"  {name} {type(llm).__name__}: {tokens / elapsed:.0f} output tokens/s ({elapsed:.2f} s; engine built "
              f"in {t_start:.1f} s)")
        if name == "p06":
            f = steps.against_floor(w, bandwidth)
            fixed = fixed_cost(llm, f["top"])
            print(f"    {counted(stats)}")
            print_floor("decode steps", f)
            print_fixed(fixed, f["top"], w, bandwidth)
            prefill = elapsed - f["wall"]  # prefill steps, and whatever is not a decode step
            host = (f["wall"] - f["gpu"]) / f["steps"]  # a decode step's wall time outside ModelRunner.decode
        else:
            f = timeline(steps.rows, w, bandwidth)
            print_timeline("decode steps", f, stats)
            fixed = empty_replay(llm, f["top"]) if f is not None else None
            prefill, host = (f["prefill"], f["gap_mean"]) if f is not None else (float("nan"), float("nan"))
        del llm, outputs
        release()
        results[name] = {"tokens_per_s": tokens / elapsed, "elapsed": elapsed, "floor": f, "fixed": fixed,
                         "prefill": prefill, "host": host, "stats": stats}
    p, q = results["p06"], results["p09"]
    print(f"  p09 / p06: {q['tokens_per_s'] / p['tokens_per_s']:.2f}x; p09's prefill steps take {q['prefill']:.2f} s "
          f"of its {q['elapsed']:.2f} s ({q['prefill'] / q['elapsed']:.0%}); p06 spends {p['prefill']:.2f} s of its "
          f"{p['elapsed']:.2f} s outside its decode steps")
    return results


# ---- summary -------------------------------------------------------------------------------------------------


def cell(value, fmt: str) -> str:
    return "" if value is None else "n/a" if value != value else format(value, fmt)  # NaN: measured nothing


def target(what: str, reached: bool, value: str, *bounds: str) -> None:
    print(f"target {what}: {'reached' if reached else 'NOT reached'} ({value})")
    for bound in () if reached else bounds:
        print(f"  {bound}")


def report(summary: dict, total: float) -> None:
    a, b = summary.get("a"), summary.get("b")
    rows = []
    if a is not None:
        shape = f"{A_PROMPTS} x {A_PROMPT_LEN} -> {A_NEW}"
        rows += [(f"(a) {shape}, p09 OverlapLLM", a["p09"], a["floor"], a["floor"] and a["floor"]["gap_mean"]),
                 (f"(a) {shape}, HF generate", a["hf"], None, None)]
    if b is not None:
        rows += [(f"(b) nano-vllm bench, {name} {kind} (graphs)", b[name]["tokens_per_s"], b[name]["floor"],
                  b[name]["host"]) for name, kind in (("p06", "LLM"), ("p09", "OverlapLLM"))]
    header = f"{'workload':<44} | {'output tokens/s':>15} | {'decode floor / time':>19} | host not hidden ms/step"
    print(f"\nsummary\n{header}\n{'-' * len(header)}")
    for name, rate, f, host in rows:
        print(f"{name:<44} | {rate:>15.0f} | {cell(f and f['ratio'], '.2f'):>19} | "
              f"{cell(None if host is None else host * 1e3, '.3f'):>23}")
    print("(host not hidden: for p09 the GPU's mean idle gap before a decode launch; for p06 a decode step's wall "
          "time outside ModelRunner.decode's GPU time)\n")
    if a is not None:
        f = a["floor"]
        target(f"(a) p09 >= {TARGET_HF:.0f}x HF", a["ratio"] >= TARGET_HF, f"{a['ratio']:.1f}x",
               *([f"a decode step of {A_PROMPTS}: HF {a['hf_step'] * 1e3:.1f} ms; p09 {f['top_step'] * 1e3:.2f} ms "
                  f"(busy {f['top_busy'] * 1e3:.2f}, idle {f['top_gap'] * 1e3:.3f}) against a floor of "
                  f"{f['top_floor'] * 1e3:.2f} ms; p09's prefill steps took {f['prefill']:.2f} s"] if f else []))
    if b is not None:
        p, q, f = b["p06"], b["p09"], b["p09"]["floor"]
        speedup = q["tokens_per_s"] / p["tokens_per_s"]
        cap = (f"; with decode steps that took no time at all, p09's prefill steps alone would cap p09 / p06 at "
               f"{p['elapsed'] / q['prefill']:.2f}x") if q["prefill"] > 0 else ""
        decode = []
        if f is not None and p["floor"] is not None:
            decode.append(f"decode steps: p06 {p['floor']['wall']:.2f} s, p09 {f['time']:.2f} s "
                          f"({p['floor']['wall'] / f['time']:.2f}x), p09 at {f['ratio']:.2f} of their floor; the "
                          f"prefill steps run p06's runner in both, so they bound the whole run's ratio")
            if q["fixed"] is not None:
                size, cost = q["fixed"]
                attention, reads = f["top_busy"] - cost, f["top_floor"] - f["weights_floor"]
                decode.append(f"at batch {f['top']}: of p09's {f['top_step'] * 1e3:.2f} ms step, the attention's reads "
                              f"of the K/V take about {attention * 1e3:.2f} ms (the step less its replay with nothing "
                              f"to attend) against their floor of {reads * 1e3:.2f} ms, and the rest of the "
                              f"recorded step {cost * 1e3:.2f} ms (the weights' floor {f['weights_floor'] * 1e3:.2f} "
                              f"ms): {'the attention' if attention > cost else 'the rest'} takes the larger share")
        target(f"(b) p09 / p06 >= {TARGET_P06:.0f}", speedup >= TARGET_P06, f"{speedup:.2f}x",
               f"p09: prefill steps {q['prefill']:.2f} s of {q['elapsed']:.2f} s ({q['prefill'] / q['elapsed']:.0%}); "
               f"p06: {p['prefill']:.2f} s of {p['elapsed']:.2f} s outside its decode steps{cap}", *decode)
    if b is not None and f is None:
        print("targets (b) decode floor / time and host time not hidden: not measured (no decode step was timed)")
    elif b is not None:
        bounds = [f"at batch {f['top']} (median context {f['top_context']:.0f}): a step takes "
                  f"{f['top_step'] * 1e3:.2f} ms = {f['top_gap'] * 1e3:.3f} ms idle + {f['top_busy'] * 1e3:.2f} ms "
                  f"busy, against a floor of {f['top_floor'] * 1e3:.2f} ms"]
        if q["fixed"] is not None:
            size, cost = q["fixed"]
            bounds.append(f"of the busy time, {cost * 1e3:.2f} ms is the recorded step of batch {size} with nothing "
                          f"to attend (it reads weights that take {f['weights_floor'] * 1e3:.2f} ms at the copy's "
                          f"bandwidth, and samples); the rest, {(f['top_busy'] - cost) * 1e3:.2f} ms, the attention's "
                          f"reads of the K/V (their floor {(f['top_floor'] - f['weights_floor']) * 1e3:.2f} ms)")
        target(f"(b) decode floor / time >= {TARGET_FLOOR}", f["ratio"] >= TARGET_FLOOR,
               f"{f['ratio']:.2f} over all decode steps; {f['top_floor'] / f['top_step']:.2f} at batch {f['top']}",
               *bounds)
        host_ms = f["gap_mean"] * 1e3
        target(f"(b) host not hidden <= {TARGET_HOST_MS} ms per decode step", host_ms <= TARGET_HOST_MS,
               f"{host_ms:.3f} ms", f"{f['idle']:.3f} s idle before {f['steps']} decode steps; {f['waited']} came "
               f"after a wait for the step in flight (stats['waits'] {q['stats'].get('waits', 'n/a')}), "
               f"{f['waited_gap'] * 1e3:.3f} ms idle before each; the others {f['unwaited_gap'] * 1e3:.3f} ms")
    print(f"whole run {total:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
