"""Checks for P04 · paged attention (mine/p04_paged_decode.py).

Oracles: p03's row in a paged cache (toy_cases/p04_paged_decode.json); attention by its definition in
float64 on each sequence's own keys and values, as they were before they were scattered into blocks
(checks/harness/attention_oracles.py); torch SDPA on keys gathered back through the block table; and
flash-attn's `flash_attn_with_kvcache` where it is installed. Every cache is poisoned: each slot no
sequence owns (spare blocks, the tail of a sequence's last block) holds random garbage (NaN in the
check made for it), and block tables are padded with -1, so a read of anything a sequence does not own
changes the output.
"""

import pytest
import torch

from checks.harness.attention_oracles import flash_attn_or_skip, gather_paged, naive_attention, sdpa_attention
from checks.harness.compare import expect_close, tolerance
from checks.harness.guard import Returns
from checks.harness.interpreter import DEVICE, INTERPRETED, verified_on  # noqa: F401 - verified_on: the report
from checks.harness.toys import load_toy

pytestmark = pytest.mark.p04

TOLERANCE_KIND = "flash"
# What `./check.sh grade` awards: a check's points, shared out over its cases (a module is worth the sum,
# 28). An optional oracle's check (absent on most machines) is worth nothing.
POINTS = {
    "test_toy_paged_row": 2,
    "test_decode_matches_naive": 5,
    "test_block_size_and_order_do_not_matter": 3,
    "test_unused_slots_never_leak": 3,
    "test_split_k_matches": 3,
    "test_long_context_small_batch": 2,
    "test_padding_row_gives_zeros": 2,
    "test_prefill_matches_naive": 4,
    "test_prefill_split_k": 2,
    "test_matches_sdpa_on_gathered_keys": 2,
    "test_matches_flash_attn_with_kvcache": 0,
}
CONTRACTS = {
    "paged_decode": lambda q, k_cache, v_cache, block_table, cache_seqlens, softmax_scale=None, num_splits=None: (
        Returns.like(q, "[B, H, D]")
    ),
    "paged_prefill": lambda q, k_cache, v_cache, block_table, cu_seqlens_q, cache_seqlens, max_seqlen_q,
    softmax_scale=None, num_splits=None: Returns.like(q, "[total_q, H, D]"),
}
TOY = load_toy("p04_paged_decode")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# The longest context in a batch: the CPU interpreter runs the kernel program by program in Python.
LONG = 200 if INTERPRETED else 4000


class PagedBatch:
    """Sequences' keys and values scattered into a paged cache `[num_blocks, block_size, KVH, D]`.

    Logical block i of sequence b lives in physical block `block_table[b, i]`; blocks are handed out in
    a random order (or in order), a few spare blocks belong to nobody, every unowned slot holds garbage
    (`poison="nan"`: NaN), and each block table row is padded with -1 past its last block (one column
    more than the longest needs).
    """

    def __init__(self, gen, dtype, KVH, D, lengths, block_size, shuffle=True, keys=None, values=None,
                 poison=None):
        self.lengths = list(lengths)
        needed = [-(-n // block_size) for n in lengths]
        num_blocks = sum(needed) + 3
        order = torch.randperm(num_blocks, generator=gen) if shuffle else torch.arange(num_blocks)
        self.keys = keys or [torch.randn(n, KVH, D, generator=gen).to(dtype) for n in lengths]  # [S, KVH, D] each
        self.values = values or [torch.randn(n, KVH, D, generator=gen).to(dtype) for n in lengths]
        shape = (num_blocks, block_size, KVH, D)
        if poison == "nan":
            k_cache = torch.full(shape, float("nan"), dtype=dtype)
            v_cache = k_cache.clone()
        else:  # garbage no correct output is made of, but finite: a mistake's output stays comparable
            k_cache = (4 * torch.randn(shape, generator=gen)).to(dtype)
            v_cache = (4 * torch.randn(shape, generator=gen)).to(dtype)
        table = torch.full((len(lengths), max(needed, default=0) + 1), -1, dtype=torch.int32)
        taken = 0
        for b, n in enumerate(lengths):
            for i in range(needed[b]):
                block, start = int(order[taken]), i * block_size
                taken += 1
                table[b, i] = block
                stop = min(n, start + block_size)
                k_cache[block, : stop - start] = self.keys[b][start:stop]
                v_cache[block, : stop - start] = self.values[b][start:stop]
        self.k_cache, self.v_cache = k_cache.to(DEVICE), v_cache.to(DEVICE)
        self.block_table = table.to(DEVICE)
        self.cache_seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)

    def expected(self, q, cu_seqlens_q, causal):
        """Attention by its definition on each sequence's own keys and values (not read through the table)."""
        cq = cu_seqlens_q.tolist()
        return torch.cat([naive_attention(q[cq[b] : cq[b + 1]], self.keys[b].to(DEVICE), self.values[b].to(DEVICE),
                                          causal=causal)[0] for b in range(len(self.lengths))])


def decode_queries(gen, dtype, B, H, D):
    return torch.randn(B, H, D, generator=gen).to(dtype).to(DEVICE)


def one_query_each(B):
    return torch.arange(B + 1, dtype=torch.int32, device=DEVICE)


def very_different_lengths(gen, B):
    """One single-token context, one short one, and the rest long, in a shuffled order."""
    lengths = [1, int(torch.randint(2, 60, (), generator=gen))]
    lengths += [int(n) for n in torch.randint(LONG // 3, LONG, (B - 2,), generator=gen)]
    return [lengths[i] for i in torch.randperm(B, generator=gen)]


def test_toy_paged_row(impl):
    """p03's row in blocks of 2 (block table [2, 0, -1], block 1 all NaN): output 36.88, split or not"""
    D, scores = TOY["head_dim"], torch.tensor(TOY["scores"])
    keys, values = torch.zeros(4, 1, D), torch.zeros(4, 1, D)
    keys[:, 0, 0] = TOY["key_scale"] * scores
    values[:, 0, 0] = torch.tensor(TOY["values"])
    k_cache = torch.full((TOY["num_blocks"], TOY["block_size"], 1, D), float("nan"))
    v_cache = k_cache.clone()
    for step in TOY["walk"]:
        k_cache[step["block"], step["offset"]] = keys[step["key"]]
        v_cache[step["block"], step["offset"]] = values[step["key"]]
    q = torch.zeros(1, 1, D)
    q[0, 0, 0] = 1.0
    q, k_cache, v_cache = (x.half().to(DEVICE) for x in (q, k_cache, v_cache))
    table = torch.tensor(TOY["block_table"], dtype=torch.int32, device=DEVICE)
    seqlens = torch.tensor(TOY["cache_seqlens"], dtype=torch.int32, device=DEVICE)
    expected = torch.zeros(1, 1, D)
    expected[0, 0, 0] = TOY["output0"]
    for splits in (1, 2):
        out = impl.paged_decode(q, k_cache, v_cache, table, seqlens, num_splits=splits)
        expect_close(out, expected, tolerance("flash", torch.float16), f"num_splits={splits}: output (dim 0 only)")


DECODE_CASES = {  # dtype, H, KVH, D, block_size (the order check adds blocks of 256); the last is Qwen3-0.6B's
    "fp16-H4-KVH2-D64-bs16": ("fp16", 4, 2, 64, 16),
    "bf16-H4-KVH1-D128-bs64": ("bf16", 4, 1, 128, 64),
    "bf16-Qwen3-H16-KVH8-D128-bs256": ("bf16", 16, 8, 128, 256),
}


def decode_lengths(gen, case: str) -> list[int]:
    """Four sequences of very different lengths; for Qwen3's 8 KV heads (8 programs a sequence, which the CPU
    interpreter runs one by one in Python) one sequence of a few dozen keys there."""
    if "Qwen3" in case and INTERPRETED:
        return [int(torch.randint(LONG // 8, LONG // 4, (), generator=gen))]
    return very_different_lengths(gen, 4)


@pytest.mark.parametrize("case", DECODE_CASES)
def test_decode_matches_naive(impl, gen, case):
    """sequences of very different lengths (1 to a few hundred keys), no split: the definition's output"""
    dtype, H, KVH, D, block_size = DECODE_CASES[case]
    lengths = decode_lengths(gen, case)
    B = len(lengths)
    batch = PagedBatch(gen, DTYPES[dtype], KVH, D, lengths, block_size)
    q = decode_queries(gen, DTYPES[dtype], B, H, D)
    out = impl.paged_decode(q, batch.k_cache, batch.v_cache, batch.block_table, batch.cache_seqlens, num_splits=1)
    expect_close(out, batch.expected(q, one_query_each(B), causal=False), tolerance("flash", DTYPES[dtype]),
                 f"output (lengths {lengths})")


BLOCK_ORDERS = ((16, False), (64, True), (256, True))  # (block_size, shuffled): the same keys in each


def test_block_size_and_order_do_not_matter(impl, gen):
    """the same keys in blocks of 16 (in order), 64 (shuffled) and 256 (shuffled): the same output each time"""
    lengths = very_different_lengths(gen, 3)
    first = PagedBatch(gen, torch.float16, 2, 64, lengths, *BLOCK_ORDERS[0])
    q = decode_queries(gen, torch.float16, 3, 4, 64)
    expected = first.expected(q, one_query_each(3), causal=False)
    tol = tolerance("flash", torch.float16)
    for block_size, shuffle in BLOCK_ORDERS:
        batch = PagedBatch(gen, torch.float16, 2, 64, lengths, block_size, shuffle, first.keys, first.values)
        out = impl.paged_decode(q, batch.k_cache, batch.v_cache, batch.block_table, batch.cache_seqlens, num_splits=1)
        order = "shuffled" if shuffle else "in order"
        expect_close(out, expected, tol, f"blocks of {block_size}, {order}: output (lengths {lengths})")


def test_unused_slots_never_leak(impl, gen):
    """sequences that end 1 slot into a block, on exact block boundaries, and with -1 table padding: the
    NaN in every unowned slot never reaches the output"""
    lengths = [17, 32, 1, 49]  # blocks of 16: 1 slot into the 2nd, exactly 2 blocks, 1 slot, 1 slot into the 4th
    batch = PagedBatch(gen, torch.bfloat16, 2, 64, lengths, 16, poison="nan")
    q = decode_queries(gen, torch.bfloat16, 4, 4, 64)
    out = impl.paged_decode(q, batch.k_cache, batch.v_cache, batch.block_table, batch.cache_seqlens, num_splits=1)
    expect_close(out, batch.expected(q, one_query_each(4), causal=False), tolerance("flash", torch.bfloat16),
                 f"output (lengths {lengths})")


def test_split_k_matches(impl, gen):
    """split-K: each sequence's keys in 3 ranges, merged by their log-sum-exps, give the same output"""
    lengths = [int(n) for n in torch.randint(LONG // 2, LONG, (2,), generator=gen)]
    batch = PagedBatch(gen, torch.float16, 2, 64, lengths, 16)
    q = decode_queries(gen, torch.float16, 2, 4, 64)
    out = impl.paged_decode(q, batch.k_cache, batch.v_cache, batch.block_table, batch.cache_seqlens, num_splits=3)
    expect_close(out, batch.expected(q, one_query_each(2), causal=False), tolerance("flash", torch.float16),
                 f"num_splits=3: output (lengths {lengths})")


def test_long_context_small_batch(impl, gen):
    """one sequence with a long context and the default num_splits (the split path, on a GPU or the CPU)"""
    lengths = [2 * LONG + int(torch.randint(0, 50, (), generator=gen))]
    batch = PagedBatch(gen, torch.bfloat16, 2, 64, lengths, 32)
    q = decode_queries(gen, torch.bfloat16, 1, 4, 64)
    out = impl.paged_decode(q, batch.k_cache, batch.v_cache, batch.block_table, batch.cache_seqlens)
    expect_close(out, batch.expected(q, one_query_each(1), causal=False), tolerance("flash", torch.bfloat16),
                 f"output (length {lengths[0]})")


def test_padding_row_gives_zeros(impl, gen):
    """a padding row (cache_seqlens 0, block table all -1, as a CUDA-graph batch pads) outputs zeros"""
    lengths = [0, int(torch.randint(20, 90, (), generator=gen))]
    batch = PagedBatch(gen, torch.float16, 2, 64, lengths, 16)
    q = decode_queries(gen, torch.float16, 2, 4, 64)
    for splits in (1, 3):
        out = impl.paged_decode(q, batch.k_cache, batch.v_cache, batch.block_table, batch.cache_seqlens,
                                num_splits=splits)
        expect_close(out, batch.expected(q, one_query_each(2), causal=False), tolerance("flash", torch.float16),
                     f"num_splits={splits}: output (row 0 is padding: zeros)")


PREFILL_CASES = {"bf16-H4-KVH2-D128-bs16": ("bf16", 4, 2, 128, 16)}  # dtype, H, KVH, D, block_size


def prefix_hits(gen, most_new: int = LONG // 5):
    """Query and key lengths for three sequences: a cached prefix plus new tokens (more keys than queries),
    no prefix at all, and a single new token after a prefix."""
    new = [int(n) for n in torch.randint(2, most_new, (2,), generator=gen)] + [1]
    prefix = [int(n) for n in torch.randint(1, LONG // 2, (3,), generator=gen)]
    prefix[1] = 0
    return new, [n + p for n, p in zip(new, prefix)]


@pytest.mark.parametrize("case", PREFILL_CASES)
def test_prefill_matches_naive(impl, gen, case):
    """prefill through the block table after a prefix-cache hit: causal, aligned bottom-right"""
    dtype, H, KVH, D, block_size = PREFILL_CASES[case]
    q_lengths, k_lengths = prefix_hits(gen)
    batch = PagedBatch(gen, DTYPES[dtype], KVH, D, k_lengths, block_size)
    q = torch.randn(sum(q_lengths), H, D, generator=gen).to(DTYPES[dtype]).to(DEVICE)
    cu_q = torch.tensor([0] + torch.tensor(q_lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    out = impl.paged_prefill(q, batch.k_cache, batch.v_cache, batch.block_table, cu_q, batch.cache_seqlens,
                             max(q_lengths), num_splits=1)
    expect_close(out, batch.expected(q, cu_q, causal=True), tolerance("flash", DTYPES[dtype]),
                 f"output (q lengths {q_lengths}, k {k_lengths})")


def test_prefill_split_k(impl, gen):
    """prefill after a prefix-cache hit with num_splits=3 gives the same output"""
    # fewer new tokens than the other prefill checks: the merge runs one program per query row and head, and
    # what split-k changes is the keys (up to LONG // 2 cached ones), not the rows
    q_lengths, k_lengths = prefix_hits(gen, LONG // 20)
    batch = PagedBatch(gen, torch.float16, 1, 64, k_lengths, 32)
    q = torch.randn(sum(q_lengths), 4, 64, generator=gen).half().to(DEVICE)
    cu_q = torch.tensor([0] + torch.tensor(q_lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    out = impl.paged_prefill(q, batch.k_cache, batch.v_cache, batch.block_table, cu_q, batch.cache_seqlens,
                             max(q_lengths), num_splits=3)
    expect_close(out, batch.expected(q, cu_q, causal=True), tolerance("flash", torch.float16),
                 f"output (q lengths {q_lengths}, k {k_lengths})")


def test_matches_sdpa_on_gathered_keys(impl, gen):
    """decode against torch SDPA on each sequence's keys gathered back out of the cache (gather, then attend)"""
    lengths = very_different_lengths(gen, 3)
    batch = PagedBatch(gen, torch.bfloat16, 2, 64, lengths, 32)
    q = decode_queries(gen, torch.bfloat16, 3, 4, 64)
    out = impl.paged_decode(q, batch.k_cache, batch.v_cache, batch.block_table, batch.cache_seqlens)
    expected = torch.cat([sdpa_attention(q[b : b + 1], gather_paged(batch.k_cache, batch.block_table[b], n),
                                         gather_paged(batch.v_cache, batch.block_table[b], n), causal=False)
                          for b, n in enumerate(lengths)])
    expect_close(out, expected, tolerance("flash", torch.bfloat16), f"output vs SDPA (lengths {lengths})")


def test_matches_flash_attn_with_kvcache(impl, gen):
    """decode against flash-attn's flash_attn_with_kvcache on the same paged cache (blocks of 256)"""
    lengths = very_different_lengths(gen, 4)
    batch = PagedBatch(gen, torch.bfloat16, 2, 128, lengths, 256)
    q = decode_queries(gen, torch.bfloat16, 4, 8, 128)
    out = impl.paged_decode(q, batch.k_cache, batch.v_cache, batch.block_table, batch.cache_seqlens)
    flash_attn = flash_attn_or_skip()  # after your call: an unwritten stub still reads "not started"
    table = batch.block_table.clamp_min(0)  # flash-attn may read a whole table row; -1 is not a block it can read
    expected = flash_attn.flash_attn_with_kvcache(q[:, None], batch.k_cache, batch.v_cache,
                                                  cache_seqlens=batch.cache_seqlens, block_table=table)[:, 0]
    expect_close(out, expected, tolerance("flash", torch.bfloat16), f"output vs flash-attn (lengths {lengths})")
