"""Where learner code runs: a fork server (optionally inside bubblewrap) and one worker per module run.

The checks' process never imports learner code. `ForkServer` starts `serve.py` as its own Python
(`python -I`: neither the kit nor the current folder on the import path; a clean environment), which
imports torch and Triton once and then forks workers in milliseconds. `Session` is one module run of
one implementation: it asks for a worker, has it import the module once, sends requests and waits for
each reply under a deadline. A worker that overruns its deadline is killed, which also stops a hang
inside C code or a GPU kernel; a worker that exits or dies (`sys.exit`, `os._exit`, a signal, a
segfault) is described in one line; either way the next request gets a fresh worker.

With a `Sandbox` (`./check.sh grade`) the fork server runs inside bubblewrap: its own pid, ipc, uts
and network namespaces (no network), a filesystem of read-only system and Python folders only, no view of
the kit (its `solutions/`, `checks/`, `.kvlab/`) or of the oracle library (transformers), only the
capabilities it needs to fork workers that drop to an unprivileged user (so the process limit holds), and
size-limited memory filesystems for everything a worker may write: `/tmp`, `/dev/shm` and the submission's
folder, which the server fills from a read-only view of the grader's copy before it serves. The checks'
own files for the worker (a checkpoint) lie in a folder only the grader writes, seen read-only inside.
Where the machine lets this process make a memory cgroup, the whole sandbox runs in one (`limits.py`):
shared memory and files in those filesystems count against its limit too.
"""

import gc
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from . import wire
from .limits import Cgroup
from .loading import Package

HERE = Path(__file__).resolve().parent
# the worker side, run as text (imports only the standard library and torch)
SHIPPED = ("values", "wire", "loading", "textgen", "standins", "serve")
START_LIMIT = 180.0  # seconds for the fork server to import torch (a cold disk on a busy machine)
UNPRIVILEGED = 65534  # nobody: the user a sandboxed worker runs as
HIDDEN_PACKAGES = ("transformers", "flash_attn", "solutions", "checks")  # oracles and the kit, not the submission's
PASSED_ENV = ("PATH", "LD_LIBRARY_PATH", "LANG", "LC_ALL", "TZ", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
              "TRITON_INTERPRET", "TRITON_CACHE_DIR", "CUDA_VISIBLE_DEVICES", "CUDA_HOME", "NVIDIA_VISIBLE_DEVICES",
              "KVLAB_RUN_TAG")  # the last: a tag the kit's self-tests give a run, to find the processes it left
DEFAULT_MEMORY_LIMIT = 4 << 30
SANDBOX_FOLDER_SIZE = 256 << 20  # bytes: each memory filesystem a sandboxed worker may write (/tmp, /dev/shm, its copy)
SOURCE = "/kvlab/submission"  # where the sandbox sees the grader's copy of the submission, read-only
# What the fork server in the sandbox may still do as root: become the unprivileged user, and end its workers
SANDBOX_CAPABILITIES = ("CAP_SETUID", "CAP_SETGID", "CAP_KILL")
# The checks' own libraries (pytest and its plugins, the report's), gone from a fork server made from the
# checks' process (`Forked`)
CHECKS_SIDE = ("book", "pytest", "_pytest", "pluggy", "py", "iniconfig", "hypothesis", "_hypothesis_pytestplugin",
               "_hypothesis_globals", "rich", "pygments", "jinja2", "markdown_it", "watchfiles", "anyio", "trio",
               "outcome", "sniffio", "attr", "attrs", "sortedcontainers", "latex2mathml")


class WorkerGone(Exception):
    """The worker exited, died or was killed; the message says how, in words (and, where Python's fault handler
    saw it crash in the learner's code, where). `backend`: the line a distributed backend printed last before it
    (gloo's "terminate called ..."), if one did."""

    def __init__(self, message: str, backend: str = ""):
        super().__init__(message)
        self.backend = backend


class Overran(Exception):
    """The worker did not answer before the deadline and was killed."""


class SandboxUnavailable(Exception):
    """bubblewrap is not installed or cannot build a sandbox here."""


def boot_program() -> str:
    """The program the fork server runs: the shipped modules as a package, then the server."""
    sources = {name: (HERE / f"{name}.py").read_text(encoding="utf-8") for name in SHIPPED}
    return (
        "import sys, types\n"
        f"sources = {sources!r}\n"
        "package = types.ModuleType('kvlab_worker'); package.__path__ = []; sys.modules['kvlab_worker'] = package\n"
        f"for name in {list(SHIPPED)!r}:\n"
        "    module = types.ModuleType('kvlab_worker.' + name); module.__package__ = 'kvlab_worker'\n"
        "    sys.modules[module.__name__] = module\n"
        "    exec(compile(sources[name], '<kvlab worker: ' + name + '.py>', 'exec'), module.__dict__)\n"
        "sys.modules['kvlab_worker.serve'].main()\n"
    )


def clean_environment(sandbox: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k in PASSED_ENV or k.startswith(("NCCL_", "CUDA_"))}
    env.setdefault("PATH", "/usr/bin:/bin")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    if sandbox:
        env["HOME"] = env["TMPDIR"] = "/tmp"
        env["TRITON_CACHE_DIR"] = "/tmp/triton"
    elif "HOME" in os.environ:
        env["HOME"] = os.environ["HOME"]  # Triton's compile cache lives there
    return env


@dataclass(frozen=True)
class Sandbox:
    """What `./check.sh grade` shows the worker: the submission's copy (read-only; the worker gets its own
    writable copy of it in memory) and the checks' fixtures (read-only), besides the system's folders."""

    submission: Path
    fixtures: Path | None = None
    cgroup: Cgroup | None = None  # the memory cgroup the sandbox runs in, where the machine gave one


def bubblewrap_command(sandbox: Sandbox, cuda: bool) -> list[str]:
    """bwrap's arguments: read-only system and Python folders, size-limited memory filesystems for /tmp,
    /dev/shm and the submission's folder, the fixtures read-only."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable("bubblewrap (bwrap) is not installed: `apt-get install bubblewrap` "
                                 "(Debian/Ubuntu), or grade with --no-sandbox")
    kit = HERE.parents[1]
    size = str(SANDBOX_FOLDER_SIZE)
    command = [bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
               "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    for capability in SANDBOX_CAPABILITIES:
        command.extend(["--cap-add", capability])
    command.extend(["--perms", "1777", "--size", size, "--tmpfs", "/tmp", "--dev", "/dev",
                    "--perms", "1777", "--size", size, "--tmpfs", "/dev/shm", "--proc", "/proc"])
    made: set[Path] = {Path("/"), Path("/tmp"), Path("/dev"), Path("/proc")}

    def parents_of(target: Path) -> None:
        for parent in reversed(target.parents):
            if parent not in made:
                command.extend(["--perms", "0755", "--dir", str(parent)])
                made.add(parent)

    bound: set[Path] = set()  # folders of the host seen read-only inside (what lies below them is there too)
    for top in ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/opt"):
        path = Path(top)
        if path.is_symlink():
            command.extend(["--symlink", os.readlink(path), top])
        elif path.is_dir():
            command.extend(["--ro-bind", top, top])
            bound.add(path)
        made.add(path)
    if cuda:
        command.extend(["--ro-bind", "/sys", "/sys"])
        for device in sorted(Path("/dev").glob("nvidia*")):
            command.extend(["--dev-bind", str(device), str(device)])
    python_folders = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    python_folders |= {Path(p).resolve() for p in sys.path if p and Path(p).is_dir()}
    for folder in sorted(python_folders):
        if any(folder == b or b in folder.parents for b in bound) or folder == kit:
            continue  # already inside a bound folder (a tmpfs such as /tmp does not count: it is empty)
        if kit in folder.parents and not folder.is_relative_to(kit / ".venv"):
            continue  # nothing of the kit but its virtual environment
        parents_of(folder)
        command.extend(["--ro-bind", str(folder), str(folder)])
        made.add(folder)
        bound.add(folder)
    for folder in sorted(python_folders):  # the oracle library and any installed copy of the kit: empty there
        for name in HIDDEN_PACKAGES:
            hidden = folder / name
            in_sandbox = not folder.is_relative_to(kit) or folder.is_relative_to(kit / ".venv")
            if hidden.is_dir() and in_sandbox:
                command.extend(["--tmpfs", str(hidden)])
    parents_of(Path(SOURCE))
    command.extend(["--ro-bind", str(sandbox.submission), SOURCE])
    parents_of(sandbox.submission)
    command.extend(["--perms", "0755", "--size", size, "--tmpfs", str(sandbox.submission)])
    if sandbox.fixtures is not None:
        parents_of(sandbox.fixtures)
        command.extend(["--ro-bind", str(sandbox.fixtures), str(sandbox.fixtures)])
    command.extend(["--chdir", "/tmp", "--clearenv"])
    for key, value in clean_environment(True).items():
        command.extend(["--setenv", key, value])
    return command


class ForkServer:
    """The process that forks workers. Started once per run, in the background; `spawn` waits for it."""

    def __init__(self, *, triton: bool, cuda: bool, memory_limit: int = DEFAULT_MEMORY_LIMIT,
                 sandbox: Sandbox | None = None, quiet: bool = False, worker_uid: int | None = None):
        self.triton, self.cuda, self.memory_limit = triton, cuda, memory_limit
        self.sandbox = sandbox  # None: no sandbox
        # the user a worker becomes (root's server only): always `nobody` in the sandbox; without it, where asked
        self.worker_uid = UNPRIVILEGED if sandbox is not None else worker_uid
        self.quiet = quiet
        self.process: subprocess.Popen | None = None
        self.control: socket.socket | None = None
        self.ready = False
        self.lock = threading.RLock()  # ranks ask from threads of their own: one request at a time

    @property
    def sandboxed(self) -> bool:
        return self.sandbox is not None

    def start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        options = {"control_fd": theirs.fileno(), "triton": self.triton, "cuda": self.cuda,
                   "memory_limit": self.memory_limit, "uid": self.worker_uid,
                   "populate": [SOURCE, str(self.sandbox.submission)] if self.sandboxed else None}
        if self.forks_from_here():
            self.process = Forked.start(theirs, options, self.quiet)
            self.control, self.ready = ours, False
            return
        command = [sys.executable, "-I", "-c", boot_program(), json.dumps(options)]
        env = clean_environment(self.sandboxed)
        if self.sandboxed:
            command = bubblewrap_command(self.sandbox, self.cuda) + command
            if self.sandbox.cgroup is not None:
                command = self.sandbox.cgroup.enter_command() + command
        output = subprocess.DEVNULL if self.quiet else None
        self.process = subprocess.Popen(command, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                        stdout=output, stderr=output, env=env, start_new_session=True)
        theirs.close()
        self.control, self.ready = ours, False

    def forks_from_here(self) -> bool:
        """Whether the server can be a fork of this process (torch already imported: a cold `./check.sh m02`
        saves importing it again beside the oracle's import) rather than a fresh Python. Not in the sandbox
        (bubblewrap starts it), not where CUDA may be touched (a forked CUDA process cannot use it), and only
        while this process is safe to fork: one thread, and torch at one OpenMP thread (no pool to inherit)."""
        return (not self.sandboxed and not self.cuda and threading.active_count() == 1
                and os.environ.get("OMP_NUM_THREADS") == "1" and "torch" in sys.modules)

    def _ask(self, message, fds=(), timeout: float = 30.0):
        with self.lock:
            return self._ask_now(message, fds, timeout)

    def _ask_now(self, message, fds, timeout: float):
        if self.process is None or self.process.poll() is not None:
            self.start()
        if not self.ready:
            self._wait_ready()
        try:
            socket.send_fds(self.control, [wire.pack(message)], list(fds))
            self.control.settimeout(timeout)
            data = self.control.recv(1 << 16)
        except OSError as error:
            raise WorkerGone(f"the fork server stopped ({type(error).__name__})") from None
        if not data:
            self.ready = False
            raise WorkerGone("the fork server stopped")
        return wire.unpack(data)

    def _wait_ready(self) -> None:
        self.control.settimeout(START_LIMIT)
        try:
            data = self.control.recv(1 << 16)
        except OSError:
            data = b""
        if not data:
            code = self.process.poll()
            where = " inside bubblewrap" if self.sandboxed else ""
            raise WorkerGone(f"the worker process could not start{where} (exit status {code})")
        self.ready = True

    def spawn(self, stderr_fd: int) -> tuple[int, socket.socket]:
        """A new worker: its pid and this end of its socket. Its standard error goes to `stderr_fd` (`Stderr`)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with self.lock:
            try:
                reply = self._ask(("spawn",), [theirs.fileno(), stderr_fd])
            except WorkerGone:  # one restart: a learner's worker may have killed the server (it is its parent)
                self.stop()
                reply = self._ask(("spawn",), [theirs.fileno(), stderr_fd])
        theirs.close()
        return reply[1], ours

    def oom_kills(self) -> int:
        """Processes the sandbox's memory cgroup has had killed at its limit (0 without one)."""
        cgroup = self.sandbox.cgroup if self.sandbox is not None else None
        return cgroup.oom_kills() if cgroup is not None else 0

    def kill(self, pid: int) -> str:
        try:
            return self._ask(("kill", pid))[1] or "was stopped"
        except WorkerGone:
            return "was stopped (with the fork server)"

    def how_it_ended(self, pid: int) -> str:
        deadline = time.monotonic() + 2
        while True:
            try:
                ended = self._ask(("ended", pid))[1]
            except WorkerGone:
                return "ended (with the fork server)"
            if ended or time.monotonic() > deadline:
                return ended or self.kill(pid)
            time.sleep(0.005)

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None and self.ready:
            try:
                socket.send_fds(self.control, [wire.pack(("stop",))], [])
                self.control.settimeout(10)
                self.control.recv(1 << 16)
            except OSError:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait()
        self.control.close()
        self.process, self.ready = None, False


class Forked:
    """The fork server as a fork of the checks' process: `Popen`'s `pid`, `poll` and `wait`.

    The child leaves the checks behind before it serves: a session of its own, default signal handlers, no
    open file but its control socket and the standard streams, the clean environment, the kit's folder off
    its import path; then it runs the same program a fresh server runs (`boot_program`), with torch already
    in memory. (Not the sandbox: without `grade`, a learner's worker may read the kit as its user can.)"""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    @classmethod
    def start(cls, theirs: socket.socket, options: dict, quiet: bool) -> "Forked":
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                cls._serve(theirs, options, quiet)
            except BaseException:  # noqa: BLE001 - a bug of the worker side itself: say so, exit 70
                import traceback

                traceback.print_exc()
                code = 70
            finally:
                os._exit(code)
        theirs.close()
        return cls(pid)

    @staticmethod
    def _serve(theirs: socket.socket, options: dict, quiet: bool) -> None:
        # Nothing of the checks' process is collected here (a collected file or socket would close an fd
        # number that may name something else by then), and none of its files stays open: only the control
        # socket and the standard streams (a worker must not reach the checks' end of any socket).
        gc.freeze()
        os.setsid()
        for number in (signal.SIGTERM, signal.SIGINT, signal.SIGALRM, signal.SIGPIPE):
            signal.signal(number, signal.SIG_IGN if number == signal.SIGPIPE else signal.SIG_DFL)
        signal.setitimer(signal.ITIMER_REAL, 0)
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
        # what a fresh `python -I` importing torch and Triton would not have: the kit, its oracles and the test
        # runner (a submission must not be able to tell that it is being checked)
        for name in [n for n in sys.modules if n.split(".")[0] in HIDDEN_PACKAGES + CHECKS_SIDE]:
            del sys.modules[name]
        keep = theirs.fileno()
        os.closerange(3, keep)
        os.closerange(keep + 1, os.sysconf("SC_OPEN_MAX"))
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        if quiet:
            os.dup2(null, 1)
            os.dup2(null, 2)
        os.close(null)
        clean = clean_environment(False)
        os.environ.clear()
        os.environ.update(clean)
        kit = HERE.parents[1]
        sys.path[:] = [p for p in sys.path if p and Path(p).resolve() != kit]  # as for a fresh `python -I`
        sys.argv = ["kvlab-worker", json.dumps({**options, "control_fd": keep})]
        exec(compile(boot_program(), "<kvlab worker>", "exec"), {"__name__": "kvlab_boot"})

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                pid, status = self.pid, 0
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            try:
                _, status = os.waitpid(self.pid, 0)
                self.returncode = os.waitstatus_to_exitcode(status)
            except ChildProcessError:
                self.returncode = 0
        return self.returncode


_generations = itertools.count(1)


class Stderr:
    """A worker's standard error: a memory file that the worker (and every process it starts: a tensor-parallel
    engine's ranks) writes, read here after each request. What the learner's code printed there is passed on to
    this process's standard error as it was (unless the server is quiet). Kept back instead: what Python's fault
    handler writes as the worker crashes (from "Fatal Python error:" on: the frames each thread was running), in
    `dump`, to say where it crashed; and what torch's distributed backends print (gloo's "terminate called after
    throwing ...", c10d's log lines, torch.distributed's warnings), the last of it in one line in `backend`, for
    the reason of a failure: never above the report."""

    READ_LIMIT = 1 << 20  # bytes read after a request; a worker that prints more in one request loses the rest

    def __init__(self, quiet: bool):
        self.fd = os.memfd_create("kvlab-worker-stderr", os.MFD_CLOEXEC)
        self.quiet = quiet
        self.dump = ""
        self.backend = ""  # what a backend said in the last request, in one line ("" if nothing)

    def take(self) -> None:
        """Read what was written since the last time, and empty the file for what comes next."""
        try:
            size = os.fstat(self.fd).st_size
            if not size:
                return
            data = os.pread(self.fd, min(size, self.READ_LIMIT), 0)
            os.ftruncate(self.fd, 0)
            os.lseek(self.fd, 0, os.SEEK_SET)  # the worker's offset too: the file's description is shared
        except OSError:
            return
        text = data.replace(b"\0", b"").decode("utf-8", "surrogateescape")
        crash = FATAL.search(text)
        if crash is not None:  # the fault handler's report ends with the line of extension modules, if it has one
            end = DUMP_END.search(text, crash.start())
            end = end.end() if end is not None else len(text)
            text, self.dump = text[: crash.start()] + text[end:], text[crash.start():end]
        text, said = backend_noise(text)
        if said:
            self.backend = said
        if text and not self.quiet:
            self.forward(text)

    @staticmethod
    def forward(text: str) -> None:
        data = text.encode("utf-8", "surrogateescape")
        try:
            while data:
                data = data[os.write(2, data):]
        except OSError:
            pass

    def close(self) -> None:
        self.take()
        os.close(self.fd)


FATAL = re.compile(r"(?m)^Fatal Python error: ")
DUMP_END = re.compile(r"(?m)^Extension modules: .*\n?")
FRAME = re.compile(r'^  File "(?P<file>.*)", line (?P<line>\d+) in (?P<function>\S+)\s*$')
# What torch's distributed backends print by themselves: a C++ abort ("terminate called ...", its "what():"
# line), c10d's glog lines, gloo's and NCCL's tags, torch.distributed's Python warnings
BACKEND = re.compile(r"^(terminate called |\s*what\(\): |(\[rank\d+\]:)?\[[WEFI]\d{4} \d\d:\d\d:\d\d|"
                     r"\[(Gloo|c10d|NCCL)\]|.*torch/distributed/\S*:\d+: \w*Warning: )")
BACKEND_STACK = re.compile(r"^(Exception raised from |frame #\d+: )")  # a C++ exception's stack, after its message
BACKEND_WHERE = re.compile(r"^(\[rank\d+\]:)?\[[^\]]*(\.(cc|cpp|h|hpp|py):\d+|enforce fail at [^\]]*)\]\s*")


def backend_noise(text: str) -> tuple[str, str]:
    """`text` without what a distributed backend printed, and the most telling of that in one line: the message of a
    C++ abort ("gloo said: ... Received data size doesn't match expected size ..."), else its last log line."""
    kept, noise, message, last = [], [], "", ""
    follows = ""  # what may follow the last backend line: "stack" (its C++ stack), "indented" (and indented lines)
    for line in text.splitlines(keepends=True):
        bare = line.rstrip("\n")
        if BACKEND.match(bare):
            words = bare.strip()
            abort = words.startswith(("terminate called", "what():"))
            follows = "indented" if abort or "torch/distributed/" in words else "stack"  # a Python warning's source
            if words.startswith("what():"):
                message = message or words.removeprefix("what():").strip()
            elif not abort:
                last = words
        elif not (follows and (BACKEND_STACK.match(bare) or follows == "indented" and bare[:1].isspace())):
            follows = ""
            kept.append(line)
            continue
        noise.append(bare)
    said = BACKEND_WHERE.sub("", (message or last).split("Warning: ")[-1]).strip()
    if not said:
        return text, ""
    printed = "\n".join(noise).lower()
    backend = "gloo" if "gloo" in printed else "nccl" if "nccl" in printed else "torch.distributed"
    return "".join(kept), f"{backend} said: {said}"


def _learner_frames(dump: str, shown_file) -> list[tuple[str, int, str]]:
    """The learner's frames (file as shown, line, function; innermost first) in the fault handler's `dump`: the
    crashing thread's, else another thread's; [] where none is the learner's."""
    threads, frames = [], None
    for line in dump.splitlines():
        if line.startswith(("Current thread", "Thread 0x")):
            frames = []
            threads.append((not line.startswith("Current thread"), frames))
        elif frames is not None and (frame := FRAME.match(line)):
            shown = shown_file(frame["file"])
            if shown is not None:
                frames.append((shown, int(frame["line"]), frame["function"]))
    return next((frames for _, frames in sorted(threads, key=lambda t: t[0]) if frames), [])


def hang_site(dump: str, shown_file, home: str, what: str) -> str:
    """Where a call that overran its time limit was when it was stopped, from the fault handler's `dump`, outermost
    first: the called function's line in the checked module's own file `home` (its loop), the innermost line of
    `home`, and the deeper call it was in: ` in `schedule` (mine/p05_scheduler.py line 145) → `preempt` (... line
    165) → `free` (mine/p01_block_manager.py line 166)`. As `crash_site` where no frame is in `home`; "" where none
    is the learner's."""
    found = _learner_frames(dump, shown_file)
    own = [i for i, (shown, _, _) in enumerate(found) if shown == home]
    if not own:
        return crash_site(dump, shown_file, what)
    called = what.strip("`").rsplit(".", 1)[-1]
    entry = next((i for i in reversed(own) if found[i][2] == called), own[-1])
    chain = sorted({entry, own[0], 0}, reverse=True)  # outermost first
    return " in " + " → ".join(f"`{found[i][2]}` ({found[i][0]} line {found[i][1]})" for i in chain)


def crash_site(dump: str, shown_file, what: str) -> str:
    """Where the learner's code was when the worker crashed, from the fault handler's `dump`: ` at mine/x.py line 12`
    (in the call the check made), ` in `f` (mine/x.py line 12)`, or ` in `entry` → `f` (...)` where `f` is a helper of
    the file `entry` is the way into. The crashing thread's frames, else another thread's; "" where none is the
    learner's. `shown_file`: a frame's file name -> how reports name it (None outside the learner's folder)."""
    found = _learner_frames(dump, shown_file)
    if not found:
        return ""
    shown, line, function = found[0]  # innermost first
    entry = function
    for file, _, name in found:
        if file != shown:
            break
        entry = name
    called = what.strip("`").rsplit(".", 1)[-1]  # `paged_prefill`, `LLM.generate`: the call the check made
    if function == called:
        return f" at {shown} line {line}"
    if entry not in (function, called):
        return f" in `{entry}` → `{function}` ({shown} line {line})"
    return f" in `{function}` ({shown} line {line})"


class Session:
    """One implementation's module in a worker: loaded once, asked many times, replaced when it dies.

    `codec_for(session)` makes the parent-side codec (handles become proxies, callbacks are served);
    see `guard.py`. Handles carry the worker's generation: after a restart, an old handle is refused."""

    def __init__(self, server: ForkServer, spec: tuple, codec_for, import_limit: float, prelude: tuple | None = None):
        self.server, self.spec, self.codec_for, self.import_limit = server, spec, codec_for, import_limit
        self.prelude = prelude  # a request a new worker answers before it imports the module (joining ranks)
        self.pid: int | None = None
        self.sock: socket.socket | None = None
        self.generation = 0
        self.stderr: Stderr | None = None  # the current worker's standard error
        self.backend = ""  # what a distributed backend printed during the last request, in one line
        self.loaded = None  # ("loaded", names) or ("load-error", reason) of the current worker
        self.notes: list[tuple] = []  # what the worker noted while calls ran (collectives), oldest first
        self.written: list[tuple] = []  # storage keys (`wire.storage_key`) of the last call's inputs it wrote
        self.peak: int | None = None  # bytes the sandbox's memory grew by at most in the last watched call
        # (name, part, deadline) -> the answer to a collective the worker entered (set for ranks: ranks.py)
        self.on_collective = None

    def ensure(self):
        """A live worker with the module imported; returns the load reply."""
        if self.sock is None:
            self.stderr = Stderr(self.server.quiet)
            self.pid, self.sock = self.server.spawn(self.stderr.fd)
            self.generation = next(_generations)
            if self.prelude is not None:
                joined = self._exchange(self.prelude, self.import_limit, "joining the other ranks")
                if joined[0] != "value":
                    self.loaded = ("load-error", joined[1])
                    return self.loaded
            self.loaded = self._exchange(("load", *self.spec), self.import_limit, "importing it")
        return self.loaded

    def request(self, message, seconds: float, what: str):
        self.ensure()
        if self.loaded[0] != "loaded":
            return self.loaded
        return self._exchange(message, seconds, what)

    def _exchange(self, message, seconds: float, what: str):
        codec = self.codec_for(self)
        callbacks = codec.callbacks  # the check's callables in `message`, served while the call runs
        tree = codec.encode(message)
        deadline = time.monotonic() + seconds
        kills = self.server.oom_kills()
        self.backend = ""
        # A call's inputs cross in shared memory: what the call wrote into them is read here, after it, from this
        # side (a worker can disable any check of its own, or forge its reply, but not this)
        shared = wire.SharedStorages(codec.storages) if message[0] in ("call", "method") and codec.storages else None
        self.written, self.peak = [], None
        cgroup = self.server.sandbox.cgroup if self.server.sandbox is not None else None
        peak = cgroup.peak_since_reset() if cgroup is not None and message[0] in ("call", "method") and \
            message[-1] is True else None  # a call watched for its largest allocation: measured here too
        try:
            if shared is None:
                wire.send(self.sock, (tree, codec.storages))
            else:
                wire.send(self.sock, (tree, shared.layout()), fds=[shared.fd])
            while True:
                tree, storages, size = wire.parts(*wire.receive(self.sock, deadline))
                reply = self.codec_for(self).decode(tree, storages, size, deadline)
                if type(reply) is not tuple or not reply or type(reply[0]) is not str:
                    raise wire.WireError("a reply that is not a message")
                if reply[0] == "note":
                    if self.on_collective is None:  # where this process carries the collectives, it counts them
                        self.notes.append(reply[1:])
                    continue
                if reply[0] == "collective" and len(reply) == 3 and type(reply[1]) is str:
                    self.notes.append(("collective", reply[1], "enter"))
                    answer = self.on_collective(reply[1], reply[2], deadline) if self.on_collective else \
                        ("collective-error", "no other rank to meet: this worker is not one of several ranks")
                    answering = self.codec_for(self)  # not `codec`: the call's storages are read after it by that
                    wire.send(self.sock, (answering.encode(answer), answering.storages))
                    self.notes.append(("collective", reply[1], "done"))
                    continue
                if reply[0] != "callback":
                    if shared is not None:
                        self.written = [codec.storage_keys[i] for i in shared.written()]
                    if peak is not None:
                        self.peak = peak.measure()
                    return reply
                wire.send(self.sock, self._serve_callback(reply, callbacks))
        except wire.Timeout:
            site = self._where_it_hangs(what)
            self.end()
            raise Overran(f"{what} did not return within {seconds:g} s{f'; it was{site} when stopped' if site else ''} "
                          f"(an endless loop? on a slow machine, --time-limit gives it longer)") from None
        except (wire.Closed, ConnectionError, BrokenPipeError):
            how = self.server.how_it_ended(self.pid)
            if self.server.oom_kills() > kills:
                how = (f"was stopped at the sandbox's memory limit ({self.server.sandbox.cgroup.limit_text()}: memory "
                       "in shared memory and in files under /tmp, /dev/shm and the submission's folder counts too)")
            self.stderr.take()
            site = crash_site(self.stderr.dump, Package(*self.spec[:2]).shown_file, what)
            self.backend = self.stderr.backend
            self.end(killed=False)
            raise WorkerGone(f"{what}: the worker process running it {how}{site}", self.backend) from None
        except (wire.WireError, RecursionError) as error:
            self.end()
            raise WorkerGone(f"{what}: the worker sent something that is not a reply ({error})") from None
        finally:
            if shared is not None:
                shared.close()
            if self.stderr is not None:
                self.stderr.take()
                self.backend, self.stderr.backend = self.stderr.backend or self.backend, ""

    def _where_it_hangs(self, what: str) -> str:
        """Where the learner's code was when `what` overran its time limit (` at mine/x.py line 12`, as for a
        crash), from the frames the worker's fault handler writes as the fork server aborts it; "" where none is the
        learner's."""
        try:
            self.server._ask(("abort", self.pid))
        except WorkerGone:
            return ""
        if self.stderr is None:
            return ""
        self.stderr.take()
        package = Package(*self.spec[:2])
        return hang_site(self.stderr.dump, package.shown_file, package.shown_path(self.spec[4]), what)

    def _serve_callback(self, reply, callbacks):
        codec = self.codec_for(self)
        try:
            _, number, args, kwargs = reply
            value = callbacks[number](*args, **kwargs)
            tree = codec.encode(("callback-result", value))
        except Exception as error:  # noqa: BLE001 - the check's callback failed: the learner's call sees why
            codec = self.codec_for(self)
            tree = codec.encode(("callback-error", f"the check's callback raised {type(error).__name__}: {error}"))
        return tree, codec.storages

    def end(self, killed: bool = True) -> None:
        if self.sock is not None:
            if killed:
                self.server.kill(self.pid)
            self.sock.close()
        if self.stderr is not None:
            self.stderr.close()
        self.sock, self.pid, self.loaded, self.stderr = None, None, None, None

    def forget(self) -> None:
        """The check ended: the worker drops the objects it made for it."""
        if self.sock is not None and self.loaded and self.loaded[0] == "loaded":
            try:
                wire.send(self.sock, (("T", ["forget"]), []))
            except OSError:
                self.end(killed=False)
