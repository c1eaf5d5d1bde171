"""The contract a page shows: each public function's signature and docstring, read from `mine/`.

While the learner's file is still the stub (every public function's body is its docstring and a
`raise NotImplementedError`), the text comes from `mine/<stem>.py` itself. Once they have written code
there, it comes from the stub that `./check.sh reset` would write (derived from `solutions/`), so a
page always shows the contract and never the learner's own code.
"""

import ast
from dataclasses import dataclass
from pathlib import Path

from checks.harness.stubs import GIVEN_CLASSES, stub_for


@dataclass(frozen=True)
class Piece:
    name: str
    kind: str  # "function" (signature + docstring) or "given" (a class the stub ships complete)
    code: str


@dataclass(frozen=True)
class Contract:
    origin: str  # "mine": read from the learner's untouched file; "stub": the learner's file has code
    pieces: tuple[Piece, ...]

    @property
    def functions(self) -> list[Piece]:
        return [p for p in self.pieces if p.kind == "function"]

    @property
    def given(self) -> list[Piece]:
        return [p for p in self.pieces if p.kind == "given"]


def _public_functions(tree: ast.Module) -> list[ast.FunctionDef]:
    return [n for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")]


def _is_docstring(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def is_untouched(tree: ast.Module) -> bool:
    """Every public function is still a docstring and `raise NotImplementedError(...)`."""
    functions = _public_functions(tree)
    for function in functions:
        body = function.body[1:] if _is_docstring(function.body[0]) else function.body
        if len(body) != 1 or not isinstance(body[0], ast.Raise) or "NotImplementedError" not in ast.unparse(body[0]):
            return False
    return bool(functions)


def pieces_of(source: str) -> tuple[Piece, ...]:
    tree = ast.parse(source)
    lines = source.splitlines()
    found = []
    for node in tree.body:
        start = (node.decorator_list[0].lineno if getattr(node, "decorator_list", None) else node.lineno) - 1
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            last = node.body[0].end_lineno if _is_docstring(node.body[0]) else node.body[0].lineno - 1
            found.append(Piece(node.name, "function", "\n".join(lines[start:last])))
        elif isinstance(node, ast.ClassDef) and node.name in GIVEN_CLASSES:
            found.append(Piece(node.name, "given", "\n".join(lines[start : node.end_lineno])))
    return tuple(found)


def contract(root: Path, stem: str) -> Contract | None:
    """None when the module has neither a readable stub in mine/ nor a reference to derive one from."""
    mine = root / "mine" / f"{stem}.py"
    if mine.is_file():
        text = mine.read_text(encoding="utf-8")
        try:
            if is_untouched(ast.parse(text)):
                return Contract("mine", pieces_of(text))
        except SyntaxError:
            pass
    try:
        return Contract("stub", pieces_of(stub_for(root, stem)))
    except (OSError, SyntaxError, ValueError):
        return None
