"""Markdown to HTML for the book: CommonMark + tables (markdown-it-py), and LaTeX math as MathML.

Math is written `$...$` (inline) or `$$...$$` (display) in the exercise pages and converted here, at
build time, by latex2mathml: the pages need no script and no network to show it, and browsers render
MathML natively. A formula latex2mathml cannot convert fails the build with the page and the formula.
Dollar signs inside code spans and code blocks are left alone (those rules run first).
"""

import re

from latex2mathml.converter import convert as latex_to_mathml
from markdown_it import MarkdownIt
from markdown_it.rules_inline import StateInline


class MarkupError(Exception):
    """A page's Markdown or math cannot be rendered; the message names the formula."""


def _math_rule(state: StateInline, silent: bool) -> bool:
    src, start = state.src, state.pos
    if src[start] != "$":
        return False
    display = src.startswith("$$", start)
    opener = 2 if display else 1
    if display:
        end = src.find("$$", start + 2)
    else:
        # Pandoc's rule: no space just inside the dollars, and no digit right after the closing one
        # (so "costs $5 and $6" stays text).
        if start + 1 >= state.posMax or src[start + 1].isspace():
            return False
        end = start + 1
        while True:
            end = src.find("$", end)
            if end == -1 or end >= state.posMax:
                return False
            if src[end - 1] != "\\":
                break
            end += 1
        if src[end - 1].isspace() or (end + 1 < len(src) and src[end + 1].isdigit()):
            return False
    if end == -1 or end >= state.posMax or end == start + opener:
        return False
    if not silent:
        token = state.push("math_display" if display else "math_inline", "math", 0)
        token.content = src[start + opener : end]
        token.markup = "$$" if display else "$"
    state.pos = end + opener
    return True


def _render_math(renderer, tokens, idx, options, env) -> str:
    token = tokens[idx]
    display = token.type == "math_display"
    try:
        mathml = latex_to_mathml(token.content.strip(), display="block" if display else "inline")
    except Exception as error:  # noqa: BLE001 - any converter failure is a content error to report
        where = env.get("where", "a page")
        raise MarkupError(f"{where}: cannot convert ${token.content}$ to MathML: {error}") from None
    if display:
        return f'<span class="math-display">{mathml}</span>'
    return mathml


def _table_open(renderer, tokens, idx, options, env) -> str:
    return '<div class="table-wrap"><table>\n'


def _table_close(renderer, tokens, idx, options, env) -> str:
    return "</table></div>\n"


def make_renderer() -> MarkdownIt:
    md = MarkdownIt("commonmark", {"html": False, "typographer": False}).enable("table")
    md.inline.ruler.after("escape", "math", _math_rule)
    md.add_render_rule("math_inline", _render_math)
    md.add_render_rule("math_display", _render_math)
    md.add_render_rule("table_open", _table_open)
    md.add_render_rule("table_close", _table_close)
    return md


_MD = make_renderer()


def to_html(text: str, where: str = "") -> str:
    """Render one section's Markdown; `where` names the page in error messages."""
    return _MD.render(text, {"where": where})


_PITFALL = re.compile(r"<li>(\s*<p>)?<code>([a-z0-9][a-z0-9-]*)</code>([:：])")


def anchor_pitfalls(html: str) -> tuple[str, list[str]]:
    """Give every Pitfalls item that starts with a mistake id an anchor `pitfall-<id>`."""
    found = []

    def add_id(match: re.Match) -> str:
        found.append(match.group(2))
        return f'<li id="pitfall-{match.group(2)}">{match.group(1) or ""}<code>{match.group(2)}</code>{match.group(3)}'

    return _PITFALL.sub(add_id, html), found
