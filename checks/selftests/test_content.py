"""Stubs, references, toy files and exercise pages agree with each other."""

import ast
import re

import pytest
import torch

from checks.harness.loader import ROOT, named
from checks.harness.mistakes import catalogue
from checks.harness.modules import front_matter, modules
from checks.harness.stubs import GIVEN_FUNCTIONS, stub_for
from checks.harness.toys import load_toy
from checks.selftests.conftest import shipped

STEMS = [m.stem for m in modules()]
SECTIONS = ["Statement", "Where it sits", "Computation", "Intuition", "Shape trace", "Pitfalls", "Toy",
            "Hints L1", "Hints L2", "Hints L3", "Follow-ups", "In real engines"]
META = {"id": str, "title": str, "track": str, "minutes": int, "difficulty": str, "depends_on": list,
        "file": str, "check": str, "summary": str}


def public_api(source: str) -> dict[str, tuple[str, str | None]]:
    """name -> (signature, docstring) of every public top-level function and class."""
    api = {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            head = ast.unparse(node.args) if isinstance(node, ast.FunctionDef) else ""
            returns = ast.unparse(node.returns) if getattr(node, "returns", None) else ""
            api[node.name] = (f"{head} -> {returns}", ast.get_docstring(node))
    return api


@pytest.mark.parametrize("stem", STEMS)
def test_stub_has_the_reference_signatures_and_docstrings(stem):
    stub, reference = shipped(f"mine/{stem}.py"), (ROOT / "solutions" / f"{stem}.py").read_text()
    assert public_api(stub) == public_api(reference)
    assert ast.get_docstring(ast.parse(stub)) == ast.get_docstring(ast.parse(reference))


@pytest.mark.parametrize("stem", STEMS)
def test_stub_is_what_reset_writes(stem):
    assert shipped(f"mine/{stem}.py") == stub_for(ROOT, stem), "regenerate mine/ with ./check.sh reset"


@pytest.mark.parametrize("stem", STEMS)
def test_stub_raises_not_implemented_naming_the_function(stem):
    tree = ast.parse(shipped(f"mine/{stem}.py"))
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name not in GIVEN_FUNCTIONS:
            raised = node.body[-1]
            assert isinstance(raised, ast.Raise) and "NotImplementedError" in ast.unparse(raised)
            assert node.name in ast.unparse(raised)


def test_learner_files_import_nothing_from_checks():
    for folder in ("mine", "solutions"):
        for path in (ROOT / folder).glob("*.py"):
            assert not re.search(r"^\s*(from|import)\s+checks\b", path.read_text(), re.M), path


# ---- toy cases ------------------------------------------------------------------------------------

EXACT = 1e-6  # toy files hold closed-form values to 10 decimals


def test_m01_toy_agrees_with_the_reference():
    ref, toy = named("solutions").load("m01_rmsnorm"), load_toy("m01_rmsnorm")
    eps_outside = catalogue("m01_rmsnorm").implementation(catalogue("m01_rmsnorm").mistake("eps-outside-sqrt"))
    for case in toy["rms_norm"]:
        args = torch.tensor(case["x"]).double(), torch.tensor(case["weight"]).double(), case["eps"]
        torch.testing.assert_close(ref.rms_norm(*args), torch.tensor(case["expected"]).double(), atol=EXACT, rtol=0)
        for mistake_id, rows in case.get("mistakes", {}).items():
            assert mistake_id == "eps-outside-sqrt"
            got = eps_outside.load("m01_rmsnorm").rms_norm(*args)
            torch.testing.assert_close(got, torch.tensor(rows).double(), atol=EXACT, rtol=0)
    for case in toy["add_rms_norm"]:
        t = {k: torch.tensor(case[k]).double() for k in ("x", "residual", "weight")}
        normed, residual = ref.add_rms_norm(t["x"], t["residual"], t["weight"], case["eps"])
        torch.testing.assert_close(normed, torch.tensor(case["expected_normed"]).double(), atol=EXACT, rtol=0)
        torch.testing.assert_close(residual, torch.tensor(case["expected_residual"]).double(), atol=EXACT, rtol=0)


def toy_attention(module, sizes):
    from types import SimpleNamespace

    toy = load_toy("m02_thinker_attention")
    weights = toy["weights"].items()
    w = SimpleNamespace(**{k: torch.tensor(v).double() if isinstance(v, list) else v for k, v in weights})
    x, cos, sin = (torch.tensor(toy[k]).double() for k in ("x", "cos", "sin"))
    if sizes == [len(x)]:
        return module.attention_forward(w, x, cos, sin)
    cache, start, rows = module.KVCache(), 0, []
    for size in sizes:
        rows.append(module.attention_forward(w, x[start:start + size], cos[start:start + size],
                                             sin[start:start + size], cache))
        start += size
    return torch.cat(rows)


def test_m02_toy_agrees_with_the_reference_and_the_page():
    toy, stem = load_toy("m02_thinker_attention"), "m02_thinker_attention"
    expected = torch.tensor(toy["whole_prefill"]).double()
    ref = named("solutions").load(stem)
    for sizes in ([3], toy["split"], [1, 1, 1]):
        torch.testing.assert_close(toy_attention(ref, sizes), expected, atol=EXACT, rtol=0)
    torch.testing.assert_close(expected, torch.tensor(toy["shown_on_page"]).double(), atol=5e-5, rtol=0)
    for mistake_id, entry in toy["mistakes"].items():
        mutant = catalogue(stem).implementation(catalogue(stem).mistake(mistake_id)).load(stem)
        torch.testing.assert_close(toy_attention(mutant, entry["calls"]), torch.tensor(entry["output"]).double(),
                                   atol=EXACT, rtol=0)


# ---- exercise pages -------------------------------------------------------------------------------


@pytest.mark.parametrize("stem", STEMS)
def test_exercise_page_has_metadata_and_every_section(stem):
    page = ROOT / "exercises" / f"{stem}.md"
    meta = front_matter(page)
    for key, kind in META.items():
        assert isinstance(meta.get(key), kind), f"{page.name}: front matter {key!r} missing or not {kind.__name__}"
    assert meta["file"] == f"{stem}.py" and meta["check"] == f"./check.sh {meta['id']}"
    headings = re.findall(r"^## (.+)$", page.read_text(), re.M)
    assert headings == SECTIONS


@pytest.mark.parametrize("stem", STEMS)
def test_pitfalls_are_the_mistake_catalogue(stem):
    """Every catalogued mistake is explained on the page, under the id the report prints."""
    text = (ROOT / "exercises" / f"{stem}.md").read_text()
    pitfalls = text.split("## Pitfalls", 1)[1].split("\n## ", 1)[0]
    ids = re.findall(r"^- `([a-z0-9-]+)`:", pitfalls, re.M)
    assert sorted(ids) == sorted(m.id for m in catalogue(stem).mistakes)


@pytest.mark.parametrize("stem", STEMS)
def test_points_name_exactly_the_checks(stem):
    """`./check.sh grade` awards POINTS: one entry per check of the module, none left over."""
    source = (ROOT / "checks" / f"test_{stem}.py").read_text()
    checks = {node.name for node in ast.parse(source).body
              if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}
    namespace = {}
    points = next(node for node in ast.parse(source).body
                  if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "POINTS")
    exec(compile(ast.Module([points], []), "POINTS", "exec"), namespace)
    assert set(namespace["POINTS"]) == checks
    assert all(isinstance(v, int) and v >= 0 for v in namespace["POINTS"].values())
    assert sum(namespace["POINTS"].values()) > 0


def test_the_readme_gives_each_module_its_points():
    """The README's list of what each module is worth is the sum of its POINTS."""
    import re

    from checks.harness.modules import modules as all_modules

    readme = " ".join((ROOT / "README.md").read_text().split())
    stated = dict(re.findall(r"\b([mp]\d\d) (\d+)\b", readme.split("a module is worth their sum (", 1)[1].split(")", 1)[0]))
    for module in all_modules():
        source = (ROOT / "checks" / f"test_{module.stem}.py").read_text()
        points = next(node for node in ast.parse(source).body
                      if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "POINTS")
        namespace: dict = {}
        exec(compile(ast.Module([points], []), "POINTS", "exec"), namespace)
        assert int(stated.get(module.id, -1)) == sum(namespace["POINTS"].values()), module.id
