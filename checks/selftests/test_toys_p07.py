"""The p07 toy file agrees with the definition of the split and with the reference, and the book's adapter builds
its walk-through and shows every catalogued mistake: on the toy where the page says so, on a probe otherwise,
with the numbers the page's Pitfalls quote. The distributed functions run on threads standing in for the ranks
(`checks/harness/simdist.py`)."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from book.i18n import text
from book.toys import Hidden, Shown, gallery
from book.toys import p07_tensor_parallel as adapter
from checks.harness.loader import ROOT, named
from checks.harness.mistakes import catalogue
from checks.harness.simdist import run_ranks
from checks.harness.toys import load_toy

P07 = "p07_tensor_parallel"
TOY = load_toy(P07)
STORED = 5e-5  # the toy file stores the layer's output to 4 decimals
# What the page's Pitfalls and Toy sections say: the mistakes the toy shows; the others need a probe.
ON_THE_TOY = {"qkv-contiguous-slice", "gate-up-contiguous-slice", "heads-not-divided", "o-proj-by-rows",
              "all-reduce-after-column", "no-reduce-after-o-proj", "no-reduce-after-down", "residual-before-reduce",
              "embedding-not-masked", "gather-out-of-order", "kv-heads-not-divided", "embedding-block-at-zero",
              "gate-up-swapped", "row-shard-start-not-scaled", "norm-before-reduce", "embedding-not-reduced",
              "merged-parts-equal", "mlp-residual-from-normed", "lm-head-slice-on-other-ranks",
              "attention-reads-unnormed", "gather-slices-aliased", "head-counts-as-floats", "merged-shard-as-one-block",
              "mlp-residual-before-reduce", "gate-up-fused-up-first"}
# A number each Pitfalls entry quotes, which the book's run of the mistake must show.
QUOTED = {
    "column-shard-unchecked": "[0], [1], [2], [3]",
    "merged-parts-equal": "[0, 1, 2, 6, 7, 8, 12, 13]",
    "merged-shard-as-one-block": "[0, 1, 2, 3]",
    "gate-up-fused-up-first": "[4, 5, 0, 1]",
    "mlp-residual-before-reduce": "[1.3631, -0.8392, 1.3738, -5.2916]",
    "qkv-contiguous-slice": "[0, 1, 2, 3, 4, 5, 6, 7]",
    "gate-up-contiguous-slice": "[4, 5, 6, 7]",
    "heads-not-divided": "[4, 2]",
    "kv-heads-not-divided": "[2, 2]",
    "kvh-not-checked": "num_kv_heads 0",
    "gate-up-swapped": "[2.7068, -0.6105, -0.121, -2.2661]",
    "row-shard-start-not-scaled": "[1, 2, 3, 4]",
    "o-proj-by-rows": "[0, 1, 2, 3, 4, 5, 6, 7]",
    "all-reduce-after-column": "[-0.3411, -0.1714, 1.1762, -2.9863]",
    "no-reduce-after-o-proj": "[0.4218, 0.236, 1.4435, -1.6021]",
    "no-reduce-after-down": "[-0.454, 0.0887, 0.6878, -2.6986]",
    "residual-before-reduce": "[0.6277, -1.0955, 1.5859, -2.9305]",
    "norm-before-reduce": "[0.4218, -0.764, 0.9435, -2.6021]",
    "mlp-residual-from-normed": "[1.7928, -0.8392, 0.2995, -1.8538]",
    "embedding-not-reduced": "[0, 0, 0, 0]",
    "embedding-not-masked": "[40, 42, 44, 46]",
    "embedding-block-at-zero": "[30, 32, 34, 36]",
    "final-norm-skipped": "[4.0256, -3.7537, 2.6619, 7.4307, -11.7342, -3.9899]",
    "positions-from-zero": "[3, 3, 3, 3]",
    "lm-head-slice-on-other-ranks": "a tensor [2, 3]",
    "gather-out-of-order": "[15, 20, 25, 0, 5, 10]",
    "one-cache-for-all-layers": "[3, 3, 0, 4]",
    "greedy-prefill-without-caches": "[3, 3, 3, 3]",
    "token-not-broadcast": "[3, 1, 1, 1]",
}


def reference():
    return named("solutions").load(P07)


@pytest.fixture(scope="module")
def entries():
    return {e.mistake.id: e for e in gallery(P07, adapter, reference(), TOY)}


def _by_definition() -> dict[str, list[list[int]]]:
    """The rows and columns each rank owns, from the layout alone (no kit code)."""
    layout, tp = TOY["layout"], TOY["world_size"]
    H, KVH, D, inter = layout["num_heads"], layout["num_kv_heads"], layout["head_dim"], layout["intermediate"]
    q, kv, i = H * D // tp, KVH * D // tp, inter // tp
    found = {"qkv_rows": [], "gate_up_rows": [], "o_proj_columns": [], "down_columns": [], "contiguous_qkv_rows": []}
    for r in range(tp):
        found["qkv_rows"].append([*range(r * q, (r + 1) * q), *range(H * D + r * kv, H * D + (r + 1) * kv),
                                  *range((H + KVH) * D + r * kv, (H + KVH) * D + (r + 1) * kv)])
        found["gate_up_rows"].append([*range(r * i, (r + 1) * i), *range(inter + r * i, inter + (r + 1) * i)])
        found["o_proj_columns"].append(list(range(r * q, (r + 1) * q)))
        found["down_columns"].append(list(range(r * i, (r + 1) * i)))
        fused = (H + 2 * KVH) * D // tp
        found["contiguous_qkv_rows"].append(list(range(r * fused, (r + 1) * fused)))
    return found


def test_p07_toy_row_ids_are_the_definition_and_the_references():
    expected = _by_definition()
    for key, rows in expected.items():
        assert TOY[key] == rows, key
    layer, tp = adapter._encoded_layer(TOY), TOY["world_size"]
    held = [adapter._held(reference().shard_layer(layer, r, tp)) for r in range(tp)]
    assert [h["qkv"] for h in held] == TOY["qkv_rows"]
    assert [h["gate_up"] for h in held] == TOY["gate_up_rows"]
    assert [h["o_proj"] for h in held] == TOY["o_proj_columns"]
    assert [h["down"] for h in held] == TOY["down_columns"]
    fused = torch.cat([layer.q_proj, layer.k_proj, layer.v_proj])
    contiguous = [[int(v) for v in reference().column_shard(fused, r, tp)[:, 0]] for r in range(tp)]
    assert contiguous == TOY["contiguous_qkv_rows"] != TOY["qkv_rows"]


def test_p07_vocab_split_is_the_definition():
    vocab, tp = TOY["vocab"], TOY["world_size"]
    block = vocab["size"] // tp
    assert vocab["rows"] == [list(range(r * block, (r + 1) * block)) for r in range(tp)]
    for r in range(tp):
        mine = [r * block <= i < (r + 1) * block for i in vocab["ids"]]
        assert vocab["mine"][r] == mine
        assert vocab["local"][r] == [i - r * block if m else 0 for i, m in zip(vocab["ids"], mine, strict=True)]
    assert all(sum(vocab["mine"][r][t] for r in range(tp)) == 1 for t in range(len(vocab["ids"])))  # one owner each


def test_p07_toy_output_is_the_single_process_layer_and_the_references_on_every_rank():
    m04 = named("solutions").load("m04_qwen3_model")
    layer, x = adapter._numeric_layer(TOY), torch.tensor(TOY["x"])
    cos, sin = adapter._tables(m04, TOY, x.shape[0])
    stored = torch.tensor(TOY["output"])
    torch.testing.assert_close(m04.decoder_layer_forward(layer, x, cos, sin), stored, atol=STORED, rtol=0)
    ref, tp = reference(), TOY["world_size"]
    shards = [ref.shard_layer(layer, r, tp) for r in range(tp)]
    for out in run_ranks(ref.tp_decoder_layer, [(s, x.clone(), cos, sin) for s in shards], tp):
        torch.testing.assert_close(out, stored, atol=STORED, rtol=0)


def test_p07_walkthrough_builds_its_tables():
    steps = adapter.walkthrough(reference(), TOY)  # raises ToyDrift when the adapter, the toy and solutions/ disagree
    assert [s.table.id for s in steps] == ["sharding", "embedding", "attention", "mlp", "lm_head"]
    assert all(s.text for s in steps)
    assert not any(getattr(getattr(dist, name), "noted", False) for name in ("all_reduce", "gather", "broadcast"))


def test_p07_each_rank_of_the_layer_makes_two_all_reduce_calls():
    fields = {f.key: f.value for f in adapter.scenarios(TOY)[2].run(reference())}
    assert fields["collectives"].en == "each rank: all_reduce, all_reduce"
    assert fields["inputs"].en == "unchanged"


def test_p07_probe_generates_m04s_tokens_on_every_rank():
    m04 = named("solutions").load("m04_qwen3_model")
    model = adapter.probe_model(TOY)
    whole = m04.generate_greedy(SimpleNamespace(**vars(model)), torch.tensor(adapter.PROMPT), adapter.NEW_TOKENS)
    fields = {f.key: f.value for f in adapter.probes()[1].run(reference())}
    assert fields["tokens0"] == fields["tokens1"] == "[" + ", ".join(str(int(t)) for t in whole) + "]"
    assert len(set(whole.tolist())) > 1  # a probe whose tokens vary, so a wrong feedback shows


def test_p07_every_mistake_is_shown_on_the_toy_or_a_probe(entries):
    assert list(entries) == [m.id for m in catalogue(P07).mistakes]
    assert {i for i, e in entries.items() if isinstance(e, Shown)} == ON_THE_TOY
    for mistake_id, entry in entries.items():
        if isinstance(entry, Hidden):
            assert not entry.error and entry.scenario is not None and entry.differences, mistake_id
            assert entry.scenario.id.startswith("probe"), mistake_id


@pytest.mark.parametrize("mistake_id", list(QUOTED))
def test_p07_pitfalls_quote_what_the_mistake_does(entries, mistake_id):
    """The number a Pitfalls entry quotes is in the book's run of that mistake (its result, not the correct one)."""
    entry = entries[mistake_id]
    shown = [text(line, "en") for d in entry.differences for line in d.got.lines]
    shown += [d.evidence.en.split(" instead of ")[0] for d in entry.differences]  # a probe shows its evidence
    assert any(QUOTED[mistake_id] in line for line in shown), shown
    page = (ROOT / "exercises" / f"{P07}.md").read_text(encoding="utf-8")
    pitfalls = page.split("## Pitfalls", 1)[1].split("\n## ", 1)[0]
    item = next(line for line in pitfalls.splitlines() if line.startswith(f"- `{mistake_id}`:"))
    assert QUOTED[mistake_id] in item
