"""Checks for P07 · tensor parallelism (mine/p07_tensor_parallel.py).

Oracles: each shard's definition, computed here and compared exactly (the toy's row ids too); Hugging
Face's `Qwen3ForCausalLM` in float64 on the unsharded weights, for a layer's output, the model's logits
and, in float32, `generate`'s greedy tokens. The distributed functions run on real ranks: the check forks
2 or 4 workers (within the same limits, and under `grade` the same sandbox, as every other check), each
joins a gloo process group as its rank before it imports your file, and every rank runs the call at
once with its own shard, which the check cuts from the weights itself (so a wrong `shard_layer` fails
only its own checks). Each rank's collectives are counted. A rank that raises or hangs ends every rank,
and the report names it. On a GPU machine the ranks still run on the CPU with gloo.
"""

import math
from dataclasses import dataclass, replace
from functools import cache

import pytest
import torch

from checks.harness.compare import Mismatch, close_enough, expect_close, tolerance
from checks.harness.guard import LearnerError, class_name_of
from checks.harness.oracles import (
    LayerWeights,
    ModelCase,
    ModelWeights,
    frozen,
    hf_causal_lm,
    hf_first_layer_keys,
    hf_greedy,
    hf_logits_after_zeros,
    model_case,
    rope_tables,
)
from checks.harness.ranks import ranks
from checks.harness.toys import load_toy

pytestmark = pytest.mark.p07

TOLERANCE_KIND = "model"
# Replays of this module are cheap: a name its failures suggest alone is replayed on the checks a learner passed too,
# and dropped where its mutant gives other outputs there (harness/report.py, contradict)
CHEAP_REPLAYS = True
# What `./check.sh grade` awards: a check's points, shared out over its cases (the module is worth 41).
POINTS = {
    "test_toy_shards": 3,
    "test_toy_layer_on_two_ranks": 2,
    "test_column_row_and_merged_shards": 3,
    "test_shard_layer_matches_the_definition": 4,
    "test_shard_layer_refuses_kv_heads_that_do_not_divide": 2,
    "test_shard_model": 2,
    "test_vocab_parallel_embedding": 3,
    "test_parallel_lm_head": 3,
    "test_layer_matches_hf": 5,
    "test_collectives": 3,
    "test_model_matches_hf": 5,
    "test_chunked_calls_with_caches": 3,
    "test_greedy_matches_hf_generate": 3,
}
CONTRACTS = {}  # a rank's result depends on its rank: checked below, rank by rank
# The rule a check stands for, named where a failure does not say which one it breaks (RULES in
# checks/mutants/p07_tensor_parallel.py, one per function)
RULE_OF = {
    "test_toy_shards": "shard-layer",
    "test_toy_layer_on_two_ranks": "layer-reduces-partial-sums",
    "test_column_row_and_merged_shards": "column-shard",
    "test_shard_layer_matches_the_definition": "shard-layer",
    "test_shard_layer_refuses_kv_heads_that_do_not_divide": "shard-layer",
    "test_shard_model": "shard-model",
    "test_vocab_parallel_embedding": "embedding-masked-and-reduced",
    "test_parallel_lm_head": "lm-head-gathered",
    "test_layer_matches_hf": "layer-reduces-partial-sums",
    "test_collectives": "two-all-reduces-a-layer",
    "test_model_matches_hf": "model-forward",
    "test_chunked_calls_with_caches": "model-forward",
    "test_greedy_matches_hf_generate": "greedy-broadcasts",
}
# A function that raises ValueError on a split it must serve (the checks' cases all divide) breaks its own rule
REFUSAL_RULES = {"column_shard": "column-shard", "row_shard": "row-shard",
                 "merged_column_shard": "merged-shard-part-by-part", "shard_layer": "shard-layer",
                 "shard_model": "shard-model"}
# An error whose words say the rule it breaks (patterns, the first that matches): ranks out of step made different
# collectives at once, or some returned while the others waited (one skipped or added one), whatever the function
# they were in. A step gathers its logits before rank 0's token is broadcast, and the gather is a forward's last
# collective: a rank at a broadcast while another is at the gather, or one that returned while another waits in the
# gather, skipped the LM head's gather. A collective the checks' ranks do not carry (point to point: send, recv)
# breaks the rule of the function that called it, which must make its collectives instead.
REASON_RULES = {
    r"\(called in `parallel_lm_head`\) is not carried": "lm-head-gathered",
    r"\(called in `vocab_parallel_embedding`\) is not carried": "embedding-masked-and-reduced",
    r"\(called in `tp_generate_greedy`\) is not carried": "greedy-broadcasts",
    r"different collectives at once \((?=[^)]*\bgather\b)(?=[^)]*\bbroadcast\b)": "lm-head-gathered",
    r"in its \w+ gather, a collective the other ranks never made": "lm-head-gathered",
    # only tp_generate_greedy broadcasts: a rank at a broadcast while another is elsewhere skipped or added one there
    r"different collectives at once \((?=[^)]*\bbroadcast\b)|in its \w+ broadcast, a collective the other ranks "
    r"never made": "greedy-broadcasts",
    r"the ranks made different collectives at once|a collective the other ranks never made": "two-all-reduces-a-layer",
}
TOY = load_toy("p07_tensor_parallel")
# (V, hidden, I, L, H, KVH, D): H != KVH; the second divides over 4 ranks, the first over 2 only
LAYOUTS = {"H4-KVH2": (64, 32, 48, 2, 4, 2, 8), "H8-KVH4": (96, 40, 64, 2, 8, 4, 8)}
SPLITS = {"tp2-H4-KVH2": (2, "H4-KVH2"), "tp2-H8-KVH4": (2, "H8-KVH4"), "tp4-H8-KVH4": (4, "H8-KVH4")}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Qwen3-0.6B's widths (hidden 1024, intermediate 3072, 16 heads on 8 KV heads, head_dim 128) in one layer, on two
# ranks: each gets a 30 MB fp32 shard, so one case (a layer's output in fp32, where the tolerance is tight).
QWEN3 = "Qwen3-L1-H16-KVH8-D128-hidden1024"
SHAPES = {**LAYOUTS, QWEN3: (96, 1024, 3072, 1, 16, 8, 128)}


# ---- the shards, by their definition ----------------------------------------------------------------


@dataclass(frozen=True)
class RankLayer:
    """A rank's shard of a layer as the checks cut it (what the learner's TPLayer must hold)."""

    qkv_proj: torch.Tensor
    o_proj: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    input_layernorm: torch.Tensor
    post_attention_layernorm: torch.Tensor
    gate_up_proj: torch.Tensor
    down_proj: torch.Tensor
    eps: float
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class RankModel:
    embed_tokens: torch.Tensor
    layers: tuple[RankLayer, ...]
    norm: torch.Tensor
    eps: float
    rope_theta: float
    head_dim: int


def rows_of(weight: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    block = weight.shape[0] // tp
    return weight[rank * block : (rank + 1) * block]


def columns_of(weight: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    block = weight.shape[1] // tp
    return weight[:, rank * block : (rank + 1) * block]


def rank_layer(layer, rank: int, tp: int) -> RankLayer:
    """Rank `rank`'s shard: q, k, v each cut by rows and stacked; gate and up likewise; o and down by columns."""
    return RankLayer(
        qkv_proj=torch.cat([rows_of(getattr(layer, n), rank, tp) for n in ("q_proj", "k_proj", "v_proj")]),
        o_proj=columns_of(layer.o_proj, rank, tp).contiguous(),
        q_norm=layer.q_norm, k_norm=layer.k_norm, input_layernorm=layer.input_layernorm,
        post_attention_layernorm=layer.post_attention_layernorm,
        gate_up_proj=torch.cat([rows_of(layer.gate_proj, rank, tp), rows_of(layer.up_proj, rank, tp)]),
        down_proj=columns_of(layer.down_proj, rank, tp).contiguous(),
        eps=layer.eps, num_heads=layer.num_heads // tp, num_kv_heads=layer.num_kv_heads // tp,
        head_dim=layer.head_dim)


def rank_model(w: ModelWeights, rank: int, tp: int) -> RankModel:
    return RankModel(rows_of(w.embed_tokens, rank, tp).clone(), tuple(rank_layer(x, rank, tp) for x in w.layers),
                     w.norm, w.eps, w.rope_theta, w.head_dim)


def random_weights(gen, layout: str) -> ModelWeights:
    return ModelWeights.random(gen, *SHAPES[layout])  # (V, hidden, I, L, H, KVH, D)


def hf_case(seed: int, layout: str, dtype: torch.dtype, P: int, **scalars) -> ModelCase:
    return model_case(seed, SHAPES[layout], dtype, P, **scalars)  # scalars: eps, rope_theta (Qwen3's unless given)


# ---- reading what the ranks return ----------------------------------------------------------------------


def only_rank_zero(results: list, what: str) -> torch.Tensor:
    """Rank 0's tensor; every other rank must return None."""
    for rank, result in enumerate(results[1:], start=1):
        if result is not None:
            raise Mismatch(f"{what}: rank {rank} returned {type(result).__name__}, expected None (only rank 0 "
                           f"returns the gathered logits)")
    if not isinstance(results[0], torch.Tensor):
        raise Mismatch(f"{what}: rank 0 returned {type(results[0]).__name__}, expected the logits tensor")
    return results[0]


def on_every_rank(results: list, expected: torch.Tensor, tol, what: str) -> None:
    for rank, result in enumerate(results):
        if not isinstance(result, torch.Tensor):
            raise Mismatch(f"{what}: rank {rank} returned {type(result).__name__}, expected a tensor on every rank")
        expect_close(result, expected, tol, f"{what} on rank {rank}")


def layer_on_every_rank(group, results: list, expected: torch.Tensor, tol, what: str) -> None:
    """`on_every_rank` for one tp_decoder_layer call: a wrong output from a rank that did not make exactly the
    layer's two all_reduces says so, and breaks that rule (an output all-reduced once more is tp times too large)."""
    try:
        on_every_rank(results, expected, tol, what)
    except Mismatch as failure:
        made = next(((r, names) for r, names in enumerate(group.collectives)
                     if names != ["all_reduce"] * LAYER_ALL_REDUCES), None)
        if made is None:
            raise
        rank, names = made
        raise Mismatch(f"{failure} · rank {rank} made {count_words(names)} in the call: a layer makes exactly "
                       f"{LAYER_ALL_REDUCES} all_reduce (one after o_proj, one after down_proj), nothing else",
                       "two-all-reduces-a-layer") from None


def attribute(obj, name: str):
    try:
        return getattr(obj, name)
    except AttributeError:
        raise Mismatch(f"the shard has no `{name}`") from None


def expect_shard(got, expected: RankLayer, rank: int, tp: int) -> None:
    """The learner's TPLayer against the definition, field by field (tensors exactly)."""
    for name in RankLayer.__dataclass_fields__:
        mine, want = attribute(got, name), getattr(expected, name)
        if isinstance(want, torch.Tensor):
            if not isinstance(mine, torch.Tensor) or tuple(mine.shape) != tuple(want.shape):
                shape = tuple(mine.shape) if isinstance(mine, torch.Tensor) else type(mine).__name__
                raise Mismatch(f"rank {rank} of {tp}: `{name}` has shape {shape}, expected {tuple(want.shape)}")
            if mine.dtype != want.dtype:
                raise Mismatch(f"rank {rank} of {tp}: `{name}` has dtype {str(mine.dtype).removeprefix('torch.')}, "
                               f"expected {str(want.dtype).removeprefix('torch.')}: a shard keeps its layer's dtype (a "
                               f"buffer made with torch.empty or torch.zeros takes the default, float32, unless told)",
                               "-")  # the dtype says it all: no rule of the module to name besides
            if not torch.equal(mine, want):
                raise Mismatch(f"rank {rank} of {tp}: `{name}` holds other values than {shard_words(name)}")
        elif mine != want or type(mine) is not type(want):  # 2.0 heads equal 2, but split no tensor
            raise Mismatch(f"rank {rank} of {tp}: `{name}` is {mine!r}, expected {want!r}" + (
                f" ({type(want).__name__}, not {type(mine).__name__}: use // for a count)" if mine == want else ""))


def shard_words(name: str) -> str:
    return {"qkv_proj": "its q heads' rows, then its k heads', then its v heads' (each part cut on its own)",
            "gate_up_proj": "its gate rows, then its up rows (each part cut on its own)",
            "o_proj": "the columns of its heads", "down_proj": "the columns of its features"}.get(
        name, "the unsharded weight (the same on every rank)")


# ---- the toys ------------------------------------------------------------------------------------------


def index_layer() -> LayerWeights:
    """The toy's layer with every weight entry set to its fused row (or column) number, so a shard shows
    which rows it holds: q rows 0-7, k 8-11, v 12-15; gate 0-3, up 4-7; o_proj and down_proj by column."""
    lay = TOY["layout"]
    H, KVH, D, hidden = lay["num_heads"], lay["num_kv_heads"], lay["head_dim"], lay["hidden"]
    inter = lay["intermediate"]

    def numbered(first, n, width):
        return torch.arange(first, first + n, dtype=torch.float32)[:, None].expand(n, width).clone()

    return LayerWeights(
        q_proj=numbered(0, H * D, hidden), k_proj=numbered(H * D, KVH * D, hidden),
        v_proj=numbered(H * D + KVH * D, KVH * D, hidden), o_proj=numbered(0, H * D, hidden).T.contiguous(),
        q_norm=torch.ones(D), k_norm=torch.ones(D), eps=lay["eps"], num_heads=H, num_kv_heads=KVH, head_dim=D,
        input_layernorm=torch.ones(hidden), post_attention_layernorm=torch.ones(hidden),
        gate_proj=numbered(0, inter, hidden), up_proj=numbered(inter, inter, hidden),
        down_proj=numbered(0, inter, hidden).T.contiguous())


def toy_layer() -> LayerWeights:
    lay = TOY["layout"]
    tensors = {name: torch.tensor(value) for name, value in TOY["layer"].items()}
    return LayerWeights(**tensors, eps=lay["eps"], num_heads=lay["num_heads"], num_kv_heads=lay["num_kv_heads"],
                        head_dim=lay["head_dim"])


def test_toy_shards(impl):
    """the toy: rank 0 of 2 holds fused qkv rows [0-3, 8-9, 12-13], gate/up rows [0, 1, 4, 5], and the o_proj
    and down_proj columns of its heads and features"""
    layer = index_layer()
    expected = {"qkv_proj": TOY["qkv_rows"], "gate_up_proj": TOY["gate_up_rows"]}
    columns = {"o_proj": TOY["o_proj_columns"], "down_proj": TOY["down_columns"]}
    for rank in range(TOY["world_size"]):
        shard = impl.shard_layer(layer, rank, TOY["world_size"])
        for name, rows in expected.items():
            got = attribute(shard, name)
            held = got[:, 0].int().tolist() if isinstance(got, torch.Tensor) and got.dim() == 2 else got
            if held != rows[rank]:
                hint = (" (a contiguous slice of the fused matrix)" if name == "qkv_proj" and
                        held == TOY["contiguous_qkv_rows"][rank] else "")
                raise Mismatch(f"rank {rank}'s `{name}` holds fused rows {held}{hint}, expected {rows[rank]}: "
                               f"{shard_words(name)}")
        for name, cols in columns.items():
            got = attribute(shard, name)
            held = got[0].int().tolist() if isinstance(got, torch.Tensor) and got.dim() == 2 else got
            if held != cols[rank]:
                raise Mismatch(f"rank {rank}'s `{name}` holds columns {held}, expected {cols[rank]}: "
                               f"{shard_words(name)}")


def test_toy_layer_on_two_ranks(impl):
    """the toy layer on 2 ranks gives the single-process output on both"""
    layer, world = toy_layer(), TOY["world_size"]
    x = torch.tensor(TOY["x"])
    cos, sin = rope_tables(layer.head_dim, torch.arange(x.shape[0]), torch.float32)
    group = ranks(impl, world)
    out = group.call("tp_decoder_layer", [(rank_layer(layer, r, world), x, cos, sin) for r in range(world)])
    layer_on_every_rank(group, out, torch.tensor(TOY["output"]), tolerance("toy", torch.float32),
                        "the toy layer's output")


# ---- sharding ------------------------------------------------------------------------------------------

RANK_IDS = lambda tp: f"{tp}-ranks" if tp > 1 else "1-rank"  # noqa: E731 - a case reads "2-ranks", not a bare "2"


SHARD_WORLD_SIZES = [1, 2, 4]  # column_shard, row_shard and merged_column_shard (1: the whole weight)
LAYER_WORLD_SIZES = [2, 4]  # shard_layer
GROUP_SIZES = [2, 4]  # the process groups of the vocabulary checks (a layer's and the model's: SPLITS)
REFUSED_KV_HEADS, REFUSED_WORLD_SIZE = 2, 4  # kv heads that do not divide over the ranks (8 query heads would)
REFUSED_EVEN_HEADS = 6  # heads and kv heads both: more than the ranks, but no multiple of them (the rows divide)


# merged_column_shard's part lists: q, k, v's sizes; one part (a plain column shard); four (any number of parts)
MERGED_PARTS = ([8, 4, 4], [16], (4, 4, 4, 4))  # the last a tuple: any sequence of sizes


@pytest.mark.parametrize("tp", SHARD_WORLD_SIZES, ids=RANK_IDS)
def test_column_row_and_merged_shards(impl, gen, tp):
    """column_shard, row_shard and merged_column_shard give every rank its block, exactly (of 3 ranks too); a size
    the world does not divide raises ValueError"""
    weight = torch.randn(16, 12, generator=gen)
    by_columns = weight.t().contiguous().t()  # the same values laid out by columns (strides (1, 16))
    try:
        expect_every_rank_block(impl, weight, tp)
    except LearnerError as error:
        if "'tuple'" not in str(error):
            raise
        raise error.noted("part_sizes was the tuple (4, 4, 4, 4) here: any sequence of sizes") from None
    for rank in range(tp):
        got = impl.row_shard(by_columns.clone(), rank, tp)
        if isinstance(got, torch.Tensor) and torch.equal(got, columns_of(weight, rank, tp)) and \
                not got.is_contiguous():
            # (a LearnerError: a replay compares values, and every catalogued mistake's are right here)
            raise LearnerError(f"row_shard of a weight [16, 12] laid out by columns (strides (1, 16), a transposed "
                               f"tensor's), rank {rank} of {tp}, gives its columns with strides "
                               f"{tuple(got.stride())}, expected a contiguous tensor: clone keeps a slice's strides, "
                               f".contiguous() lays the shard out by rows", rule="row-shard")
    if tp == 1:  # (once) a world size that is no power of two
        expect_three_ranks(impl, gen)
    if tp > 1:
        # columns the world does not divide: column_shard splits the rows, and raises nothing
        expect_other_side_split(impl, "column_shard", torch.randn(8, 5, generator=gen), rows_of, "rows", "columns")
        expect_value_error(lambda: impl.column_shard(torch.randn(6, 4, generator=gen), 0, 4),
                           "column_shard of 6 rows over 4 ranks")
        expect_value_error(lambda: impl.row_shard(torch.randn(4, 6, generator=gen), 0, 4),
                           "row_shard of 6 columns over 4 ranks")
        # rows the world does not divide: row_shard splits the columns, and raises nothing
        expect_other_side_split(impl, "row_shard", torch.randn(5, 8, generator=gen), columns_of, "columns", "rows")
        # the whole divides (8 rows over 2 ranks), one part does not (3): each part is sharded on its own
        expect_value_error(lambda: impl.merged_column_shard(torch.randn(8, 4, generator=gen), [3, 5], 0, 2),
                           "merged_column_shard of parts [3, 5] over 2 ranks")


def expect_every_rank_block(impl, weight: torch.Tensor, tp: int) -> None:
    """column_shard, row_shard and merged_column_shard (of MERGED_PARTS) of `weight` [16, 12]: every rank's block."""
    for rank in range(tp):
        for name, got, want, parts in (
            ("column_shard", impl.column_shard(weight.clone(), rank, tp), rows_of(weight, rank, tp), None),
            ("row_shard", impl.row_shard(weight.clone(), rank, tp), columns_of(weight, rank, tp), None),
            *(("merged_column_shard", impl.merged_column_shard(weight.clone(), parts, rank, tp),
               torch.cat([rows_of(p, rank, tp) for p in weight.split(parts)]), parts) for parts in MERGED_PARTS),
        ):
            if not isinstance(got, torch.Tensor) or got.shape != want.shape or not torch.equal(got, want):
                shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
                raise Mismatch(f"{name}(weight [16, 12], rank {rank}, world_size {tp}"
                               f"{f', part_sizes {parts}' if parts else ''}) gives {shape} "
                               f"with other values than rank {rank}'s block {tuple(want.shape)}",
                               {"column_shard": "column-shard", "row_shard": "row-shard"}.get(name,
                                                                                              "merged-shard-part-by-part"))


ODD_WORLD = 3  # a world size that is no power of two: only what it splits must divide by it


def expect_three_ranks(impl, gen) -> None:
    """Rank 1 of 3 of a weight of 6 rows (column_shard), 6 columns (row_shard) and parts [3, 6] (merged); 4 rows over
    3 ranks raise ValueError."""
    n = 2 * ODD_WORLD
    for name, weight, want, rule in (
            ("column_shard", torch.randn(n, 4, generator=gen), lambda w: rows_of(w, 1, ODD_WORLD), "column-shard"),
            ("row_shard", torch.randn(4, n, generator=gen), lambda w: columns_of(w, 1, ODD_WORLD), "row-shard")):
        got = getattr(impl, name)(weight.clone(), 1, ODD_WORLD)
        if not isinstance(got, torch.Tensor) or not torch.equal(got, want(weight)):
            raise Mismatch(f"{name} of a weight of shape {list(weight.shape)}, rank 1 of {ODD_WORLD}: expected its "
                           f"block 2..3 (a world size need only divide what it splits, a power of two or not)", rule)
    weight = torch.randn(ODD_WORLD + n, 4, generator=gen)
    got = impl.merged_column_shard(weight.clone(), [ODD_WORLD, n], 1, ODD_WORLD)
    want = torch.cat([rows_of(part, 1, ODD_WORLD) for part in weight.split([ODD_WORLD, n])])
    if not isinstance(got, torch.Tensor) or not torch.equal(got, want):
        raise Mismatch(f"merged_column_shard of parts [{ODD_WORLD}, {n}], rank 1 of {ODD_WORLD}: expected row 1 of the "
                       f"first part and rows 2..3 of the second", "merged-shard-part-by-part")
    expect_value_error(lambda: impl.column_shard(torch.randn(4, 4, generator=gen), 0, ODD_WORLD),
                       f"column_shard of 4 rows over {ODD_WORLD} ranks")


def expect_other_side_split(impl, name: str, weight: torch.Tensor, block_of, split: str, kept: str) -> None:
    """`name` of `weight` over 4 ranks (8 of what it splits, 5 of what it keeps whole) gives rank 1 its block."""
    what, rule = f"{name} of a weight of shape {list(weight.shape)} over 4 ranks", REFUSAL_RULES[name]
    try:
        got = getattr(impl, name)(weight.clone(), 1, 4)
    except LearnerError as error:
        if "raised ValueError" not in str(error):
            raise
        raise Mismatch(f"{what} raised ValueError: it splits the {split}, so only they must divide (the 5 {kept} "
                       f"stay whole)", rule) from None
    if not isinstance(got, torch.Tensor) or not torch.equal(got, block_of(weight, 1, 4)):
        raise Mismatch(f"{what}, rank 1: expected its {split} 2..3, all 5 {kept}", rule)


def expect_value_error(call, what: str) -> None:
    rule = {"column_shard": "column-shard", "row_shard": "row-shard",
            "merged_column_shard": "merged-shard-part-by-part", "shard_model": "shard-model"}.get(
        what.split(" ")[0], "shard-layer")
    try:
        call()
    except LearnerError as error:
        if "raised ValueError" in str(error):
            return
        if "raised AssertionError" in str(error):  # an assert is not the contract's refusal (python -O drops it)
            raise LearnerError(f"{error} · {what} must raise ValueError, not AssertionError: raise ValueError(...) "
                               "rather than assert", rule=rule) from None
        raise
    raise Mismatch(f"{what} returned a result instead of raising ValueError", rule)


ODD_HIDDEN = 41  # shard_layer splits heads and features, never the hidden size: one no world divides is served


@pytest.mark.parametrize("tp", LAYER_WORLD_SIZES, ids=RANK_IDS)
def test_shard_layer_matches_the_definition(impl, gen, tp):
    """shard_layer gives every rank its q, k and v heads, its gate and up features, its o_proj and down_proj
    columns, the shared norms and its own head counts, in the layer's dtype (bfloat16 too), of a layer it cannot
    write to as well"""
    layer = random_weights(gen, "H8-KVH4").layers[0]
    for rank in range(tp):
        expect_shard(impl.shard_layer(layer, rank, tp), rank_layer(layer, rank, tp), rank, tp)
    half = random_weights(gen, "H8-KVH4").to(torch.bfloat16).layers[0]  # a bfloat16 layer: shards of its dtype
    expect_shard(impl.shard_layer(half, 0, tp), rank_layer(half, 0, tp), 0, tp)
    V, _, intermediate, _, H, KVH, D = SHAPES["H8-KVH4"]  # a hidden size no world divides: it is never split
    odd = ModelWeights.random(gen, V, ODD_HIDDEN, intermediate, 1, H, KVH, D).layers[0]
    expect_shard(impl.shard_layer(odd, tp - 1, tp), rank_layer(odd, tp - 1, tp), tp - 1, tp)
    try:  # any object with a layer's attributes, one that cannot be written to: shard_layer keeps nothing on it
        got = impl.shard_layer(frozen(layer), tp - 1, tp)
    except LearnerError as error:
        if "raised AttributeError" not in str(error):
            raise
        raise LearnerError(f"{error} · a layer given as a namedtuple: read the layer, keep nothing on it",
                           error.identifiable, rule="shard-layer") from None
    expect_shard(got, rank_layer(layer, tp - 1, tp), tp - 1, tp)


def test_shard_layer_refuses_kv_heads_that_do_not_divide(impl, gen):
    """shard_layer raises ValueError for 2 kv heads over 4 ranks (8 query heads would divide), and for 6 heads and 6
    kv heads over 4 ranks (more heads than ranks, but not a multiple of them)"""
    V, hidden, intermediate, L, H, KVH, D = LAYOUTS["H8-KVH4"]
    layer = ModelWeights.random(gen, V, hidden, intermediate, 1, H, REFUSED_KV_HEADS, D).layers[0]
    expect_value_error(lambda: impl.shard_layer(layer, 0, REFUSED_WORLD_SIZE),
                       f"shard_layer with {H} heads and {REFUSED_KV_HEADS} kv heads over {REFUSED_WORLD_SIZE} ranks")
    n = REFUSED_EVEN_HEADS
    layer = ModelWeights.random(gen, V, hidden, intermediate, 1, n, n, D).layers[0]  # 6 * D rows: they divide by 4
    expect_value_error(lambda: impl.shard_layer(layer, 0, REFUSED_WORLD_SIZE),
                       f"shard_layer with {n} heads and {n} kv heads over {REFUSED_WORLD_SIZE} ranks (each rank would "
                       f"hold {n}/{REFUSED_WORLD_SIZE} of a head: tp must divide H and KVH, not only be at most them)")


def test_shard_model(impl, gen):
    """shard_model gives each rank its vocabulary rows, every layer's shard and the whole final norm, and refuses a
    vocabulary the ranks do not divide"""
    # another norm eps and RoPE base than Qwen3's 1e-6 and 1e6: a TPWeights that holds Qwen3's constants is wrong here
    w = replace(random_weights(gen, "H4-KVH2"), eps=1e-3, rope_theta=1e4)
    V = w.embed_tokens.shape[0]
    for rank, tp in ((0, 1), (0, 2), (1, 2)):  # one rank too: its TPWeights holds the whole model, fused
        shard = impl.shard_model(w, rank, tp)
        embed = attribute(shard, "embed_tokens")
        if not isinstance(embed, torch.Tensor) or not torch.equal(embed, rows_of(w.embed_tokens, rank, tp)):
            raise Mismatch(f"rank {rank} of {tp}'s `embed_tokens` is not vocabulary rows {rank * V // tp} .. "
                           f"{(rank + 1) * V // tp - 1}")
        layers = attribute(shard, "layers")
        if not isinstance(layers, list):  # a generator, a map: sharded only when walked, and walked only once
            raise Mismatch(f"rank {rank}'s `layers` is a {class_name_of(layers)}, expected a list of its "
                           f"{len(w.layers)} layer shards: shard every layer in shard_model itself (a list "
                           f"comprehension), so that an indivisible head count raises there and every forward can "
                           f"index and walk the layers again",
                           "shard-model")
        if len(layers) != len(w.layers):
            raise Mismatch(f"rank {rank}'s shard has {len(layers)} layers, expected {len(w.layers)}")
        for index, layer in enumerate(layers):
            expect_shard(layer, rank_layer(w.layers[index], rank, tp), rank, tp)
        for name in ("norm", "eps", "rope_theta", "head_dim"):
            mine, want = attribute(shard, name), getattr(w, name)
            same = torch.equal(mine, want) if isinstance(want, torch.Tensor) else mine == want
            if not same:
                shown = f" ({mine}, expected {want})" * (name in ("eps", "rope_theta", "head_dim"))
                raise Mismatch(f"rank {rank}'s `{name}` differs from the model's{shown}: every rank holds it whole, "
                               f"not split, as the model gives it (this model's eps is {w.eps:g} and RoPE base "
                               f"{w.rope_theta:g}, not Qwen3's)")
    V, hidden, intermediate, L, H, KVH, D = SHAPES["H4-KVH2"]
    odd = ModelWeights.random(gen, V - 1, hidden, intermediate, 1, H, KVH, D)  # a vocabulary 2 ranks cannot split
    expect_value_error(lambda: impl.shard_model(odd, 0, 2), f"shard_model of a vocabulary of {V - 1} over 2 ranks")


# ---- the vocabulary, split ----------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", GROUP_SIZES, ids=RANK_IDS)
def test_vocab_parallel_embedding(impl, gen, tp):
    """every rank gets the embedding of every id, whichever rank's block holds it (block edges included), in
    float32 and bfloat16"""
    w = random_weights(gen, "H8-KVH4")
    V, block = w.embed_tokens.shape[0], w.embed_tokens.shape[0] // tp
    edges = [i for r in range(tp) for i in (r * block, r * block + block - 1)]
    ids = torch.tensor(edges + torch.randint(0, V, (6,), generator=gen).tolist())
    group = ranks(impl, tp)
    out = group.call("vocab_parallel_embedding", [(ids, rows_of(w.embed_tokens, r, tp).clone()) for r in range(tp)])
    on_every_rank(out, w.embed_tokens[ids], tolerance("model", torch.float32), f"the embeddings of ids {ids.tolist()}")
    half = w.embed_tokens.bfloat16()  # a bfloat16 shard: the sum over ranks is the lookup itself, in its dtype
    out = group.call("vocab_parallel_embedding", [(ids, rows_of(half, r, tp).clone()) for r in range(tp)])
    on_every_rank(out, half[ids], tolerance("model", torch.bfloat16), f"the bfloat16 embeddings of ids {ids.tolist()}")


@pytest.mark.parametrize("tp", GROUP_SIZES, ids=RANK_IDS)
def test_parallel_lm_head(impl, gen, tp):
    """rank 0 gets the whole vocabulary's logits, the slices in rank order; the other ranks get None"""
    w = random_weights(gen, "H8-KVH4")
    hidden = torch.randn(3, w.embed_tokens.shape[1], generator=gen)
    group = ranks(impl, tp)
    out = group.call("parallel_lm_head", [(hidden, rows_of(w.embed_tokens, r, tp).clone()) for r in range(tp)])
    logits = only_rank_zero(out, "parallel_lm_head")
    expected = hidden.double() @ w.embed_tokens.double().T
    expect_close(logits, expected, tolerance("model", torch.float32), "rank 0's logits")


# ---- a layer and the model ------------------------------------------------------------------------------


LAYER_SPLITS = {**SPLITS, f"tp2-{QWEN3}": (2, QWEN3)}
LAYER_CASES = [(split, dtype) for dtype in DTYPES for split in SPLITS] + [(f"tp2-{QWEN3}", "fp32")]
LAYER_EPS = 1e-3  # the layer check's norm eps, not Qwen3's 1e-6: a layer reads its own


@pytest.mark.parametrize("split, dtype", LAYER_CASES, ids=[f"{split}-{dtype}" for split, dtype in LAYER_CASES])
def test_layer_matches_hf(impl, seed, split, dtype):
    """tp_decoder_layer on every rank gives layer 0's output of HF Qwen3ForCausalLM (float64), for a layer whose norm
    eps is 0.001"""
    tp, layout = LAYER_SPLITS[split]
    dtype = DTYPES[dtype]
    case = hf_case(seed, layout, dtype, 6, eps=LAYER_EPS)
    layer = case.w.layers[0]
    hidden = case.w.embed_tokens[case.prompt]  # [P, hidden]: what layer 0 receives
    cos, sin = rope_tables(case.w.head_dim, torch.arange(6), dtype)
    group = ranks(impl, tp)
    out = group.call("tp_decoder_layer", [(rank_layer(layer, r, tp), hidden, cos, sin) for r in range(tp)])
    tol, what = tolerance("model", dtype), f"layer 0's output ({tp} ranks, norm eps {LAYER_EPS:g})"
    try:
        layer_on_every_rank(group, out, case.steps[(0, "output")], tol, what)
    except Mismatch as failure:
        try:  # the same weights and tokens with Qwen3's eps: a layer that writes 1e-6 in gives this output
            on_every_rank(out, hf_case(seed, layout, dtype, 6).steps[(0, "output")], tol, what)
        except Mismatch:
            raise failure from None
        raise Mismatch(f"{failure} · it is the output of a norm eps of 1e-6, Qwen3's: every norm reads the layer's "
                       f"own eps", "layer-reduces-partial-sums") from None


def count_words(names: list[str]) -> str:
    counted = {n: names.count(n) for n in dict.fromkeys(names)}
    return ", ".join(f"{n} x{c}" for n, c in counted.items()) or "none"


LAYER_ALL_REDUCES = 2  # one after o_proj, one after down_proj; a model makes 2L + 1 (the embedding's too)


def test_collectives(impl, seed):
    """a layer makes exactly two collectives on every rank, both all_reduce (after o_proj, after down_proj);
    the model 2L + 1 all_reduce and one gather"""
    tp, layout = SPLITS["tp2-H4-KVH2"]
    case = hf_case(seed, layout, torch.float32, 5)
    hidden = case.w.embed_tokens[case.prompt]
    cos, sin = rope_tables(case.w.head_dim, torch.arange(5), torch.float32)
    group = ranks(impl, tp)
    group.call("tp_decoder_layer", [(rank_layer(case.w.layers[0], r, tp), hidden, cos, sin) for r in range(tp)])
    for rank, names in enumerate(group.collectives):
        if names != ["all_reduce"] * LAYER_ALL_REDUCES:
            raise Mismatch(f"one tp_decoder_layer call made {count_words(names)} on rank {rank}: expected exactly "
                           f"{LAYER_ALL_REDUCES} all_reduce (one after o_proj, one after down_proj), nothing else")
    group.call("tp_model_forward", [(rank_model(case.w, r, tp), case.prompt) for r in range(tp)])
    L = len(case.w.layers)
    for rank, names in enumerate(group.collectives):
        body, last = names[:-1], names[-1:]
        if body != ["all_reduce"] * (LAYER_ALL_REDUCES * L + 1) or last not in (["gather"], ["all_gather"]):
            # a layer's own collectives are right (above): whole layers' all_reduces and the gather, but for another
            # number of layers, is the model walking other layers than its own, not a layer's step
            layers = (len(body) - 1) / LAYER_ALL_REDUCES
            walked = body == ["all_reduce"] * len(body) and layers.is_integer() and \
                last in (["gather"], ["all_gather"])
            raise Mismatch(f"one tp_model_forward call ({L} layers) made {count_words(names)} on rank {rank}: "
                           f"expected {LAYER_ALL_REDUCES * L + 1} all_reduce (the embedding, then "
                           f"{LAYER_ALL_REDUCES} per layer) and one gather"
                           + f" (the collectives of {int(layers)} layer{'s' * (layers != 1)}: walk every layer of "
                             f"the model, with or without caches)" * walked,
                           # the layers' all_reduces right, the LM head's gather missing: the model's step, not a layer's
                           "model-forward" if names == ["all_reduce"] * (LAYER_ALL_REDUCES * L + 1) or walked else "")


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("split", SPLITS)
def test_model_matches_hf(impl, seed, gen, split, dtype):
    """tp_model_forward: rank 0's logits for every position (all_logits) or the last one match HF Qwen3ForCausalLM,
    the others return None, a bf16 model's caches hold bf16 keys (rotated at positions past 5000 too), and models of
    another eps or RoPE base on the same ranks match too"""
    tp, layout = SPLITS[split]
    P = int(torch.randint(4, 10, (), generator=gen))
    case = hf_case(seed, layout, dtype, P)
    # the last position first: a mistake on one path only is then told from one on both by what it got right
    out = ranks(impl, tp).call("tp_model_forward", [(rank_model(case.w, r, tp), case.prompt) for r in range(tp)])
    expect_close(only_rank_zero(out, "tp_model_forward"), case.logits[-1:], tolerance("model", dtype),
                 f"rank 0's logits without all_logits (the last of {P} tokens only, [1, V])")
    out = ranks(impl, tp).call("tp_model_forward", [(rank_model(case.w, r, tp), case.prompt, None, True)
                                                    for r in range(tp)])
    logits = only_rank_zero(out, "tp_model_forward")
    expect_close(logits, case.logits, tolerance("model", dtype), f"rank 0's logits ({P} tokens, {tp} ranks)")
    if dtype == torch.float32:
        expect_other_models_on_the_same_ranks(impl, seed, tp, layout, P)
    if dtype != torch.float32:
        expect_half_caches_far_in(impl, case, tp, dtype)


def expect_half_caches_far_in(impl, case: ModelCase, tp: int, dtype: torch.dtype) -> None:
    """A half-precision model's prompt after caches of FAR_START zero keys and values: its caches hold its dtype (keys
    rotated by float32 tables are float32: twice the memory, rounded otherwise than HF's, and the logits cannot tell)
    and layer 0's new keys are HF's, rotated at positions FAR_START and on (integers: bfloat16 holds them exactly
    only up to 256)."""
    group = ranks(impl, tp)
    kvh, D = case.w.layers[0].num_kv_heads // tp, case.w.head_dim
    caches = [[group.make_on(r, "KVCache") for _ in case.w.layers] for r in range(tp)]
    for r in range(tp):
        for layer_cache in caches[r]:
            group.set_up(layer_cache, "append", torch.zeros(FAR_START, kvh, D, dtype=dtype),
                         torch.zeros(FAR_START, kvh, D, dtype=dtype))
    group.call("tp_model_forward", [(rank_model(case.w, r, tp), case.prompt, caches[r]) for r in range(tp)])
    name = str(dtype).removeprefix("torch.")
    for rank in range(tp):
        chunks = attribute(caches[rank][0], "k")
        held = sorted({str(c.dtype).removeprefix("torch.") for c in chunks}) if isinstance(chunks, list) else chunks
        if held != [name]:
            raise Mismatch(f"rank {rank}'s layer-0 cache holds keys of dtype {held} in a {name} model: keys and "
                           f"values keep the model's dtype (the RoPE tables too: rope_cos_sin(..., dtype))",
                           "model-forward")
    P = len(case.prompt)
    keys = hf_first_layer_keys(case.w, case.prompt, FAR_START)  # [P, KVH, D]
    for rank in range(tp):
        new = torch.cat(list(attribute(caches[rank][0], "k")))[FAR_START:]
        try:
            expect_close(new, keys[:, rank * kvh : (rank + 1) * kvh], tolerance("model", dtype),
                         f"rank {rank}'s layer-0 cached keys of a {name} model's {P} tokens after {FAR_START} cached")
        except Mismatch as failure:  # (a LearnerError: a replay compares results, not caches)
            raise LearnerError(f"{failure} · each key is rotated at its token's own position, {FAR_START} .. "
                               f"{FAR_START + P - 1} here: positions are integers ({name} holds them exactly only "
                               f"up to 256)", rule="model-forward") from None


OTHER_MODELS = (("eps", 1e-3), ("rope_theta", 1e4))  # on the ranks that served Qwen3's 1e-6 and 1e6 just before


def expect_other_models_on_the_same_ranks(impl, seed: int, tp: int, layout: str, P: int) -> None:
    """Two more models on the same ranks, one with another norm eps, one with another RoPE base: each call reads
    its model's (nothing kept from an earlier model: a frequency or a table of Qwen3's is another model's)."""
    for name, value in OTHER_MODELS:
        case = hf_case(seed, layout, torch.float32, P, **{name: value})
        shards = [rank_model(case.w, r, tp) for r in range(tp)]
        if name == "rope_theta":  # ... whose shard layers are namedtuples (any object with their attributes)
            shards = [replace(m, layers=tuple(frozen(x) for x in m.layers)) for m in shards]
        try:
            out = ranks(impl, tp).call("tp_model_forward", [(shards[r], case.prompt, None, True) for r in range(tp)])
        except LearnerError as error:
            if "raised AttributeError" not in str(error) or name != "rope_theta":
                raise
            raise error.noted("this model's shard layers are namedtuples: read a shard, keep nothing on it") from None
        try:
            expect_close(only_rank_zero(out, "tp_model_forward"), case.logits, tolerance("model", torch.float32),
                         f"rank 0's logits of a model whose {name} is {value:g}, on the same ranks")
        except Mismatch as failure:
            raise Mismatch(f"{failure} · every norm and RoPE reads the model's own {name} at each call (not "
                           f"Qwen3's, nor an earlier model's)", "model-forward") from None


# tokens start .. stop - 1 of each call, and whether it asks for all_logits: two prefill chunks of one length at two
# offsets (the second wants its last row's logits only, as a chunked prompt's last chunk does), a decode step
CHUNKED_CALLS = ((0, 4, True), (4, 8, False), (8, 9, True))


def test_chunked_calls_with_caches(impl, seed):
    """prefill in two chunks (the second without all_logits: its last row's logits, [1, V]), then a decode step, with
    one KVCache per layer on every rank: HF's logits, and each rank's cache holds HF's keys of its own kv heads; and
    a chunk at positions 5000 and 5001"""
    tp, layout = SPLITS["tp2-H8-KVH4"]
    case = hf_case(seed, layout, torch.float32, CHUNKED_CALLS[-1][1])
    group = ranks(impl, tp)
    caches = [[group.make_on(r, "KVCache") for _ in case.w.layers] for r in range(tp)]
    shards = [rank_model(case.w, r, tp) for r in range(tp)]
    tol = tolerance("model", torch.float32)
    for start, stop, every in CHUNKED_CALLS:
        held = [cached_tokens(caches[r][-1]) for r in range(tp)]  # what the earlier calls left in the last layer
        out = group.call("tp_model_forward", [(shards[r], case.prompt[start:stop], caches[r], every)
                                              for r in range(tp)])
        logits = only_rank_zero(out, "tp_model_forward")
        first = start if every else stop - 1  # without all_logits: the last row only
        try:
            expect_close(logits, case.logits[first:stop], tol,
                         f"rank 0's logits for tokens {first} .. {stop - 1} (after {start} cached; all_logits={every})")
        except Mismatch as failure:
            short = [(r, n) for r, n in enumerate(held) if n != start]
            if not short and start and close_enough(logits, alone_logits(case, start, stop)[first - start :], tol):
                raise Mismatch(f"{failure} · they are the logits of tokens {start} .. {stop - 1} alone (at their "
                               f"positions), as if nothing were cached, though every layer's cache held the {start} "
                               f"before them: with a cache, a layer's attention reads every key it holds",
                               "layer-reduces-partial-sums") from None
            if not short:
                raise
            rank, n = short[0]
            raise Mismatch(f"{failure} · rank {rank}'s last layer's cache held {n} tokens' keys before this call, "
                           f"expected {start}: every layer appends each call's keys and values to its own cache",
                           "caches-per-layer-and-rank") from None
    kvh = case.w.layers[0].num_kv_heads // tp
    for rank in range(tp):
        chunks = attribute(caches[rank][0], "k")
        shapes = [tuple(c.shape) for c in chunks] if isinstance(chunks, list) else chunks
        if not isinstance(shapes, list) or [s[1] if len(s) == 3 else None for s in shapes] != [kvh] * len(shapes):
            raise Mismatch(f"rank {rank}'s layer-0 cache holds chunks {shapes}: each rank keeps its own "
                           f"KVH / tp = {kvh} kv heads", "caches-per-layer-and-rank")
    expect_a_chunk_far_in(group, case, shards, tp)
    keys = hf_first_layer_keys(case.w, case.prompt)  # [T, KVH, D]: normed, rotated at positions 0 .. T-1
    for rank in range(tp):  # (the logits cannot tell: every position shifted alike leaves RoPE's scores as they are)
        held = torch.cat(list(attribute(caches[rank][0], "k")))
        try:
            expect_close(held, keys[:, rank * kvh : (rank + 1) * kvh], tol, f"rank {rank}'s layer-0 cached keys")
        except Mismatch as failure:  # (a LearnerError: a replay compares the ranks' results, not their caches, so
            # every mutant whose logits are right here would seem to give these keys)
            raise LearnerError(f"{failure} · a cache holds each token's key normed and rotated at the token's own "
                               f"position (0 .. {len(case.prompt) - 1} over the three calls), for the rank's kv "
                               f"heads {rank * kvh} .. {(rank + 1) * kvh - 1}", rule="model-forward") from None


def alone_logits(case: ModelCase, start: int, stop: int) -> torch.Tensor:
    """HF's float64 logits [stop - start, V] of the case's tokens start .. stop-1 alone, at their positions, with
    nothing cached before them (what a layer that ignores its cache computes for a later chunk)."""
    model = hf_causal_lm(case.w.to(torch.float64), torch.float64)
    with torch.no_grad():
        return model(case.prompt[None, start:stop], position_ids=torch.arange(start, stop)[None],
                     use_cache=False).logits[0]


FAR_START = 5000  # a chunk at positions 5000 and 5001: past 4096, where a RoPE table of a fixed length ends


def expect_a_chunk_far_in(group, case: ModelCase, shards: list, tp: int) -> None:
    """Two tokens after caches holding 5000 zero keys and values per layer: HF's logits at positions 5000 and 5001
    (RoPE at the positions the caches give, however far)."""
    kvh = case.w.layers[0].num_kv_heads // tp
    far = [[group.make_on(r, "KVCache") for _ in case.w.layers] for r in range(tp)]
    for r in range(tp):
        for layer_cache in far[r]:
            group.set_up(layer_cache, "append", torch.zeros(FAR_START, kvh, case.w.head_dim),
                         torch.zeros(FAR_START, kvh, case.w.head_dim))
    tokens = case.prompt[:2]
    out = group.call("tp_model_forward", [(shards[r], tokens, far[r], True) for r in range(tp)])
    expect_close(only_rank_zero(out, "tp_model_forward"), hf_logits_after_zeros(case.w, tokens, FAR_START),
                 tolerance("model", torch.float32),
                 f"rank 0's logits for 2 tokens after caches of {FAR_START} zero keys and values (positions "
                 f"{FAR_START} and {FAR_START + 1}: RoPE at any position the caches give)")


def cached_tokens(cache) -> int | object:
    """The tokens a learner's KVCache holds keys for (its `k` chunks' rows), or what its `k` is when not chunks."""
    chunks = attribute(cache, "k")
    if isinstance(chunks, list) and all(isinstance(c, torch.Tensor) and c.dim() == 3 for c in chunks):
        return sum(c.shape[0] for c in chunks)
    return chunks


GREEDY_TOKENS, GREEDY_RANKS = 8, 2  # tp_generate_greedy's new tokens, on this many ranks


@cache
def greedy_case(seed: int) -> tuple[ModelCase, torch.Tensor]:
    """An fp32 case whose greedy steps are never near-ties (else the next seed's), with HF generate's tokens."""
    for attempt in range(20):
        case = hf_case(seed * 100 + attempt, "H4-KVH2", torch.float32, 7)
        tokens, margins = hf_greedy(hf_causal_lm(case.w, torch.float32), case.prompt, GREEDY_TOKENS)
        if margins.min() > 1e-4:
            return case, tokens
    raise RuntimeError(f"no well-separated greedy case for seed {seed}")


SECOND_PROMPT = 4  # tokens of the prompt a second call on the same shards generates from (shorter than the first's)


@cache
def second_greedy_prompt(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Another prompt for greedy_case's weights whose greedy steps are never near-ties, with HF generate's tokens."""
    case, _ = greedy_case(seed)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(20):
        prompt = torch.randint(case.w.embed_tokens.shape[0], (SECOND_PROMPT,), generator=gen)
        tokens, margins = hf_greedy(hf_causal_lm(case.w, torch.float32), prompt, GREEDY_TOKENS)
        if margins.min() > 1e-4:
            return prompt, tokens
    raise RuntimeError(f"no well-separated second greedy prompt for seed {seed}")


def test_greedy_matches_hf_generate(impl, seed):
    """tp_generate_greedy on 2 ranks: every rank returns HF generate's 8 greedy tokens, each token it feeds back
    broadcast from rank 0 as int64, and a second call on the same shards gives another prompt's"""
    case, expected = greedy_case(seed)
    tp = GREEDY_RANKS
    group = ranks(impl, tp)
    out = group.call("tp_generate_greedy", [(rank_model(case.w, r, tp), case.prompt, GREEDY_TOKENS) for r in range(tp)])
    for rank, tokens in enumerate(out):
        if not isinstance(tokens, torch.Tensor) or tokens.dtype != torch.int64 or tokens.shape != (GREEDY_TOKENS,):
            got = f"shape {list(tokens.shape)} {str(tokens.dtype).removeprefix('torch.')}" \
                if isinstance(tokens, torch.Tensor) else "None" if tokens is None else \
                f"a {type(tokens).__name__} {tokens!r:.60}, not a tensor"
            counted_wrong = isinstance(tokens, torch.Tensor) and tokens.dtype == torch.int64 and tokens.dim() == 1
            only_rank_0 = tokens is None and rank > 0 and isinstance(out[0], torch.Tensor)  # as parallel_lm_head does
            raise Mismatch(f"tp_generate_greedy on rank {rank} returned {got}, expected shape [{GREEDY_TOKENS}] int64: "
                           f"one token id per new token" + (
                               ", on every rank: rank 0 broadcasts each token, so every rank holds them all (None "
                               "off rank 0 is parallel_lm_head's contract, not this one's)" if only_rank_0 else ""),
                           # a count of tokens is the loop's; any other form is a result's, no rule of its own
                           "greedy-broadcasts" if counted_wrong or only_rank_0 else "-")
    # what each forward fed, read from the rows of its embedding's all_reduce (the first after a broadcast)
    hidden, P = case.w.embed_tokens.shape[1], len(case.prompt)
    for rank, made in enumerate(group.shapes):
        tokens = out[rank]
        fed = [math.prod(shape) // hidden for k, (name, shape) in enumerate(made) if name == "all_reduce" and shape
               and (k == 0 or made[k - 1][0] == "broadcast")]
        # (a forward is told by the broadcast before it: without broadcasts fewer are seen, which the broadcasts'
        # own count below says; not a Mismatch: the tokens may be right, and no catalogued mistake is told apart by
        # them here)
        if fed[:1] != [P] or any(n != 1 for n in fed[1:]) or len(fed) > GREEDY_TOKENS:
            raise LearnerError(f"rank {rank}'s forwards in tp_generate_greedy fed {fed} tokens (the rows of each one's "
                               f"embedding all_reduce), expected the {P}-token prompt, then 1 token per step, "
                               f"{GREEDY_TOKENS} forwards for {GREEDY_TOKENS} tokens: the caches hold the rest, and "
                               f"the last token is returned, never fed", rule="greedy-broadcasts")
        if not torch.equal(tokens, expected):
            step = int((tokens != expected).nonzero()[0])
            hint = " · are the other ranks given rank 0's token (a broadcast) before the next step?" if rank else ""
            raise Mismatch(f"rank {rank}: token {step} is {int(tokens[step])}, HF generate chose "
                           f"{int(expected[step])} (HF: {expected.tolist()}){hint}")
    for rank, made in enumerate(group.shapes):  # right tokens, and each one fed back came from rank 0 by a broadcast
        names = [name for name, _ in made]
        floats = sorted({str(dtype).removeprefix("torch.") for (name, _), dtype in zip(made, group.dtypes[rank])
                         if name == "broadcast" and dtype is not None and dtype.is_floating_point})
        if floats:
            raise LearnerError(f"rank {rank} broadcast the tokens it feeds back as {', '.join(floats)}: a token id is "
                               f"an integer, broadcast as int64 (bfloat16 holds ids exactly only up to 256, float16 "
                               f"up to 2048: a bfloat16 model's id 562 would arrive as 560)", rule="greedy-broadcasts")
        if names.count("broadcast") < GREEDY_TOKENS - 1:
            others = count_words([n for n in names if n not in ("all_reduce", "gather", "all_gather")])
            raise LearnerError(f"rank {rank} made {names.count('broadcast')} broadcast calls in tp_generate_greedy "
                               f"(and {others} besides the forwards' all_reduce and gather), expected one per token "
                               f"fed back, {GREEDY_TOKENS - 1} at least: rank 0's argmax reaches every rank by "
                               f"dist.broadcast(token, src=0)", rule="greedy-broadcasts")
    # ... and twice on shards that live on the ranks (as an engine keeps them), another prompt the second time: each
    # call generates from caches of its own, empty, whatever an earlier call on those shards left
    shards = [rank_model(case.w, r, tp) for r in range(tp)]
    held = [group.make_on(r, "TPWeights", s.embed_tokens, list(s.layers), s.norm, s.eps, s.rope_theta, s.head_dim)
            for r, s in enumerate(shards)]
    second, second_expected = second_greedy_prompt(seed)
    for prompt, want in ((case.prompt, expected), (second, second_expected), (second, second_expected[:1])):
        out = group.call("tp_generate_greedy", [(held[r], prompt, len(want)) for r in range(tp)])
        for rank, tokens in enumerate(out):
            if isinstance(tokens, torch.Tensor) and tokens.shape != want.shape:  # one token is [1], not 0-d
                raise Mismatch(f"rank {rank}: tp_generate_greedy with max_new_tokens {len(want)} returned shape "
                               f"{list(tokens.shape)}, expected [{len(want)}] int64: one id per new token, one token "
                               f"too", "-")
            if not isinstance(tokens, torch.Tensor) or not torch.equal(tokens, want):
                got = tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens
                if prompt is case.prompt:  # (right on shards sent with the call, so their kind is what differs)
                    raise Mismatch(f"rank {rank}: tp_generate_greedy on shards made on the rank (a TPWeights) gave "
                                   f"{got}, HF generate {want.tolist()}: read the shards' fields, whatever their class")
                raise Mismatch(f"rank {rank}: a second call on the same shards (prompt {second.tolist()}) gave {got}, "
                               f"HF generate {want.tolist()}: each call makes new, empty caches, one per layer (an "
                               f"earlier call's keys are another prompt's)", "caches-per-layer-and-rank")
