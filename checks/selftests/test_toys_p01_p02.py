"""The p01 and p02 toy files agree with the references, and the mistakes they store with the named mutants
(the pages quote both)."""

import os

import pytest
import torch

from book.toys.p01_block_manager import replay
from checks.harness.loader import named
from checks.harness.mistakes import catalogue
from checks.harness.toys import load_toy

P01, P02 = "p01_block_manager", "p02_store_kvcache"
STATE = ("block_tables", "num_cached_tokens", "free", "ref_counts", "cached_blocks")


def mutant(stem: str, mistake_id: str):
    return catalogue(stem).implementation(catalogue(stem).mistake(mistake_id)).load(stem)


def p01_steps(module, scenario: dict, upto: int | None = None) -> list[dict]:
    """What each step of a toy scenario (up to step `upto`) gives: a question's answer, or the state after a
    call (the book's replay of the scenario, which the book's page shows)."""
    return replay(module, load_toy(P01)["block_size"], scenario, upto)[2]


def p01_metadata(module, kind: str) -> dict:
    toy = load_toy(P01)
    seqs = [module.Sequence(r["tokens"], toy["block_size"], r["block_table"], r["num_cached_tokens"])
            for r in toy[kind]["sequences"]]
    result = (module.prefill_metadata if kind == "prefill" else module.decode_metadata)(seqs)
    return {name: v.tolist() if isinstance(v, torch.Tensor) else v for name, v in result._asdict().items()}


def test_p01_scenarios_agree_with_the_reference():
    reference = named("solutions").load(P01)
    for scenario in load_toy(P01)["scenarios"]:
        for step, got in zip(scenario["steps"], p01_steps(reference, scenario), strict=True):
            assert got == {key: step[key] for key in got}, f"{scenario['name']} step {step['step']}"


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_p01_metadata_agrees_with_the_reference(kind):
    assert p01_metadata(named("solutions").load(P01), kind) == load_toy(P01)[kind]["expected"]


@pytest.mark.parametrize("entry", load_toy(P01)["mistakes"], ids=lambda e: e["id"])
def test_p01_stored_mistakes_are_the_mutants(entry):
    """What the toy file (and the page) says a mistake gives is what its mutant gives, and differs from the
    reference's."""
    toy, module, reference = load_toy(P01), mutant(P01, entry["id"]), named("solutions").load(P01)
    if "scenario" in entry:
        scenario = next(s for s in toy["scenarios"] if s["name"] == entry["scenario"])
        got = p01_steps(module, scenario, upto=entry["step"])[-1]  # a mutant may crash later on
        expected = scenario["steps"][entry["step"] - 1]
        for key in ("answer", *STATE):
            if key in entry:
                shown = got[key] if not isinstance(entry[key], dict) else {n: got[key][n] for n in entry[key]}
                assert shown == entry[key], key
                assert entry[key] != (expected[key] if not isinstance(entry[key], dict)
                                      else {n: expected[key][n] for n in entry[key]}), f"{key}: not a difference"
        return
    kind = "prefill" if "prefill" in entry else "decode"
    got, right = p01_metadata(module, kind), p01_metadata(reference, kind)
    for field, value in entry[kind].items():
        assert got[field] == value, field
        assert right[field] != value, f"{field}: not a difference"


# ---- p02 -------------------------------------------------------------------------------------------------

DEVICE = torch.device("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu")


def p02_rows(module, function: str) -> tuple[list, list]:
    """The toy's caches after one version ran, as lists of slot rows (None for an untouched, NaN row)."""
    toy = load_toy(P02)
    key = torch.tensor(toy["key"], dtype=torch.float32, device=DEVICE)
    value = torch.tensor(toy["value"], dtype=torch.float32, device=DEVICE)
    shape = (toy["num_blocks"], toy["block_size"], toy["KVH"], toy["D"])
    k_cache = torch.full(shape, float("nan"), device=DEVICE)
    v_cache = torch.full(shape, float("nan"), device=DEVICE)
    slot_mapping = torch.tensor(toy["slot_mapping"], dtype=torch.int32, device=DEVICE)
    getattr(module, function)(key, value, k_cache, v_cache, slot_mapping)
    row = toy["KVH"] * toy["D"]
    return tuple([None if r.isnan().all() else r.tolist() for r in cache.view(-1, row).cpu()]
                 for cache in (k_cache, v_cache))


@pytest.mark.parametrize("function", ["store_kvcache_torch", "store_kvcache"])
def test_p02_toy_agrees_with_the_reference(function):
    toy = load_toy(P02)
    k_rows, v_rows = p02_rows(named("solutions").load(P02), function)
    assert k_rows == toy["k_cache_rows"] and v_rows == toy["v_cache_rows"]
    for t, slot in enumerate(toy["slot_mapping"]):  # the tagging the page relies on: tens digit = token
        if slot != -1:
            assert k_rows[slot][0] // 10 == t and v_rows[slot][0] - k_rows[slot][0] == 100


@pytest.mark.parametrize("mistake_id", list(load_toy(P02)["mistakes"]))
def test_p02_stored_mistakes_are_the_mutants(mistake_id):
    entry = load_toy(P02)["mistakes"][mistake_id]
    function = {"torch": "store_kvcache_torch", "triton": "store_kvcache"}[entry["version"]]
    k_rows, v_rows = p02_rows(mutant(P02, mistake_id), function)
    if "k_cache_rows" in entry:
        assert k_rows == entry["k_cache_rows"]
    if "v_cache_rows" in entry:
        assert v_rows == entry["v_cache_rows"]
