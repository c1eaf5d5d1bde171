"""When one rank fails, the report blames the rank that failed first, with its own reason, and says what followed
on the others in one short line under it; what gloo prints never reaches the terminal. Three copies of the
reference, checked in one run on p07's greedy check and p06's engine on two ranks:
- `rank1`: p07's rank 1 broadcasts its token as int32 (rank 0's is int64), and its `shard_layer` raises on rank 1
  (the engine's ranks shard the model themselves);
- `dtype`: the engine's rank 1 all_reduces o_proj's output in float32 (rank 0's is float16): gloo aborts rank 0
  (the worker) with "terminate called after throwing ... collective mismatch";
- `abort`: the engine's rank 1 aborts (SIGABRT) in the step, and rank 0 then reads "Connection reset by peer"."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from checks.harness.loader import ROOT
from checks.harness.ranks import combine
from checks.harness.worker import backend_noise

LOGITS = "        logits = parallel_lm_head(normed, model.embed_tokens)  # [B, V] on rank 0, None elsewhere\n"
PATCHES = {
    "rank1": [("p07_tensor_parallel", "else torch.zeros(1, dtype=torch.int64)",
               "else torch.zeros(1, dtype=torch.int32)"),
              ("p07_tensor_parallel", "def shard_layer(layer, rank: int, world_size: int) -> TPLayer:\n",
               "def shard_layer(layer, rank: int, world_size: int) -> TPLayer:\n"
               "    if rank == 1:\n        raise RuntimeError('rank 1 cannot shard')\n")],
    "dtype": [("p06_engine", "    if reduce:\n        dist.all_reduce(projected)\n",
               "    if reduce:\n        dist.all_reduce(projected.float() if dist.get_rank() == 1 else projected)\n")],
    "abort": [("p06_engine", LOGITS, "        if dist.get_rank() == 1:\n            os.abort()\n" + LOGITS)],
}
NOISE = ("terminate called", "what():", "enforce fail", "Fatal Python error", "Connection reset by peer",
         "most recent call first")


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    top = tmp_path_factory.mktemp("ranks")
    impls = []
    for name, patches in PATCHES.items():
        folder = top / name
        shutil.copytree(ROOT / "solutions", folder, ignore=shutil.ignore_patterns("__pycache__"))
        for stem, old, new in patches:
            path = folder / f"{stem}.py"
            source = path.read_text()
            assert source.count(old) == 1, (name, old)
            path.write_text(source.replace(old, new))
        impls += ["--impl", str(folder)]
    report = top / "results.json"
    done = subprocess.run([sys.executable, "-m", "checks", "p06", "p07", *impls, "--seed", "1", "-k",
                           "two_ranks_give or greedy_matches_hf_generate", "--json", str(report)], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "140"}, capture_output=True,
                          text=True, timeout=600)
    rows = {(r["impl"].rsplit("/", 1)[-1], r["module"]): r for r in json.loads(report.read_text())["results"]}
    return rows, done.stdout, done.stderr


def test_a_broadcast_that_does_not_fit_blames_its_rank(checked):
    rows, _, _ = checked
    row = rows["rank1", "p07_tensor_parallel"]
    assert row["status"] == "failed", row
    assert row["reason"].startswith("rank 1: `tp_generate_greedy` raised RuntimeError: torch.distributed.broadcast: "
                                    "rank 1's tensor is [1] int32, the source rank 0's [1] int64"), row["reason"]
    assert row["detail"].startswith("rank 0 then: RuntimeError: torch.distributed.broadcast"), row["detail"]


def test_a_rank_that_cannot_shard_is_named_at_once(checked):
    rows, _, _ = checked
    row = rows["rank1", "p06_engine"]
    assert row["status"] == "failed" and "rank 1: RuntimeError: rank 1 cannot shard" in row["reason"], row
    assert "did not return within" not in row["reason"]  # rank 0 no longer waits for it to join


def test_a_rank_that_aborts_is_blamed_before_the_connection_it_reset(checked):
    rows, _, _ = checked
    row = rows["abort", "p06_engine"]
    assert row["status"] == "failed", row
    assert "raised RuntimeError: rank 1 was killed by SIGABRT (a crash in native code)" in row["reason"], row["reason"]
    assert "Connection" not in row["reason"] and row["detail"].startswith("then rank 0: RuntimeError: "), row
    assert "Connection" in row["detail"], row["detail"]


def test_gloos_abort_is_one_line_of_the_report(checked):
    rows, _, _ = checked
    row = rows["dtype", "p06_engine"]
    assert row["status"] == "failed" and "killed by SIGABRT" in row["reason"], row
    assert row["detail"].startswith("gloo said: ") and "collective mismatch" in row["detail"], row["detail"]
    assert "\n" not in row["detail"] and len(row["detail"]) <= 160


def test_no_backend_text_outside_the_report(checked):
    rows, stdout, stderr = checked
    notice = [line for line in stderr.splitlines() if line.strip() and "runs as you" not in line]
    assert not notice, stderr[-3000:]
    assert any(r["detail"] for r in rows.values())
    for line in stdout.splitlines():  # the report may quote the backend in a failure's detail line (indented by 8)
        assert line.startswith(" " * 8) or not any(word in line for word in NOISE), stdout[-3000:]


def test_backend_lines_are_told_from_the_learners():
    kept, said = backend_noise(
        "my own line\n"
        "terminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
        "  what():  [enforce fail at /x/gloo/transport/tcp/pair.cc:456] op.preamble.length <= op.nbytes. 8 vs 4. "
        "Is there a distributed collective mismatch in your code?\n"
        "[W1203 10:11:12.123456 ProcessGroupGloo.cpp:516] Warning: Unable to resolve hostname\n"
        "  my indented line\n")
    assert kept == "my own line\n  my indented line\n"
    assert said == ("gloo said: op.preamble.length <= op.nbytes. 8 vs 4. Is there a distributed collective mismatch "
                    "in your code?")
    assert backend_noise("nothing here\n") == ("nothing here\n", "")


def test_a_broadcast_blames_the_rank_whose_tensor_is_not_the_sources():
    source, wrong = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int32)
    answers, culprits = combine([("broadcast", {"src": 0, "tensor": t}) for t in (source, wrong, source)])
    assert culprits == {1} and [a[0] for a in answers] == ["collective-error"] * 3
    assert "rank 1's tensor is [1] int32, the source rank 0's [1] int64" in answers[1][1]
    assert answers[0][1] == answers[2][1] == "torch.distributed.broadcast: rank 1's tensor did not fit"
    answers, culprits = combine([("broadcast", {"src": 1, "tensor": source})] * 2)
    assert culprits == set() and all(a[0] == "collective-result" for a in answers)
