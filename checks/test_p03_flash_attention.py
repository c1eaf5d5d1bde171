"""Checks for P03 · FlashAttention (mine/p03_flash_attention.py).

Oracles: the seed article's row (toy_cases/p03_flash_attention.json), attention by its definition in
float64 (checks/harness/attention_oracles.py) on exactly the inputs the learner's code gets, torch SDPA,
and flash-attn's `flash_attn_varlen_func` where it is installed. The PyTorch steps run on the CPU; the
Triton kernel runs compiled on a GPU, or in Triton's interpreter on the CPU with smaller sizes.
"""

import pytest
import torch

from checks.harness.attention_oracles import flash_attn_or_skip, naive_attention, naive_varlen, sdpa_attention
from checks.harness.compare import Mismatch, expect_close, tolerance
from checks.harness.guard import Returns
from checks.harness.interpreter import DEVICE, INTERPRETED, verified_on  # noqa: F401 - verified_on: the report
from checks.harness.toys import load_toy

pytestmark = pytest.mark.p03

TOLERANCE_KIND = "flash"


def _flash_contract(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                    causal=True, return_lse=False):
    out = Returns.like(q, "[total_q, H, D]")
    lse = Returns((q.shape[1], q.shape[0]), torch.float32, q.device, "lse [H, total_q] float32")
    return (out, lse) if return_lse else out


# What `./check.sh grade` awards: a check's points, shared out over its cases (a module is worth the sum,
# 32). An optional oracle's check (absent on most machines) is worth nothing.
POINTS = {
    "test_toy_steps": 2,
    "test_toy_output": 1,
    "test_online_softmax_matches_softmax": 2,
    "test_online_softmax_far_from_zero": 1,
    "test_step_state_matches_its_definition": 2,
    "test_tiled_matches_naive": 3,
    "test_tiled_scores_far_from_zero": 1,
    "test_tiled_never_builds_the_score_matrix": 2,
    "test_kernel_toy_row": 2,
    "test_varlen_matches_naive": 5,
    "test_varlen_lse": 3,
    "test_queries_that_see_no_key_get_zeros": 2,
    "test_scores_far_from_zero": 2,
    "test_fused_qkv_views": 2,
    "test_matches_sdpa": 2,
    "test_matches_flash_attn": 0,
}
CONTRACTS = {
    "online_softmax_step": lambda m, sum_exp, acc, scores, values: (
        Returns.like(m, "m [*rows]"), Returns.like(sum_exp, "sum_exp [*rows]"), Returns.like(acc, "acc [*rows, Dv]")
    ),
    "online_softmax": lambda scores, values, block_size: Returns.like(values, "[Dv]", shape=values.shape[-1:]),
    "tiled_attention": lambda q, k, v, block_q, block_k, softmax_scale=None, causal=True: (
        Returns.like(q, "out [Tq, H, D]"),
        Returns((q.shape[1], q.shape[0]), torch.float32, q.device, "lse [H, Tq] float32"),
    ),
    "flash_attn_varlen": _flash_contract,
}
TOY = load_toy("p03_flash_attention")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# Query lengths up to MAX_Q and cached prefixes (keys before the queries) up to MAX_PREFIX: the CPU
# interpreter runs a kernel program by program in Python, so it gets short sequences; a GPU gets long ones.
MAX_Q, MAX_PREFIX = (80, 40) if INTERPRETED else (1500, 700)


def fp32(*shape, gen):
    return torch.randn(*shape, generator=gen)


# ---- step 1: online softmax on one row ------------------------------------------------------------


def toy_row():
    return torch.tensor(TOY["scores"]), torch.tensor(TOY["values"])


def test_toy_steps(impl):
    """the seed's row, block by block: the state after [1, 3], then [2, 5] rescales it and adds its own"""
    tol = tolerance("toy", torch.float32)
    m, sum_exp, acc = torch.tensor(float("-inf")), torch.tensor(0.0), torch.zeros(1)
    for n, step in enumerate(TOY["steps"], 1):
        m, sum_exp, acc = impl.online_softmax_step(m, sum_exp, acc, torch.tensor(step["block"]),
                                                   torch.tensor(step["block_values"]))
        for name, got in (("m", m), ("sum_exp", sum_exp), ("acc", acc)):
            expect_close(got, torch.tensor(step[name]), tol, f"after block {n} ({step['block']}): {name}")


@pytest.mark.parametrize("block_size", [1, 2, 4], ids=lambda b: f"blocks of {b}")
def test_toy_output(impl, block_size):
    """the seed's row: any block size gives the one-shot softmax output 36.8806"""
    scores, values = toy_row()
    out = impl.online_softmax(scores, values, block_size)
    expect_close(out, torch.tensor(TOY["output"]), tolerance("toy", torch.float32), f"blocks of {block_size}")


def softmax_oracle(scores, values):
    return torch.softmax(scores.double(), dim=-1) @ values.double()


@pytest.mark.parametrize("block_size", [1, 3, 8], ids=lambda b: f"blocks of {b}")
def test_online_softmax_matches_softmax(impl, gen, block_size):
    """one random row in blocks (the last one partial) gives softmax(scores) @ values"""
    S = int(torch.randint(9, 40, (), generator=gen))
    scores, values = 3 * fp32(S, gen=gen), fp32(S, 5, gen=gen)
    out = impl.online_softmax(scores, values, block_size)
    expect_close(out, softmax_oracle(scores, values), tolerance("flash", torch.float32), f"{S} scores")


FAR_FROM_ZERO = 300.0  # scores shifted to about -300 or +300: exp of any of them underflows or overflows in fp32


@pytest.mark.parametrize("shift", [-FAR_FROM_ZERO, FAR_FROM_ZERO],
                         ids=[f"shift-{FAR_FROM_ZERO:g}", f"shift+{FAR_FROM_ZERO:g}"])
def test_online_softmax_far_from_zero(impl, gen, shift):
    """scores near -300 or +300 (exp of any of them overflows or underflows in fp32) give the same output"""
    S = int(torch.randint(9, 40, (), generator=gen))
    scores, values = 3 * fp32(S, gen=gen) + shift, fp32(S, 5, gen=gen)
    out = impl.online_softmax(scores, values, 4)
    expect_close(out, softmax_oracle(scores, values), tolerance("flash", torch.float32), f"{S} scores near {shift:+g}")


def test_step_state_matches_its_definition(impl, gen):
    """a batch of rows [2, 3] through three blocks: m, sum_exp and acc are the max, sum of exp(s - m) and
    sum of exp(s - m) * v over every score seen so far"""
    scores, values = 4 * fp32(2, 3, 17, gen=gen), fp32(2, 17, 6, gen=gen)  # rows [2, 3]; values per batch of rows
    m, sum_exp, acc = torch.full((2, 3), float("-inf")), torch.zeros(2, 3), torch.zeros(2, 3, 6)
    tol = tolerance("flash", torch.float32)
    for n, (start, stop) in enumerate([(0, 5), (5, 6), (6, 17)], 1):
        m, sum_exp, acc = impl.online_softmax_step(m, sum_exp, acc, scores[..., start:stop], values[:, start:stop])
        seen = scores[..., :stop].double()
        max_seen = seen.amax(dim=-1)
        weights = torch.exp(seen - max_seen[..., None])
        where = f"after block {n} (scores {start}..{stop - 1})"
        expect_close(m, max_seen, tol, f"{where}: m")
        expect_close(sum_exp, weights.sum(dim=-1), tol, f"{where}: sum_exp")
        expect_close(acc, weights @ values[:, :stop].double(), tol, f"{where}: acc")


# ---- step 2: tiled attention in PyTorch -------------------------------------------------------------

# (H, KVH, D) with H / KVH = 1, 2, 4, each with its own tile shape (tiles need not divide the lengths); the last
# with Qwen3-0.6B's heads (16 on 8 KV heads, head_dim 128)
TILED_CASES = {"H2-KVH2-tiles-16x16": (2, 2, 16, 16, 16), "H4-KVH2-tiles-7x11": (4, 2, 16, 7, 11),
               "H4-KVH1-tiles-32x64": (4, 1, 16, 32, 64), "Qwen3-H16-KVH8-D128-tiles-16x32": (16, 8, 128, 16, 32)}


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("case", TILED_CASES)
def test_tiled_matches_naive(impl, gen, case, causal):
    """tiled attention for one sequence with a cached prefix (Tk >= Tq) gives the output and LSE of the definition"""
    H, KVH, D, block_q, block_k = TILED_CASES[case]
    Tq = int(torch.randint(1, 40, (), generator=gen))
    Tk = Tq + int(torch.randint(0, 25, (), generator=gen))
    q, k, v = fp32(Tq, H, D, gen=gen), fp32(Tk, KVH, D, gen=gen), fp32(Tk, KVH, D, gen=gen)
    out, lse = impl.tiled_attention(q, k, v, block_q, block_k, causal=causal)
    expected_out, expected_lse = naive_attention(q, k, v, causal=causal)
    tol = tolerance("flash", torch.float32)
    expect_close(out, expected_out, tol, f"output (Tq {Tq}, Tk {Tk})")
    expect_close(lse, expected_lse, tol, f"lse (Tq {Tq}, Tk {Tk})")


def scores_far_from_zero(gen, Tq, Tk, H, KVH, D, sign):
    """q and k whose scaled scores sit near sign * 150 (exp of that underflows or overflows in fp32 unless
    the running max is subtracted), spread over a few units so the softmax still has work to do. Every
    entry is a multiple of 1/8, exact in fp16, and so is every partial sum of their products in fp32: the
    scores carry no rounding of their own, whatever order a kernel sums them in."""
    base = round(8 * (150 * D**0.5) ** 0.5) / 8  # q . k ~ base^2 along dim 0; times D ** -0.5, ~150
    q, k = torch.round(4 * fp32(Tq, H, D, gen=gen)) / 8, torch.round(4 * fp32(Tk, KVH, D, gen=gen)) / 8
    q[..., 0] += base
    k[..., 0] += sign * base
    return q, k


def test_tiled_scores_far_from_zero(impl, gen):
    """every score near -150 (exp underflows to 0 in fp32 unless shifted by the running max)"""
    q, k = scores_far_from_zero(gen, 20, 30, 2, 1, 16, -1)
    v = fp32(30, 1, 16, gen=gen)
    out, lse = impl.tiled_attention(q, k, v, 8, 8, causal=True)
    expected_out, expected_lse = naive_attention(q, k, v, causal=True)
    tol = tolerance("flash", torch.float32)
    expect_close(out, expected_out, tol, "output")
    expect_close(lse, expected_lse, tol, "lse")


SCORE_MATRIX_SHARE = 0.5  # no tensor may reach this share of the whole [H, Tq, Tk] fp32 score matrix


def test_tiled_never_builds_the_score_matrix(impl, gen):
    """tiles of 16 x 16 over 32 queries and 128 keys: no tensor is half the size of the [H, Tq, Tk] scores"""
    H, KVH, D, Tq, Tk = 2, 1, 16, 32, 128  # 16 tiles: enough to tell tiles from rows of scores, and cheap to watch
    q, k, v = fp32(Tq, H, D, gen=gen), fp32(Tk, KVH, D, gen=gen), fp32(Tk, KVH, D, gen=gen)
    with impl.watch_tensors() as watch:  # measured in the worker, where the learner's code runs
        out, lse = impl.tiled_attention(q, k, v, 16, 16, causal=False)
    expect_close(out, naive_attention(q, k, v, causal=False)[0], tolerance("flash", torch.float32), "output")
    full = H * Tq * Tk * 4  # bytes of the fp32 score matrix
    if watch.largest >= full * SCORE_MATRIX_SHARE:
        raise Mismatch(f"a tensor of {watch.largest} bytes was made; the whole [H, Tq, Tk] fp32 score matrix takes "
                       f"{full}: with 16 x 16 tiles no tensor needs more than the inputs")
    if watch.outside is not None:  # `grade` with a memory cgroup: the kernel's count, whatever the worker says
        T, tile = 2048, 256  # scores of 16 MiB against tiles of 256 KiB: far apart in pages, whatever else moves
        q, k, v = fp32(T, 1, 16, gen=gen), fp32(T, 1, 16, gen=gen), fp32(T, 1, 16, gen=gen)
        with impl.watch_tensors() as outside:
            impl.tiled_attention(q, k, v, tile, tile, causal=False)
        if outside.outside >= T * T * 4 * SCORE_MATRIX_SHARE:
            raise Mismatch(f"the worker's memory grew by {outside.outside >> 20} MiB during one call over {T} queries "
                           f"and keys in {tile} x {tile} tiles: the whole fp32 score matrix takes {T * T * 4 >> 20} "
                           "MiB, tiles a few hundred KiB")


# ---- step 3: the Triton kernel ------------------------------------------------------------------------


def cumulative(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)


@pytest.fixture
def varlen(gen):
    """Makes a packed batch: (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), on DEVICE."""

    def make(dtype, H, KVH, D, q_lengths, k_lengths):
        q = fp32(sum(q_lengths), H, D, gen=gen).to(dtype)
        k = fp32(sum(k_lengths), KVH, D, gen=gen).to(dtype)
        v = fp32(sum(k_lengths), KVH, D, gen=gen).to(dtype)
        return (q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), cumulative(q_lengths), cumulative(k_lengths),
                max(q_lengths), max(k_lengths))

    return make


def random_lengths(gen, prefix=True):
    """Three sequences: a single query, a prefill without a cached prefix, and one with a prefix (more
    keys than queries); lengths are random, so rarely a multiple of any tile size."""
    q_lengths = [1] + [int(n) for n in torch.randint(2, MAX_Q, (2,), generator=gen)]
    prefixes = [int(n) for n in torch.randint(1, MAX_PREFIX, (3,), generator=gen)] if prefix else [0, 0, 0]
    prefixes[1] = 0
    return q_lengths, [n + p for n, p in zip(q_lengths, prefixes)]


def test_kernel_toy_row(impl):
    """the seed's row through the kernel (1 query, 4 keys, D 16, fp16): output 36.88 and LSE 5.1852"""
    t = TOY["kernel"]
    D, scores = t["head_dim"], torch.tensor(TOY["scores"])
    q = torch.zeros(1, 1, D)
    k, v = torch.zeros(4, 1, D), torch.zeros(4, 1, D)
    q[0, 0, 0] = 1.0
    k[:, 0, 0] = t["key_scale"] * scores
    v[:, 0, 0] = torch.tensor(TOY["values"])[:, 0]
    q, k, v = (x.half().to(DEVICE) for x in (q, k, v))
    out, lse = impl.flash_attn_varlen(q, k, v, cumulative([1]), cumulative([4]), 1, 4, return_lse=True)
    expected = torch.zeros(1, 1, D)
    expected[0, 0, 0] = t["output0"]
    expect_close(out, expected, tolerance("flash", torch.float16), "output (only dim 0 is non-zero)")
    expect_close(lse, torch.tensor([[t["lse"]]]), tolerance("toy", torch.float32), "lse")


KERNEL_CASES = {  # dtype, H, KVH, D, causal: with LSE_CASES, H / KVH in {1, 2, 4}, D 64 and 128, both masks,
    # and Qwen3-0.6B's heads (16 on 8 KV heads, head_dim 128)
    "fp16-H4-KVH2-D64-causal": ("fp16", 4, 2, 64, True),
    "bf16-H4-KVH1-D128-causal": ("bf16", 4, 1, 128, True),
    "bf16-H2-KVH2-D64-full": ("bf16", 2, 2, 64, False),
    "bf16-Qwen3-H16-KVH8-D128-causal": ("bf16", 16, 8, 128, True),
}


def qwen3_lengths(gen):
    """Qwen3's 16 heads make 4 times the programs of 4 heads, which the CPU interpreter runs one by one in
    Python: there, one sequence of a few new tokens after a cached prefix; on a GPU the usual three."""
    if not INTERPRETED:
        return random_lengths(gen)
    new, prefix = (int(torch.randint(2, 17, (), generator=gen)), int(torch.randint(1, MAX_PREFIX, (), generator=gen)))
    return [new], [new + prefix]


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_varlen_matches_naive(impl, gen, varlen, case):
    """packed sequences (1 query; a prefill; a prefill after a cached prefix) match the definition"""
    dtype, H, KVH, D, causal = KERNEL_CASES[case]
    q_lengths, k_lengths = qwen3_lengths(gen) if "Qwen3" in case else random_lengths(gen)
    q, k, v, cu_q, cu_k, max_q, max_k = varlen(DTYPES[dtype], H, KVH, D, q_lengths, k_lengths)
    out = impl.flash_attn_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal)
    expected, _ = naive_varlen(q, k, v, cu_q, cu_k, causal=causal)
    expect_close(out, expected, tolerance("flash", DTYPES[dtype]), f"output (q lengths {q_lengths}, k {k_lengths})")


LSE_CASES = {"fp16-H4-KVH2-D128-causal": ("fp16", 4, 2, 128, True)}


@pytest.mark.parametrize("case", LSE_CASES)
def test_varlen_lse(impl, gen, varlen, case):
    """return_lse=True: the log-sum-exp [H, total_q] (natural log, float32) matches the definition"""
    dtype, H, KVH, D, causal = LSE_CASES[case]
    q_lengths, k_lengths = random_lengths(gen)
    q, k, v, cu_q, cu_k, max_q, max_k = varlen(DTYPES[dtype], H, KVH, D, q_lengths, k_lengths)
    out, lse = impl.flash_attn_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, return_lse=True)
    expected_out, expected_lse = naive_varlen(q, k, v, cu_q, cu_k, causal=causal)
    what = f"(q lengths {q_lengths}, k {k_lengths})"
    expect_close(lse, expected_lse, tolerance("flash", torch.float32), f"lse {what}")
    expect_close(out, expected_out, tolerance("flash", DTYPES[dtype]), f"output {what}")


def test_queries_that_see_no_key_get_zeros(impl, gen, varlen):
    """causal with more queries than keys: the first queries see no key and output 0, the others attend"""
    q_lengths, k_lengths = [40, 23], [25, 30]  # sequence 0: queries 0..14 see nothing (bottom-right alignment)
    q, k, v, cu_q, cu_k, max_q, max_k = varlen(torch.float16, 4, 2, 64, q_lengths, k_lengths)
    out = impl.flash_attn_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)
    expected, _ = naive_varlen(q, k, v, cu_q, cu_k, causal=True)
    expect_close(out, expected, tolerance("flash", torch.float16), "output (rows 0..14 must be 0)")


def test_scores_far_from_zero(impl, gen):
    """every score near -150 (exp2 of it underflows to 0 in fp32 unless the running max is subtracted)"""
    q_lengths, k_lengths = [20, 33], [20, 50]
    q, k = scores_far_from_zero(gen, sum(q_lengths), sum(k_lengths), 2, 1, 64, -1)
    v = fp32(sum(k_lengths), 1, 64, gen=gen)
    q, k, v = (x.half().to(DEVICE) for x in (q, k, v))
    cu_q, cu_k = cumulative(q_lengths), cumulative(k_lengths)
    out, lse = impl.flash_attn_varlen(q, k, v, cu_q, cu_k, 33, 50, causal=True, return_lse=True)
    expected_out, expected_lse = naive_varlen(q, k, v, cu_q, cu_k, causal=True)
    expect_close(out, expected_out, tolerance("flash", torch.float16), "output")
    expect_close(lse, expected_lse, tolerance("flash", torch.float32), "lse")


def test_fused_qkv_views(impl, gen):
    """q, k, v as views into one fused qkv projection output (row stride (H + 2 KVH) * D, not H * D)"""
    H, KVH, D = 4, 2, 64
    lengths = [int(n) for n in torch.randint(2, MAX_Q, (2,), generator=gen)]
    qkv = fp32(sum(lengths), (H + 2 * KVH) * D, gen=gen).to(torch.bfloat16).to(DEVICE)
    q = qkv[:, : H * D].view(-1, H, D)
    k = qkv[:, H * D : (H + KVH) * D].view(-1, KVH, D)
    v = qkv[:, (H + KVH) * D :].view(-1, KVH, D)
    cu = cumulative(lengths)
    out = impl.flash_attn_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
    expected, _ = naive_varlen(q, k, v, cu, cu, causal=True)
    expect_close(out, expected, tolerance("flash", torch.bfloat16), f"output (lengths {lengths})")


def test_matches_sdpa(impl, gen, varlen):
    """the same batch through torch's scaled_dot_product_attention, one sequence at a time"""
    q_lengths, k_lengths = random_lengths(gen)
    q, k, v, cu_q, cu_k, max_q, max_k = varlen(torch.bfloat16, 4, 2, 64, q_lengths, k_lengths)
    out = impl.flash_attn_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    expected = torch.cat([sdpa_attention(q[cq[b] : cq[b + 1]], k[ck[b] : ck[b + 1]], v[ck[b] : ck[b + 1]])
                          for b in range(len(q_lengths))])
    expect_close(out, expected, tolerance("flash", torch.bfloat16), f"output vs SDPA (q {q_lengths}, k {k_lengths})")


def test_matches_flash_attn(impl, gen, varlen):
    """the same batch through flash-attn's flash_attn_varlen_func (output and LSE)"""
    q_lengths, k_lengths = random_lengths(gen)
    q, k, v, cu_q, cu_k, max_q, max_k = varlen(torch.bfloat16, 4, 2, 128, q_lengths, k_lengths)
    out, lse = impl.flash_attn_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, return_lse=True)
    flash_attn = flash_attn_or_skip()  # after your call: an unwritten stub still reads "not started"
    expected_out, expected_lse, _ = flash_attn.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max_q, max_k, causal=True, return_attn_probs=True)
    expect_close(out, expected_out, tolerance("flash", torch.bfloat16), "output vs flash-attn")
    expect_close(lse, expected_lse, tolerance("flash", torch.float32), "lse vs flash-attn")
