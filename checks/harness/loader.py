"""Loading an implementation folder (`mine/`, `solutions/`, a student's folder, or a mutant).

Each implementation gets a package of its own whose `__path__` is its folder, so two folders never
share modules, a file may import its siblings (`from .m01_rmsnorm import rms_norm`), and nothing is
written anywhere (no `__pycache__` in the learner's folder). A file that cannot be loaded becomes a
`LoadError` whose message is one line naming the file and the line.
"""

import itertools
import linecache
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IMPORT_TIME_LIMIT = 30  # seconds; importing torch inside a learner's file is already paid for


class LoadError(Exception):
    """The implementation file is missing or cannot be imported; the message is the report's reason."""


@dataclass(frozen=True)
class Implementation:
    """Where a module's code comes from.

    `label` names it in reports ("mine", "solutions", a folder path, "mutant:m02:no-causal-mask");
    `patch` rewrites the source of one module (mutants and broken samples are patches of solutions/).
    """

    label: str
    folder: Path
    patch: tuple[str, Callable[[str], str]] | None = None
    kind: str = "learner"  # learner | reference | mutant | variant | broken
    _packages: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def path(self, stem: str) -> Path:
        return self.folder / f"{stem}.py"

    def shown_path(self, stem: str) -> str:
        return display(self.path(stem))

    def source_name(self, stem: str) -> str:
        """The file name the module's code objects carry: its path, or for a patched source the path and
        the label, registered in `linecache` with the patched lines. `inspect` then reads the code that
        runs, not the file on disk, and so does Triton, which compiles (or interprets) a kernel from its
        source text."""
        patched = self.patch is not None and self.patch[0] == stem
        return f"{self.path(stem)} ({self.label})" if patched else str(self.path(stem))

    def load(self, stem: str) -> types.ModuleType:
        if stem in self._packages:
            loaded = self._packages[stem]
            if isinstance(loaded, LoadError):
                raise loaded
            return loaded
        try:
            module = self._load(stem)
        except LoadError as error:
            self._packages[stem] = error
            raise
        self._packages[stem] = module
        return module

    def _load(self, stem: str) -> types.ModuleType:
        path = self.path(stem)
        if not path.is_file():
            raise LoadError(f"{display(path)} does not exist")
        source = path.read_text(encoding="utf-8")
        if self.patch is not None and self.patch[0] == stem:
            source = self.patch[1](source)
        package = self._package()
        name = f"{package.__name__}.{stem}"
        code_name = self.source_name(stem)
        if code_name != str(path):
            linecache.cache[code_name] = (len(source), None, source.splitlines(keepends=True), code_name)
        try:
            code = compile(source, code_name, "exec", dont_inherit=True)
        except SyntaxError as error:
            raise LoadError(
                f"{display(path)} line {error.lineno}: SyntaxError: {error.msg}"
            ) from None
        module = types.ModuleType(name)
        module.__file__ = str(path)
        module.__package__ = package.__name__
        sys.modules[name] = module
        from .guard import TimeLimitReached, run_with_time_limit

        try:
            run_with_time_limit(exec, IMPORT_TIME_LIMIT, code, module.__dict__)
        except TimeLimitReached:
            del sys.modules[name]
            raise LoadError(f"{display(path)}: importing it took over {IMPORT_TIME_LIMIT} s "
                            "(code at the top level that never ends?)") from None
        except (Exception, SystemExit) as error:  # noqa: BLE001 - any import-time failure is the learner's to see
            del sys.modules[name]
            line = last_line_in(error.__traceback__, code_name)
            where = f" line {line}" if line else ""
            raise LoadError(
                f"{display(path)}{where}: importing it raised {type(error).__name__}: {error}"
            ) from None
        return module

    def _package(self) -> types.ModuleType:
        package = self._packages.get("")
        if package is None:
            package = types.ModuleType(f"kvlab_impl_{next(_counter)}")
            package.__path__ = [str(self.folder)]
            sys.modules[package.__name__] = package
            self._packages[""] = package
        return package


_counter = itertools.count()


def last_line_in(tb, filename: str) -> int | None:
    """The line of the deepest traceback frame that lies in `filename` (the learner's own line)."""
    line = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == filename:
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


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
