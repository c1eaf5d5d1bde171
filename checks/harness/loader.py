"""Which implementation a run checks (`mine/`, `solutions/`, a student's folder, or a mutant), and how
its files are named in reports.

An `Implementation` says where a module's code comes from; it is imported by a worker process for
the checks (`spec` is what the worker needs, see `serve.py`) and, for the kit's own code only (the
catalogue's mutants when a mistake is named, the reference when the book is built), in this process
with `load` (`loading.py`).
"""

import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .loading import LoadError, Package

ROOT = Path(__file__).resolve().parents[2]

__all__ = ["NOT_SANDBOXED", "ROOT", "Implementation", "LoadError", "display", "named"]
# said whenever a folder other than mine/ runs outside `grade`
NOT_SANDBOXED = ("./check.sh: {} runs as you, with your files and your network, as your own code in mine/ does: "
                 "fine for your own folder. To check someone else's code, use ./check.sh grade FOLDER (sandboxed).")


# The catalogue's own code (a patch of the reference, or a sample): on a CPU, the reference kernels of the modules
# it does not patch run by PyTorch (`standins.py`), in the worker as in a replay; learners' code and the reference
# itself run every kernel as written.
STOOD_IN = ("mutant", "variant", "broken")


@dataclass(frozen=True)
class Implementation:
    """Where a module's code comes from.

    `label` names it in reports ("mine", "solutions", a folder path, "mutant:m02:no-causal-mask");
    `patch` rewrites the source of one module (mutants and broken samples are patches of solutions/);
    `shown` is how reports name the folder (defaults to its path relative to the kit).
    """

    label: str
    folder: Path
    patch: tuple[str, Callable[[str], str]] | None = None
    kind: str = "learner"  # learner | reference | mutant | variant | broken
    shown: str | None = None
    _packages: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def path(self, stem: str) -> Path:
        return self.folder / f"{stem}.py"

    def shown_folder(self) -> str:
        return self.shown if self.shown is not None else display(self.folder)

    def shown_path(self, stem: str) -> str:
        return f"{self.shown_folder()}/{stem}.py"

    def patched_source(self) -> tuple[str, str] | None:
        if self.patch is None:
            return None
        return self.patch[0], self.patch[1](self.path(self.patch[0]).read_text(encoding="utf-8"))

    def spec(self, stem: str) -> tuple:
        """What a worker needs to import `stem`: folder, shown folder, patch, label, stem, and whether the
        reference kernels its siblings launch run by PyTorch (`standins.py`: the catalogue's entries only)."""
        return (str(self.folder), self.shown_folder(), self.patched_source(), self.label, stem,
                self.kind in STOOD_IN)

    def package(self) -> Package:
        if "" not in self._packages:
            self._packages[""] = Package(str(self.folder), self.shown_folder(), self.patched_source(), self.label)
        return self._packages[""]

    def load(self, stem: str) -> types.ModuleType:
        """Import `stem` into this process: for the kit's own code only (reference, mutants, variants)."""
        assert self.kind != "learner", "learner code runs in a worker process, never in the checks' process"
        return self.package().load(stem)

    def load_to_time(self, stem: str) -> types.ModuleType:
        """Import `stem`, whoever wrote it, into this process to time its kernels (the benchmarks): nothing
        there is a verdict, and no check runs in that process."""
        return self.package().load(stem)


def display(path: Path) -> str:
    path = Path(path).resolve()
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


def named(label: str) -> Implementation:
    """`mine`, `solutions`, or a folder path (relative to the current directory or the kit)."""
    if label in ("mine", "solutions"):
        return Implementation(label, ROOT / label, kind="reference" if label == "solutions" else "learner")
    folder = Path(label).expanduser()
    if not folder.is_absolute() and not folder.exists():
        folder = ROOT / folder
    if not folder.is_dir():
        raise LoadError(f"--impl {label}: no such folder")
    folder = folder.resolve()
    kind = "reference" if folder == (ROOT / "solutions").resolve() else "learner"
    return Implementation(display(folder), folder, kind=kind)
