"""Checks for P02 · store_kvcache (mine/p02_store_kvcache.py).

Oracles: the page's toy (toy_cases/p02_store_kvcache.json), and for random cases the expected cache
built here row by row (`slot_mapping[t] = s` puts token t's keys in row s). Every cache starts filled
with NaN and sits inside a larger NaN buffer, with guard rows before and after it; the buffer must end
equal to the expected one bit for bit, so a write to slot -1, to the wrong row or past the cache's end
shows, and so does any byte changed elsewhere. Each check runs both versions, the PyTorch one and the
Triton kernel: compiled on a GPU, in Triton's interpreter on a CPU (small sizes there: it is slow).
"""

import pytest
import torch

from checks.harness.compare import Mismatch
from checks.harness.guard import LearnerError, Writes
from checks.harness.interpreter import DEVICE, verified_on  # noqa: F401 - the report reads verified_on
from checks.harness.toys import load_toy

pytestmark = pytest.mark.p02

TOLERANCE_KIND = "exact"  # a copy: every bit of every written row, NaN included
# What `./check.sh grade` awards: a check's points, shared out over its cases (a module is worth the sum,
# 20). An optional oracle's check (absent on most machines) is worth nothing.
POINTS = {
    "test_toy": 3,
    "test_exactly_the_mapped_slots": 6,
    "test_slices_of_a_fused_qkv": 4,
    "test_padding_rows_store_nothing": 2,
    "test_int64_slot_mapping": 2,
    "test_launcher_refuses_layouts_the_kernel_cannot_address": 3,
}
CONTRACTS = {
    "store_kvcache": lambda key, value, k_cache, v_cache, slot_mapping: Writes(k_cache, v_cache),
    "store_kvcache_torch": lambda key, value, k_cache, v_cache, slot_mapping: Writes(k_cache, v_cache),
}
VERSIONS = {"torch": "store_kvcache_torch", "triton": "store_kvcache"}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# ROW = 16, 24 (not a power of two), 6, and Qwen3-0.6B's 8 KV heads of head_dim 128 (ROW 1024). The block size
# stays 3-5 even there: the kernel addresses flat slots (block_size never enters it), and the guard rows after a
# cache (slots x block_size of them, where a slot taken for a block id writes) would be 270 MB at 256.
LAYOUTS = {"KVH2-D8": (2, 8), "KVH3-D8": (3, 8), "KVH1-D6": (1, 6), "Qwen3-KVH8-D128": (8, 128)}
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
TOY = load_toy("p02_store_kvcache")


class Caches:
    """A NaN-filled k_cache and v_cache `[num_blocks, block_size, KVH, D]`, each a contiguous view into
    a NaN buffer `[rows, KVH*D]` with `block_size` guard rows before it (slot -1 lands there) and
    `slots * block_size` after it (a slot taken for a block id lands there)."""

    def __init__(self, num_blocks: int, block_size: int, kvh: int, d: int, dtype: torch.dtype):
        self.slots, self.before = num_blocks * block_size, block_size
        rows = self.before + self.slots + self.slots * block_size
        self.buffers = {name: torch.full((rows, kvh * d), float("nan"), dtype=dtype, device=DEVICE)
                        for name in ("k_cache", "v_cache")}
        self.views = {name: b[self.before : self.before + self.slots].view(num_blocks, block_size, kvh, d)
                      for name, b in self.buffers.items()}

    def expected(self, rows: dict[int, torch.Tensor], name: str) -> torch.Tensor:
        buffer = torch.full_like(self.buffers[name], float("nan"))
        for slot, row in rows.items():
            buffer[self.before + slot] = row
        return buffer

    def where(self, row: int) -> str:
        slot = row - self.before
        if slot < 0:
            return f"row {slot} before the cache"
        if slot >= self.slots:
            return f"row {slot - self.slots} past the cache's end"
        return f"slot {slot}"


def describe_row(row: torch.Tensor, named_rows: dict[str, torch.Tensor]) -> str:
    if torch.isnan(row).all():
        return "NaN (untouched)"
    for name, candidate in named_rows.items():
        if torch.equal(row, candidate):
            return name
    return "other values"


def expect_buffer(caches: Caches, name: str, expected: torch.Tensor, named_rows: dict[str, torch.Tensor]) -> None:
    got = caches.buffers[name]
    bits = BITS[got.dtype]
    differ = (got.view(bits) != expected.view(bits)).any(dim=1)  # [rows]: any bit of the row changed
    if not differ.any():
        return
    first = int(differ.nonzero()[0])
    raise Mismatch(
        f"{name}: {int(differ.sum())} of {len(differ)} rows differ (cache and guard rows); first: "
        f"{caches.where(first)} holds {describe_row(got[first], named_rows)}, expected "
        f"{describe_row(expected[first], named_rows)}"
    )


def store_and_check(impl, version: str, key, value, slot_mapping, caches: Caches) -> None:
    """Run one version on (key, value, slot_mapping) and compare both buffers with the expected ones."""
    getattr(impl, VERSIONS[version])(key, value, caches.views["k_cache"], caches.views["v_cache"], slot_mapping)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    N = key.shape[0]
    keys, values = key.reshape(N, -1), value.reshape(N, -1)  # [N, ROW]
    named = {f"token {t}'s keys": keys[t] for t in range(N)} | {f"token {t}'s values": values[t] for t in range(N)}
    mapped = [(t, int(s)) for t, s in enumerate(slot_mapping.tolist()) if s != -1]
    expect_buffer(caches, "k_cache", caches.expected({s: keys[t] for t, s in mapped}, "k_cache"), named)
    expect_buffer(caches, "v_cache", caches.expected({s: values[t] for t, s in mapped}, "v_cache"), named)


def random_slots(gen, N: int, slots: int, skipped: int) -> torch.Tensor:
    """Distinct slots in random order for N - skipped tokens, -1 for `skipped` random tokens."""
    mapping = torch.randperm(slots, generator=gen)[:N]
    mapping[torch.randperm(N, generator=gen)[:skipped]] = -1
    return mapping.to(torch.int32).to(DEVICE)


def random_case(gen, kvh: int, d: int, dtype: torch.dtype):
    """N in 5..11 tokens, 2-4 blocks of 3-5 slots, 1-2 tokens skipped."""
    N = int(torch.randint(5, 12, (), generator=gen))
    block_size = int(torch.randint(3, 6, (), generator=gen))
    num_blocks = max(int(torch.randint(2, 5, (), generator=gen)), -(-N // block_size))
    key = torch.randn(N, kvh, d, generator=gen).to(dtype).to(DEVICE)
    value = torch.randn(N, kvh, d, generator=gen).to(dtype).to(DEVICE)
    skipped = int(torch.randint(1, 3, (), generator=gen))
    return key, value, random_slots(gen, N, num_blocks * block_size, skipped), Caches(num_blocks, block_size, kvh,
                                                                                          d, dtype)


# ---- the toy ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_toy(impl, version):
    """the page's toy: slot = [2, 0, -1, 1], values tagged by token number; slot 3 stays untouched"""
    t = TOY
    key = torch.tensor(t["key"], dtype=torch.float32, device=DEVICE)
    value = torch.tensor(t["value"], dtype=torch.float32, device=DEVICE)
    caches = Caches(t["num_blocks"], t["block_size"], t["KVH"], t["D"], torch.float32)
    slot_mapping = torch.tensor(t["slot_mapping"], dtype=torch.int32, device=DEVICE)
    getattr(impl, VERSIONS[version])(key, value, caches.views["k_cache"], caches.views["v_cache"], slot_mapping)
    named = {f"token {i}'s keys": row for i, row in enumerate(key.reshape(len(key), -1))}
    named |= {f"token {i}'s values": row for i, row in enumerate(value.reshape(len(value), -1))}
    for name in ("k_cache", "v_cache"):
        rows = {s: torch.tensor(r, device=DEVICE) for s, r in enumerate(t[f"{name}_rows"]) if r is not None}
        expect_buffer(caches, name, caches.expected(rows, name), named)


# ---- random cases ------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("version", VERSIONS)
def test_exactly_the_mapped_slots(impl, gen, version, dtype, layout):
    """a NaN-filled cache ends with exactly the mapped slots written; -1 tokens and every other byte untouched"""
    key, value, slot_mapping, caches = random_case(gen, *LAYOUTS[layout], dtype)
    store_and_check(impl, version, key, value, slot_mapping, caches)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("version", VERSIONS)
def test_slices_of_a_fused_qkv(impl, gen, version, dtype):
    """K and V that are non-contiguous slices of one fused qkv output are read with their real token stride"""
    H, KVH, D = 4, 2, 6  # qkv row: H*D queries, then KVH*D keys, then KVH*D values
    N = int(torch.randint(5, 10, (), generator=gen))
    qkv = torch.randn(N, (H + 2 * KVH) * D, generator=gen).to(dtype).to(DEVICE)
    key = qkv[:, H * D : (H + KVH) * D].view(N, KVH, D)  # stride(0) = (H + 2*KVH) * D, not KVH*D
    value = qkv[:, (H + KVH) * D :].view(N, KVH, D)
    caches = Caches(3, 4, KVH, D, dtype)
    store_and_check(impl, version, key, value, random_slots(gen, N, caches.slots, 1), caches)


@pytest.mark.parametrize("version", VERSIONS)
def test_padding_rows_store_nothing(impl, gen, version):
    """a batch of padding rows only (every slot -1, as in a padded CUDA-graph batch) leaves the cache as it was"""
    key, value, _, caches = random_case(gen, 2, 8, torch.float32)
    slot_mapping = torch.full((key.shape[0],), -1, dtype=torch.int32, device=DEVICE)
    store_and_check(impl, version, key, value, slot_mapping, caches)


@pytest.mark.parametrize("version", VERSIONS)
def test_int64_slot_mapping(impl, gen, version):
    """an int64 slot_mapping works like an int32 one"""
    key, value, slot_mapping, caches = random_case(gen, 3, 8, torch.float32)
    store_and_check(impl, version, key, value, slot_mapping.long(), caches)


BAD_LAYOUTS = ["heads-not-packed", "cache-not-contiguous", "one-slot-missing"]


@pytest.mark.parametrize("layout", BAD_LAYOUTS)
def test_launcher_refuses_layouts_the_kernel_cannot_address(impl, gen, layout):
    """the launcher asserts its preconditions: packed heads, a contiguous cache, one slot per token"""
    key, value, slot_mapping, caches = random_case(gen, 2, 8, torch.float32)
    k_cache, v_cache = caches.views["k_cache"], caches.views["v_cache"]
    N, KVH, D = key.shape
    if layout == "heads-not-packed":  # each head's D values followed by D others: stride(1) = 2*D
        key = torch.randn(N, KVH, 2 * D, generator=gen).to(DEVICE)[..., :D]
        value = torch.randn(N, KVH, 2 * D, generator=gen).to(DEVICE)[..., :D]
    elif layout == "cache-not-contiguous":  # the blocks of a bigger cache, every other slot
        num_blocks, block_size = k_cache.shape[:2]
        k_cache = torch.full((num_blocks, 2 * block_size, KVH, D), float("nan"), device=DEVICE)[:, ::2]
        v_cache = torch.full((num_blocks, 2 * block_size, KVH, D), float("nan"), device=DEVICE)[:, ::2]
    else:
        slot_mapping = slot_mapping[:-1]
    try:
        impl.store_kvcache(key, value, k_cache, v_cache, slot_mapping)
    except LearnerError as error:
        if "raised AssertionError" in str(error) or "raised ValueError" in str(error):
            return
        raise
    raise Mismatch(f"store_kvcache accepted {layout.replace('-', ' ')} instead of failing an assert: the kernel "
                   f"would read or write the wrong elements")
