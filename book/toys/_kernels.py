"""Where the book runs a module's Triton kernels (p02, p03, p04): compiled on a GPU, in Triton's CPU
interpreter elsewhere, as `./check.sh` runs them for the checks.

A kernel reads the switch `TRITON_INTERPRET` when its module is imported, and the book imports a
module's reference (and its mutants) after the module's adapter: so importing this (each kernel
adapter does) sets `TRITON_INTERPRET=1` where there is no GPU, as `checks/conftest.py` and `./check.sh`
do, and repairs the interpreter's bf16 dots (`checks/harness/interpreter.py`). `device()` says where
the kernels run, or None where this process cannot run them (no Triton, or no GPU with
`TRITON_INTERPRET` set to something else): an adapter then shows the PyTorch parts of its module only,
and says why the kernel's result is missing (`NOT_RUN`).
"""

import contextlib
import importlib.util
import os
import warnings

import torch

from book.i18n import T

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_TRITON = importlib.util.find_spec("triton") is not None

if HAS_TRITON:
    import checks.harness.interpreter  # noqa: F401 - repairs the interpreter's bf16 dots (when it interprets)
    from checks.harness.loading import prepare_interpreter

    if os.environ.get("TRITON_INTERPRET") == "1":
        prepare_interpreter()  # idempotent; also when interpreter.py was imported before the switch was set

NOT_RUN = T("not run: this build has no GPU and TRITON_INTERPRET is not 1",
            "未运行：本次构建没有 GPU，TRITON_INTERPRET 也不是 1")


def device() -> torch.device | None:
    """Where the kernels run in this process: the CPU (Triton's interpreter), a GPU, or None (nowhere)."""
    if not HAS_TRITON:
        return None
    if os.environ.get("TRITON_INTERPRET") == "1":
        return torch.device("cpu")
    return torch.device("cuda") if torch.cuda.is_available() else None


def where() -> T:
    """The words for where the kernels ran, for a sentence under a table."""
    found = device()
    if found is None:
        return NOT_RUN
    if found.type == "cpu":
        return T("in Triton's CPU interpreter", "在 Triton 的 CPU 解释器里")
    return T("compiled, on the GPU", "编译后在 GPU 上")


@contextlib.contextmanager
def quiet():
    """The interpreter's own numpy warnings (log2 of 0 in a masked lane, an empty split) are not the book's."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def synchronize() -> None:
    if device() is not None and device().type == "cuda":
        torch.cuda.synchronize()
