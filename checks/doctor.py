"""`./check.sh doctor`: what this machine has for the kit, and what to do about what is missing.

Each line is one thing the kit uses, its state here, and, when it is missing or not what the kit was
tested with, the command or step that fixes it. Only a missing required package makes the exit status 1;
the optional ones (a GPU, flash-attn, bubblewrap, Chromium) each say what goes without them.
"""

import importlib.metadata
import sys
from pathlib import Path

# The versions the kit's own tests run with (a CPU box and an H200 box); others usually work too.
TESTED = {"torch": ("2.11", "2.13"), "triton": ("3.6", "3.9"), "transformers": ("5.17", "5.24")}
REQUIRED = ("torch", "triton", "transformers", "pytest", "hypothesis", "rich", "jinja2", "markdown-it-py",
            "latex2mathml", "watchfiles")


def version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def rows() -> list[tuple[str, bool, str, str]]:
    """(what, fine, state, what to do) for every item, in order."""
    found = []
    python = sys.version.split()[0]
    found.append(("Python", sys.version_info >= (3, 11), python, "" if sys.version_info >= (3, 11)
                  else "the kit needs Python 3.11 or newer"))
    for package in REQUIRED:
        got = version(package)
        if got is None:
            found.append((package, False, "missing", "pip install -e . (from the kit's folder)"))
            continue
        tested = TESTED.get(package)
        usual = tested is None or any(got.startswith(t) for t in tested)
        note = "" if usual else f"tested with {' and '.join(tested)}; if a check misbehaves, try one of those"
        found.append((package, True, got, note))
    found.append(accelerator())
    flash = version("flash-attn") or version("flash_attn")
    found.append(("flash-attn (optional)", True, flash or "not installed",
                  "" if flash else "an extra oracle for p03/p04 on a GPU: pip install flash-attn (builds CUDA code); "
                                   "the checks say when it is absent"))
    from checks.grading import sandbox_problem

    problem = sandbox_problem()
    found.append(("bubblewrap (grade)", True, "works" if problem is None else "not usable",
                  "" if problem is None else f"{problem}; without it `grade` needs --no-sandbox"))
    chromium = Path("/usr/bin/chromium").exists() and Path("/usr/bin/chromedriver").exists()
    found.append(("Chromium (book test)", True, "installed" if chromium else "not installed",
                  "" if chromium else "only the kit's browser test needs it: apt-get install chromium chromium-driver"))
    return found


def accelerator() -> tuple[str, bool, str, str]:
    try:
        import torch
    except ImportError:
        return ("GPU", True, "unknown (no torch)", "install torch first")
    if torch.cuda.is_available():
        return ("GPU", True, f"{torch.cuda.get_device_name(0)}: kernels compiled by Triton", "")
    return ("GPU", True, "none: Triton kernels run in its CPU interpreter (TRITON_INTERPRET=1, set by the kit)",
            "fine for every check; --bench and the benchmarks need a CUDA GPU")


def doctor() -> int:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="KV Lab doctor", title_justify="left", show_edge=False, pad_edge=False)
    for column in ("", "what", "here", "what to do"):
        table.add_column(column)
    found = rows()
    for what, fine, state, todo in found:
        table.add_row("[green]✓[/]" if fine and not todo else "[yellow]![/]" if fine else "[red]✗[/]", what, state,
                      todo)
    Console(highlight=False, width=None if sys.stdout.isatty() else 120).print(table)
    broken = [what for what, fine, _, _ in found if not fine]
    print("\nEverything the checks need is here." if not broken else f"\nMissing: {', '.join(broken)}.")
    return 1 if broken else 0
