"""The p05 toy file agrees with the reference, the mistakes it stores with the named mutants, and the book's
adapter builds its walk-through and shows every catalogued mistake (the page quotes all three)."""

import pytest

from book.toys import Hidden, Shown, gallery
from book.toys import p05_scheduler as adapter
from book.toys.p05_scheduler import replay
from checks.harness.loader import named
from checks.harness.mistakes import catalogue
from checks.harness.toys import load_toy

P05 = "p05_scheduler"
TOY = load_toy(P05)


def mutant(mistake_id: str):
    return catalogue(P05).implementation(catalogue(P05).mistake(mistake_id)).load(P05)


@pytest.mark.parametrize("scenario", TOY["scenarios"], ids=lambda s: s["name"])
def test_p05_scenarios_agree_with_the_reference(scenario):
    found, completions = replay(named("solutions").load(P05), scenario)
    for step, got in zip(scenario["steps"], found, strict=True):
        assert {key: got[key] for key in adapter.STATE} == {key: step[key] for key in adapter.STATE}, \
            f"{scenario['name']} step {step['step']}"
        assert got[adapter.STATUS] == {name: "running" if name in got["running"] else "waiting"
                                       for name in got["block_tables"]}, f"{scenario['name']} step {step['step']}"
    assert completions == scenario["completions"]


def test_p05_toy_steps_say_why_and_use_every_rule():
    """Each step explains itself, and the toy holds what the page promises: three requests, a budget that
    cuts a chunk, a prefix hit, a preemption (of the newest, and of a request by itself), a finish on eos."""
    steps = [step for s in TOY["scenarios"] for step in s["steps"]]
    assert all(step["why"] for step in steps)
    assert any(len(s["completions"]) >= 3 for s in TOY["scenarios"])
    chunk = any(n == s["max_num_batched_tokens"] and len(step["batch"]) == 1 and step["batch"][0][0] in step["waiting"]
                for s in TOY["scenarios"] for step in s["steps"] for _, n in step["batch"])
    preempted = any(step["waiting"] and not step["is_prefill"] for step in steps)
    cached = any(n and name in step["waiting"] and name not in {b[0] for b in step["batch"]}
                 for step in steps for name, n in step["num_computed_tokens"].items())  # computed, never batched
    assert chunk and preempted and cached


@pytest.mark.parametrize("entry", TOY["mistakes"], ids=lambda e: e["id"])
def test_p05_stored_mistakes_are_the_mutants(entry):
    """What the toy file (and the page) says a mistake gives is what its mutant gives, and differs from the
    reference's."""
    scenario = next(s for s in TOY["scenarios"] if s["name"] == entry["scenario"])
    got = replay(mutant(entry["id"]), scenario, entry["step"])[0][-1]
    expected = scenario["steps"][entry["step"] - 1]
    keys = [k for k in entry if k not in ("id", "scenario", "step", "why")]
    assert keys
    for key in keys:
        assert got[key] == entry[key], key
        assert entry[key] != expected[key], f"{key}: not a difference"


def test_p05_walkthrough_builds_and_shows_every_mistake():
    reference = named("solutions").load(P05)
    steps = adapter.walkthrough(reference, TOY)  # raises ToyDrift when the adapter and solutions/ disagree
    assert [s.table.id for s in steps] == ["scenario1", "scenario2", "costs"]
    entries = gallery(P05, adapter, reference, TOY)
    assert [e.mistake.id for e in entries] == [m.id for m in catalogue(P05).mistakes]
    hidden = [e.mistake.id for e in entries if isinstance(e, Hidden) and (e.scenario is None or not e.differences)]
    assert not hidden, f"neither the toy nor a probe shows {hidden}"
    # seq-cap-ignored, decode-seq-cap-off-by-one, decode-capped-by-budget, recompute-chunk-by-prompt,
    # scheduled-not-reset, prefill-preempts-for-room, idle-schedule-returns-none, empty-postprocess-returns-none,
    # preempt-most-tokens-left, preempted-take-seats, preempt-spares-finishing, preempt-skips-prefix-sharers,
    # readmitted-later-chunked, add-slot-for-max-tokens-1 and allocation-failure-returns need a probe
    assert sum(isinstance(e, Shown) for e in entries) >= len(entries) - 15
