"""The p09 toy file agrees with the definitions (worked here in float64, no kit code) and with the reference, and
the mistake it stores is what the named mutant gives. The kernels run in Triton's interpreter on a CPU
(`book/toys/_kernels.py`); the timeline steps the reference engine on a small random model (its bookkeeping does
not depend on the tokens: every request runs to its max_tokens)."""

import math

import torch

from book.toys import _kernels  # noqa: F401 - sets TRITON_INTERPRET before the reference is imported
from checks.harness.loader import named
from checks.harness.mistakes import catalogue
from checks.harness.toys import load_toy
from checks.test_p06_engine import ONE_HEAD, Config, Params, on_device, weights

P09 = "p09_overlap"
TOY = load_toy(P09)
STORED = 5e-5


def reference():
    return named("solutions").load(P09)


def test_p09_kernel_toys_are_the_definition():
    norm = TOY["fused_add_rms_norm"]
    s = torch.tensor(norm["x"], dtype=torch.float64) + torch.tensor(norm["residual"], dtype=torch.float64)
    assert s.tolist() == norm["expected_residual"]
    normed = s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + norm["eps"]) * torch.tensor(norm["weight"])
    torch.testing.assert_close(normed, torch.tensor(norm["expected_normed"], dtype=torch.float64), atol=STORED, rtol=0)
    silu = TOY["fused_silu_mul"]
    gate, up = torch.tensor(silu["gate_up"], dtype=torch.float64).chunk(2, -1)
    expected = gate / (1 + torch.exp(-gate)) * up
    torch.testing.assert_close(expected, torch.tensor(silu["expected"], dtype=torch.float64), atol=STORED, rtol=0)
    assert math.isclose(silu["expected"][0][1], 10 / (1 + math.exp(-2)), abs_tol=STORED)


def run_norm(module):
    norm = TOY["fused_add_rms_norm"]
    residual = torch.tensor(norm["residual"])
    normed = module.fused_add_rms_norm(torch.tensor(norm["x"]), residual, torch.tensor(norm["weight"]), norm["eps"])
    return normed, residual


def test_p09_kernels_reproduce_the_toy():
    module = reference()
    normed, residual = run_norm(module)
    norm = TOY["fused_add_rms_norm"]
    torch.testing.assert_close(normed.double(), torch.tensor(norm["expected_normed"], dtype=torch.float64),
                               atol=STORED, rtol=0)
    assert residual.tolist() == norm["expected_residual"]
    out = module.fused_silu_mul(torch.tensor(TOY["fused_silu_mul"]["gate_up"]))
    torch.testing.assert_close(out.double(), torch.tensor(TOY["fused_silu_mul"]["expected"], dtype=torch.float64),
                               atol=STORED, rtol=0)


def test_p09_stored_mistake_is_the_mutant():
    stem = P09
    for mistake_id, stored in TOY["fused_add_rms_norm"]["mistakes"].items():
        mutant = catalogue(stem).implementation(catalogue(stem).mistake(mistake_id)).load(stem)
        _, residual = run_norm(mutant)
        assert residual.tolist() == stored, mistake_id


def test_p09_timeline_is_the_reference():
    timeline = TOY["timeline"]
    llm = reference().OverlapLLM(on_device(weights(0, ONE_HEAD)), Config(block_size=timeline["block_size"]))
    requests = [llm.add_request(r["prompt"], Params(max_tokens=r["max_tokens"])) for r in timeline["requests"]]
    for call, expected in enumerate(timeline["calls"], start=1):
        finished = [r.request_id for r in llm.step()]
        flight = llm.in_flight
        got = {
            "in_flight": None if flight is None else flight.request_ids,
            "kind": None if flight is None else ("prefill" if flight.is_prefill else "decode"),
            "finished": finished,
            "tokens": [[t if t < 0 else "t" for t in r.token_ids[r.num_prompt_tokens:]] for r in requests],
            "blocks": [len(r.block_table) for r in requests],
        }
        assert got == expected, f"step call {call}"
