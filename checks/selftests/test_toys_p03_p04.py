"""The p03 and p04 toy files agree with themselves, with the reference, and (for the mistake outputs they
store) with the named mutants. The kernels run in Triton's interpreter here when there is no GPU."""

import math

import torch

from book.toys.p04_paged_decode import paged_cache
from checks.harness.compare import close_enough, tolerance
from checks.harness.interpreter import DEVICE
from checks.harness.loader import named
from checks.harness.mistakes import catalogue
from checks.harness.toys import load_toy

EXACT = 1e-6  # toy files hold float64 values to 10 decimals
P03, P04 = "p03_flash_attention", "p04_paged_decode"


def mutant(stem: str, mistake_id: str):
    return catalogue(stem).implementation(catalogue(stem).mistake(mistake_id)).load(stem)


def close(got, expected, atol=EXACT) -> bool:
    def exact(x):  # a Python number or list straight to float64 (through float32 it would lose digits)
        return x.detach().double().cpu() if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=torch.float64)

    return torch.allclose(exact(got), exact(expected), atol=atol, rtol=0)


def nan(value) -> bool:
    return bool(torch.as_tensor(value).isnan().all())


# ---- p03: the seed's row --------------------------------------------------------------------------


def run_steps(module, toy, dtype=torch.float64):
    state = torch.tensor(float("-inf"), dtype=dtype), torch.tensor(0.0, dtype=dtype), torch.zeros(1, dtype=dtype)
    states = []
    for step in toy["steps"]:
        state = module.online_softmax_step(*state, torch.tensor(step["block"], dtype=dtype),
                                           torch.tensor(step["block_values"], dtype=dtype))
        states.append(state)
    return states


def test_p03_toy_is_consistent():
    """The page's numbers follow from the scores: one-shot softmax, block A's state, its rescale by block B."""
    toy = load_toy(P03)
    scores, values = torch.tensor(toy["scores"]).double(), torch.tensor(toy["values"]).double()
    one = toy["one_shot"]
    exps = torch.exp(scores - scores.max())
    assert close(exps, one["exp"]) and close(exps.sum(), one["sum_exp"]) and close(exps / exps.sum(), one["weights"])
    assert close(torch.softmax(scores, 0) @ values, one["output"]) and close(torch.logsumexp(scores, 0), one["lse"])
    a, b = toy["steps"]
    assert close(b["alpha"], math.exp(a["m"] - b["m"]))
    assert close(b["rescaled_sum_exp"], a["sum_exp"] * b["alpha"])
    assert close(b["rescaled_acc"], [a["acc"][0] * b["alpha"]])
    assert close(b["rescaled_sum_exp"], sum(one["exp"][:2]))  # block A's share of the one-shot sum
    assert close(toy["output"], [b["acc"][0] / b["sum_exp"]]) and close(toy["output"], one["output"])
    assert toy["shifted"]["scores"] == [s - 302 for s in toy["scores"]]


def test_p03_toy_agrees_with_the_reference():
    toy, ref = load_toy(P03), named("solutions").load(P03)
    for state, step in zip(run_steps(ref, toy), toy["steps"]):
        assert all(close(got, step[name]) for got, name in zip(state, ("m", "sum_exp", "acc")))
    scores, values = torch.tensor(toy["scores"]).double(), torch.tensor(toy["values"]).double()
    for block_size in (1, 2, 3, 4):
        assert close(ref.online_softmax(scores, values, block_size), toy["output"])
    shifted = torch.tensor(toy["shifted"]["scores"])  # fp32: exp of any of them underflows
    assert close(ref.online_softmax(shifted, values.float(), toy["block_size"]), toy["shifted"]["output"], 1e-4)


def test_p03_toy_mistakes_are_the_mutants():
    toy = load_toy(P03)
    scores, values = torch.tensor(toy["scores"]).double(), torch.tensor(toy["values"]).double()
    for mistake_id in ("no-rescale", "rescale-l-not-acc"):
        module, stored = mutant(P03, mistake_id), toy["mistakes"][mistake_id]
        m, sum_exp, acc = run_steps(module, toy)[-1]
        assert close(sum_exp, stored["sum_exp"]) and close(acc, stored["acc"]), mistake_id
        assert close(module.online_softmax(scores, values, toy["block_size"]), stored["output"]), mistake_id
    shifted = torch.tensor(toy["shifted"]["scores"])
    assert toy["mistakes"]["max-init-zero"]["shifted_output"] == "nan"
    assert nan(mutant(P03, "max-init-zero").online_softmax(shifted, values.float(), toy["block_size"]))


def kernel_row(toy, module):
    """The row through `flash_attn_varlen` (1 query, 4 keys, D 16, fp16) -> (output dim 0, lse)."""
    t = toy["kernel"]
    D = t["head_dim"]
    q, k, v = torch.zeros(1, 1, D), torch.zeros(4, 1, D), torch.zeros(4, 1, D)
    q[0, 0, 0] = 1.0
    k[:, 0, 0] = t["key_scale"] * torch.tensor(toy["scores"])
    v[:, 0, 0] = torch.tensor(toy["values"])[:, 0]
    q, k, v = (x.half().to(DEVICE) for x in (q, k, v))
    cu_q, cu_k = (torch.tensor([0, n], dtype=torch.int32, device=DEVICE) for n in (1, 4))
    out, lse = module.flash_attn_varlen(q, k, v, cu_q, cu_k, 1, 4, return_lse=True)
    assert not out[..., 1:].any(), "only dim 0 of the values is set"
    return out[0, 0, 0], lse[0, 0]


def test_p03_kernel_toy_agrees_with_the_reference_and_the_mutants():
    toy = load_toy(P03)
    t, fp16 = toy["kernel"], tolerance("flash", torch.float16)
    out, lse = kernel_row(toy, named("solutions").load(P03))
    assert close_enough(out[None], torch.tensor([t["output0"]]), fp16) and close(lse, t["lse"], 1e-4)
    for mistake_id, stored in t["mistakes"].items():
        out, lse = kernel_row(toy, mutant(P03, mistake_id))
        assert close_enough(out[None], torch.tensor([stored["output0"]]), fp16), mistake_id
        assert close(lse, stored["lse"], 1e-4), mistake_id


# ---- p04: the same row in a paged cache ---------------------------------------------------------------


def paged_row(toy, module, num_splits):
    q, k_cache, v_cache = paged_cache(toy, toy["walk"], device=DEVICE)  # the book's own toy cache
    table = torch.tensor(toy["block_table"], dtype=torch.int32, device=DEVICE)
    seqlens = torch.tensor(toy["cache_seqlens"], dtype=torch.int32, device=DEVICE)
    return module.paged_decode(q, k_cache, v_cache, table, seqlens, num_splits=num_splits)[0, 0, 0]


def test_p04_toy_is_consistent():
    toy = load_toy(P04)
    for step in toy["walk"]:
        assert step["page"] == step["key"] // toy["block_size"] and step["offset"] == step["key"] % toy["block_size"]
        assert step["block"] == toy["block_table"][0][step["page"]]
        assert step["slot"] == step["block"] * toy["block_size"] + step["offset"]
    assert toy["poisoned_block"] not in toy["block_table"][0]
    scores, values = torch.tensor(toy["scores"]).double(), torch.tensor(toy["values"]).double()
    splits, outs, lses = toy["splits"], [], []
    for start, stop in splits["ranges"]:
        outs.append(torch.softmax(scores[start:stop], 0) @ values[start:stop])
        lses.append(torch.logsumexp(scores[start:stop], 0))
    assert close(outs, splits["partial_output0"]) and close(lses, splits["partial_lse"])
    weights = torch.exp(torch.stack(lses) - max(lses))
    assert close(weights, splits["weights"])
    assert close((weights * torch.stack(outs)).sum() / weights.sum(), splits["merged0"])
    assert close(splits["merged0"], toy["output0"]) and close(torch.stack(outs).mean(), splits["averaged0"])
    assert close(torch.softmax(scores[:3], 0) @ values[:3], toy["mistakes"]["seqlen-off-by-one"]["output0"])


def test_p04_toy_agrees_with_the_reference_and_the_mutants():
    toy, fp16 = load_toy(P04), tolerance("flash", torch.float16)
    ref = named("solutions").load(P04)
    for splits in (1, 2):
        assert close_enough(paged_row(toy, ref, splits)[None], torch.tensor([toy["output0"]]), fp16)
    stored = toy["mistakes"]["seqlen-off-by-one"]["output0"]
    assert close_enough(paged_row(toy, mutant(P04, "seqlen-off-by-one"), 1)[None], torch.tensor([stored]), fp16)
    assert toy["mistakes"]["block-id-as-slot"]["output0"] == "nan"
    assert nan(paged_row(toy, mutant(P04, "block-id-as-slot"), 1))
