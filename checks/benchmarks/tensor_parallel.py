"""The engine (p06) on tensor-parallel ranks (p07) over NCCL: throughput at tensor_parallel_size 1 and N, and
what a decode step's collectives cost, in one run.

The workload is (a) of `checks.benchmarks.engine`: Qwen3-0.6B's shapes with random bf16 weights, 64 prompts
of 256 random tokens, 256 new tokens each, greedy, no stop token, `EngineConfig()`'s limits with CUDA
graphs, each engine after a warm-up run. Output tokens per second at tp 1 (one GPU) and at tp N (N GPUs,
one rank each, started by `LLM`), and the wall time of their decode steps.

A decode step of B sequences makes 2L + 1 all_reduces of `[B, hidden]` (the embedding's, then two per
layer) and one gather of `[B, V/N]` logits to rank 0. Those collectives are timed alone on N ranks (CUDA
events, the median of 50 steps), eagerly and replayed from a CUDA graph as the engine's decode steps are,
and set beside the decode step at tp 1: a rank reads 1/N of the weights, and pays for the collectives.

    python -m checks.benchmarks.tensor_parallel [--impl solutions|mine|DIR] [--tp N]
"""

import argparse
import os
import socket
import statistics
import sys
from functools import partial

import torch
import torch.distributed as dist

from checks.benchmarks.engine import (
    A_NEW,
    A_PROMPT_LEN,
    A_PROMPTS,
    MODEL,
    DecodeSteps,
    copy_bandwidth,
    engine_config,
    random_weights,
    release,
    seconds,
    weight_bytes,
)

STEPS = 50  # decode steps' collectives timed, after 5 untimed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impl", default="solutions", help="solutions (default), mine, or a folder")
    parser.add_argument("--tp", type=int, default=2, help="ranks of the tensor-parallel engine (default 2)")
    args = parser.parse_args()
    if args.tp < 2:
        parser.error("--tp must be at least 2 (tp 1 is the engine's own benchmark)")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < args.tp:
        print(f"tensor-parallel benchmark: needs {args.tp} GPUs (one per rank, NCCL); this machine has {gpus}. "
              f"./check.sh p06 checks two ranks on a CPU with gloo.")
        return 0
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("tensor-parallel benchmark: unset TRITON_INTERPRET to measure the compiled kernels.", file=sys.stderr)
        return 2
    from checks.harness.loader import named

    engine = named(args.impl).load_to_time("p06_engine")
    print(f"engine ({args.impl}) at tensor_parallel_size 1 and {args.tp} on {torch.cuda.get_device_name()} x {gpus}; "
          f"torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
    w = random_weights(torch.device("cuda"))
    bandwidth = copy_bandwidth(torch.device("cuda"))
    print(f"Qwen3-0.6B's shapes, random bf16 weights: {weight_bytes(w) / 1e9:.3f} GB read by a decode step at tp 1, "
          f"{weight_bytes(w) / args.tp / 1e9:.3f} GB per rank at tp {args.tp}")
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, MODEL["vocab"], (A_PROMPTS, A_PROMPT_LEN), generator=gen).tolist()
    warmup = torch.randint(0, MODEL["vocab"], (8, A_PROMPT_LEN), generator=gen).tolist()
    one = serve(engine, w, 1, prompts, warmup)
    cpu = w.to(torch.device("cpu"))  # a tensor-parallel engine takes its model on the CPU
    del w
    release()
    many = serve(engine, cpu, args.tp, prompts, warmup)
    collectives = time_collectives(args.tp, A_PROMPTS)

    tokens = A_PROMPTS * A_NEW
    print(f"\n{A_PROMPTS} prompts x {A_PROMPT_LEN} random tokens in, {A_NEW} out (greedy, no stop token)")
    header = f"{'':<24} | {'seconds':>8} | {'tokens/s':>9} | {'ms per decode step':>18}"
    print(header)
    print("-" * len(header))
    for label, run in (("tp 1 (one GPU)", one), (f"tp {args.tp} ({args.tp} GPUs)", many)):
        print(f"{label:<24} | {run['seconds']:>8.2f} | {tokens / run['seconds']:>9.0f} | {run['step'] * 1e3:>18.3f}")
    print(f"  tp {args.tp} / tp 1: {one['seconds'] / many['seconds']:.2f}x the tokens per second, decode steps "
          f"{many['step'] / one['step']:.2f}x as long. Tokens equal at tp 1 and tp {args.tp}: "
          f"{sum(a == b for a, b in zip(one['out'], many['out']))} of {A_PROMPTS} sequences (greedy bf16 runs part "
          f"at near-ties, and the partial sums add in another order)")
    calls = 2 * MODEL["layers"] + 1
    print(f"  a decode step's collectives at batch {A_PROMPTS} on {args.tp} ranks ({calls} all_reduce of "
          f"[{A_PROMPTS}, {MODEL['hidden']}] bf16, 1 gather of [{A_PROMPTS}, {MODEL['vocab'] // args.tp}]): "
          f"{collectives['eager'] * 1e3:.3f} ms eager, {collectives['graph'] * 1e3:.3f} ms replayed from a CUDA "
          f"graph ({collectives['graph'] / calls * 1e6:.1f} us per collective); that is "
          f"{collectives['graph'] / many['step']:.0%} of a tp {args.tp} decode step")
    print(f"  why: a decode step at tp 1 takes {one['step'] * 1e3:.3f} ms, of which reading the weights at the "
          f"measured copy bandwidth ({bandwidth / 1e12:.2f} TB/s) is {weight_bytes(cpu) / bandwidth * 1e3:.3f} ms; "
          f"tp {args.tp} can save at most part of that, while each of the {calls} collectives costs a fixed "
          f"latency of some microseconds whatever its size, so a model this small gains little or loses")
    return 0


def serve(engine, w, tp: int, prompts: list, warmup: list) -> dict:
    """One engine at `tensor_parallel_size` tp: the workload's wall time, its tokens, its mean decode step."""
    llm = engine.LLM(w, engine_config(engine, tensor_parallel_size=tp))
    try:
        llm.generate(warmup, engine.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        steps = DecodeSteps(llm)
        greedy = engine.SamplingParams(temperature=0.0, max_tokens=A_NEW, ignore_eos=True)
        wall, out = seconds(partial(llm.generate, prompts, greedy))
        step = sum(r[2] for r in steps.rows) / len(steps.rows)
        steps.close()
    finally:
        llm.close()
    del llm
    release()
    return {"seconds": wall, "out": out, "step": step}


def time_collectives(world_size: int, batch: int) -> dict:
    """Seconds of one decode step's collectives on `world_size` ranks (rank 0's view), eager and from a graph."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    results = torch.multiprocessing.get_context("spawn").SimpleQueue()
    torch.multiprocessing.spawn(collectives_on_rank, args=(world_size, address, batch, results), nprocs=world_size)
    return results.get()


def collectives_on_rank(rank: int, world_size: int, address: str, batch: int, results) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=address, rank=rank, world_size=world_size,
                            device_id=torch.device("cuda", rank))
    hidden = torch.zeros(batch, MODEL["hidden"], dtype=torch.bfloat16, device="cuda")
    logits = torch.zeros(batch, MODEL["vocab"] // world_size, dtype=torch.bfloat16, device="cuda")
    slices = [torch.empty_like(logits) for _ in range(world_size)] if rank == 0 else None

    def step():
        for _ in range(2 * MODEL["layers"] + 1):
            dist.all_reduce(hidden)
        dist.gather(logits, slices, dst=0)

    def median_seconds(run) -> float:
        times = []
        for index in range(5 + STEPS):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            dist.barrier()
            begin.record()
            run()
            end.record()
            end.synchronize()
            if index >= 5:
                times.append(begin.elapsed_time(end) * 1e-3)
        return statistics.median(times)

    eager = median_seconds(step)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # NCCL's first use on this stream happens outside the recording
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        step()
    replayed = median_seconds(graph.replay)
    if rank == 0:
        results.put({"eager": eager, "graph": replayed})
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
