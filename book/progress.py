"""The learner's progress: the last result per module that `./check.sh` keeps in `.kvlab/results.json`."""

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Status:
    kind: str  # never | not-started | partial | done
    passed: int = 0
    checks: int = 0
    when: str = ""
    functions: tuple = ()  # (name, kind, passed, checks) per learner function, as the checks called them

    @property
    def fraction(self) -> float:
        return self.passed / self.checks if self.checks else 0.0


def read_results(path: Path) -> dict:
    """The results file, or nothing when it is missing or unreadable (a book must still build)."""
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def status_of(entry: dict | None) -> Status:
    if not isinstance(entry, dict):
        return Status("never")
    try:
        checks, passed, not_started = int(entry["checks"]), int(entry["passed"]), int(entry["not_started"])
    except (KeyError, TypeError, ValueError):
        return Status("never")
    when = str(entry.get("when", ""))
    functions = []
    for name, counts in (entry.get("functions") or {}).items() if isinstance(entry.get("functions"), dict) else ():
        inner = status_of({**counts, "when": when}) if isinstance(counts, dict) else Status("never")
        if inner.kind != "never":
            functions.append((str(name), inner.kind, inner.passed, inner.checks))
    if checks and passed == checks:
        return Status("done", passed, checks, when, tuple(functions))
    if not_started == checks:
        return Status("not-started", passed, checks, when, tuple(functions))
    return Status("partial", passed, checks, when, tuple(functions))
