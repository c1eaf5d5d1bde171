"""`./check.sh autograder OUT.zip [MODULE ...]`: a Gradescope autograder built from this kit.

    ./check.sh autograder kvlab-m01-m02.zip m01 m02 --visibility after_published --points m02=40

The zip holds `setup.sh` (run once by Gradescope when it builds the image: Python 3.11+, a CPU build of
torch, the kit's dependencies and bubblewrap; the kit's own folder made readable by root only),
`run_autograder` (run for each submission: it grades `/autograder/submission` with `./check.sh grade`
and writes `/autograder/results/results.json`) and the kit under `kvlab/` with `kvlab/autograder.json`
(the modules, points and visibility chosen here). A submission is the learner's module files, as files,
in a folder one level down, or in a zip. Nothing is fetched while grading.

Where bubblewrap cannot start in the container (no user namespaces), the submission is graded without
the sandbox: its worker still runs under the time, memory and process limits, as an unprivileged user
that cannot read the kit (so not `solutions/`), and the results say so. `KVLAB_GRADESCOPE_ROOT` moves
`/autograder` (the kit's self-test runs `run_autograder` in a temporary folder).
"""

import argparse
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from checks.harness.loader import ROOT
from checks.harness.modules import find, modules

VISIBILITIES = ("visible", "hidden", "after_due_date", "after_published")  # Gradescope's words
LEFT_OUT = ("mine/", ".ci/", ".kvlab/", ".venv/", ".git/")  # a learner's stubs and local state are not the grader's
MAX_UNZIPPED = 64 << 20  # bytes a submitted zip may unpack to (module files weigh kilobytes)
TORCH_CPU = "https://download.pytorch.org/whl/cpu"

SETUP = """#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder's image (network allowed here only).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"   # /autograder/source
root="$(dirname "$here")"                              # /autograder
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends python3 python3-venv python3-pip bubblewrap ca-certificates
if python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  python3 -m venv "$root/kvlab-venv"
else  # an older image (Ubuntu 22.04 has 3.10): a standalone Python 3.12 through uv
  python3 -m pip install -q uv
  python3 -m uv venv --python 3.12 --seed "$root/kvlab-venv"
fi
"$root/kvlab-venv/bin/pip" install -q torch --index-url {torch_index}
"$root/kvlab-venv/bin/pip" install -q -e "$here/kvlab"
chmod -R go-rwx "$here"   # the kit (checks, solutions) is root's alone: an unsandboxed worker runs as nobody
chmod 755 "$root/run_autograder" 2>/dev/null || true
cd "$here/kvlab" && "$root/kvlab-venv/bin/python" -P -c 'import sys; sys.path.insert(0, "."); import checks.autograder'
echo "KV Lab autograder ready: $(cat "$here/kvlab/autograder.json")"
"""

RUN = """#!/usr/bin/env bash
# Gradescope runs this for each submission: grade /autograder/submission, write /autograder/results/results.json.
root="${KVLAB_GRADESCOPE_ROOT:-/autograder}"
kit="$root/source/kvlab"
python="${KVLAB_PYTHON:-$root/kvlab-venv/bin/python}"
cd "$kit" && exec env PYTHONPATH="$kit" "$python" -P -m checks.autograder --grade "$root"
"""


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="./check.sh autograder", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("zip", metavar="OUT.zip", help="the autograder to write")
    parser.add_argument("modules", nargs="*", metavar="MODULE", help="the modules graded (default: all)")
    parser.add_argument("--visibility", choices=VISIBILITIES, default="after_published",
                        help="when students see their tests' results (Gradescope's setting; default after_published)")
    parser.add_argument("--points", action="append", default=[], metavar="MODULE=N",
                        help="what a module is worth (its checks scaled to N; default: the module's own POINTS)")
    parser.add_argument("--time-limit", type=float, default=10.0, metavar="S", help="seconds one call may take")
    parser.add_argument("--memory-limit", type=float, default=4.0, metavar="GIB", help="GiB the sandbox may use")
    return parser.parse_args(argv)


def config_from(args) -> dict:
    stems = []
    for name in args.modules or [m.id for m in modules()]:
        module = find(name)
        if module is None:
            raise ValueError(f"no module {name!r}")
        stems.append(module.stem)
    points = {}
    for item in args.points:
        name, _, value = item.partition("=")
        module = find(name)
        try:
            worth = float(value)
        except ValueError:
            worth = -1.0
        if module is None or module.stem not in stems or worth < 0:
            raise ValueError(f"--points {item}: give MODULE=N for a graded module and N >= 0")
        points[module.stem] = worth
    return {"modules": stems, "visibility": args.visibility, "points": points, "time_limit": args.time_limit,
            "memory_limit": args.memory_limit}


def kit_files() -> list[str]:
    """The kit's files as the repository tracks them (or every file, outside git), but what the grader never uses."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True)
    if listed.returncode == 0:
        names = [n for n in listed.stdout.decode().split("\0") if n and (ROOT / n).is_file()]
    else:
        names = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    return sorted(n for n in names if not n.startswith(LEFT_OUT))


def build(args) -> int:
    try:
        config = config_from(args)
    except ValueError as error:
        print(f"./check.sh autograder: {error}", file=sys.stderr)
        return 2
    out = Path(args.zip).expanduser()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, text in (("setup.sh", SETUP.replace("{torch_index}", TORCH_CPU)), ("run_autograder", RUN)):
            info = zipfile.ZipInfo(name)
            info.external_attr = (stat.S_IFREG | 0o755) << 16
            archive.writestr(info, text)
        for name in kit_files():
            archive.write(ROOT / name, f"kvlab/{name}")
        archive.writestr("kvlab/autograder.json", json.dumps(config, indent=1))
    ids = ", ".join(find(s).id for s in config["modules"])
    print(f"{out}: Gradescope autograder for {ids} · visibility {config['visibility']} · "
          f"{out.stat().st_size / 1e6:.1f} MB. Upload it under Configure Autograder (base image Ubuntu 22.04 or "
          "24.04); see the README's Instructors section.")
    return 0


# ---- inside Gradescope's container ---------------------------------------------------------------------


def unpacked(submission: Path, into: Path) -> Path:
    """The submission, its one zip unpacked when that is all it holds (no path leaves `into`, 64 MiB at most)."""
    items = [p for p in submission.iterdir() if not p.name.startswith(".")] if submission.is_dir() else []
    if len(items) != 1 or items[0].suffix.lower() != ".zip" or not items[0].is_file():
        return submission
    total = 0
    with zipfile.ZipFile(items[0]) as archive:
        for entry in archive.infolist():
            target = (into / entry.filename).resolve()
            total += entry.file_size
            if entry.is_dir() or not target.is_relative_to(into.resolve()) or total > MAX_UNZIPPED:
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(entry) as source, open(target, "wb") as copy:
                shutil.copyfileobj(source, copy)
    return into


def grade_submission(root: Path) -> int:
    from checks.grading import module_folder, sandbox_problem

    config = json.loads((ROOT / "autograder.json").read_text(encoding="utf-8"))
    results = root / "results" / "results.json"
    results.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvlab-upload-") as temp:
        folder = module_folder(unpacked(root / "submission", Path(temp)))
        if folder is None:
            names = ", ".join(f"{find(s).stem}.py" for s in config["modules"])
            results.write_text(json.dumps({
                "score": 0, "visibility": config["visibility"], "stdout_visibility": "hidden",
                "output": f"No module file found. Upload your files themselves ({names}), or a folder or a zip "
                          "that holds them.", "tests": []}, indent=1))
            print("no module file in the submission")
            return 0
        command = [sys.executable, "-P", "-m", "checks", "grade", str(folder), *config["modules"],
                   "--gradescope", str(results), "--visibility", config["visibility"],
                   "--time-limit", str(config["time_limit"]), "--memory-limit", str(config["memory_limit"])]
        for stem, worth in config["points"].items():
            command += ["--points", f"{stem}={worth:g}"]
        problem = sandbox_problem() if os.environ.get("KVLAB_AUTOGRADER_SANDBOX") != "off" else "turned off"
        if problem is not None:  # no user namespaces here: the worker's limits and an unprivileged user remain
            print(f"no sandbox: {problem}")
            command += ["--no-sandbox"] + (["--worker-user", "nobody"] if os.getuid() == 0 else [])
        done = subprocess.run(command, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    return 0 if done.returncode in (0, 1) else done.returncode


def main(argv: list[str]) -> int:
    if argv[:1] == ["--grade"]:
        return grade_submission(Path(argv[1]) if len(argv) > 1 else Path("/autograder"))
    return build(parse(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
