"""Names and seeds of check cases, shared by the fixtures (`conftest.py`) and the report."""

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
    """Where a check writes a checkpoint the worker can read: a temp folder, or under `grade`'s sandbox the
    submission's temporary copy (the one folder the worker sees besides the system's)."""
    writable = request.config.getoption("--sandbox")
    folder = Path(writable[0]) / ".kvlab-checkpoint" if writable else tmp_path / "checkpoint"
    folder.mkdir(parents=True, exist_ok=True)
    return folder
