"""How well the kit NAMES mistakes it did not write itself: `python -m checks.naming_rate [MODULE | MISTAKE ...]`.

The mistakes under checks/selftests/independent/ (one file per mistake, `<module>-<short-name>.json`: the
module file it changes and one exact edit of the reference, `old` -> `new`) were written from the stubs'
contracts and the reference solutions, without looking at the kit's mistake catalogue. For each one this runs
`./check.sh <module> --impl <copy> --seed 3 --json ...` on a copy of solutions/ with that one edit made, and
sorts the outcome into:

- passed: no check rejected the mistake (the checks are too weak for it);
- named: rejected, and the report names known mistakes (listed in the report's ranking order);
- rule: rejected, the report names no known mistake but the contract's rule the code breaks (the catalogue's
  RULES), listed as `rule:<id>` in the report's ranking order;
- cause: rejected, the report names neither, and a failing case gives a cause that needs no catalogue (a value
  returned as a view of an input, an exception, a time-out, a dtype or shape; the other failing cases, if any, say
  what differs and name nothing): the right outcome where the guess column says `(cause)`;
- unnamed: rejected, but the report names none.

Per module it prints how many were rejected, how many of those were named, and how many were named
FIRST with the id guessed in the set's README.md (the last column of its table): `first=guess` counts the guess
alone; `first=listed` also counts a second name the table lists, before the run, as just as fair (`rule:x; also
(cause)`: the mistake's own description breaks that rule too, or the report's plain cause says it all). Runs on a
CPU, uses no network.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from checks.harness.report import Result, plain_causes, rank_mistakes, rank_rules

KIT = Path(__file__).resolve().parent.parent
MISTAKES = KIT / "checks" / "selftests" / "independent"
FIELDS = set(Result.__dataclass_fields__)
# what a failing case's reason says when the cause is plain without a catalogue (the report's own wording)
CAUSES = re.compile(r"returned one of its inputs|raised |did not return within|: shape \[|returned shape |returned a |"
                    r"returned \w+, expected \w+ \(|has dtype \w+, expected \w+|was killed by|changed its input|"
                    r"not a Request|"
                    r"expected a (list|bool|\(requests, is_prefill\) pair)|expected an int|"
                    r"expected the list of finished|not one of the requests add\(\) returned")


def guesses() -> dict[str, list[str]]:
    """The README's guessed names per mistake (its table: | mistake | what | guess |), the guess first, then the
    names listed after "; also " as just as fair."""
    rows = {}
    for line in (MISTAKES / "README.md").read_text().splitlines():
        cells = [c.strip().strip("`") for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]  # "\|": a pipe
        if len(cells) == 3 and re.fullmatch(r"p\d\d-[\w-]+", cells[0]):
            first, _, also = cells[2].partition("; also ")
            rows[cells[0]] = [name.strip().strip("`") for name in [first, *also.split(",")] if name.strip()]
    return rows


def judge(mistake: Path) -> tuple[str, list[str], str]:
    """Check one mistake: (verdict, named ids in ranking order, the module's stem)."""
    edit = json.loads(mistake.read_text())
    stem = edit["file"].removesuffix(".py")
    with tempfile.TemporaryDirectory() as tmp:
        impl = Path(tmp) / "impl"
        shutil.copytree(KIT / "solutions", impl)
        source = (impl / edit["file"]).read_text()
        if source.count(edit["old"]) != 1:
            return "stale", [], stem  # the reference changed under the edit: write the mistake again
        (impl / edit["file"]).write_text(source.replace(edit["old"], edit["new"]))
        out = Path(tmp) / "results.json"
        subprocess.run(["./check.sh", stem.split("_")[0], "--impl", str(impl), "--seed", "3", "--json", str(out)],
                       cwd=KIT, env={**os.environ, "KVLAB_PYTHON": os.environ.get("KVLAB_PYTHON", sys.executable)},
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not out.exists():
            return "no json", [], stem
        rows = [r for r in json.loads(out.read_text())["results"] if r.get("module") == stem]
    if not any(r["status"] == "failed" for r in rows):
        return ("kit error" if any(r["status"] == "kit error" for r in rows) else "passed"), [], stem
    results = [Result(**{k: v for k, v in r.items() if k in FIELDS}) for r in rows]
    named = rank_mistakes(results)
    if named:
        return "named", named, stem
    rules = [f"rule:{rule}" for rule in rank_rules(results)]
    if plain_causes(results):  # the report says the contract breach first, then the rules
        return "cause", ["(cause)", *rules], stem
    if rules:
        return "rule", rules, stem
    if any(CAUSES.search(r["reason"]) for r in rows if r["status"] == "failed"):
        return "cause", ["(cause)"], stem
    return "unnamed", [], stem


def main(argv: list[str]) -> None:
    wanted = [m.split("_")[0] for m in argv]  # module ids (p05, p06_engine), or mistakes by name (p05-preempt-to-right)
    mistakes = sorted(f for f in MISTAKES.glob("*.json")
                      if not wanted or f.name.split("-")[0] in wanted or f.stem in argv)
    guessed, totals = guesses(), {}
    print(f"{'mistake':42} {'verdict':8} {'guess':32} named (ranked)")
    for mistake in mistakes:
        verdict, named, stem = judge(mistake)
        listed = guessed.get(mistake.stem, [])
        guess = listed[0] if listed else ""
        t = totals.setdefault(stem, {"mistakes": 0, "rejected": 0, "named": 0, "rule": 0, "cause": 0,
                                     "first=guess": 0, "first=listed": 0})
        t["mistakes"] += 1
        t["rejected"] += verdict in ("named", "rule", "cause", "unnamed")
        t["named"] += verdict == "named"
        t["rule"] += verdict == "rule"
        t["cause"] += verdict == "cause"
        t["first=guess"] += bool(guess) and named[:1] == [guess]
        t["first=listed"] += bool(named) and named[0] in listed
        shown = guess + (" (+)" if len(listed) > 1 else "")  # (+): a second name is listed as just as fair
        print(f"{mistake.stem:42} {verdict:8} {shown or '-':32} {', '.join(named) or '-'}", flush=True)
    print()
    for stem, t in totals.items():
        print(f"{stem}: " + ", ".join(f"{k} {v}" for k, v in t.items()))


if __name__ == "__main__":
    main(sys.argv[1:])
