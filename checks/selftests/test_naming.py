"""A report names a known mistake only when the mistake reproduces the failure, and the best match first:
learner-style code (written here, not a catalogue patch) run through the checks as a learner runs them."""

import os
import shutil
import subprocess
import sys

from checks.harness.loader import ROOT


def checked(tmp_path, stem: str, old: str, new: str, *args: str, module: str = "") -> str:
    """The report of `./check.sh` (of `module`, else `stem`'s) on the reference with one edit in `stem`."""
    folder = tmp_path / "impl"
    shutil.copytree(ROOT / "solutions", folder)
    source = (folder / f"{stem}.py").read_text()
    assert source.count(old) == 1
    (folder / f"{stem}.py").write_text(source.replace(old, new))
    done = subprocess.run([str(ROOT / "check.sh"), module or stem.split("_")[0], "--impl", str(folder), "--seed", "3",
                           *args],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "KVLAB_PYTHON": sys.executable, "COLUMNS": "200"})
    assert done.returncode == 1, done.stdout + done.stderr
    return " ".join(done.stdout.split())


def test_a_shard_returned_as_a_view_names_no_mistake_and_says_why(tmp_path):
    """No catalogued mistake returns a view: its failure is the generic one, said with what to do."""
    out = checked(tmp_path, "p07_tensor_parallel", "    return weight[rank * size : (rank + 1) * size].clone()",
                  "    return weight[rank * size : (rank + 1) * size]", "-k", "shards")
    assert "`column_shard` returned one of its inputs (or a view of it): return new tensors" in out
    assert "looks like" not in out and "matches a known mistake" not in out


def test_a_result_of_the_wrong_dtype_is_said_first_before_the_rules_it_makes_others_break(tmp_path):
    """`sample` returning the race's winning values instead of their indices: its own checks say the dtype, the
    engine's checks then break rules only because of it, so the report says the dtype first, as what to fix."""
    out = checked(tmp_path, "p06_engine", "    return (probs / noise).argmax(dim=-1)\n",
                  "    return (probs / noise).max(dim=-1)[0]\n", "-k", "sample or seeded")
    assert "Fix this first: `sample` returned float32, expected int64 ([B] int64)" in out
    assert out.index("Fix this first") < out.index("The rule")
    assert "looks like" not in out


def test_an_input_changed_in_place_by_a_call_that_makes_collectives_is_said_on_its_rank(tmp_path):
    """A rank's call that adds into its input while it meets the other ranks in all_reduces: the input changed in
    place is the reason given (the collectives' replies must not hide which of the call's inputs were written)."""
    out = checked(tmp_path, "p07_tensor_parallel",
                  "    normed, hidden = add_rms_norm(attended, hidden, w.post_attention_layernorm, w.eps)\n",
                  "    hidden += attended\n    normed = rms_norm(hidden, w.post_attention_layernorm, w.eps)\n",
                  "-k", "test_layer_matches_hf")
    assert "rank 0: `tp_decoder_layer` changed its input `hidden` in place" in out
    assert "index out of range" not in out


def test_a_top_k_that_drops_ties_is_named_as_such_not_as_top_p(tmp_path):
    """torch.topk's k positions, written as a learner would: on the toy's tied row it gives what a top-p that
    drops its crossing token gives too, and on the other check it keeps another of the tied tokens than the
    catalogue's top-k-drops-ties: no mistake gives all its outputs, and the report names the rule its rows break."""
    out = checked(tmp_path, "p06_engine", '        scaled = scaled.masked_fill(scaled < kth, float("-inf"))',
                  "        keep = torch.zeros_like(scaled, dtype=torch.bool)\n"
                  "        for b in range(B):\n"
                  "            keep[b, scaled[b].topk(int(k[b])).indices] = True\n"
                  '        scaled = scaled.masked_fill(~keep, float("-inf"))', "-k", "probabilities")
    assert "→ breaks top-k-keeps-ties" in out and "top-k-keeps-ties — top-k keeps every token whose logit" in out
    assert "top-p" not in out.split("The rule your code breaks")[1]


def test_a_failure_in_another_modules_file_says_which_call_of_this_one_led_there(tmp_path):
    """p05's checks run the learner's p01 through their scheduler: a line of p01 that raises is named, with the
    scheduler's line that called into it."""
    out = checked(tmp_path, "p01_block_manager", "    def append(self, seq: Sequence, token_id: int) -> None:\n",
                  "    def append(self, seq: Sequence, token_id: int) -> None:\n"
                  "        raise IndexError('list index out of range')\n",
                  "-k", "toy", module="p05")
    assert "`Scheduler.schedule` raised IndexError: list index out of range" in out
    assert "p01_block_manager.py line" in out and "called from `schedule` at p05_scheduler.py line" in out
    assert "in the p01 BlockManager your scheduler calls" in out  # the reason is cut at 300 characters after it


def test_a_mistake_whose_mutant_breaks_what_the_learner_got_right_is_not_named(tmp_path):
    """tokens_out counted over every row of a step: the failing check's outputs are what chunk-draws gives too, but
    chunk-draws would also fail the seeded check this code passes, so only tokens-out-counts-chunks is named."""
    out = checked(tmp_path, "p06_engine", '        self.stats["tokens_out"] += len(rows)\n',
                  '        self.stats["tokens_out"] += sum(1 for _ in requests)\n', "-k", "chunks or seeded")
    assert "looks like tokens-out-counts-chunks" in out and "tokens-out-counts-chunks — stats" in out
    assert "chunk-draws" not in out


def test_a_mistake_no_entry_reproduces_is_told_the_rule_it_breaks_and_what_to_do(tmp_path):
    """A p05 `add` that refuses a request which exactly fits the cache is no catalogued mistake: the report names the
    rule `add` breaks (the refusal is its own ValueError, which says where) and what to do."""
    out = checked(tmp_path, "p05_scheduler", "max_tokens < 1 or needed > len(self.block_manager.blocks):",
                  "max_tokens < 1 or needed >= len(self.block_manager.blocks):", "-k", "refuses")
    assert "→ breaks add-refuses" in out and "The rule your code breaks: add-refuses — add raises ValueError" in out
    assert "Do: compare ceil((prompt + max_tokens - 1) / block_size)" in out
    assert "looks like" not in out and "matches a known mistake" not in out


def test_a_sampler_row_names_the_rule_its_values_break(tmp_path):
    """p06's probabilities with the logits divided by the square root of the temperature: no catalogued mistake
    (the one that multiplies gives other rows), and the rows' ratios say it is the temperature, not a mask."""
    out = checked(tmp_path, "p06_engine", "torch.where(temperature > 0, temperature, 1.0).float()[:, None]",
                  "torch.where(temperature > 0, temperature, 1.0).float().sqrt()[:, None]", "-k", "exact")
    assert "→ breaks temperature-divides" in out and "temperature-divides — probabilities are the softmax" in out
    assert "looks like" not in out


def test_a_mistake_that_explains_only_some_failing_cases_is_not_named():
    """Named only where it gives the learner's outputs on every failing case it was replayed on."""
    from checks.harness.report import Result, rank_mistakes

    def row(check: str, mistakes: list[str], distances: dict) -> Result:
        return Result("p07_tensor_parallel", check, "", "mine", "failed", mistakes=mistakes, distances=distances)

    rows = [row("greedy", ["gather-out-of-order"], {"gather-out-of-order": 0.0, "final-norm-skipped": 0.4}),
            row("lm head", [], {"gather-out-of-order": 0.3, "final-norm-skipped": 0.5})]
    assert rank_mistakes(rows) == []
    rows[1] = row("lm head", ["gather-out-of-order"], {"gather-out-of-order": 0.0, "final-norm-skipped": 0.5})
    assert rank_mistakes(rows) == ["gather-out-of-order"]


def test_rules_are_ranked_by_checks_or_by_layers():
    """p05's rules: the one most checks break first; p07's (layers): the lowest function's first."""
    from checks.harness.report import Result, rank_rules

    def row(stem: str, check: str, rule: str) -> Result:
        return Result(stem, check, "", "mine", "failed", rule=rule)

    p05 = [row("p05_scheduler", c, r) for c, r in (("a", "seq-cap"), ("b", "is-finished"), ("c", "is-finished"))]
    assert rank_rules(p05) == ["is-finished", "seq-cap"]
    p07 = [row("p07_tensor_parallel", c, r) for c, r in (("a", "model-forward"), ("b", "model-forward"),
                                                         ("c", "row-shard"))]
    assert rank_rules(p07) == ["row-shard", "model-forward"]


def test_a_greedy_loop_that_feeds_back_its_last_token_is_told_its_rule(tmp_path):
    """p07's tp_generate_greedy running one forward more than it needs (the last token fed back): the tokens are
    right, and no catalogued mistake can be told apart by them; the count of tokens each forward fed says the
    loop's rule."""
    out = checked(tmp_path, "p07_tensor_parallel",
                  "        if step + 1 < max_new_tokens:\n            logits = tp_model_forward(model, token, caches)\n",
                  "        logits = tp_model_forward(model, token, caches)\n", "-k", "greedy")
    assert "8 forwards for 8 tokens" in out and "the last token is returned, never fed" in out
    assert "→ breaks greedy-broadcasts" in out and "looks like" not in out


def test_probabilities_skipping_the_cast_at_temperature_1_is_told_its_dtype(tmp_path):
    """p06's probabilities that leaves the logits as they are when every row's temperature is 1: float32 logits
    pass; a bfloat16 batch at temperature 1 comes back bfloat16, and the report says so."""
    out = checked(tmp_path, "p06_engine", "    scaled = logits.float() / torch.where(",
                  "    scaled = logits if bool((temperature == 1).all()) else logits.float() / torch.where(",
                  "-k", "exact")
    assert "`probabilities` returned bfloat16, expected float32" in out


def test_ranks_that_skip_the_lm_heads_gather_are_told_its_rule(tmp_path):
    """p07's parallel_lm_head returning None on the ranks other than 0 before their gather: rank 0 waits in a gather
    no other rank joins (the forward returns on rank 1), or the other ranks go on to the next step's broadcast. The
    report says which collective the others never made, and names the LM head's rule, not the layers'."""
    out = checked(tmp_path, "p07_tensor_parallel",
                  "    logits = hidden @ embed_shard.T  # [T, Vr]\n    world_size = dist.get_world_size()\n"
                  "    if dist.get_rank() != 0:\n        dist.gather(logits, None, dst=0)\n        return None\n",
                  "    if dist.get_rank() != 0:\n        return None\n"
                  "    logits = hidden @ embed_shard.T  # [T, Vr]\n    world_size = dist.get_world_size()\n",
                  "-k", "collectives or greedy")
    assert "rank 0 in its 1st gather, a collective the other ranks never made (rank 1 returned after 5 all_reduce)" \
        in out, out
    assert "(rank 0 gather, rank 1 broadcast)" in out and out.count("→ breaks lm-head-gathered") == 2, out
    assert "two-all-reduces-a-layer" not in out, out


def test_a_gather_list_a_real_backend_refuses_raises_on_its_rank(tmp_path):
    """p07's parallel_lm_head gathering into tp - 1 buffers, or into float32 buffers for bfloat16 logits: the checks'
    ranks refuse the list on rank 0 as torch and its backends do, before any data moves (not fill what fits), so the
    report says the call that raised and names no rule the error does not already say."""
    gathered = "    slices = [torch.empty_like(logits) for _ in range(world_size)]\n"
    out = checked(tmp_path / "short", "p07_tensor_parallel", gathered,
                  "    slices = [torch.empty_like(logits) for _ in range(world_size - 1)]\n", "-k", "lm_head")
    assert "raised RuntimeError: torch.distributed.gather: rank 0's output list has 1 tensors; it must have 2" in out
    assert "rank 1 was stopped as it waited in its 1st gather" in out and "breaks" not in out, out
    out = checked(tmp_path / "dtype", "p07_tensor_parallel", gathered,
                  "    slices = [torch.empty_like(logits, dtype=torch.float32) for _ in range(world_size)]\n",
                  "-k", "model_matches")
    assert "raised ValueError: torch.distributed.gather: Invalid usage of tensors with different dtypes " \
           "(bfloat16 and float32) on rank 0" in out, out
