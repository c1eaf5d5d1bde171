"""The p08 toy file agrees with the definitions (worked here in float64, no kit code) and with the reference, and
the book's adapter builds its walk-through; where the mistake catalogue exists, the book shows every mistake on
the toy or on a probe. The kernel runs in Triton's interpreter on a CPU (`book/toys/_kernels.py`); the
distributed function runs on threads standing in for the ranks (`checks/harness/simdist.py`)."""

import importlib.util
import math

import pytest
import torch

from book.toys import _kernels  # noqa: F401 - sets TRITON_INTERPRET before the reference is imported
from book.toys import p08_moe as adapter
from checks.harness.loader import named
from checks.harness.toys import load_toy

P08 = "p08_moe"
TOY = load_toy(P08)
STORED = 5e-5  # the toy file stores its real numbers to 4 decimals
D64 = torch.float64
HAS_CATALOGUE = importlib.util.find_spec(f"checks.mutants.{P08}") is not None


def reference():
    return named("solutions").load(P08)


def _weights():
    x = torch.tensor(TOY["hidden_states"], dtype=D64)
    return x, torch.tensor(TOY["router"], dtype=D64), torch.tensor(TOY["gate_up_proj"], dtype=D64), \
        torch.tensor(TOY["down_proj"], dtype=D64)


def _close(got, stored, what: str):
    torch.testing.assert_close(torch.as_tensor(got, dtype=D64), torch.tensor(stored, dtype=D64), atol=STORED, rtol=0,
                               msg=what)


def test_p08_routing_is_the_definition():
    x, router, _, _ = _weights()
    logits = x @ router.T
    assert logits.tolist() == TOY["logits"]  # small integers: exact
    probs = torch.softmax(logits, -1)
    _close(probs, TOY["probs"], "probs")
    top, ids = torch.topk(probs, TOY["top_k"], -1)
    assert ids.tolist() == TOY["expert_ids"]
    _close(top, TOY["top_probs"], "top_probs")
    _close(top / top.sum(-1, keepdim=True), TOY["weights"], "weights")
    gaps = probs.sort(-1, descending=True).values
    assert (gaps[:, 1] - gaps[:, 2] > 0.01).all()  # no tie decides a token's top 2


def test_p08_permutations_are_the_definition():
    ids = sum(TOY["expert_ids"], [])
    pairs, E = len(ids), TOY["num_experts"]
    for stored in (TOY["permutation"], TOY["kernel_permutation"]):
        bs = stored["block_size"]
        counts = [ids.count(e) for e in range(E)]
        padded = [math.ceil(c / bs) * bs for c in counts]
        order = sum(([p for p in range(pairs) if ids[p] == e] + [pairs] * (padded[e] - counts[e]) for e in range(E)), [])
        assert stored["counts"] == counts and stored["block_expert"] == sum(([e] * (n // bs) for e, n in
                                                                               enumerate(padded)), [])
        assert stored["offsets"] == [sum(padded[:e]) for e in range(E + 1)]
        if "order" in stored:
            assert stored["order"] == order
    assert 0 in TOY["permutation"]["counts"]  # an expert with no token: no rows
    assert any(c % TOY["permutation"]["block_size"] for c in TOY["permutation"]["counts"])  # padding shows


def test_p08_pair_outputs_and_block_output_are_the_definition():
    x, _, gate_up, down = _weights()
    ids, k = sum(TOY["expert_ids"], []), TOY["top_k"]
    rows = []
    for p, e in enumerate(ids):
        gate, up = (gate_up[e] @ x[p // k]).chunk(2)
        rows.append(down[e] @ (torch.nn.functional.silu(gate) * up))
    rows = torch.stack(rows)
    _close(rows, TOY["pair_outputs"], "pair_outputs")
    _, router, _, _ = _weights()
    top = torch.topk(torch.softmax(x @ router.T, -1), k, -1).values  # [T, k], exact
    for key, w in (("output", top / top.sum(-1, keepdim=True)), ("output_not_renormalised", top)):
        _close((rows.view(len(x), k, -1) * w[:, :, None]).sum(1), TOY[key], key)


def test_p08_expert_parallel_counts_are_the_definition():
    ep, ids, k = TOY["expert_parallel"], TOY["expert_ids"], TOY["top_k"]
    R, E = ep["world_size"], TOY["num_experts"]
    Er = E // R
    assert ep["experts"] == [list(range(r * Er, (r + 1) * Er)) for r in range(R)]
    assert sorted(sum(ep["tokens"], [])) == list(range(TOY["T"]))
    for r in range(R):
        mine = [ids[t][j] for t in ep["tokens"][r] for j in range(k)]
        assert ep["pairs_per_expert"][r] == [mine.count(e) for e in range(E)]
        assert ep["send_sizes"][r] == [sum(1 for e in mine if e // Er == d) for d in range(R)]
        assert ep["received_per_expert"][r] == sum((ep["pairs_per_expert"][s][r * Er:(r + 1) * Er]
                                                    for s in range(R)), [])
        assert ep["receive_sizes"][r] == [ep["send_sizes"][s][r] for s in range(R)]
        assert all(e // Er == r for _, _, e in ep["arrivals"][r]) and len(ep["arrivals"][r]) == sum(
            ep["receive_sizes"][r])


def test_p08_reference_reproduces_the_toy():
    ref = reference()
    x, w = adapter._inputs(ref, TOY)
    for norm, key in ((False, "top_probs"), (True, "weights")):
        weights, ids = ref.route(x, w.router, TOY["top_k"], norm)
        assert ids.tolist() == TOY["expert_ids"] and ids.dtype == torch.int64
        _close(weights, TOY[key], key)
    ids = torch.tensor(TOY["expert_ids"])
    for stored in (TOY["permutation"], TOY["kernel_permutation"]):
        perm = ref.permute(ids, TOY["num_experts"], stored["block_size"])
        for name in ("order", "block_expert", "counts", "offsets"):
            if name in stored:
                assert getattr(perm, name).tolist() == stored[name], name
    _close(ref.moe_reference(x, w), TOY["output"], "moe_reference")
    device = _kernels.device()
    if device is None:
        pytest.skip("this process cannot run Triton kernels")
    _close(adapter._kernel_fields(ref, TOY)[0].value, TOY["pair_outputs"], "fused_moe's rows")
    _close(adapter._block_fields(ref, TOY, True)[0].value, TOY["output"], "moe_block")
    _close(adapter._block_fields(ref, TOY, False)[0].value, TOY["output_not_renormalised"], "moe_block, norm off")
    for r, out in enumerate(adapter._ep_run(ref, TOY)):
        _close(out, [TOY["output"][t] for t in TOY["expert_parallel"]["tokens"][r]], f"rank {r}")


def test_p08_walkthrough_builds_its_tables():
    steps = adapter.walkthrough(reference(), TOY)  # raises ToyDrift when the adapter, the toy and solutions/ disagree
    assert [s.table.id for s in steps] == ["router", "permute", "kernel", "combine", "expert_parallel"]
    assert all(s.text for s in steps)


@pytest.mark.skipif(not HAS_CATALOGUE, reason="no checks/mutants/p08_moe.py yet")
def test_p08_every_mistake_is_shown_on_the_toy_or_a_probe():
    from book.toys import Hidden, gallery
    from checks.harness.mistakes import catalogue

    entries = {e.mistake.id: e for e in gallery(P08, adapter, reference(), TOY)}
    assert list(entries) == [m.id for m in catalogue(P08).mistakes]
    for mistake_id, entry in entries.items():
        assert entry.differences, f"{mistake_id}: neither the toy nor a probe shows it"
        if isinstance(entry, Hidden):
            assert not entry.error and entry.scenario.id.startswith("probe"), mistake_id
