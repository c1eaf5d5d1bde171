"""The book's computed toys for the Triton modules p02, p03 and p04 (`book/toys/`): their tables hold the toy
files' numbers, every catalogued mistake is shown on the toy or caught by a probe (the ones the pages say
the toy shows, on the toy), the shown results are the ones the toy files store, and a build that cannot
run kernels still gets each page's PyTorch parts. The kernels run in Triton's interpreter here when there
is no GPU (`checks/conftest.py` sets TRITON_INTERPRET=1, and so does `book/toys/_kernels.py`)."""

import pytest
import torch

from book import toys
from book.i18n import text
from book.toys import _kernels
from checks.harness.mistakes import catalogue
from checks.harness.toys import load_toy

P02, P03, P04 = "p02_store_kvcache", "p03_flash_attention", "p04_paged_decode"
STEMS = [P02, P03, P04]
# What each page's Pitfalls and Toy sections say: the mistakes the toy shows, and those only a larger case shows.
ON_THE_TOY = {
    P02: {"minus-one-not-skipped", "k-written-to-v", "slot-as-block-id"},
    P03: {"no-rescale", "rescale-l-not-acc", "max-init-zero", "causal-top-left", "lse-units-mixed", "no-scale"},
    P04: {"seqlen-off-by-one", "block-id-as-slot", "block-table-ignored", "no-scale"},
}


@pytest.fixture(scope="module")
def computed() -> dict:
    return {stem: toys.compute(stem) for stem in STEMS}


def rows(toy: toys.ComputedToy, table_id: str, lang: str = "en") -> list[list[list[str]]]:
    table = next(t for t in toy.tables if t.id == table_id)
    return [[[text(line, lang) for line in cell.lines] for cell in row] for row in table.rows]


def shown(toy: toys.ComputedToy, mistake_id: str) -> dict[str, tuple[list[str], list[str]]]:
    """A shown mistake's differences: label -> (lines with the mistake, correct lines)."""
    entry = next(e for e in toy.shown if e.mistake.id == mistake_id)
    return {d.label.en: ([text(x, "en") for x in d.got.lines], [text(x, "en") for x in d.expected.lines])
            for d in entry.differences}


def test_the_kernels_run_here():
    assert _kernels.device() is not None


@pytest.mark.parametrize("stem", STEMS)
def test_every_mistake_is_shown_on_the_toy_or_caught_by_a_probe(computed, stem):
    toy = computed[stem]
    assert toy.available
    on_toy = {e.mistake.id for e in toy.shown}
    probed = {e.mistake.id: e for e in toy.hidden}
    assert on_toy == ON_THE_TOY[stem]
    assert on_toy | set(probed) == {m.id for m in catalogue(stem).mistakes}
    for mistake_id, entry in probed.items():
        assert not entry.error and entry.scenario is not None and entry.differences, mistake_id


def _rows_of(values: list) -> list[str]:
    return [toys.vector([float("nan")] * 4 if r is None else r) for r in values]


def test_p02_tables_and_mistakes_are_the_toy_files(computed):
    toy, stored = computed[P02], load_toy(P02)
    caches = rows(toy, "caches")
    assert [r[2][0] for r in caches] == _rows_of(stored["k_cache_rows"])
    assert [r[3][0] for r in caches] == _rows_of(stored["v_cache_rows"])
    assert [r[4][0] for r in caches] == ["✓"] * len(caches)  # the kernel's caches are the same
    for mistake_id, entry in stored["mistakes"].items():
        got = shown(toy, mistake_id)
        for name in ("k_cache", "v_cache"):
            if f"{name}_rows" in entry:
                assert got[f"{name} rows (slots 0..)"][0] == _rows_of(entry[f"{name}_rows"]), (mistake_id, name)
    outside = shown(toy, "slot-as-block-id")["memory around k_cache"][0]
    assert outside == ["row 4 ← token 3's keys, row 8 ← token 0's keys (past its end)"]  # slot · block_size
    programs = rows(toy, "programs")
    assert programs[3][2:4] == [["3 · 4 + lanes = 12..15"], ["1 · 4 + lanes = 4..7"]]  # Hints L3's program 3


def test_p03_tables_and_mistakes_are_the_toy_files(computed):
    toy, stored = computed[P03], load_toy(P03)
    one = rows(toy, "one_shot")
    assert [r[4][0] for r in one[:-1]] == [toys.number(x) for x in stored["one_shot"]["exp"]]
    assert one[-1][4:] == [[toys.number(stored["one_shot"]["sum_exp"])], ["1"], [toys.number(stored["output"][0])]]
    blocks = {r[0][0]: [c[0] for c in r[1:]] for r in rows(toy, "blocks")}
    assert blocks["alpha = exp(m_old − m_new)"][1] == toys.number(stored["steps"][1]["alpha"])
    assert blocks["acc = alpha · acc + Σ exp(s − m_new) · v"] == [toys.number(s["acc"][0]) for s in stored["steps"]]
    for mistake_id in ("no-rescale", "rescale-l-not-acc"):
        got, entry = shown(toy, mistake_id), stored["mistakes"][mistake_id]
        assert got["online_softmax, blocks of 2"][0] == [toys.number(entry["output"][0])]
        assert got["acc after block B"][0] == [toys.number(entry["acc"][0])]
    assert shown(toy, "max-init-zero")["output"][0] == ["nan"]
    kernel = stored["kernel"]
    for mistake_id, entry in kernel["mistakes"].items():
        got = shown(toy, mistake_id)
        assert got["LSE"][0] == [toys.number(entry["lse"])], mistake_id
        if "output[0, 0, 0]" in got:
            assert got["output[0, 0, 0]"][0] == [toys.number(torch.tensor(entry["output0"]).half())], mistake_id
    runs = {r[0][0]: r for r in rows(toy, "kernel")}
    assert runs["flash_attn_varlen (the Triton kernel)"][1] == [toys.number(torch.tensor(kernel["output0"]).half())]
    assert runs["flash_attn_varlen (the Triton kernel)"][3] == [toys.number(kernel["lse"])]


def test_p04_tables_and_mistakes_are_the_toy_files(computed):
    toy, stored = computed[P04], load_toy(P04)
    walk = rows(toy, "walk")
    assert [[r[0][0], r[2][0], r[4][0].rsplit(" ", 1)[-1]] for r in walk] == \
        [[str(s["key"]), str(s["block"]), str(s["slot"])] for s in stored["walk"]]
    fp16 = toys.number(torch.tensor(stored["output0"]).half())
    assert [r[4][0] for r in rows(toy, "paged_decode")] == [fp16, fp16, fp16, toys.number(stored["output0"])]
    splits = rows(toy, "splits")
    assert [r[4][0] for r in splits] == [toys.number(x) for x in stored["splits"]["partial_output0"]] + \
        [toys.number(stored["splits"]["merged0"]), toys.number(stored["splits"]["averaged0"])]
    assert [r[3][0] for r in splits[:2]] == [toys.number(torch.tensor(x).half())
                                            for x in stored["splits"]["partial_output0"]]
    off_by_one = stored["mistakes"]["seqlen-off-by-one"]["output0"]
    assert shown(toy, "seqlen-off-by-one")["output[0, 0, 0]"][0] == [toys.number(torch.tensor(off_by_one).half())]
    assert shown(toy, "block-id-as-slot")["output[0, 0, 0]"][0] == ["nan"]


@pytest.mark.parametrize("stem", STEMS)
def test_without_kernels_a_page_gets_the_pytorch_parts(monkeypatch, stem):
    monkeypatch.setattr(_kernels, "device", lambda: None)
    toy = toys.compute(stem)
    assert toy.available and toy.steps
    everything = " ".join(text(line, "en") for table in toy.tables for row in table.rows for cell in row
                          for line in cell.lines) + " ".join(text(s.text, "en") for s in toy.steps if s.text)
    assert _kernels.NOT_RUN.en in everything
    assert not any("kernel" in e.scenario.id or "probe" in e.scenario.id for e in toy.shown)
    if stem == P04:  # every mistake is in the kernel: nothing to show it on
        assert not toy.shown and all(e.scenario is None for e in toy.hidden)
    else:
        # shown only by a kernel: the launch's scale (p03), a kernel's LSE (p03), slots past the end (p02)
        kernel_only = {"slot-as-block-id", "lse-units-mixed", "no-scale"}
        assert {e.mistake.id for e in toy.shown} == ON_THE_TOY[stem] - kernel_only
