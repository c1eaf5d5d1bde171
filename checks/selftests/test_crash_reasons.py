"""A worker killed by a signal says which call it was running, on what, and where: a copy of the reference
whose p04 `paged_prefill` segfaults (`ctypes.string_at(0)`) gets, on one prefill check, a one-line reason that
names the function, the line and the arguments' shapes and dtypes; the engine that reaches it (p06, one
check) names the function it crashed in and the module whose reference makes it pass. Python's own report of
the crash (the fault handler's frames) never reaches the terminal."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from checks.harness.guard import value_shown, with_arguments
from checks.harness.loader import ROOT

CRASH = "    import ctypes; ctypes.string_at(0)  # reads address 0: SIGSEGV\n"
ANCHOR = "    return _paged_attention(q, k_cache, v_cache, block_table, cu_seqlens_q, cache_seqlens, max_seqlen_q,\n"


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    """One run of p04's split-K prefill check and p06's prefix-cache check on the crashing copy."""
    top = tmp_path_factory.mktemp("crash")
    folder = top / "segfaults"
    shutil.copytree(ROOT / "solutions", folder, ignore=shutil.ignore_patterns("__pycache__"))
    path = folder / "p04_paged_decode.py"
    source = path.read_text()
    prefill = source.index("def paged_prefill(")
    at = source.index(ANCHOR, prefill)  # the return of paged_prefill, after its docstring
    path.write_text(source[:at] + CRASH + source[at:])
    line = source[:at].count("\n") + 1
    report = top / "results.json"
    done = subprocess.run([sys.executable, "-m", "checks", "p04", "p06", "--impl", str(folder), "--seed", "1",
                           "-k", "prefill_split_k or prefix_hits", "--json", str(report)], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "140"}, capture_output=True,
                          text=True, timeout=600)
    rows = {r["module"]: r for r in json.loads(report.read_text())["results"]}
    return rows, line, done.stdout + done.stderr


def test_the_reason_names_the_call_its_line_and_its_arguments(crashed):
    rows, line, _ = crashed
    row = rows["p04_paged_decode"]
    reason = row["reason"]
    assert row["status"] == "failed" and "\n" not in reason and len(reason) <= 300, reason
    assert reason.startswith("`paged_prefill`: the worker process running it was killed by SIGSEGV"), reason
    assert f"p04_paged_decode.py line {line}" in reason, reason
    # the arguments as the reference names them: tensors as shape and dtype
    assert re.search(r"; called with q \[\d+, \d+, \d+\] fp16, k_cache \[\d+, \d+, \d+, \d+\] fp16", reason), reason


def test_the_engine_names_the_function_it_crashed_in_and_the_module_to_fix(crashed):
    rows, line, _ = crashed
    row = rows["p06_engine"]
    reason = row["reason"]
    assert row["status"] == "failed" and "\n" not in reason and len(reason) <= 300, reason
    assert reason.startswith("`LLM.generate`: the worker process running it was killed by SIGSEGV"), reason
    assert "in `paged_prefill` (" in reason and f"p04_paged_decode.py line {line})" in reason, reason
    assert "it passes with the reference in place of your p04_paged_decode.py" in reason, reason


def test_the_fault_handlers_report_stays_off_the_terminal(crashed):
    _, _, output = crashed
    assert "Fatal Python error" not in output and "most recent call first" not in output, output[-2000:]


def test_arguments_give_way_to_the_limit():
    import torch

    shown = tuple(f"t{i} {value_shown(torch.zeros(4, 8, 16, dtype=torch.bfloat16))}" for i in range(40))
    assert shown[0] == "t0 [4, 8, 16] bf16"
    text = with_arguments("`f`: the worker process running it was killed by SIGSEGV", shown, limit=120)
    assert len(text) <= 120 and text.endswith(", …") and "t0 [4, 8, 16] bf16" in text
    assert [value_shown(v) for v in (5, 0.125, None, [3, 4], "abc", (7,))] == ["5", "0.125", "None", "[3, 4]",
                                                                               "'abc'", "(7,)"]
