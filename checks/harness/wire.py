"""Values crossing between the checks' process and the worker that runs learner code.

A message is a tree of plain Python values in which every container and tensor carries a tag, so
that nothing a learner returns can pose as another kind of value: `("T", items)` is a tuple, `("X",
...)` a tensor (its whole storage travels, with its dtype, size, strides and offset, so a view stays a
view and a write beside it is seen), `("H", id, class, kind)` an object that stays in the worker.
What either side cannot send as data it hands to `Codec.other` (handles, records, callbacks).

The bytes are a pickle of builtins only, read back by an unpickler that refuses every global: a
worker can send wrong data, never code. Both sides use this module; it imports only the standard
library and torch, so the worker runs it as shipped text.
"""

import io
import mmap
import os
import pickle
import select
import socket
import struct
import time
from collections import deque, namedtuple

import torch

MAX_MESSAGE = 256 << 20  # bytes; a message larger than this is refused, not read (the checks send megabytes)
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)}
_SCALARS = (type(None), bool, int, float, str, bytes)


def node_budget(size: int) -> int:
    """Values a message of `size` bytes may stand for: every value costs pickle at least a byte."""
    return 2 * size + 10_000


def tensor_budget(size: int) -> int:
    """Bytes of tensors a message of `size` bytes may stand for (views can be larger than their storage: an
    expanded tensor, a cache's chunks viewed twice), at most eight times the message or 64 MiB."""
    return max(8 * size, 64 << 20)


class WireError(Exception):
    """A message that does not decode: the other side sent something that is not a value."""


class Closed(Exception):
    """The other side closed its end (it exited or died)."""


class Timeout(Exception):
    """No message before the deadline."""


class Codec:
    """Encodes and decodes one side's values; subclasses say what to do with everything else."""

    def __init__(self):
        self.storages: list[bytes] = []
        self.storage_keys: list[tuple] = []  # what each storage is on this side (`storage_key`)
        self._storage_index: dict = {}

    # ---- encoding ----
    def encode(self, value):
        kind = type(value)
        if kind in _SCALARS:
            return value
        if kind is list:
            return ("L", [self.encode(v) for v in value])
        if kind is tuple:
            return ("T", [self.encode(v) for v in value])
        if kind is dict:
            return ("D", [(self.encode(k), self.encode(v)) for k, v in value.items()])
        if kind is set or kind is frozenset:
            return ("S" if kind is set else "FS", [self.encode(v) for v in value])
        if kind is deque:
            return ("Q", [self.encode(v) for v in value])
        if kind is torch.Tensor or kind is torch.nn.Parameter:
            return self.encode_tensor(value)
        if isinstance(value, tuple) and hasattr(kind, "_fields"):  # a NamedTuple: a tuple with field names
            return ("NT", kind.__name__, list(kind._fields), [self.encode(v) for v in value])
        if kind is torch.dtype:
            return ("DT", str(value).removeprefix("torch."))
        if kind is torch.device:
            return ("DV", str(value))
        if kind is torch.Size:
            return ("SZ", list(value))
        if kind is range:  # (a prompt may be any sequence of ids)
            return ("RG", value.start, value.stop, value.step)
        return self.other(value)

    def encode_tensor(self, t: torch.Tensor):
        t = t.detach()
        storage = t.untyped_storage()
        key = storage_key(t)
        index = self._storage_index.get(key) if storage.nbytes() else None
        if index is None:
            flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            self.storages.append(flat.cpu().numpy().tobytes())
            self.storage_keys.append(key)
            index = len(self.storages) - 1
            if storage.nbytes():
                self._storage_index[key] = index
        name = str(t.dtype).removeprefix("torch.")
        return ("X", index, name, list(t.shape), list(t.stride()), t.storage_offset(), str(t.device))

    def other(self, value):
        raise WireError(f"a {type(value).__name__} cannot be sent")

    # ---- decoding ----
    def decode(self, tree, storages: list[bytes], size: int = MAX_MESSAGE, deadline: float | None = None):
        """The value `tree` stands for. A message of `size` bytes may stand for at most `node_budget(size)`
        values and tensors of `tensor_budget(size)` bytes in all, each storage its own bytes: pickle's memo lets
        a few hundred bytes name a tree of 2**100 nodes or one blob as a thousand storages, and those are
        refused, as is a decode past `deadline`. Any failure is a `WireError`: the other side's fault."""
        if type(storages) is not list or any(type(b) not in (bytes, memoryview) for b in storages):
            raise WireError("a message whose storages are not bytes")
        if len({id(b) for b in storages}) != len(storages) or sum(map(len, storages)) > size:
            raise WireError("a message whose storages share bytes (more data than the message carried)")
        self._decoded_storages: dict[tuple[int, str], torch.UntypedStorage] = {}
        self._incoming = storages
        self._nodes_left, self._bytes_left, self._deadline = node_budget(size), tensor_budget(size), deadline
        try:
            return self._decode(tree)
        except WireError:
            raise
        except RecursionError:
            raise WireError("a message nested too deep") from None
        except Exception as error:  # noqa: BLE001 - whatever a malformed message breaks is the sender's fault
            raise WireError(f"a message that does not decode ({type(error).__name__}: {str(error)[:100]})") from None

    def _decode(self, node):
        self._nodes_left -= 1
        if self._nodes_left < 0:
            raise WireError("a message that stands for more values than it has bytes")
        if self._deadline is not None and self._nodes_left % 4096 == 0 and time.monotonic() > self._deadline:
            raise Timeout
        if type(node) in _SCALARS:
            return node
        if type(node) is not tuple or not node or type(node[0]) is not str:
            raise WireError(f"not a value: {type(node).__name__}")
        tag, rest = node[0], node[1:]
        if tag in ("L", "T", "S", "FS", "Q"):
            items = [self._decode(v) for v in _items(rest)]
            return {"L": list, "T": tuple, "S": set, "FS": frozenset, "Q": deque}[tag](items)
        if tag == "D":
            return {self._decode(k): self._decode(v) for k, v in (_pair(p) for p in _items(rest))}
        if tag == "X":
            return self._decode_tensor(*rest)
        if tag == "DT" and len(rest) == 1 and rest[0] in _DTYPES:
            return _DTYPES[rest[0]]
        if tag == "DV" and len(rest) == 1 and type(rest[0]) is str:
            return torch.device(rest[0])
        if tag == "SZ":
            return torch.Size(_ints(_items(rest)))
        if tag == "RG" and len(rest) == 3 and all(type(x) is int for x in rest) and rest[2] != 0:
            return range(*rest)
        if tag == "NT" and len(rest) == 3 and type(rest[0]) is str and type(rest[1]) is list:
            return _named_tuple(rest[0], tuple(rest[1]))(*(self._decode(v) for v in _items(rest[2:])))
        return self.decode_other(tag, rest)

    def _decode_tensor(self, index, dtype, shape, stride, offset, device):
        if type(index) is not int or not 0 <= index < len(self._incoming) or dtype not in _DTYPES:
            raise WireError("a tensor with no storage or an unknown dtype")
        if type(device) is not str or not (device == "cpu" or device.startswith("cuda")):
            raise WireError(f"a tensor on an unknown device {device!r}")
        shape, stride = _ints(shape), _ints(stride)
        if not 0 <= len(shape) <= 16 or any(n < 0 for n in shape) or type(offset) is not int:
            raise WireError("a tensor with a malformed shape")
        numel = 1
        for n in shape:
            numel *= n
        self._bytes_left -= numel * _DTYPES[dtype].itemsize
        if self._bytes_left < 0:  # a view repeating a few bytes many times (stride 0) is as large as it reads
            raise WireError("tensors far larger than the message that carried them")
        storage = self._decoded_storages.get((index, device))
        if storage is None:
            data = self._incoming[index]
            if not len(data):
                flat = torch.empty(0, dtype=torch.uint8)
            elif type(data) is memoryview:  # shared with the sender (`shared_storages`): it sees any write
                flat = torch.frombuffer(data, dtype=torch.uint8)
            else:
                flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            storage = flat.to(device).untyped_storage()
            self._decoded_storages[(index, device)] = storage
        try:
            return torch.empty(0, dtype=_DTYPES[dtype], device=device).set_(storage, offset, shape, stride)
        except (RuntimeError, TypeError) as error:
            raise WireError(f"a tensor that does not fit its storage ({error})") from None

    def decode_other(self, tag: str, rest: tuple):
        raise WireError(f"unknown value tag {tag!r}")


_named_tuples: dict = {}


def _named_tuple(name: str, fields: tuple):
    """A NamedTuple class of this side with the other side's name and fields."""
    if (name, fields) not in _named_tuples:
        try:
            _named_tuples[(name, fields)] = namedtuple(name, fields)
        except (ValueError, TypeError) as error:
            raise WireError(f"a NamedTuple that cannot be rebuilt ({error})") from None
    return _named_tuples[(name, fields)]


def _items(rest: tuple) -> list:
    if len(rest) != 1 or type(rest[0]) is not list:
        raise WireError("a container without its items")
    return rest[0]


def _pair(pair):
    if type(pair) is not tuple or len(pair) != 2:
        raise WireError("a dict entry that is not a pair")
    return pair


def _ints(values) -> list[int]:
    if type(values) is not list or any(type(v) is not int for v in values):
        raise WireError("a shape or stride that is not a list of ints")
    return values


# ---- framing --------------------------------------------------------------------------------------


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module, name):
        raise WireError(f"a message asked for {module}.{name}: only plain data is accepted")


def pack(message) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def unpack(data: bytes):
    try:
        return _NoGlobals(io.BytesIO(data)).load()
    except WireError:
        raise
    except Exception as error:  # noqa: BLE001 - any malformed message is a wire error, never a crash
        raise WireError(f"a message that does not decode ({type(error).__name__})") from None


def storage_key(t: torch.Tensor) -> tuple:
    """What a tensor's storage is in this process (two tensors with the same key share their memory)."""
    storage = t.untyped_storage()
    return str(t.device), storage.data_ptr(), storage.nbytes()


def send(sock, message, fds: tuple = ()) -> None:
    data = pack(message)
    header = struct.pack("<Q", len(data))
    if fds:  # the descriptors travel with the header's bytes
        sent = socket.send_fds(sock, [header], list(fds))
        header = header[sent:]
    sock.sendall(header + data)


def receive(sock, deadline: float | None = None):
    """The next message and its size in bytes; `Timeout` once `deadline` (time.monotonic()) passes, `Closed`
    on end of file."""
    message, size, _ = receive_with_fds(sock, deadline, 0)
    return message, size


def receive_with_fds(sock, deadline: float | None = None, most: int = 1):
    """The next message, its size and the descriptors (at most `most`) sent with it."""
    header, fds = b"", []
    while len(header) < 8:
        _wait(sock, deadline)
        if most:
            chunk, got, _, _ = socket.recv_fds(sock, 8 - len(header), most)
            fds.extend(got)
        else:
            chunk = sock.recv(8 - len(header))
        if not chunk:
            raise Closed
        header += chunk
    (size,) = struct.unpack("<Q", header)
    if size > MAX_MESSAGE:
        raise WireError(f"a message of {size} bytes (at most {MAX_MESSAGE})")
    return unpack(_read(sock, size, deadline)), size, fds


# ---- inputs in shared memory: a write to them is seen by the sender -------------------------------


class SharedStorages:
    """The storages of a message in one memory file that both sides map: the receiver's tensors are views of
    it, and the sender, which keeps its own copy of the bytes, finds afterwards which storages were written
    (from its side of the file, whatever the receiver says)."""

    def __init__(self, storages: list[bytes]):
        self.storages = storages
        self.fd = os.memfd_create("kvlab-inputs", os.MFD_CLOEXEC)
        os.write(self.fd, b"".join(storages)) if storages else None

    def layout(self) -> tuple:
        return ("M", [len(b) for b in self.storages])

    def written(self) -> list[int]:
        """The storages whose bytes are no longer those sent."""
        found, offset = [], 0
        for index, data in enumerate(self.storages):
            if data and os.pread(self.fd, len(data), offset) != data:
                found.append(index)
            offset += len(data)
        return found

    def close(self) -> None:
        os.close(self.fd)


def shared_views(layout, fds: list[int]) -> tuple[list[memoryview], int]:
    """The receiver's side of `SharedStorages`: a view of each storage (writable, mapped from the file) and
    their total size."""
    if type(layout) is not tuple or len(layout) != 2 or layout[0] != "M" or len(fds) != 1:
        raise WireError("shared storages without their memory")
    lengths = _ints(layout[1])
    total = sum(lengths)
    if any(n < 0 for n in lengths) or os.fstat(fds[0]).st_size != total:
        raise WireError("shared storages that do not fit their memory")
    memory = mmap.mmap(fds[0], total) if total else b""
    os.close(fds[0])
    whole, views, offset = memoryview(memory), [], 0
    for n in lengths:
        views.append(whole[offset:offset + n] if total else memoryview(b""))
        offset += n
    return views, total


def _wait(sock, deadline: float | None) -> None:
    if deadline is not None:
        wait = deadline - time.monotonic()
        if wait <= 0 or not select.select([sock], [], [], wait)[0]:
            raise Timeout


def parts(message, size: int) -> tuple:
    """A received message's value tree, its storages and its size; a `WireError` if it is not such a pair."""
    if type(message) is not tuple or len(message) != 2:
        raise WireError("a message that is not a (value, storages) pair")
    return message[0], message[1], size


def _read(sock, size: int, deadline: float | None) -> bytes:
    chunks, left = [], size
    while left:
        _wait(sock, deadline)
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise Closed
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
