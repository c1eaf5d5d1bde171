"""A memory cgroup for `./check.sh grade`'s sandbox, where the machine lets the grader make one.

The worker's own limits (an address-space limit, the fork server's watch on its resident memory) do not see
memory that is never mapped: a memfd, a file in the sandbox's memory filesystems (`/tmp`, `/dev/shm`, the
submission's copy). A cgroup does: the kernel charges every page the sandbox's processes use, shared memory
and those files included, to its cgroup, and stops a process that would pass the limit. The grader makes one
cgroup below its own (cgroup v2 where the memory controller is delegated to it, else the v1 memory hierarchy),
starts bubblewrap inside it, and reads its count of processes killed at the limit to say why a worker died.
Where no cgroup can be made, `problem` says why, and the grade's report says so.

Only the standard library: the cgroup is made and removed in the checks' process, outside the sandbox.
"""

import errno
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

SANDBOX_SHARE = 1 << 30  # bytes the fork server and the other ranks' workers may use beside the largest worker


@dataclass(frozen=True)
class Cgroup:
    path: Path
    version: int  # 1 or 2

    @classmethod
    def make(cls, name: str, limit: int) -> "Cgroup":
        """A new memory cgroup `name` below this process's own, holding at most `limit` bytes (no swap).
        Raises OSError (with the reason) where the machine does not allow it."""
        parent, version = own_memory_cgroup()
        path = parent / name
        path.mkdir()
        group = cls(path, version)
        try:
            if version == 2:
                (path / "memory.max").write_text(str(limit))
                if (path / "memory.swap.max").exists():
                    (path / "memory.swap.max").write_text("0")
            else:
                (path / "memory.limit_in_bytes").write_text(str(limit))
                if (path / "memory.memsw.limit_in_bytes").exists():
                    (path / "memory.memsw.limit_in_bytes").write_text(str(limit))
            # a process must be able to enter it (cgroup v2 asks for rights over the common ancestor too)
            entered = subprocess.run(group.enter_command() + ["true"], capture_output=True, text=True)
            if entered.returncode != 0:
                raise OSError(errno.EACCES, f"a process cannot enter it ({entered.stderr.strip()[-200:]})")
        except OSError:
            group.remove()
            raise
        return group

    @classmethod
    def at(cls, path: str) -> "Cgroup":
        return cls(Path(path), 2 if (Path(path) / "memory.max").exists() else 1)

    def enter_command(self) -> list[str]:
        """A prefix for a command line: the command runs in this cgroup (at its limit, the kernel stops a worker
        before the fork server: workers raise their own out-of-memory score, `serve.py`)."""
        return ["/bin/sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(self.path)]

    def limit_text(self) -> str:
        name = "memory.max" if self.version == 2 else "memory.limit_in_bytes"
        try:
            return f"{int((self.path / name).read_text()) / 2**30:.3g} GiB"
        except (OSError, ValueError):
            return "its limit"

    def oom_kills(self) -> int:
        """How many processes of the cgroup the kernel has killed at its limit so far."""
        try:
            text = (self.path / ("memory.events" if self.version == 2 else "memory.oom_control")).read_text()
        except OSError:
            return 0
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def usage(self) -> int | None:
        """The memory the cgroup holds now (bytes)."""
        try:
            return int((self.path / ("memory.current" if self.version == 2 else "memory.usage_in_bytes")).read_text())
        except (OSError, ValueError):
            return None

    def peak_since_reset(self):
        """A measure of the most memory the cgroup holds from now on: `measure()` gives the bytes above what it
        held now, or None where the kernel cannot restart its peak (cgroup v1's max_usage_in_bytes restarts
        when written; v2's memory.peak restarts for the file handle that writes it, from Linux 6.12)."""
        return PeakSince(self)

    def remove(self) -> None:
        try:
            self.path.rmdir()
        except OSError:
            pass


class PeakSince:
    def __init__(self, cgroup: Cgroup):
        self.base, self.handle = cgroup.usage(), None
        try:
            if cgroup.version == 1:
                (cgroup.path / "memory.max_usage_in_bytes").write_text("0")
                self.read = lambda: int((cgroup.path / "memory.max_usage_in_bytes").read_text())
            else:
                self.handle = open(cgroup.path / "memory.peak", "r+")
                self.handle.write("reset\n")
                self.handle.flush()
                self.read = self._read_handle
        except (OSError, ValueError):
            self.read = None

    def _read_handle(self) -> int:
        self.handle.seek(0)
        return int(self.handle.read())

    def measure(self) -> int | None:
        try:
            return None if self.read is None or self.base is None else max(0, self.read() - self.base)
        except (OSError, ValueError):
            return None
        finally:
            if self.handle is not None:
                self.handle.close()


def own_memory_cgroup() -> tuple[Path, int]:
    """This process's memory cgroup folder and the cgroup version it is from; OSError where there is none."""
    mounts = {}
    with open("/proc/self/mountinfo") as info:
        for line in info:
            fields = line.split()
            separator = fields.index("-")
            kind, options = fields[separator + 1], fields[separator + 3].split(",") + fields[5].split(",")
            if kind == "cgroup2":
                mounts.setdefault(2, (Path(fields[4]), fields[3]))
            elif kind == "cgroup" and "memory" in options:
                mounts.setdefault(1, (Path(fields[4]), fields[3]))
    with open("/proc/self/cgroup") as groups:
        lines = [line.rstrip("\n").split(":", 2) for line in groups]
    def folder_of(version: int, relative: str) -> Path:
        mount, root = mounts[version]
        if root != "/" and relative.startswith(root):
            relative = relative[len(root):]
        return mount / relative.lstrip("/")

    for number, controllers, relative in lines:
        if controllers == "" and 2 in mounts:
            folder = folder_of(2, relative)
            enabled = (folder / "cgroup.subtree_control").read_text().split() if folder.is_dir() else []
            if "memory" in enabled and os.access(folder, os.W_OK):
                return folder, 2
    for number, controllers, relative in lines:
        if "memory" in controllers.split(",") and 1 in mounts:
            folder = folder_of(1, relative)
            if folder.is_dir() and os.access(folder, os.W_OK):
                return folder, 1
    raise OSError("no memory cgroup this user may divide (cgroup v2 with the memory controller delegated, or v1's "
                  "memory hierarchy, writable)")


def make_for_sandbox(name: str, largest_worker: int) -> tuple[Cgroup | None, str | None]:
    """A cgroup for a sandbox whose largest worker may use `largest_worker` bytes, or (None, why not)."""
    try:
        return Cgroup.make(name, largest_worker + SANDBOX_SHARE), None
    except OSError as error:
        return None, error.strerror or str(error)
