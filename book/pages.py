"""The book's source: `exercises/<stem>.md` (English) and `exercises/zh/<stem>.md` (Simplified Chinese).

A page is TOML front matter between `+++` lines, then `## ` sections with fixed English names (the same
in both languages, so one parser serves both; the book shows them translated). A module whose
Chinese page is not written yet is shown in Chinese chrome with its English text and a note.
"""

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

SECTIONS = ["Statement", "Where it sits", "Computation", "Intuition", "Shape trace", "Pitfalls", "Toy",
            "Hints L1", "Hints L2", "Hints L3", "Follow-ups", "In real engines"]
LANGUAGES = ("en", "zh")
FOLDERS = {"en": "exercises", "zh": "exercises/zh"}


def slug(name: str) -> str:
    """`Where it sits` -> `where-it-sits`: the section's anchor on the page."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


@dataclass
class Source:
    stem: str
    lang: str  # the language the text is written in
    path: Path
    meta: dict
    sections: dict[str, str]  # section name -> Markdown, in the page's order
    missing: list[str] = field(default_factory=list)  # sections not written yet (a note on the page, never fatal)

    @property
    def extra_sections(self) -> list[str]:
        return [name for name in self.sections if name not in SECTIONS]


def split_page(text: str) -> tuple[dict, dict[str, str]]:
    meta = {}
    if text.startswith("+++\n"):
        end = text.index("\n+++", 3)
        meta = tomllib.loads(text[4:end])
        text = text[end + 4 :]
    sections: dict[str, str] = {}
    parts = re.split(r"^## (.+?)\s*$", text, flags=re.M)
    for name, body in zip(parts[1::2], parts[2::2]):
        sections[name.strip()] = body.strip("\n")
    return meta, sections


def page_path(root: Path, stem: str, lang: str) -> Path:
    return root / FOLDERS[lang] / f"{stem}.md"


def load(root: Path, stem: str, lang: str) -> Source | None:
    """The page in `lang`; None when it does not exist."""
    path = page_path(root, stem, lang)
    if not path.is_file():
        return None
    meta, sections = split_page(path.read_text(encoding="utf-8"))
    return Source(stem, lang, path, meta, sections, [name for name in SECTIONS if name not in sections])


def stems_with_pages(root: Path) -> list[str]:
    """Every module page in exercises/ (files named like `m02_thinker_attention.md`)."""
    return sorted(p.stem for p in (root / FOLDERS["en"]).glob("*.md") if re.match(r"[a-z][0-9]{2}_", p.stem))
