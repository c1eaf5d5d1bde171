"""Importing an implementation folder (`mine/`, `solutions/`, a student's folder, or a mutant), and
saying in one line where its code failed.

Each folder gets a package of its own whose `__path__` is the folder, so two folders never share
modules, a file may import its siblings (`from .m01_rmsnorm import rms_norm`), and nothing is written
anywhere (no `__pycache__` in the learner's folder). A file that cannot be imported becomes a
`LoadError` whose message is one line naming the file and the line.

The worker process imports learner code with this module (it imports only the standard library, so
the worker runs it as shipped text); the checks' process uses it for the kit's own code only (the
catalogue's mutants when a mistake is named, the reference when the book is built).
"""

import itertools
import linecache
import sys
import traceback
import types
from pathlib import Path

sys.dont_write_bytecode = True  # sibling imports in a checked folder must not leave __pycache__ there


KIT_PACKAGES = ("mine", "solutions", "checks", "book")  # folders of the kit, never on a worker's import path


class LoadError(Exception):
    """The implementation file is missing or cannot be imported; the message is the report's reason."""


class Package:
    """One implementation folder as a package. `shown` is how reports name the folder (`mine`,
    `path/to/student`); `patch` = (stem, source) replaces one file's text (a mutant of the reference)
    and `label` names that patched text in tracebacks and in `inspect`."""

    def __init__(self, folder: str, shown: str, patch: tuple[str, str] | None = None, label: str = ""):
        self.folder, self.shown, self.patch, self.label = Path(folder), shown, patch, label
        self._modules: dict[str, types.ModuleType | LoadError] = {}
        self._package: types.ModuleType | None = None

    def path(self, stem: str) -> Path:
        return self.folder / f"{stem}.py"

    def shown_path(self, stem: str) -> str:
        return f"{self.shown}/{stem}.py"

    def source_name(self, stem: str) -> str:
        """The file name the module's code objects carry: its path, or for a patched source the path and
        the label, registered in `linecache` with the patched lines. `inspect` then reads the code that
        runs, not the file on disk, and so does Triton, which compiles (or interprets) a kernel from its
        source text."""
        patched = self.patch is not None and self.patch[0] == stem
        return f"{self.path(stem)} ({self.label})" if patched else str(self.path(stem))

    def shown_file(self, filename: str) -> str | None:
        """How a report names a code object's file, when the file is one of this folder's; else None."""
        for stem_path in (filename, filename.split(" (", 1)[0]):
            path = Path(stem_path)
            if path.parent == self.folder and path.suffix == ".py":
                return self.shown_path(path.stem)
        return None

    def load(self, stem: str) -> types.ModuleType:
        loaded = self._modules.get(stem)
        if loaded is None:
            try:
                loaded = self._load(stem)
            except LoadError as error:
                loaded = error
            self._modules[stem] = loaded
        if isinstance(loaded, LoadError):
            raise loaded
        return loaded

    def _load(self, stem: str) -> types.ModuleType:
        path = self.path(stem)
        if not path.is_file():
            raise LoadError(f"{self.shown_path(stem)} does not exist")
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise LoadError(f"{self.shown_path(stem)} cannot be read: {error}") from None
        if self.patch is not None and self.patch[0] == stem:
            source = self.patch[1]
        package = self._make_package()
        name = f"{package.__name__}.{stem}"
        code_name = self.source_name(stem)
        if code_name != str(path):
            linecache.cache[code_name] = (len(source), None, source.splitlines(keepends=True), code_name)
        try:
            code = compile(source, code_name, "exec", dont_inherit=True)
        except SyntaxError as error:
            raise LoadError(f"{self.shown_path(stem)} line {error.lineno}: SyntaxError: {error.msg}") from None
        module = types.ModuleType(name)
        module.__file__ = str(path)
        module.__package__ = package.__name__
        sys.modules[name] = module
        try:
            exec(code, module.__dict__)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM while the checks' process imports a mutant: stop the run
            sys.modules.pop(name, None)
            raise
        except BaseException as error:  # noqa: BLE001 - any import-time failure is the learner's to see
            sys.modules.pop(name, None)
            advice = ""
            if isinstance(error, ModuleNotFoundError) and (error.name or "").split(".")[0] in KIT_PACKAGES:
                advice = " (the kit is not importable from your code: import a sibling file relatively, " \
                         "e.g. `from .m01_rmsnorm import rms_norm`)"
            raise LoadError(f"{self.shown_path(stem)}{self.where(error, stem)}: importing it raised "
                            f"{type(error).__name__}: {first_line(error)}{advice}") from None
        return module

    def _make_package(self) -> types.ModuleType:
        if self._package is None:
            self._package = types.ModuleType(f"kvlab_impl_{next(_counter)}")
            self._package.__path__ = [str(self.folder)]
            sys.modules[self._package.__name__] = self._package
        return self._package

    # ---- one-line reasons ----
    def where(self, error: BaseException, stem: str) -> str:
        """` line 57` (in the module's own file) or ` (m01_rmsnorm.py line 12)`: the deepest frame in
        this folder's files (kernel lines too: the innermost error of the chain is read first); the
        deepest frame of all when none is."""
        frames = traceback.extract_tb(error.__traceback__)
        causes, seen = [], error  # innermost first: Triton wraps an error in a kernel's line as the cause
        while seen is not None and len(causes) < 8:
            causes.insert(0, seen)
            seen = seen.__cause__ or (None if seen.__suppress_context__ else seen.__context__)  # `from None` ends it
        own = self.shown_path(stem)
        for cause in causes:
            stack = traceback.extract_tb(cause.__traceback__)
            for frame in reversed(stack):
                shown = self.shown_file(frame.filename)
                if shown is not None:
                    line = frame.lineno
                    if shown == own:
                        return f" line {line}"
                    # another of the learner's files: and the line of this module's file that called into it
                    via = next((f for f in reversed(stack[: stack.index(frame)]) if self.shown_file(f.filename) == own),
                               None)
                    led = f", called from `{via.name}` at {own.rsplit('/', 1)[-1]} line {via.lineno}" if via else ""
                    return f" ({shown} line {line}{led})"
        return f" ({frames[-1].filename.rsplit('/', 1)[-1]} line {frames[-1].lineno})" if frames else ""

    def describe(self, error: BaseException, stem: str) -> str:
        """`TypeError: message (mine/m02_thinker_attention.py line 57)`, the learner's deepest line; then, on a
        second line, the first of the error's notes (`add_note`: what a tensor-parallel engine's rank 0 met when
        another rank failed), if it has one."""
        where = self.where(error, stem)
        if where.startswith(" line"):
            where = f" ({self.shown_path(stem)}{where})"
        said = f"{type(error).__name__}: {first_line(error)}{where}".replace(": (", " (")
        notes = getattr(error, "__notes__", None)
        if type(notes) is list and notes and type(notes[0]) is str and first_line(notes[0]):
            said += "\n" + first_line(notes[0])
        return said

    def not_started(self, error: NotImplementedError, stem: str, name: str) -> str:
        """`<file>: `name` raises NotImplementedError`, naming the sibling module that raised it when the
        function runs on another of the learner's files (m04 runs on their m01-m03) that is still a stub."""
        frames = traceback.extract_tb(error.__traceback__)
        raiser = self.shown_file(frames[-1].filename) if frames else None
        if raiser is None or raiser == self.shown_path(stem):
            return f"{self.shown_path(stem)}: `{name}` raises NotImplementedError"
        module_id = raiser.rsplit("/", 1)[-1].split("_")[0]
        return (f"{self.shown_path(stem)}: `{name}` reaches `{frames[-1].name}` in {raiser}, which raises "
                f"NotImplementedError: finish {module_id} first")


def prepare_interpreter() -> None:
    """What the checks change in Triton's CPU interpreter, before a kernel runs in it (idempotent)."""
    repair_bf16_dot()
    remember_lang_builtins()
    swap_once_per_launch()
    remember_numpy_dtypes()


def remember_lang_builtins() -> None:
    """Triton's interpreter swaps every builtin of `triton.language` for an interpreted one on each kernel
    launch and on each call of a `@triton.jit` helper, finding them anew each time with `inspect.getmembers`
    over the whole package: a fifth of a p06 engine check's time (seen with triton 3.9). Find each package's
    builtins once and swap the same ones each time; the swap itself (and its undoing) is Triton's own. Left
    as it is where the interpreter's internals differ from what this expects."""
    import inspect

    from triton import language as tl
    from triton.runtime import interpreter

    swap, patch_builtin = getattr(interpreter, "_patch_attr", None), getattr(interpreter, "_patch_builtin", None)
    is_builtin = getattr(tl.core, "is_builtin", None)
    if None in (swap, patch_builtin, is_builtin) or getattr(patch_builtin, "kvlab_remembered", False):
        return
    if list(inspect.signature(patch_builtin).parameters) != ["pkg", "builder", "scope"]:
        return
    builtins: dict[object, list[tuple[str, object]]] = {}

    def _patch_builtin(pkg, builder, scope):
        if pkg not in builtins:  # found while nothing is swapped: the first launch of this process's first kernel
            builtins[pkg] = [(name, member) for name, member in inspect.getmembers(pkg) if is_builtin(member)]
        for name, member in builtins[pkg]:
            swap(pkg, name, member, builder, scope)

    _patch_builtin.kvlab_remembered = True
    interpreter._patch_builtin = _patch_builtin


def swap_once_per_launch() -> None:
    """The interpreter swaps `triton.language`'s builtins when a kernel launches and undoes it when the
    launch ends, but it swaps them again on every call of a `@triton.jit` helper inside the kernel, once per
    program of the grid (and never undoes those). Swap once per launch: a helper called inside a running
    launch finds its modules swapped already and changes nothing. Launches that overlap (the ranks of a
    simulated group are threads) share one swap, undone when the last of them ends. Left as it is where the
    interpreter's internals differ from what this expects."""
    import inspect
    import threading

    from triton import language as tl
    from triton.runtime import interpreter

    swap, scope_class = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "_LangPatchScope", None)
    if swap is None or scope_class is None or getattr(swap, "kvlab_once", False):
        return
    lock, thread = threading.Lock(), threading.local()
    swaps: list = []  # the scopes of the swaps in force, in the order they were made
    swapped: set[int] = set()  # the modules they swapped
    running = [0]  # launches running now, in any thread

    class Launch(scope_class):
        """What a launch undoes when it ends: the swaps, once no other launch runs."""

        def restore(self) -> None:
            thread.launch = False
            with lock:
                running[0] -= 1
                if running[0] == 0:
                    while swaps:
                        swaps.pop().restore()
                    swapped.clear()

    def _patch_lang(fn):
        langs = {id(value) for value in fn.__globals__.values() if inspect.ismodule(value) and value in (tl, tl.core)}
        with lock:
            if not langs or not langs <= swapped:  # none in force, or a module this function sees is not swapped
                swaps.append(swap(fn))
                swapped.update(langs)
            if getattr(thread, "launch", False):
                return scope_class()  # a helper inside this thread's running launch: nothing of its own to undo
            thread.launch = True
            running[0] += 1
            return Launch()

    _patch_lang.kvlab_once = True
    interpreter._patch_lang = _patch_lang


def remember_numpy_dtypes() -> None:
    """The interpreter builds its table of Triton-to-numpy dtypes (eighteen `np.dtype`s) anew on every
    operation that asks which numpy dtype a value has: a twentieth of an engine check's time. Ask it once per
    dtype; the answer is its own."""
    from triton import language as tl
    from triton.runtime import interpreter

    original = getattr(interpreter, "_get_np_dtype", None)
    if original is None or getattr(original, "kvlab_remembered", False):
        return
    found: dict = {}
    pointer = object()  # every pointer is stored as uint64, whatever it points to

    def _get_np_dtype(tt_dtype):
        key = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype  # a block: its elements'
        if isinstance(key, tl.pointer_type):
            key = pointer
        if key not in found:
            found[key] = original(tt_dtype)
        return found[key]

    _get_np_dtype.kvlab_remembered = True
    interpreter._get_np_dtype = _get_np_dtype


def repair_bf16_dot() -> None:
    """Triton's CPU interpreter stores bfloat16 values as raw 16-bit patterns and its `tl.dot` multiplies
    those as integers (seen with triton 3.9); widen bf16 operands to fp32 first, as a GPU's tensor cores
    do (see `interpreter.py`). Only for the interpreter; idempotent."""
    from triton import language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "kvlab_repaired", False):
        return
    original = builder.create_dot

    def create_dot(self, a, b, d, *args, **kwargs):
        if a.dtype == tl.bfloat16:
            a = self.cast_impl(a, tl.float32)
        if b.dtype == tl.bfloat16:
            b = self.cast_impl(b, tl.float32)
        return original(self, a, b, d, *args, **kwargs)

    create_dot.kvlab_repaired = True
    builder.create_dot = create_dot


def preload_triton() -> None:
    """Load what Triton imports at a kernel's first launch (specialising an argument loads its Gluon modules,
    a fifth of a second), once in the fork server instead of in every worker. Nothing without Triton."""
    try:
        from triton.runtime.jit import mangle_type

        mangle_type(0)
    except Exception:  # noqa: BLE001 - another Triton: its workers load what they need themselves
        pass


def one_config_per_kernel() -> None:
    """Under the checks, an autotuned kernel runs one config, the one with the smallest tiles (the likeliest
    to fit any GPU's shared memory), instead of timing every config of its `@triton.autotune` list on each
    new key in every fresh worker: a verdict needs a correct kernel, not the fastest one, and it is then the
    same config on every run. The benchmarks do not call this. Idempotent; nothing without Triton."""
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:
        return
    prune = getattr(Autotuner, "prune_configs", None)
    if prune is None or getattr(prune, "kvlab_one_config", False):
        return

    def tiles(config) -> int:
        size = max(1, getattr(config, "num_stages", 1) or 1)
        for value in getattr(config, "kwargs", {}).values():
            if type(value) is int and value > 0:
                size *= value
        return size

    def prune_configs(self, *args, **kwargs):
        configs = prune(self, *args, **kwargs)
        return [min(configs, key=tiles)] if len(configs) > 1 else configs

    prune_configs.kvlab_one_config = True
    Autotuner.prune_configs = prune_configs


_counter = itertools.count()


def first_line(error: BaseException) -> str:
    try:
        text = str(error).strip()
    except Exception:  # noqa: BLE001 - a learner's exception whose __str__ raises
        return "(its message cannot be shown)"
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= 200 else line[:199] + "…"  # a reason stays one readable line
