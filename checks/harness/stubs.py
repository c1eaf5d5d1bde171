"""The learner's starting files, derived from the reference so the two can never drift.

A stub keeps the reference's module docstring, imports and constants, keeps given classes and functions
whole (`KVCache` in m02 is part of the exercise's set-up, not of the exercise), drops private helpers, and
keeps each public function's signature and docstring with a body that raises `NotImplementedError`
naming the module and the function.

A class the learner writes (p01's `BlockManager`) keeps its class line and docstring, its class-level
statements, the methods listed in `GIVEN_METHODS` whole (an `__init__` that lays out the state the
docstring describes), and every other public or dunder method as signature + docstring + a raise naming
`Class.method`; its private methods are dropped.
"""

import ast
import re
from pathlib import Path

GIVEN_CLASSES = {"KVCache", "Sequence", "Block", "PrefillMetadata", "DecodeMetadata",  # classes a stub ships complete
                 "Qwen3Layer", "Qwen3Weights", "Request", "SamplingParams", "EngineConfig", "TPLayer", "TPWeights",
                 "TensorParallel", "MoEWeights", "Permutation", "EPShard", "Launched"}
# methods of a learner's class that a stub ships complete
GIVEN_METHODS = {"BlockManager.__init__", "Scheduler.__init__", "Scheduler.add", "Scheduler.is_finished",
                 "ModelRunner.__init__", "LLM.__init__", "LLM.close", "LLM._blocks_that_fit",
                 "OverlapLLM.__init__", "OverlapLLM.add_request"}
# functions a stub ships complete (set-up the exercise leans on)
GIVEN_FUNCTIONS = {"serves_on_gpus", "move_weights", "rank_weights"}


def make_stub(reference: str, stem: str) -> str:
    tree = ast.parse(reference)
    lines = reference.splitlines(keepends=True)
    parts = []
    imports_start = None  # first line of the import block being copied
    for node in tree.body:
        start = (node.decorator_list[0].lineno if getattr(node, "decorator_list", None) else node.lineno) - 1
        is_import = isinstance(node, (ast.Import, ast.ImportFrom))
        if not is_import:
            imports_start = None
        if isinstance(node, ast.FunctionDef):
            if node.name.startswith("_"):
                continue
            if node.name in GIVEN_FUNCTIONS:
                parts.append("".join(lines[start : node.end_lineno]))
            else:
                parts.append(function_stub(node, lines, stem, node.name))
        elif isinstance(node, ast.ClassDef) and node.name.startswith("_"):
            continue  # a private helper class, like a private function
        elif isinstance(node, ast.ClassDef) and node.name not in GIVEN_CLASSES:
            parts.append(class_stub(node, lines, stem))
        elif isinstance(node, ast.Assign) and all(
            isinstance(t, ast.Name) and t.id.startswith("_") for t in node.targets
        ):
            continue
        elif is_import and imports_start is not None:  # consecutive imports stay as written (isort's groups)
            parts[-1] = "".join(lines[imports_start : node.end_lineno]) + "\n"
        else:
            imports_start = start if is_import else None
            parts.append("".join(lines[start : node.end_lineno]) + "\n")
    text = "".join(p if p.endswith("\n") else p + "\n" for p in parts)
    # two blank lines before top-level definitions, one after the import block
    text = re.sub(r"\n+(?=(def|class|@)\b)", "\n\n\n", text)
    text = re.sub(r"^(@[^\n]*)\n+(?=(def|class)\b)", r"\1\n", text, flags=re.M)  # a decorator stays on its line
    text = re.sub(r'^(""".*?"""\n)\n*', r"\1\n", text, flags=re.S)
    return text


def function_stub(node: ast.FunctionDef, lines: list[str], stem: str, shown_name: str) -> str:
    """Decorators, signature and docstring of `node`, and a body that raises `NotImplementedError`."""
    start = (node.decorator_list[0].lineno if node.decorator_list else node.lineno) - 1
    end = node.body[0].end_lineno if _docstring(node) else node.body[0].lineno - 1
    indent = " " * (node.col_offset + 4)
    message = f"{shown_name} (mine/{stem}.py) is not written yet"
    return "".join(lines[start:end]) + f'{indent}raise NotImplementedError("{message}")\n'


def class_stub(node: ast.ClassDef, lines: list[str], stem: str) -> str:
    start = (node.decorator_list[0].lineno if node.decorator_list else node.lineno) - 1
    has_docstring = _docstring(node)
    members = ["".join(lines[start : node.body[0].end_lineno if has_docstring else node.body[0].lineno - 1])]
    statements_start = None  # first line of a run of class-level statements (fields), kept as written
    for item in node.body[1 if has_docstring else 0 :]:
        item_start = (item.decorator_list[0].lineno if getattr(item, "decorator_list", None) else item.lineno) - 1
        if not isinstance(item, ast.FunctionDef):
            if statements_start is None:
                statements_start = item_start
                members.append("")
            members[-1] = "".join(lines[statements_start : item.end_lineno])
            continue
        statements_start = None
        if f"{node.name}.{item.name}" in GIVEN_METHODS:
            members.append("".join(lines[item_start : item.end_lineno]))
        elif not item.name.startswith("_") or (item.name.startswith("__") and item.name.endswith("__")):
            members.append(function_stub(item, lines, stem, f"{node.name}.{item.name}"))
    return "\n".join(m if m.endswith("\n") else m + "\n" for m in members)


def _docstring(node) -> bool:
    first = node.body[0]
    return isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)


def stub_for(root: Path, stem: str) -> str:
    return make_stub((root / "solutions" / f"{stem}.py").read_text(encoding="utf-8"), stem)
