"""The kit's modules: one `checks/test_<stem>.py` each, described by `exercises/<stem>.md`."""

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from .loader import ROOT


@dataclass(frozen=True)
class Module:
    id: str  # "m02"
    stem: str  # "m02_thinker_attention": the file name in mine/ and solutions/
    title: str
    track: str = ""
    minutes: int = 0
    difficulty: str = ""
    depends_on: tuple[str, ...] = field(default_factory=tuple)

    @property
    def checks(self) -> Path:
        return ROOT / "checks" / f"test_{self.stem}.py"

    @property
    def page(self) -> Path:
        return ROOT / "exercises" / f"{self.stem}.md"


def front_matter(page: Path) -> dict:
    """The TOML block between the `+++` lines at the top of an exercise page."""
    text = page.read_text(encoding="utf-8")
    if not text.startswith("+++\n"):
        return {}
    return tomllib.loads(text[4 : text.index("\n+++", 3)])


def modules() -> list[Module]:
    found = []
    for checks in sorted((ROOT / "checks").glob("test_*.py")):
        stem = checks.stem.removeprefix("test_")
        page = ROOT / "exercises" / f"{stem}.md"
        meta = front_matter(page) if page.is_file() else {}
        found.append(
            Module(
                id=meta.get("id", stem.split("_", 1)[0]),
                stem=stem,
                title=meta.get("title", stem),
                track=meta.get("track", ""),
                minutes=meta.get("minutes", 0),
                difficulty=meta.get("difficulty", ""),
                depends_on=tuple(meta.get("depends_on", ())),
            )
        )
    return found


def find(name: str) -> Module | None:
    name = name.lower().removesuffix(".py").removeprefix("test_")
    return next((m for m in modules() if name in (m.id, m.stem)), None)
