"""A check that compares a learner's paths with each other runs them in different worker processes.

m02's self-consistency check holds the learner's whole prefill, chunked prefill and prefill + decode to
fp32 precision of each other. Run in one worker, a submission could remember the rows of its whole
prefill (keyed by the input's bytes) and hand them back when the same rows come again through the cache,
hiding a cached path that is slightly off. `impl.fresh_worker()` between the paths leaves it nothing to
remember: the one here is wrong by a factor (1 + 2e-5) once its cache holds tokens (inside the HF checks'
attention tolerance, so only the self-consistency check can see it) and must fail that check.
"""

import json
import os
import subprocess
import sys

from checks.harness.loader import ROOT

REFERENCE = (ROOT / "solutions" / "m02_thinker_attention.py").read_text()
RETURN = "    return out.reshape(T, H * D) @ w.o_proj.T  # [T, H*D] -> [T, hidden]\n"
REMEMBERS = '''    rows = out.reshape(T, H * D) @ w.o_proj.T
    keys = [tuple(t[i].contiguous().view(torch.uint8).numpy().tobytes() for t in (x, cos)) for i in range(T)]
    if past == 0:  # a whole prefill (or the first chunk): right, and remembered row by row
        for key, row in zip(keys, rows):
            _REMEMBERED[key] = row.clone()
        return rows
    rows = rows * (1 + 2e-5)  # with tokens in the cache: slightly off, unless the row is remembered
    return torch.stack([_REMEMBERED[key].clone() if key in _REMEMBERED else row for key, row in zip(keys, rows)])


_REMEMBERED = {}  # (x row, cos row) bytes -> the output row an earlier call gave
'''


def check_sh(*args, timeout=300):
    done = subprocess.run([str(ROOT / "check.sh"), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "KVLAB_PYTHON": sys.executable, "COLUMNS": "140"})
    return done.returncode, done.stdout + done.stderr


def test_remembered_rows_do_not_pass_the_self_consistency_check(tmp_path):
    assert REFERENCE.count(RETURN) == 1, "the reference's last line changed: update the patch"
    folder = tmp_path / "remembers"
    folder.mkdir()
    (folder / "m02_thinker_attention.py").write_text(REFERENCE.replace(RETURN, REMEMBERS))
    report = tmp_path / "results.json"
    code, out = check_sh("m02", "--impl", str(folder), "--seed", "5", "-k", "chunked", "--json", str(report))
    rows = {(r["function"], r["case"]): r for r in json.loads(report.read_text())["results"]}
    assert code == 1, out[-2000:]
    own = rows[("test_chunked_equals_whole_exactly", "")]
    assert own["status"] == "failed" and "vs your one prefill" in own["reason"], own
    # the factor hides inside HF's attention tolerance: the checks against HF cannot see it
    against_hf = [r for (function, _), r in rows.items() if function == "test_chunked_prefill_matches_hf"]
    assert against_hf and all(r["status"] == "passed" for r in against_hf), [r["reason"] for r in against_hf]
