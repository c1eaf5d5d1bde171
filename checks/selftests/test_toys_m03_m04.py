"""The toy files of m03 and m04 agree with the reference, and their stored wrong answers with the named
mutants (the book page and the checks read the same numbers)."""

from types import SimpleNamespace

import torch

from checks.harness.loader import named
from checks.harness.mistakes import catalogue
from checks.harness.toys import load_toy

EXACT = 1e-6  # toy files hold closed-form values to 10 decimals


def close(got, expected) -> None:
    torch.testing.assert_close(torch.as_tensor(got).double(), torch.as_tensor(expected).double(), atol=EXACT, rtol=0)


def mutant(stem: str, mistake_id: str):
    return catalogue(stem).implementation(catalogue(stem).mistake(mistake_id)).load(stem)


def test_m03_toy_agrees_with_the_reference():
    ref, toy = named("solutions").load("m03_rope"), load_toy("m03_rope")
    case = toy["inverse_frequencies"]
    inv_freq = ref.inverse_frequencies(case["head_dim"], case["theta"])
    close(inv_freq, case["expected"])
    tables = toy["cos_sin"]
    cos, sin = ref.rope_cos_sin(torch.tensor(tables["positions"]), inv_freq, torch.float64)
    close(cos, tables["cos"])
    close(sin, tables["sin"])
    close(ref.rotate_half(torch.tensor(toy["rotate_half"]["x"])), toy["rotate_half"]["expected"])
    rotation = toy["apply_rope"]
    q, k = ref.apply_rope(torch.tensor(rotation["q"]).double(), torch.tensor(rotation["k"]).double(), cos, sin)
    close(q, rotation["expected_q"])
    close(k, rotation["expected_k"])
    mrope = toy["mrope"]
    close(ref.inverse_frequencies(mrope["head_dim"], mrope["theta"]), mrope["inv_freq"])
    cos, sin = ref.mrope_cos_sin(torch.tensor(mrope["position_ids"]), torch.tensor(mrope["inv_freq"]),
                                 mrope["mrope_section"], torch.float64)
    close(cos, mrope["cos"])
    close(sin, mrope["sin"])
    close(torch.tensor(mrope["angles"]).cos(), [row[:4] for row in mrope["cos"]])


def test_m03_toy_mistakes_are_the_mutants_answers():
    stem, toy = "m03_rope", load_toy("m03_rope")
    stored = toy["mistakes"]
    x = torch.tensor(toy["rotate_half"]["x"])
    for mistake_id in ("interleaved-pairs", "sin-sign-flipped"):
        close(mutant(stem, mistake_id).rotate_half(x), stored[mistake_id]["rotate_half"])
    inv_freq = torch.tensor(toy["inverse_frequencies"]["expected"])
    cos, _ = mutant(stem, "halves-not-duplicated").rope_cos_sin(torch.tensor([1]), inv_freq, torch.float64)
    close(cos[0], stored["halves-not-duplicated"]["cos_row_at_position_1"])
    close(mutant(stem, "theta-default").inverse_frequencies(4, 100.0), stored["theta-default"]["inverse_frequencies"])
    mrope = toy["mrope"]
    cos, _ = mutant(stem, "mrope-sections-misassigned").mrope_cos_sin(
        torch.tensor(mrope["position_ids"]), torch.tensor(mrope["inv_freq"]), mrope["mrope_section"], torch.float64)
    close(cos[0, :4], torch.tensor(stored["mrope-sections-misassigned"]["angles_of_token_0"]).cos())


def toy_model(module):
    spec = load_toy("m04_qwen3_model")["model"]
    layer = {name: torch.tensor(value).double() for name, value in spec["layer"].items()}
    numbers = {"eps": spec["eps"], "num_heads": spec["num_heads"], "num_kv_heads": spec["num_kv_heads"],
               "head_dim": spec["head_dim"]}
    return module.Qwen3Weights(torch.tensor(spec["embed_tokens"]).double(), [module.Qwen3Layer(**layer, **numbers)],
                               torch.tensor(spec["norm"]).double(), spec["eps"], spec["rope_theta"], spec["head_dim"])


def test_m04_toy_agrees_with_the_reference_and_the_mutants():
    stem, toy = "m04_qwen3_model", load_toy("m04_qwen3_model")
    ref = named("solutions").load(stem)
    mlp = toy["mlp"]
    w = SimpleNamespace(**{name: torch.tensor(mlp[name]).double() for name in ("gate_proj", "up_proj", "down_proj")})
    close(ref.mlp_forward(w, torch.tensor(mlp["x"]).double()), mlp["expected"])
    close(mutant(stem, "gate-up-swapped").mlp_forward(w, torch.tensor(mlp["x"]).double()),
          mlp["mistakes"]["gate-up-swapped"])
    spec, prompt = toy["model"], torch.tensor(toy["model"]["prompt"])
    close(ref.model_forward(toy_model(ref), prompt, all_logits=True), spec["logits"])
    assert ref.generate_greedy(toy_model(ref), prompt, len(spec["greedy"])).tolist() == spec["greedy"]
    wrong, stored = mutant(stem, "no-final-norm"), spec["mistakes"]["no-final-norm"]
    close(wrong.model_forward(toy_model(wrong), prompt, all_logits=True), stored["logits"])
    assert wrong.generate_greedy(toy_model(wrong), prompt, len(stored["greedy"])).tolist() == stored["greedy"]
