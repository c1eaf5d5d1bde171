"""Checks for P08 · mixture of experts (mine/p08_moe.py).

Oracles: the page's toy (toy_cases/p08_moe.json); Hugging Face's `Qwen3MoeTopKRouter` and
`Qwen3MoeSparseMoeBlock` (eager experts) built from tiny random `Qwen3MoeConfig`s, in float64 on the very
weights and tokens a check passes (and the router in the input's own dtype where its rounding is the point);
the permutation and each expert's rows by their definitions, computed here with plain loops. Random tokens
are drawn so that each token's k-th and (k+1)-th experts are well apart (a rounding cannot swap them),
except in the checks whose point is a tie. The kernels run compiled on a GPU and in Triton's interpreter
on a CPU (small sizes there: it is slow). The expert-parallel function runs on 2 and 4 real ranks, as in
p07: each collective is carried and counted by the checks' process.
"""

from dataclasses import dataclass

import pytest
import torch

from checks.harness.compare import Mismatch, expect_close, tolerance
from checks.harness.guard import LearnerError, Returns
from checks.harness.interpreter import DEVICE, verified_on  # noqa: F401 - the report reads verified_on
from checks.harness.oracles import MoEBlockWeights, hf_moe, hf_route
from checks.harness.ranks import ranks
from checks.harness.toys import load_toy

pytestmark = pytest.mark.p08

TOLERANCE_KIND = "moe"
# What `./check.sh grade` awards: a check's points, shared out over its cases (the module is worth 44).
POINTS = {
    "test_toy": 3,
    "test_route_matches_hf": 3,
    "test_route_softmax_in_float32": 2,
    "test_route_ties_as_torch_topk": 2,
    "test_route_refuses_a_bad_top_k": 1,
    "test_permute_structure": 4,
    "test_unpermute": 3,
    "test_fused_moe_matches_each_expert": 5,
    "test_moe_reference_matches_hf": 3,
    "test_moe_block_matches_hf": 5,
    "test_chunked_calls_equal_one_call": 2,
    "test_real_size": 2,
    "test_shard_experts": 2,
    "test_shard_experts_refuses_experts_that_do_not_divide": 1,
    "test_expert_parallel_matches_hf": 4,
    "test_expert_parallel_collectives": 2,
}
CONTRACTS = {
    "route": lambda hidden, router_weight, top_k, norm_topk_prob: (
        Returns((hidden.shape[0], top_k), hidden.dtype, hidden.device, "weights [T, k] in hidden's dtype"),
        Returns((hidden.shape[0], top_k), torch.int64, hidden.device, "expert_ids [T, k] int64")),
    "moe_reference": lambda hidden, w: Returns.like(hidden, "[T, hidden]"),
    "unpermute": lambda rows, perm, weights: Returns((weights.shape[0], rows.shape[1]), rows.dtype, rows.device,
                                                     "[T, hidden] in rows' dtype"),
    "fused_moe": lambda hidden, gate_up_proj, down_proj, perm, block_size: Returns(
        (perm.order.shape[0], hidden.shape[1]), hidden.dtype, hidden.device, "rows [P, hidden] in hidden's dtype"),
    "moe_block": lambda hidden, w, block_size=16: Returns.like(hidden, "hidden's shape"),
    "expert_parallel_moe": lambda hidden, shard, block_size=16: Returns.like(hidden, "[T_r, hidden]"),
}
TOY = load_toy("p08_moe")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BLOCK_SIZE = 16  # rows per block in the kernels' checks (tl.dot's smallest tile)
# (E, hidden, I, k): hidden and I not multiples of the kernel's 32-wide tiles, k of 2 and 3
LAYOUTS = {"E4-k2-h40-I24": (4, 40, 24, 2), "E8-k2-h48-I16": (8, 48, 16, 2), "E8-k3-h32-I20": (8, 32, 20, 3)}
MARGIN = 0.25  # logits between each token's k-th and (k+1)-th expert: bf16's logit error is ~0.02 here


# ---- cases ----------------------------------------------------------------------------------------------


def moe_weights(gen, layout: str, dtype: torch.dtype, norm_topk_prob: bool = True) -> MoEBlockWeights:
    E, hidden, inter, k = LAYOUTS[layout] if isinstance(layout, str) else layout
    return MoEBlockWeights.random(gen, E, hidden, inter, k, norm_topk_prob).to(dtype)


def tokens(gen, w: MoEBlockWeights, T: int, dtype: torch.dtype) -> torch.Tensor:
    """`[T, hidden]` in `dtype`, each token's k-th and (k+1)-th router logits at least MARGIN apart."""
    hidden = w.router.shape[1]
    rows = []
    while len(rows) < T:
        x = torch.randn(hidden, generator=gen).to(dtype)
        logits = (w.router.double() @ x.double()).sort(descending=True).values
        if w.top_k == w.num_experts or logits[w.top_k - 1] - logits[w.top_k] >= MARGIN:
            rows.append(x)
    return torch.stack(rows) if rows else torch.zeros(0, hidden, dtype=dtype)


def on_device(w: MoEBlockWeights) -> MoEBlockWeights:
    return MoEBlockWeights(w.router.to(DEVICE), w.gate_up_proj.to(DEVICE), w.down_proj.to(DEVICE), w.top_k,
                           w.norm_topk_prob)


@dataclass(eq=False)
class Layout:
    """A permutation as the checks build it (what the learner's `Permutation` must hold)."""

    order: torch.Tensor
    block_expert: torch.Tensor
    counts: torch.Tensor
    offsets: torch.Tensor


def permutation(expert_ids: torch.Tensor, num_experts: int, block_size: int) -> Layout:
    """The definition, one expert at a time: its pairs in ascending pair index, then T*k up to whole blocks."""
    flat = expert_ids.reshape(-1).tolist()
    sentinel = len(flat)
    order, blocks, counts, offsets = [], [], [], [0]
    for e in range(num_experts):
        pairs = [p for p, x in enumerate(flat) if x == e]
        padded = -(-len(pairs) // block_size) * block_size
        order += pairs + [sentinel] * (padded - len(pairs))
        blocks += [e] * (padded // block_size)
        counts.append(len(pairs))
        offsets.append(len(order))
    as_tensor = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    return Layout(as_tensor(order), as_tensor(blocks), as_tensor(counts), as_tensor(offsets))


def expert_rows(x: torch.Tensor, w: MoEBlockWeights, perm: Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """Each real row's expert output in float64 (no weight), and which rows are real."""
    k = w.top_k
    real = perm.order < x.shape[0] * k
    out = torch.zeros(perm.order.shape[0], x.shape[1], dtype=torch.float64)
    for row in torch.nonzero(real).flatten().tolist():
        e = int(perm.block_expert[row // (perm.order.shape[0] // perm.block_expert.shape[0])])
        token = int(perm.order[row]) // k
        gate, up = (w.gate_up_proj[e].double() @ x[token].double()).chunk(2)
        out[row] = w.down_proj[e].double() @ (torch.nn.functional.silu(gate) * up)
    return out, real


def field(obj, name: str):
    try:
        return getattr(obj, name)
    except AttributeError:
        raise Mismatch(f"the result has no `{name}`") from None


def as_list(value, what: str) -> list:
    if not isinstance(value, torch.Tensor):
        raise Mismatch(f"{what} is {type(value).__name__}, expected an int64 tensor")
    if value.dtype != torch.int64:
        raise Mismatch(f"{what} is {str(value.dtype).removeprefix('torch.')}, expected int64")
    return value.cpu().tolist()


def expect_value_error(call, what: str) -> None:
    try:
        call()
    except LearnerError as error:
        if "raised ValueError" in str(error):
            return
        raise LearnerError(f"{what} should raise ValueError; instead {str(error).partition(' raised ')[2] or error}",
                           identifiable=getattr(error, "identifiable", True)) from None
    raise Mismatch(f"{what} returned a result instead of raising ValueError")


# ---- the toy ---------------------------------------------------------------------------------------------


def toy_weights(norm_topk_prob: bool) -> MoEBlockWeights:
    return MoEBlockWeights(torch.tensor(TOY["router"]), torch.tensor(TOY["gate_up_proj"]),
                           torch.tensor(TOY["down_proj"]), TOY["top_k"], norm_topk_prob)


def test_toy(impl):
    """the toy (4 tokens, 4 experts, top-2): the route, the permutation in blocks of 2, and the block's output
    with and without renormalisation"""
    w = toy_weights(True)
    x = torch.tensor(TOY["hidden_states"])
    weights, expert_ids = impl.route(x, w.router, w.top_k, True)
    if expert_ids.tolist() != TOY["expert_ids"]:
        raise Mismatch(f"route's expert_ids are {expert_ids.tolist()}, expected {TOY['expert_ids']} (each token's "
                       f"two most probable experts, the more probable first)")
    tol = tolerance("toy", torch.float32)
    expect_close(weights, torch.tensor(TOY["weights"]), tol, "route's weights (renormalised over the 2)")
    toy_perm = TOY["permutation"]
    expect_permutation(impl.permute(torch.tensor(TOY["expert_ids"]), w.num_experts, toy_perm["block_size"]),
                       Layout(*(torch.tensor(toy_perm[n]) for n in ("order", "block_expert", "counts", "offsets"))),
                       f"permute(the toy's expert_ids, {w.num_experts}, block_size {toy_perm['block_size']})")
    for norm, key in ((True, "output"), (False, "output_not_renormalised")):
        out = impl.moe_block(x.to(DEVICE), on_device(toy_weights(norm)))
        expect_close(out, torch.tensor(TOY[key]), tol, f"the toy's moe_block (norm_topk_prob {norm})")


# ---- the router ----------------------------------------------------------------------------------------------


ROUTE_CASES = [(layout, dtype, norm) for layout in LAYOUTS for dtype in DTYPES for norm in (True, False)]


@pytest.mark.parametrize("layout, dtype, norm", ROUTE_CASES,
                         ids=[f"{lay}-{d}-{'norm' if n else 'no-norm'}" for lay, d, n in ROUTE_CASES])
def test_route_matches_hf(impl, gen, layout, dtype, norm):
    """route gives HF Qwen3MoeTopKRouter's experts (exactly, the most probable first) and weights, renormalised
    only when asked"""
    dtype = DTYPES[dtype]
    w = moe_weights(gen, layout, dtype, norm)
    x = tokens(gen, w, 7, dtype)
    weights, expert_ids = impl.route(x, w.router, w.top_k, norm)
    hf_weights, hf_ids = hf_route(w.to(torch.float64), x.double())
    # The k experts are well apart from the rest, but two of them may be close: a rounding may order those two
    # either way, so the experts are compared as a set (each with its weight), and their order by weight.
    mine, theirs = expert_ids.sort(-1), hf_ids.sort(-1)
    if not torch.equal(mine.values, theirs.values):
        t = int((mine.values != theirs.values).any(-1).nonzero()[0])
        raise Mismatch(f"token {t}'s experts are {expert_ids[t].tolist()}, HF's router chose {hf_ids[t].tolist()} "
                       f"(the {w.top_k} most probable)")
    if (weights[:, 1:] > weights[:, :-1]).any():
        t = int((weights[:, 1:] > weights[:, :-1]).any(-1).nonzero()[0])
        raise Mismatch(f"token {t}'s weights {weights[t].tolist()} are not in descending order (torch.topk's "
                       f"order: the most probable expert first)")
    expect_close(weights.gather(1, mine.indices), hf_weights.gather(1, theirs.indices), tolerance("moe", dtype),
                 f"route's weights (norm_topk_prob {norm}, {str(dtype).removeprefix('torch.')}), expert by expert")


# Two experts' logits 2^-12 apart (exact in bf16, as are the router's weights), the larger first in one token and
# second in the other: their float32 probabilities differ, but by far less than a bf16 ulp, so a softmax rounded to
# bf16 ties them, and whichever way torch.topk breaks that tie, one of the two tokens gets the wrong expert.
NEAR_TIES = [[2**-12, 0.0, -3.0, -2.0], [0.0, 2**-12, -3.0, -2.0]]


def exact_router(E: int, hidden: int, gen) -> torch.Tensor:
    """A router whose first E input features are the identity: a token's logits are its first E values, exactly."""
    return torch.cat([torch.eye(E), torch.randn(E, hidden - E, generator=gen) * hidden**-0.5], dim=1)


def tokens_with_logits(logits: list[list[float]], hidden: int, dtype: torch.dtype) -> torch.Tensor:
    x = torch.zeros(len(logits), hidden, dtype=dtype)
    x[:, : len(logits[0])] = torch.tensor(logits, dtype=dtype)
    return x


def test_route_softmax_in_float32(impl, gen):
    """for bf16 tokens the softmax runs in float32: two experts whose probabilities differ by less than a bf16
    ulp are still told apart (the more probable one is chosen)"""
    E, hidden = len(NEAR_TIES[0]), 8
    router = exact_router(E, hidden, gen).to(torch.bfloat16)
    x = tokens_with_logits(NEAR_TIES, hidden, torch.bfloat16)
    for norm in (True, False):
        w = MoEBlockWeights(router, torch.zeros(E, 2, hidden), torch.zeros(E, hidden, 1), 1, norm)
        expected_weights, expected_ids = hf_route(w, x)
        weights, expert_ids = impl.route(x, router, 1, norm)
        if expert_ids[:, 0].tolist() != expected_ids[:, 0].tolist():
            raise Mismatch(f"route chose experts {expert_ids[:, 0].tolist()}, HF chose {expected_ids[:, 0].tolist()} "
                           f"for logits {NEAR_TIES}: their float32 probabilities differ by less than a bf16 ulp "
                           f"(softmax in float32, whatever the input's dtype)")
        expect_close(weights, expected_weights, tolerance("moe", torch.bfloat16), f"route's weights (norm {norm})")


# Each row a token's logits over 4 experts (top-2): a zero token ties all four; two equal logits at the top; two
# tied for the second place; and one expert far ahead (logit 200), so that every other probability underflows to
# 0 in float32 and the three tie there, whatever their logits (the k are chosen on the probabilities).
TIES = [[0.0, 0.0, 0.0, 0.0], [1.0, 2.0, 2.0, 0.0], [3.0, 1.0, 0.0, 1.0], [200.0, 5.0, 0.0, 3.0],
        [200.0, 0.0, 3.0, 5.0]]


def test_route_ties_as_torch_topk(impl, gen):
    """exact ties among a token's probabilities (equal logits, or probabilities that underflow to 0 in float32) are
    broken as torch.topk breaks them on the float32 probabilities"""
    E, hidden, k = len(TIES[0]), 12, 2
    router = exact_router(E, hidden, gen)
    x = torch.cat([tokens_with_logits(TIES, hidden, torch.float32), torch.randn(2, hidden, generator=gen)])
    w = MoEBlockWeights(router, torch.zeros(E, 2, hidden), torch.zeros(E, hidden, 1), k, True)
    expected_weights, expected_ids = hf_route(w, x)
    weights, expert_ids = impl.route(x, router, k, True)
    for t in range(x.shape[0]):
        if expert_ids[t].tolist() != expected_ids[t].tolist():
            logits = f"logits {TIES[t]}" if t < len(TIES) else "random logits"
            raise Mismatch(f"token {t} ({logits}): experts {expert_ids[t].tolist()}, torch.topk on the float32 "
                           f"probabilities gives {expected_ids[t].tolist()} (ties broken as torch.topk breaks them)")
    expect_close(weights, expected_weights, tolerance("moe", torch.float32), "route's weights with ties")


def test_route_refuses_a_bad_top_k(impl, gen):
    """route raises ValueError for top_k larger than the number of experts, and for top_k 0"""
    router, x = torch.randn(4, 8, generator=gen), torch.randn(3, 8, generator=gen)
    expect_value_error(lambda: impl.route(x, router, 5, True), "route with top_k 5 of 4 experts")
    expect_value_error(lambda: impl.route(x, router, 0, True), "route with top_k 0")


# ---- the permutation ---------------------------------------------------------------------------------------------


def expect_permutation(got, want: Layout, what: str) -> None:
    """The learner's Permutation against the definition, field by field, with what each field means."""
    counts = as_list(field(got, "counts"), f"{what}: counts")
    if counts != want.counts.tolist():
        raise Mismatch(f"{what}: counts {counts}, expected {want.counts.tolist()} (pairs routed to each expert)")
    offsets = as_list(field(got, "offsets"), f"{what}: offsets")
    if offsets != want.offsets.tolist():
        raise Mismatch(f"{what}: offsets {offsets}, expected {want.offsets.tolist()} (offsets[0] = 0, each expert's "
                       f"group padded up to whole blocks, offsets[E] = P; an expert without pairs adds nothing)")
    blocks = as_list(field(got, "block_expert"), f"{what}: block_expert")
    if blocks != want.block_expert.tolist():
        raise Mismatch(f"{what}: block_expert {blocks}, expected {want.block_expert.tolist()} (one entry per block "
                       f"of rows: the expert that owns it)")
    order = as_list(field(got, "order"), f"{what}: order")
    if order != want.order.tolist():
        sentinel = int(want.counts.sum())
        for e in range(len(counts)):
            start, stop = want.offsets[e], want.offsets[e + 1]
            mine, expected = order[start:stop], want.order[start:stop].tolist()
            if mine != expected:
                raise Mismatch(f"{what}: expert {e}'s rows order[{start}:{stop}] hold {short(mine)}, expected "
                               f"{short(expected)} (its pairs t*k + slot in ascending order, then {sentinel} = T*k "
                               f"to the end of its last block)")
        raise Mismatch(f"{what}: order has {len(order)} rows, expected {len(want.order)}")


def short(values: list) -> str:
    return str(values) if len(values) <= 20 else f"{str(values[:18])[:-1]}, … ({len(values)} rows)]"


# (E, counts, k, block_size): each count a multiple of the block size, one over, one under, none, a single pair
EDGE_CASES = {
    "edges-block16": (6, [16, 17, 15, 0, 32, 1], 3, 16),
    "edges-block4": (5, [4, 5, 3, 0, 8], 4, 4),
    "one-expert-block16": (4, [0, 0, 32, 0], 1, 16),
}


def pairs_with_counts(gen, counts: list[int], k: int) -> torch.Tensor:
    """expert_ids [T, k] holding expert e exactly counts[e] times, in a random order."""
    flat = torch.cat([torch.full((c,), e, dtype=torch.int64) for e, c in enumerate(counts)])
    return flat[torch.randperm(flat.numel(), generator=gen)].reshape(-1, k)


@pytest.mark.parametrize("case", EDGE_CASES)
def test_permute_structure(impl, gen, case):
    """permute: counts, offsets, one expert per block, and each expert's pairs in ascending order then T*k,
    for counts at the block edges (an exact multiple of block_size, one over, one under) and idle experts"""
    E, counts, k, block_size = EDGE_CASES[case]
    expert_ids = pairs_with_counts(gen, counts, k)
    got = impl.permute(expert_ids, E, block_size)
    expect_permutation(got, permutation(expert_ids, E, block_size),
                       f"permute(expert_ids {list(expert_ids.shape)} with counts {counts}, {E}, block_size "
                       f"{block_size})")


def test_unpermute(impl, gen):
    """unpermute: each token gets the sum of its k rows times their weights; padding rows are ignored whatever
    they hold (NaN here)"""
    E, T, k, hidden = 5, 9, 2, 12
    expert_ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    perm = permutation(expert_ids, E, 4)
    rows = torch.randn(perm.order.shape[0], hidden, generator=gen)
    rows[perm.order == T * k] = float("nan")
    weights = torch.rand(T, k, generator=gen)
    expected = torch.zeros(T, hidden, dtype=torch.float64)
    for row, pair in enumerate(perm.order.tolist()):
        if pair < T * k:
            expected[pair // k] += weights[pair // k, pair % k].double() * rows[row].double()
    out = impl.unpermute(rows, perm, weights)
    expect_close(out, expected, tolerance("moe", torch.float32), "unpermute's tokens")


# ---- the kernel -------------------------------------------------------------------------------------------------


FUSED_CASES = [(layout, dtype) for layout in LAYOUTS for dtype in DTYPES]


@pytest.mark.parametrize("layout, dtype", FUSED_CASES, ids=[f"{lay}-{d}" for lay, d in FUSED_CASES])
def test_fused_moe_matches_each_expert(impl, gen, layout, dtype):
    """fused_moe: every real row is its block's expert's SwiGLU MLP of its token (unweighted), with blocks of 16;
    some experts get a full block, some none"""
    dtype = DTYPES[dtype]
    w = moe_weights(gen, layout, dtype)
    E, k = w.num_experts, w.top_k
    T = 16 + 3
    # token t's experts: expert 0 for the first 16 tokens (a full block), the rest spread over the others
    expert_ids = torch.stack([torch.cat([torch.tensor([0]), 1 + torch.randperm(E - 2, generator=gen)[: k - 1]])
                              if t < 16 else 1 + torch.randperm(E - 2, generator=gen)[:k] for t in range(T)])
    perm = permutation(expert_ids, E, BLOCK_SIZE)
    x = torch.randn(T, w.router.shape[1], generator=gen).to(dtype)
    expected, real = expert_rows(x, w, perm)
    dw = on_device(w)
    rows = impl.fused_moe(x.to(DEVICE), dw.gate_up_proj, dw.down_proj,
                          Layout(*(t.to(DEVICE) for t in (perm.order, perm.block_expert, perm.counts, perm.offsets))),
                          BLOCK_SIZE)
    expect_close(rows[real.to(rows.device)], expected[real], tolerance("moe", dtype),
                 f"fused_moe's real rows ({int(real.sum())} of {perm.order.shape[0]}, expert {E - 1} idle)")


# ---- the whole block -----------------------------------------------------------------------------------------------


BLOCK_CASES = [(layout, dtype, norm) for layout in LAYOUTS for dtype in DTYPES for norm in (True, False)]
BLOCK_IDS = [f"{lay}-{d}-{'norm' if n else 'no-norm'}" for lay, d, n in BLOCK_CASES]


@pytest.mark.parametrize("layout, dtype, norm", BLOCK_CASES[::3], ids=BLOCK_IDS[::3])
def test_moe_reference_matches_hf(impl, gen, layout, dtype, norm):
    """moe_reference gives HF Qwen3MoeSparseMoeBlock's output (float64)"""
    dtype = DTYPES[dtype]
    w = moe_weights(gen, layout, dtype, norm)
    x = tokens(gen, w, 6, dtype)
    expect_close(impl.moe_reference(x, w), hf_moe(w.to(torch.float64), x), tolerance("moe", dtype),
                 "moe_reference's output")


@pytest.mark.parametrize("layout, dtype, norm", BLOCK_CASES, ids=BLOCK_IDS)
def test_moe_block_matches_hf(impl, gen, layout, dtype, norm):
    """moe_block (route, permute, fused_moe, unpermute) gives HF Qwen3MoeSparseMoeBlock's output (float64), for
    [T, hidden] and [B, S, hidden]"""
    dtype = DTYPES[dtype]
    w = moe_weights(gen, layout, dtype, norm)
    x = tokens(gen, w, 6, dtype)
    expected = hf_moe(w.to(torch.float64), x)
    tol, dw = tolerance("moe", dtype), on_device(w)
    expect_close(impl.moe_block(x.to(DEVICE), dw), expected, tol, "moe_block's output for [6, hidden]")
    expect_close(impl.moe_block(x.reshape(2, 3, -1).to(DEVICE), dw), expected.reshape(2, 3, -1), tol,
                 "moe_block's output for [2, 3, hidden]")


CHUNKS = ((0, 5), (5, 7), (7, 12))  # tokens start .. stop - 1 of each call


def test_chunked_calls_equal_one_call(impl, gen):
    """moe_block on tokens in three chunks, each in a fresh worker, equals one call on all 12"""
    w = moe_weights(gen, "E8-k2-h48-I16", torch.float32)
    x = tokens(gen, w, 12, torch.float32)
    dw = on_device(w)
    whole = impl.moe_block(x.to(DEVICE), dw)
    expect_close(whole, hf_moe(w.to(torch.float64), x), tolerance("moe", torch.float32), "one call's output")
    for start, stop in CHUNKS:
        impl.fresh_worker()
        part = impl.moe_block(x[start:stop].to(DEVICE), dw)
        expect_close(part, whole[start:stop].double(), tolerance("moe", torch.float32),
                     f"tokens {start} .. {stop - 1} alone, against the same rows of one call")


# Qwen3-MoE's hidden width (1024, as in the dense Qwen3-0.6B) with 4 experts of width 256, top-2, 3 tokens: the kernel's
# tiles loop over 32 reduction tiles, the weights are 12 MB in fp32.
REAL = (4, 1024, 256, 2)


def test_real_size(impl, gen):
    """moe_block at hidden 1024 (4 experts of width 256, top-2, 3 tokens) gives HF's output (fp32)"""
    w = MoEBlockWeights.random(gen, *REAL, True)
    x = tokens(gen, w, 3, torch.float32)
    expect_close(impl.moe_block(x.to(DEVICE), on_device(w)), hf_moe(w.to(torch.float64), x),
                 tolerance("moe", torch.float32), "moe_block's output at hidden 1024")


# ---- experts over ranks -----------------------------------------------------------------------------------------


@dataclass(eq=False)
class RankShard:
    """A rank's EPShard as the checks cut it."""

    router: torch.Tensor
    gate_up_proj: torch.Tensor
    down_proj: torch.Tensor
    first_expert: int
    num_experts: int
    top_k: int
    norm_topk_prob: bool


def rank_shard(w: MoEBlockWeights, rank: int, world: int) -> RankShard:
    Er = w.num_experts // world
    return RankShard(w.router, w.gate_up_proj[rank * Er : (rank + 1) * Er].clone(),
                     w.down_proj[rank * Er : (rank + 1) * Er].clone(), rank * Er, w.num_experts, w.top_k,
                     w.norm_topk_prob)


RANK_IDS = lambda tp: f"{tp}-ranks"  # noqa: E731


@pytest.mark.parametrize("world", [2, 4], ids=RANK_IDS)
def test_shard_experts(impl, gen, world):
    """shard_experts gives rank r experts r*E/R .. (r+1)*E/R - 1, the whole router and the global counts"""
    w = moe_weights(gen, "E8-k2-h48-I16", torch.float32)
    for rank in range(world):
        got, want = impl.shard_experts(w, rank, world), rank_shard(w, rank, world)
        for name in RankShard.__dataclass_fields__:
            mine, expected = field(got, name), getattr(want, name)
            if isinstance(expected, torch.Tensor):
                same = isinstance(mine, torch.Tensor) and mine.shape == expected.shape and torch.equal(mine, expected)
                if not same:
                    shape = list(mine.shape) if isinstance(mine, torch.Tensor) else type(mine).__name__
                    Er = w.num_experts // world
                    raise Mismatch(f"rank {rank} of {world}: `{name}` ({shape}) is not "
                                   + ("the whole router" if name == "router" else
                                      f"experts {rank * Er} .. {rank * Er + Er - 1} of {w.num_experts}"))
            elif mine != expected:
                raise Mismatch(f"rank {rank} of {world}: `{name}` is {mine!r}, expected {expected!r}")


REFUSED_EXPERTS, REFUSED_WORLD_SIZE = 6, 4  # experts that do not split over the ranks


def test_shard_experts_refuses_experts_that_do_not_divide(impl, gen):
    """shard_experts raises ValueError for 6 experts over 4 ranks"""
    w = MoEBlockWeights.random(gen, REFUSED_EXPERTS, 16, 8, 2, True)
    expect_value_error(lambda: impl.shard_experts(w, 0, REFUSED_WORLD_SIZE),
                       f"shard_experts of {REFUSED_EXPERTS} experts over {REFUSED_WORLD_SIZE} ranks")


# tokens on each rank (one rank may have none), and the layout each world uses
EP_CASES = {"2-ranks": (2, [5, 3], "E8-k2-h48-I16"), "4-ranks": (4, [3, 0, 4, 2], "E8-k3-h32-I20")}


@pytest.mark.parametrize("case", EP_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_expert_parallel_matches_hf(impl, gen, case, dtype):
    """expert_parallel_moe: every rank gets HF's output for its own tokens, the experts spread over the ranks"""
    world, counts, layout = EP_CASES[case]
    dtype = DTYPES[dtype]
    w = moe_weights(gen, layout, dtype)
    xs = [tokens(gen, w, n, dtype) for n in counts]
    out = ranks(impl, world).call("expert_parallel_moe", [(xs[r].to(DEVICE), on_device_shard(rank_shard(w, r, world)))
                                                          for r in range(world)])
    for rank, result in enumerate(out):
        expect_close(result, hf_moe(w.to(torch.float64), xs[rank]), tolerance("moe", dtype),
                     f"rank {rank}'s output ({counts[rank]} tokens, {world} ranks)")


def on_device_shard(s: RankShard) -> RankShard:
    return RankShard(s.router.to(DEVICE), s.gate_up_proj.to(DEVICE), s.down_proj.to(DEVICE), s.first_expert,
                     s.num_experts, s.top_k, s.norm_topk_prob)


ALL_TO_ALL = ("all_to_all", "all_to_all_single")
MAX_EXCHANGES = 4  # the counts, the rows (and the expert ids, if sent apart), the results back


def test_expert_parallel_collectives(impl, gen):
    """expert_parallel_moe sends pairs only to their experts' ranks: all_to_all collectives only (at most 4 per
    call, the same on every rank), never an all_gather or all_reduce of every token"""
    world, counts, layout = EP_CASES["2-ranks"]
    w = moe_weights(gen, layout, torch.float32)
    xs = [tokens(gen, w, n, torch.float32) for n in counts]
    group = ranks(impl, world)
    group.call("expert_parallel_moe", [(xs[r].to(DEVICE), on_device_shard(rank_shard(w, r, world)))
                                       for r in range(world)])
    for rank, names in enumerate(group.collectives):
        others = sorted(set(names) - set(ALL_TO_ALL))
        if others or not names or len(names) > MAX_EXCHANGES:
            made = ", ".join(f"{n} x{names.count(n)}" for n in dict.fromkeys(names)) or "none"
            raise Mismatch(f"rank {rank} made {made}: expected all_to_all or all_to_all_single only, 1 to "
                           f"{MAX_EXCHANGES} of them (counts, rows, results back)")
