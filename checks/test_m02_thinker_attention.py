"""Checks for M02 · thinker attention: QK-norm + GQA + KV cache (mine/m02_thinker_attention.py).

Oracles: the M02 page's toy (toy_cases/m02_thinker_attention.json) and Hugging Face's
`Qwen3Attention` (eager) over the whole sequence, built from tiny random configs with H != KVH.
Every way of feeding the tokens (one prefill, chunks, prefill + decode) must give HF's rows, and the
cache must hold HF's rotated keys and raw values, [t, KVH, D] per call.
"""

from dataclasses import dataclass
from functools import cache

import pytest
import torch

from checks.harness.compare import Mismatch, expect_close, tolerance
from checks.harness.guard import LearnerError, Returns
from checks.harness.oracles import AttentionWeights, hf_attention, hf_cache_contents, rope_tables
from checks.harness.toys import load_toy

pytestmark = pytest.mark.m02

TOLERANCE_KIND = "attention"
# What `./check.sh grade` awards: a check's points, shared out over its cases (a module is worth the sum,
# 30). An optional oracle's check (absent on most machines) is worth nothing.
POINTS = {
    "test_toy_whole_prefill": 2,
    "test_toy_two_calls": 2,
    "test_prefill_matches_hf": 6,
    "test_prefill_into_empty_cache": 4,
    "test_chunked_prefill_matches_hf": 6,
    "test_prefill_then_decode_matches_hf": 6,
    "test_chunked_equals_whole_exactly": 4,
}
CONTRACTS = {
    "attention_forward": lambda w, x, cos, sin, cache=None: Returns.like(
        x, "[T, hidden]", shape=(x.shape[0], w.o_proj.shape[0])
    ),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# (H, KVH, D, hidden): every layout has H != KVH, and hidden != H*D so a missing o_proj shows.
LAYOUTS = {
    "H4-KVH2-D16": (4, 2, 16, 48),
    "H8-KVH2-D8": (8, 2, 8, 40),
    "H6-KVH3-D16": (6, 3, 16, 40),
    "H4-KVH1-D32": (4, 1, 32, 64),
}
# Qwen3-0.6B's own attention: 16 heads on 8 KV heads, head_dim 128, hidden 1024 (only the token counts stay
# small). Its fp32 weights are 24 MB, sent with every call: it gets two calls (a prefill into an empty cache,
# then a decode step: the chunked check's "10+1"), in fp32, where the tolerance is tight.
QWEN3 = "Qwen3-H16-KVH8-D128-hidden1024"
SHAPES = {**LAYOUTS, QWEN3: (16, 8, 128, 1024)}
TOY = load_toy("m02_thinker_attention")


@dataclass(frozen=True)
class Case:
    w: AttentionWeights
    x: torch.Tensor  # [S, hidden]
    cos: torch.Tensor  # [S, D] for positions 0 .. S-1
    sin: torch.Tensor
    expected: torch.Tensor  # [S, hidden]: HF over the whole sequence, in float64 on these very inputs
    keys: torch.Tensor  # [S, KVH, D]: what the cache must hold (float64, like expected)
    values: torch.Tensor

    def rows(self, start: int, stop: int):
        """Fresh copies of the inputs for tokens start .. stop-1 (a learner may not change them)."""
        return self.w.clone(), self.x[start:stop].clone(), self.cos[start:stop].clone(), self.sin[start:stop].clone()


@cache
def hf_case(seed: int, layout: str, dtype: torch.dtype, S: int) -> Case:
    """Random weights and tokens from `seed`, and HF's answers for them (computed once per case).

    HF runs in float64 on exactly the (rounded) inputs the learner gets, so the expected values carry
    no rounding of their own; the tolerance is the room a correct `dtype` computation needs."""
    gen = torch.Generator().manual_seed(seed)
    H, KVH, D, hidden = SHAPES[layout]
    w = AttentionWeights.random(gen, hidden, H, KVH, D).to(dtype)
    x = torch.randn(S, hidden, generator=gen).to(dtype)
    cos, sin = rope_tables(D, torch.arange(S), dtype)
    exact = (w.to(torch.float64), x.double(), cos.double(), sin.double())
    keys, values = hf_cache_contents(*exact)
    return Case(w, x, cos, sin, hf_attention(*exact), keys, values)


def toy_case() -> Case:
    t = {name: torch.tensor(value) for name, value in TOY["weights"].items() if isinstance(value, list)}
    w = AttentionWeights(**t, **{k: TOY["weights"][k] for k in ("eps", "num_heads", "num_kv_heads", "head_dim")})
    expected = torch.tensor(TOY["whole_prefill"])
    x, cos, sin = (torch.tensor(TOY[k]) for k in ("x", "cos", "sin"))
    return Case(w, x, cos, sin, expected, keys=None, values=None)


def feed(impl, case: Case, sizes: list[int], dtype_tol) -> object:
    """Feed the tokens in calls of `sizes` tokens through one cache; check every call's rows and the
    cache after it. Returns the cache."""
    kv_cache = impl.KVCache()
    start = 0
    for n, size in enumerate(sizes, 1):
        out = impl.attention_forward(*case.rows(start, start + size), kv_cache)
        what = f"call {n} of {len(sizes)} (tokens {start}..{start + size - 1}, past {start}): output rows"
        expect_close(out, case.expected[start : start + size], dtype_tol, what)
        start += size
        expect_cache(kv_cache, case, start, n)
    return kv_cache


def expect_cache(kv_cache, case: Case, held: int, calls: int) -> None:
    try:
        length = len(kv_cache)
    except Exception as error:  # noqa: BLE001 - KVCache is the learner's file too
        raise LearnerError(f"len(cache) raised {type(error).__name__}: {error}") from None
    if length != held:
        raise Mismatch(f"after call {calls}: len(cache) is {length}, expected {held} tokens")
    KVH, D = case.w.num_kv_heads, case.w.head_dim
    for name in ("k", "v"):
        shapes = [list(chunk.shape) for chunk in getattr(kv_cache, name)]
        if len(shapes) != calls or any(s[1:] != [KVH, D] for s in shapes):
            raise Mismatch(f"after call {calls}: cache.{name} chunk shapes {shapes}, expected {calls} chunks of "
                           f"[t, KVH={KVH}, D={D}]")
    if case.keys is None:
        return
    tol = tolerance("attention", case.x.dtype)
    expect_close(torch.cat(kv_cache.k), case.keys[:held], tol, f"after call {calls}: cache keys (k_norm, then RoPE)")
    expect_close(torch.cat(kv_cache.v), case.values[:held], tol, f"after call {calls}: cache values (raw v)")


def attention_tol(dtype):
    return tolerance("attention", dtype)


def test_toy_whole_prefill(impl):
    """the book's toy: one prefill of 3 tokens gives the page's rows"""
    case = toy_case()
    out = impl.attention_forward(*case.rows(0, 3))
    expect_close(out, case.expected, tolerance("toy", torch.float32), "output (no cache)")


def test_toy_two_calls(impl):
    """the book's toy: calls of 2 then 1 tokens give the same rows, and the cache grows 2 -> 3"""
    sizes = TOY["split"]
    feed(impl, toy_case(), sizes, tolerance("toy", torch.float32))


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("layout", LAYOUTS)
def test_prefill_matches_hf(impl, seed, gen, layout, dtype):
    """one prefill without a cache matches HF Qwen3Attention (eager)"""
    S = int(torch.randint(5, 14, (), generator=gen))
    case = hf_case(seed, layout, dtype, S)
    out = impl.attention_forward(*case.rows(0, S))
    expect_close(out, case.expected, attention_tol(dtype), f"output ({S} tokens, no cache)")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_prefill_into_empty_cache(impl, seed, layout):
    """one prefill into an empty cache matches HF, and the cache holds HF's keys and values"""
    case = hf_case(seed, layout, torch.float32, 9)
    feed(impl, case, [9], attention_tol(torch.float32))


SPLITS = {"4+7": [4, 7], "1+10": [1, 10], "3+3+5": [3, 3, 5], "6+5": [6, 5], "2+2+2+2+3": [2, 2, 2, 2, 3]}
# (split, layout, dtype): every split on a small layout in both dtypes, and a prefill then a decode step at
# Qwen3's sizes in fp32
CHUNKINGS = [(split, list(LAYOUTS)[n % len(LAYOUTS)], dtype) for n, split in enumerate(SPLITS) for dtype in DTYPES]
CHUNKINGS.append(("10+1", QWEN3, "fp32"))
SIZES = {**SPLITS, "10+1": [10, 1]}


@pytest.mark.parametrize("split, layout, dtype", CHUNKINGS,
                         ids=[f"{s}-{d}" if layout in LAYOUTS else f"{s}-{layout}-{d}" for s, layout, d in CHUNKINGS])
def test_chunked_prefill_matches_hf(impl, seed, split, layout, dtype):
    """a prefill of 11 tokens in chunks gives HF's whole-prefill rows, with the cache right after each"""
    feed(impl, hf_case(seed, layout, DTYPES[dtype], 11), SIZES[split], attention_tol(DTYPES[dtype]))


PREFILL_THEN_DECODE = (5, 7)  # a prefill of 5 tokens, then 7 single-token decode steps: 12 tokens in all


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("layout", ["H8-KVH2-D8", "H6-KVH3-D16"])
def test_prefill_then_decode_matches_hf(impl, seed, layout, dtype):
    """a prefill of 5 then 7 single-token decode steps gives HF's whole-prefill rows"""
    prefill, steps = PREFILL_THEN_DECODE
    feed(impl, hf_case(seed, layout, dtype, prefill + steps), [prefill] + [1] * steps, attention_tol(dtype))


def test_chunked_equals_whole_exactly(impl, seed):
    """your own whole prefill, chunks (4 + 7) and prefill + decode (5 + 6 x 1) agree to fp32 precision"""
    case = hf_case(seed, "H4-KVH2-D16", torch.float32, 11)
    whole = impl.attention_forward(*case.rows(0, 11))
    tol = tolerance("elementwise", torch.float32)
    for sizes in ([4, 7], [5] + [1] * 6):
        # each path runs in a worker of its own: rows remembered from an earlier call (keyed by its inputs)
        # cannot stand in for the ones this path computes
        impl.fresh_worker()
        kv_cache, start, rows = impl.KVCache(), 0, []
        for size in sizes:
            rows.append(impl.attention_forward(*case.rows(start, start + size), kv_cache))
            start += size
        expect_close(torch.cat(rows), whole, tol, f"calls of {'+'.join(map(str, sizes))} vs your one prefill")
