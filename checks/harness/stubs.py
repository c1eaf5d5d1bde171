"""The learner's starting files, derived from the reference so the two can never drift.

A stub keeps the reference's module docstring, imports and constants, keeps given classes whole
(`KVCache` in m02 is part of the exercise's set-up, not of the exercise), drops private helpers, and
keeps each public function's signature and docstring with a body that raises `NotImplementedError`
naming the module and the function.
"""

import ast
import re
from pathlib import Path

GIVEN_CLASSES = {"KVCache"}  # classes a stub ships complete


def make_stub(reference: str, stem: str) -> str:
    tree = ast.parse(reference)
    lines = reference.splitlines(keepends=True)
    parts = []
    for node in tree.body:
        start = (node.decorator_list[0].lineno if getattr(node, "decorator_list", None) else node.lineno) - 1
        if isinstance(node, ast.FunctionDef):
            if node.name.startswith("_"):
                continue
            head_and_docstring = "".join(lines[start : node.body[0].end_lineno])
            message = f"{node.name} (mine/{stem}.py) is not written yet"
            parts.append(f'{head_and_docstring}    raise NotImplementedError("{message}")\n')
        elif isinstance(node, ast.ClassDef) and node.name not in GIVEN_CLASSES:
            raise ValueError(f"{stem}: class {node.name} must be listed in GIVEN_CLASSES or be a function")
        elif isinstance(node, ast.Assign) and all(
            isinstance(t, ast.Name) and t.id.startswith("_") for t in node.targets
        ):
            continue
        else:
            parts.append("".join(lines[start : node.end_lineno]) + "\n")
    text = "".join(p if p.endswith("\n") else p + "\n" for p in parts)
    # two blank lines before top-level definitions, one after the import block
    text = re.sub(r"\n+(?=(def|class|@)\b)", "\n\n\n", text)
    text = re.sub(r'^(""".*?"""\n)\n*', r"\1\n", text, flags=re.S)
    return text


def stub_for(root: Path, stem: str) -> str:
    return make_stub((root / "solutions" / f"{stem}.py").read_text(encoding="utf-8"), stem)
