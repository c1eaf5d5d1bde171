"""Names and seeds of check cases, shared by the fixtures (`conftest.py`) and the report."""

import tempfile
import zlib
from pathlib import Path


def module_stem(module) -> str:
    return module.__name__.rsplit(".", 1)[-1].removeprefix("test_")


def case_id(item) -> str:
    """The case's parameters without the implementation (`fp32-H8-KVH2`), the same for every impl."""
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return ""
    label = callspec.params["impl"].label if "impl" in callspec.params else None
    parts = callspec.id
    if label is not None:
        for cut in (f"-{label}", f"{label}-", label):
            if parts.endswith(cut) or parts.startswith(cut):
                parts = parts[: -len(cut)] if parts.endswith(cut) else parts[len(cut):]
                break
    return parts


def case_seed(item) -> int:
    name = f"{item.module.__name__}::{item.originalname}[{case_id(item)}]"
    return zlib.crc32(f"{item.config.kvlab_seed}:{name}".encode()) % 1_000_000


def checkpoint_folder(request, tmp_path: Path) -> Path:
    """Where a check writes a checkpoint the worker can read: a temp folder, or under `grade`'s sandbox a fresh
    folder in the grader's private `--fixture-folder` (read-only in the sandbox): never a folder the submission
    can write or prepare, since the checks write there with the grader's rights."""
    fixtures = request.config.getoption("--fixture-folder") if request.config.getoption("--sandbox") else None
    if fixtures is None:
        folder = tmp_path / "checkpoint"
        folder.mkdir(parents=True, exist_ok=True)
        return folder
    folder = Path(tempfile.mkdtemp(prefix="checkpoint-", dir=fixtures))
    folder.chmod(0o755)  # the worker's unprivileged user reads it; only the grader writes it
    return folder
