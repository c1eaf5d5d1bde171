"""The p06 toy file agrees with itself and with the reference, and (for the mistake outputs it stores)
with the named mutants once checks/mutants/p06_engine.py exists. The page quotes these numbers."""

import importlib.util

import pytest
import torch

from book.toys import p06_engine as adapter
from checks.harness.loader import named
from checks.harness.mistakes import catalogue
from checks.harness.toys import load_toy

EXACT = 1e-6  # the toy file holds closed-form values to 10 decimals; the reference works in float32
P06 = "p06_engine"
ROWS = load_toy(P06)["sampler"]["rows"]


def batch(rows):
    return (torch.tensor([r["logits"] for r in rows], dtype=torch.float32),
            torch.tensor([float(r["temperature"]) for r in rows]),
            torch.tensor([int(r["top_k"]) for r in rows]),
            torch.tensor([float(r["top_p"]) for r in rows]))


def noise(rows):
    return torch.tensor([r["noise"] for r in rows], dtype=torch.float32)


def stored(rows):
    return torch.tensor([r["probabilities"] for r in rows], dtype=torch.float64)


def test_p06_rows_have_the_layout_the_checks_read():
    for row in ROWS:
        assert set(row) == {"logits", "temperature", "top_k", "top_p", "probabilities", "noise", "token", "why"}
        assert len(row["logits"]) == len(row["probabilities"]) == len(row["noise"])
        assert all(n > 0 for n in row["noise"]) and row["why"]
        assert abs(sum(row["probabilities"]) - 1) < EXACT


def test_p06_probabilities_are_the_references():
    got = named("solutions").load(P06).probabilities(*batch(ROWS))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), stored(ROWS), atol=EXACT, rtol=0)
    for row in ROWS:  # one row at a time gives the same: no row depends on another
        alone = named("solutions").load(P06).probabilities(*batch([row]))[0]
        torch.testing.assert_close(alone.double(), torch.tensor(row["probabilities"], dtype=torch.float64),
                                   atol=EXACT, rtol=0)


def test_p06_tokens_are_the_references_race():
    reference = named("solutions").load(P06)
    tokens = reference.sample(stored(ROWS).float(), noise(ROWS))
    assert tokens.tolist() == [r["token"] for r in ROWS]
    ratio = stored(ROWS) / noise(ROWS).double()  # the race by hand: no ties among the winners
    assert ratio.argmax(dim=-1).tolist() == tokens.tolist()
    assert all(sorted(r, reverse=True)[0] > sorted(r, reverse=True)[1] for r in ratio.tolist())


def test_p06_rows_show_the_cases_the_page_explains():
    """A greedy row with a tie at the top, a top-k row with a tie at the k-th value, a top-p row whose crossing
    token is kept, and a token that is not its row's most likely one."""
    greedy = [r for r in ROWS if r["temperature"] == 0]
    assert greedy and any(r["logits"].count(max(r["logits"])) > 1 for r in greedy)
    for r in greedy:
        assert r["probabilities"][r["logits"].index(max(r["logits"]))] == 1
    ties = [r for r in ROWS if r["top_k"] > 0 and r["top_p"] == 1
            and sum(x > 0 for x in r["probabilities"]) > r["top_k"]]
    assert ties, "no top-k row keeps more than k tokens through a tie"
    crossing = [r for r in ROWS if r["top_k"] == 0 and r["top_p"] < 1]
    assert crossing
    for r in crossing:
        probs = torch.tensor(r["logits"], dtype=torch.float64).div(r["temperature"]).softmax(-1)
        kept = [p for p, q in zip(probs.tolist(), r["probabilities"]) if q > 0]
        assert sum(kept) >= r["top_p"] > sum(kept) - min(kept)  # the last kept token crosses p
    assert any(r["token"] != max(range(len(r["probabilities"])), key=r["probabilities"].__getitem__) for r in ROWS)


def test_p06_probe_serves_a_seeded_request_the_same_chunked_or_not():
    fields = {f.key: f.value for f in adapter.probes()[0].run(named("solutions").load(P06))}
    assert fields["same"].en == "yes"


def _mutants_written() -> bool:
    return importlib.util.find_spec("checks.mutants.p06_engine") is not None


@pytest.mark.skipif(not _mutants_written(), reason="checks/mutants/p06_engine.py is not written yet")
@pytest.mark.parametrize("mistake_id", sorted(load_toy(P06)["sampler"]["mistakes"]))
def test_p06_stored_mistakes_are_the_mutants(mistake_id):
    entry = load_toy(P06)["sampler"]["mistakes"][mistake_id]
    mutant = catalogue(P06).implementation(catalogue(P06).mistake(mistake_id)).load(P06)
    if "tokens" in entry:
        got = mutant.sample(stored(ROWS).float(), noise(ROWS)).tolist()
        assert got == entry["tokens"] and got != [r["token"] for r in ROWS]
        return
    row = entry["row"]
    got = mutant.probabilities(*batch(ROWS))[row].double()
    torch.testing.assert_close(got, torch.tensor(entry["probabilities"], dtype=torch.float64), atol=EXACT, rtol=0)
    assert not torch.allclose(got, stored(ROWS)[row], atol=EXACT, rtol=0), "not a difference"
