"""How long `./check.sh m02` takes, against the floor it cannot beat: importing torch and HF's Qwen3.

Each command runs as a cold process, in alternating pairs, timed from outside: wall and CPU seconds (the
CPU of the process and of everything it waited for); the report prints medians and the median difference
of the pairs. The target is a difference of 1.5 s or less (the checks themselves, pytest and the report).
Then `--watch`: the time from saving a file to the next verdict, for m01 and m02 (target: under 1 s).

    python -m checks.benchmarks.check_speed [--runs 7] [--module m02]
"""

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from checks.harness.loader import ROOT

FLOOR = "import torch; from transformers.models.qwen3 import modeling_qwen3"


def seconds(command: list[str]) -> tuple[float, float]:
    """Wall and CPU seconds of a command run as a cold process, timed from outside it (the CPU time of the
    process and of every process it waited for: the workers' fork server, the workers)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--module", default="m02")
    args = parser.parse_args()
    floor_cmd = [sys.executable, "-c", FLOOR]
    check_cmd = [sys.executable, "-m", "checks", args.module, "--impl", "solutions"]
    floor, check = [], []
    for _ in range(args.runs):  # alternating pairs, so a busy moment costs both sides alike
        floor.append(seconds(floor_cmd))
        check.append(seconds(check_cmd))
    rows = (("import torch + HF Qwen3 modeling", floor), (f"./check.sh {args.module} --impl solutions", check))
    for name, runs in rows:
        wall, cpu = [w for w, _ in runs], [c for _, c in runs]
        print(f"{name:34} median {statistics.median(wall):5.2f} s wall (min {min(wall):.2f}, max {max(wall):.2f}), "
              f"{statistics.median(cpu):5.2f} s CPU")
    walls = [c[0] - f[0] for f, c in zip(floor, check)]
    cpus = [c[1] - f[1] for f, c in zip(floor, check)]
    print(f"{'difference (pair by pair)':34} median {statistics.median(walls):5.2f} s wall, "
          f"{statistics.median(cpus):5.2f} s CPU, over {args.runs} pairs of cold runs")
    respawn = fresh_worker_seconds(args.runs * 4)
    print(f"{'a fresh worker (after a crash)':34} median {statistics.median(respawn) * 1000:5.1f} ms "
          f"(fork, import the module, first call; {len(respawn)} times)")
    for module, stem in (("m01", "m01_rmsnorm"), ("m02", "m02_thinker_attention")):
        waits = watch_seconds(module, stem, args.runs)
        print(f"{f'--watch {module}: save to verdict':34} median {statistics.median(waits):5.2f} s  "
              f"(min {min(waits):.2f}, max {max(waits):.2f}; {len(waits)} saves)")


def watch_seconds(module: str, stem: str, saves: int) -> list[float]:
    """`./check.sh MODULE --watch` on a copy of the reference: the wall time from writing the file to the
    end of the verdict that follows, for each of `saves` saves."""
    found = []
    with tempfile.TemporaryDirectory(prefix="kvlab-watch-") as folder:
        for path in (ROOT / "solutions").glob("*.py"):
            shutil.copy2(path, folder)
        target = Path(folder) / f"{stem}.py"
        env = {**os.environ, "COLUMNS": "120"}
        process = subprocess.Popen([sys.executable, "-m", "checks", module, "--watch", "--impl", folder], cwd=ROOT,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        try:
            wait_for(process, "watching")
            for i in range(saves):
                time.sleep(0.5)
                start = time.perf_counter()
                target.write_text(target.read_text() + f"# save {i}\n")
                wait_for(process, "from the save to this verdict")
                found.append(time.perf_counter() - start)
        finally:
            process.terminate()
            process.wait()
    return found


def wait_for(process: subprocess.Popen, text: str) -> None:
    for line in process.stdout:
        if text in line:
            return
    raise RuntimeError(f"--watch ended before printing {text!r}")


def fresh_worker_seconds(times: int) -> list[float]:
    """What replacing a dead worker costs: a fork from the server, importing m01, one call."""
    import torch

    from checks.harness.guard import Guarded, Runs
    from checks.harness.loader import named

    runs = Runs(triton=False, cuda=False, quiet=True)
    runs.start()
    found = []
    x, weight = torch.randn(4, 8), torch.ones(8)
    try:
        for _ in range(times + 1):
            run = runs.run(named("solutions"), "m01_rmsnorm", 10.0)
            start = time.perf_counter()
            Guarded(run, "m01_rmsnorm", {}, 10.0).rms_norm(x, weight, 1e-6)
            found.append(time.perf_counter() - start)
            runs.close_module("m01_rmsnorm")
    finally:
        runs.close()
    return found[1:]  # the first waits for the server to import torch


if __name__ == "__main__":
    main()
