"""How to run P07's toy: the 2-rank split of `toy_cases/p07_tensor_parallel.json`, with threads standing in for
the ranks (`checks/harness/simdist.py`), so no process group is needed at build time.

Four runs on the toy. (a) Who holds what: `shard_layer` on a layer whose entries are their own row index (qkv,
gate/up) or column index (o_proj, down_proj), so that each shard reads as the rows or columns it holds; they
must be the toy file's lists (else `ToyDrift`). (b) The vocab-parallel embedding of the toy's ids on an
embedding whose row v is `10·v + [0, 1, 2, 3]`. (c) The numeric layer on each rank, whose output must be the
toy file's single-process output. (d) The LM head on the same embedding, gathered to rank 0.

Worked here and tied to the reference with `agree`: each rank's local ids, mask and partial rows, which add up
to the reference's embedding; each rank's heads (m02's `attention_forward` from solutions/, on the rank's
shard), its o_proj partial sum, its SwiGLU features and its down_proj partial sum, whose sums over the ranks
must be the tensors the reference's `tp_decoder_layer` all-reduced (read as it runs); the LM head's slices.
"""

import threading
from types import SimpleNamespace

import torch
import torch.distributed as dist

from book.i18n import T
from book.toys import Cell, Field, Scenario, Step, Table, ToyDrift, agree, vector
from checks.harness.simdist import run_ranks
from checks.harness.toys import load_toy

F32 = torch.float32
STORED = 5e-5  # the toy file stores the layer's output to 4 decimals

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
_REST = ("input_layernorm", "post_attention_layernorm", "gate_proj", "up_proj", "down_proj")
_COLLECTIVES = ("all_reduce", "gather", "all_gather", "broadcast")


def _tensor(value) -> torch.Tensor:
    return torch.tensor(value, dtype=F32)


def _ints(values) -> list[int]:
    return [int(v) for v in values]


def _layer(toy: dict, tensors: dict) -> SimpleNamespace:
    """An m04 layer (any object with its attributes) with the toy's head counts."""
    layout = toy["layout"]
    return SimpleNamespace(**tensors, eps=layout["eps"], num_heads=layout["num_heads"],
                           num_kv_heads=layout["num_kv_heads"], head_dim=layout["head_dim"])


def _numeric_layer(toy: dict) -> SimpleNamespace:
    return _layer(toy, {name: _tensor(value) for name, value in toy["layer"].items()})


def _encoded_layer(toy: dict) -> SimpleNamespace:
    """The toy's shapes, each entry its own index: a row index in the fused qkv (q 0.., k after q, v after k)
    and in the fused gate/up (gate 0.., up after gate), a column index in o_proj and down_proj."""
    layout = toy["layout"]
    H, KVH, D, hidden, inter = (layout[k] for k in ("num_heads", "num_kv_heads", "head_dim", "hidden",
                                                    "intermediate"))

    def rows(start: int, n: int) -> torch.Tensor:
        return torch.arange(start, start + n, dtype=F32)[:, None].expand(n, hidden).clone()

    def columns(n: int) -> torch.Tensor:
        return torch.arange(n, dtype=F32)[None, :].expand(hidden, n).clone()

    tensors = {"q_proj": rows(0, H * D), "k_proj": rows(H * D, KVH * D), "v_proj": rows((H + KVH) * D, KVH * D),
               "o_proj": columns(H * D), "gate_proj": rows(0, inter), "up_proj": rows(inter, inter),
               "down_proj": columns(inter), "q_norm": torch.ones(D), "k_norm": torch.ones(D),
               "input_layernorm": torch.ones(hidden), "post_attention_layernorm": torch.ones(hidden)}
    return _layer(toy, tensors)


def _embedding(toy: dict) -> torch.Tensor:
    """Row v is 10·v + [0, 1, 2, ...]: a looked-up row says which id it is."""
    V, hidden = toy["vocab"]["size"], toy["layout"]["hidden"]
    return (10 * torch.arange(V, dtype=F32)[:, None] + torch.arange(hidden, dtype=F32)[None, :]).contiguous()


def _tables(module, toy: dict, T_: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = module.inverse_frequencies(toy["layout"]["head_dim"], toy["layout"]["rope_theta"])
    return module.rope_cos_sin(torch.arange(T_), inv_freq, F32)


# ---- collectives, noted as a rank makes them -----------------------------------------------------------


_noting = threading.local()
_install = threading.Lock()


def _noted(name: str, collective):
    def collective_noted(*args, **kwargs):
        collective(*args, **kwargs)
        calls = getattr(_noting, "calls", None)
        if calls is not None:  # all_reduce sums in place: what it leaves is the summed tensor
            calls.append((name, args[0].clone() if name == "all_reduce" else None))

    collective_noted.noted = True
    return collective_noted


def _noting_collectives(function):
    """`function` on one rank, returning `(result, [(collective, tensor after it) ...])`. The simulated
    collectives that `run_ranks` puts in place are wrapped once per run (it puts the real ones back after)."""

    def on_rank(*args):
        with _install:
            for name in _COLLECTIVES:
                if not getattr(getattr(dist, name), "noted", False):
                    setattr(dist, name, _noted(name, getattr(dist, name)))
        _noting.calls = []
        try:
            return function(*args), _noting.calls
        finally:
            _noting.calls = None

    return on_rank


def _calls_text(noted: list[list]) -> T:
    names = [", ".join(name for name, _ in calls) or "—" for calls in noted]
    if len(set(names)) == 1:
        return T(f"each rank: {names[0]}", f"每个 rank：{names[0]}")
    return T("; ".join(f"rank {r}: {n}" for r, n in enumerate(names)),
             "；".join(f"rank {r}：{n}" for r, n in enumerate(names)))


# ---- (a) who holds what ------------------------------------------------------------------------------


def _held(shard) -> dict:
    """What an encoded layer's shard holds: row ids of the column-parallel weights, column ids of the others."""
    return {"qkv": _ints(shard.qkv_proj[:, 0]), "gate_up": _ints(shard.gate_up_proj[:, 0]),
            "o_proj": _ints(shard.o_proj[0]), "down": _ints(shard.down_proj[0]),
            "heads": [int(shard.num_heads), int(shard.num_kv_heads)]}


HELD = {"qkv": T("qkv_proj rows, per rank", "每个 rank 的 qkv_proj 行"),
        "gate_up": T("gate_up_proj rows, per rank", "每个 rank 的 gate_up_proj 行"),
        "o_proj": T("o_proj columns, per rank", "每个 rank 的 o_proj 列"),
        "down": T("down_proj columns, per rank", "每个 rank 的 down_proj 列"),
        "heads": T("num_heads, num_kv_heads, per rank", "每个 rank 的 num_heads、num_kv_heads")}


def _sharding_fields(module, toy: dict) -> list[Field]:
    held = [_held(module.shard_layer(_encoded_layer(toy), r, toy["world_size"])) for r in range(toy["world_size"])]
    return [Field(key, label, [h[key] for h in held]) for key, label in HELD.items()]


# ---- (b) the vocab-parallel embedding -------------------------------------------------------------------


def _blocks(toy: dict) -> list[torch.Tensor]:
    embedding = _embedding(toy)
    return [embedding[rows].clone() for rows in toy["vocab"]["rows"]]


def _embedding_fields(module, toy: dict) -> list[Field]:
    ids = torch.tensor(toy["vocab"]["ids"])
    found = run_ranks(module.vocab_parallel_embedding, [(ids.clone(), block) for block in _blocks(toy)],
                      toy["world_size"])
    return [Field(f"rank{r}", T(f"rank {r} returns", f"rank {r} 的返回值"), out) for r, out in enumerate(found)]


# ---- (c) the layer ------------------------------------------------------------------------------------------


def _layer_run(module, toy: dict) -> tuple[list, list, bool]:
    x = _tensor(toy["x"])
    cos, sin = _tables(module, toy, x.shape[0])
    shards = [module.shard_layer(_numeric_layer(toy), r, toy["world_size"]) for r in range(toy["world_size"])]
    args = [(shard, x.clone(), cos.clone(), sin.clone()) for shard in shards]
    found = run_ranks(_noting_collectives(module.tp_decoder_layer), args, toy["world_size"])
    unchanged = all(torch.equal(a[1], x) and torch.equal(a[2], cos) and torch.equal(a[3], sin) for a in args)
    return [out for out, _ in found], [calls for _, calls in found], unchanged


def _layer_fields(module, toy: dict) -> list[Field]:
    outs, noted, unchanged = _layer_run(module, toy)
    inputs = (T("unchanged", "未被修改") if unchanged else
              T("hidden, cos or sin changed in place", "hidden、cos 或 sin 被原地修改"))
    return [*(Field(f"out{r}", T(f"output on rank {r}", f"rank {r} 上的输出"), out) for r, out in enumerate(outs)),
            Field("collectives", T("collectives", "集合通信"), _calls_text(noted)),
            Field("inputs", T("inputs", "输入"), inputs)]


# ---- (d) the LM head ---------------------------------------------------------------------------------------


def _head_fields(module, toy: dict) -> list[Field]:
    x = _tensor(toy["x"])
    found = run_ranks(module.parallel_lm_head, [(x.clone(), block) for block in _blocks(toy)], toy["world_size"])
    others = ["None" if out is None else f"a tensor {list(out.shape)}" for out in found[1:]]
    return [Field("rank0", T("rank 0 returns", "rank 0 的返回值"), found[0]),
            Field("others", T("the other ranks return", "其他 rank 的返回值"), ", ".join(others))]


def scenarios(toy: dict) -> list[Scenario]:
    ids, tp = vector(toy["vocab"]["ids"]), toy["world_size"]
    return [
        Scenario("sharding", T(f"shard_layer(layer, r, {tp}) on the layer whose entries are their row or column ids",
                               f"shard_layer(layer, r, {tp})，层里每个元素就是它的行号或列号"),
                 lambda module: _sharding_fields(module, toy)),
        Scenario("embedding", T(f"vocab_parallel_embedding({ids}, rank's block) on {tp} ranks",
                                f"在 {tp} 个 rank 上调用 vocab_parallel_embedding({ids}, 本 rank 的块)"),
                 lambda module: _embedding_fields(module, toy)),
        Scenario("layer", T(f"tp_decoder_layer on {tp} ranks, the toy's layer and x",
                            f"在 {tp} 个 rank 上调用 tp_decoder_layer，用 toy 的层和 x"),
                 lambda module: _layer_fields(module, toy)),
        Scenario("lm-head", T(f"parallel_lm_head(x, rank's block) on {tp} ranks",
                              f"在 {tp} 个 rank 上调用 parallel_lm_head(x, 本 rank 的块)"),
                 lambda module: _head_fields(module, toy)),
    ]


# ---- probes: what a 2-rank split of one layer never exercises ------------------------------------------


PROBE_CASE = T("runs like the checks' (the toy's layer split over 4 ranks, where its 2 kv heads do not divide; "
               "column_shard of a matrix of 6 rows, as many as the toy's vocabulary, over 4 ranks, which do not "
               "divide them; and a one-layer model built on the toy's layer, with a vocabulary of 6, generating 4 "
               "tokens greedily on 2 ranks and giving rank 0's logits for its prompt, without caches and with them; "
               "and the same model with the toy's layer twice, two layers, generating 4 tokens greedily on 2 ranks)",
               "和检查里一样的运行（把 toy 的层切到 4 个 rank 上，它的 2 个 kv head 分不开；用 column_shard 把一个 "
               "6 行的矩阵（行数和 toy 的词表一样）切给 4 个 rank，6 行分不开；用 toy 的层搭一个单层模型，"
               "词表大小 6，在 2 个 rank 上贪心生成 4 个 token，并给出 rank 0 上 prompt 的 logits（不带 cache "
               "和带 cache 各一次）；以及把 toy 的层用两次、搭成两层的同一个模型，在 2 个 rank 上贪心生成 4 个 token）")

PROMPT = [4, 0, 5, 2]
NEW_TOKENS = 4


def _split_fields(module, toy: dict, world_size: int = 4) -> list[Field]:
    try:
        shards = [module.shard_layer(_encoded_layer(toy), r, world_size) for r in range(world_size)]
    except ValueError:
        return [Field("split", T(f"shard_layer(layer, r, {world_size})", f"shard_layer(layer, r, {world_size})"),
                      T("raises ValueError", "抛出 ValueError"))]
    held = [_held(s) for s in shards]
    kv = ", ".join(str(h["heads"][1]) for h in held)
    rows = " ".join(vector(h["qkv"]) for h in held)
    return [Field("split", T(f"shard_layer(layer, r, {world_size})", f"shard_layer(layer, r, {world_size})"),
                  T(f"returns shards with num_kv_heads {kv} and qkv rows {rows}",
                    f"返回了分片：num_kv_heads 为 {kv}，qkv 行为 {rows}"))]


SIX_HEADS = 6  # heads and kv heads: more than 4 ranks, but no multiple of them


def _with_heads(toy: dict, n: int) -> dict:
    """The toy with `n` heads and `n` kv heads (its other sizes kept)."""
    return {**toy, "layout": {**toy["layout"], "num_heads": n, "num_kv_heads": n}}


def _column_split_fields(module, toy: dict, world_size: int = 4) -> list[Field]:
    """column_shard of a matrix whose row i is all i, with as many rows as the toy's vocabulary, over
    `world_size` ranks that do not divide them: the rows each rank gets, or the ValueError."""
    n, hidden = toy["vocab"]["size"], toy["layout"]["hidden"]
    weight = torch.arange(n, dtype=F32)[:, None].expand(n, hidden).contiguous()
    label = T(f"column_shard({n} rows, r, {world_size})", f"column_shard({n} 行, r, {world_size})")
    try:
        held = [_ints(module.column_shard(weight.clone(), r, world_size)[:, 0]) for r in range(world_size)]
    except ValueError:
        return [Field("split", label, T("raises ValueError", "抛出 ValueError"))]
    rows = ", ".join(vector(h) for h in held)
    return [Field("split", label, T(f"returns rows {rows}", f"返回的行为 {rows}"))]


def probe_model(toy: dict, layers: int = 1) -> SimpleNamespace:
    """The toy's layer (`layers` times) under a random embedding of 6 tokens: an m04 `Qwen3Weights` (any object
    with its attributes)."""
    layout = toy["layout"]
    gen = torch.Generator().manual_seed(4)
    embed = torch.randn(toy["vocab"]["size"], layout["hidden"], generator=gen, dtype=F32)
    return SimpleNamespace(embed_tokens=embed, layers=[_numeric_layer(toy) for _ in range(layers)],
                           norm=torch.ones(layout["hidden"]),
                           eps=layout["eps"], rope_theta=layout["rope_theta"], head_dim=layout["head_dim"])


def _greedy_fields(module, toy: dict, layers: int = 1) -> list[Field]:
    model, tp = probe_model(toy, layers), toy["world_size"]
    shards = [module.shard_model(model, r, tp) for r in range(tp)]
    found = run_ranks(module.tp_generate_greedy, [(s, torch.tensor(PROMPT), NEW_TOKENS) for s in shards], tp)
    return [Field(f"tokens{r}", T(f"tokens on rank {r}", f"rank {r} 上的 token"), vector(tokens))
            for r, tokens in enumerate(found)]


def _logits_fields(module, toy: dict, caches: bool = False) -> list[Field]:
    model, tp = probe_model(toy), toy["world_size"]
    shards = [module.shard_model(model, r, tp) for r in range(tp)]
    found = run_ranks(module.tp_model_forward, [(s, torch.tensor(PROMPT), *([[module.KVCache() for _ in s.layers]]
                                                                           if caches else [])) for s in shards], tp)
    logits = "None" if found[0] is None else found[0].round(decimals=4)
    return [Field("logits", T("rank 0's logits", "rank 0 的 logits"), logits)]


def probes() -> list[Scenario]:
    toy = load_toy("p07_tensor_parallel")
    return [
        Scenario("probe-split4", T("shard_layer of the toy's layer for 4 ranks (H = 4, KVH = 2)",
                                   "把 toy 的层切给 4 个 rank（H = 4，KVH = 2）"),
                 lambda module: _split_fields(module, toy)),
        Scenario("probe-greedy", T(f"tp_generate_greedy({vector(PROMPT)}, {NEW_TOKENS}) on 2 ranks",
                                   f"在 2 个 rank 上调用 tp_generate_greedy({vector(PROMPT)}, {NEW_TOKENS})"),
                 lambda module: _greedy_fields(module, toy)),
        Scenario("probe-logits", T(f"tp_model_forward({vector(PROMPT)}) on 2 ranks: rank 0's logits of the last "
                                   "token",
                                   f"在 2 个 rank 上调用 tp_model_forward({vector(PROMPT)})：rank 0 上最后一个 "
                                   "token 的 logits"),
                 lambda module: _logits_fields(module, toy)),
        Scenario("probe-logits-with-caches",
                 T(f"tp_model_forward({vector(PROMPT)}, caches) on 2 ranks, one KVCache per layer, without "
                   "all_logits: rank 0's logits",
                   f"在 2 个 rank 上调用 tp_model_forward({vector(PROMPT)}, caches)，每层一个 KVCache，"
                   "不带 all_logits：rank 0 的 logits"),
                 lambda module: _logits_fields(module, toy, caches=True)),
        Scenario("probe-two-layers", T(f"tp_generate_greedy({vector(PROMPT)}, {NEW_TOKENS}) on 2 ranks, the toy's "
                                       "layer twice (two layers)",
                                       f"在 2 个 rank 上调用 tp_generate_greedy({vector(PROMPT)}, {NEW_TOKENS})，"
                                       "toy 的层用两次（两层）"),
                 lambda module: _greedy_fields(module, toy, layers=2)),
        Scenario("probe-split-6-heads", T("shard_layer of a layer like the toy's, with 6 heads and 6 kv heads, for 4 "
                                          "ranks",
                                          "把一个和 toy 一样、但有 6 个 head 和 6 个 kv head 的层切给 4 个 rank"),
                 lambda module: _split_fields(module, _with_heads(toy, SIX_HEADS))),
        Scenario("probe-column-split", T(f"column_shard of {toy['vocab']['size']} rows for 4 ranks",
                                         f"用 column_shard 把 {toy['vocab']['size']} 行切给 4 个 rank"),
                 lambda module: _column_split_fields(module, toy)),
    ]


# ---- the walk-through ---------------------------------------------------------------------------------------


def _same(got, want, what: str) -> None:
    if got != want:
        raise ToyDrift(f"{what}: the reference gives {got}, toy_cases/p07_tensor_parallel.json stores {want}: the toy "
                       "file and solutions/ disagree")


def _parts(ids: list[int], sizes: list[int], names: tuple[str, ...]) -> list[str]:
    """`ids` cut into the fused matrix's parts: 'q [0, 1, 2, 3]', 'k [8, 9]', ..."""
    found, start = [], 0
    for name, size in zip(names, sizes, strict=True):
        found.append(f"{name} {vector(ids[start:start + size])}")
        start += size
    return found


def _sharding_step(reference, toy: dict) -> Step:
    layout, tp = toy["layout"], toy["world_size"]
    layer = _encoded_layer(toy)
    held = [_held(reference.shard_layer(layer, r, tp)) for r in range(tp)]
    for key, stored in (("qkv", "qkv_rows"), ("gate_up", "gate_up_rows"), ("o_proj", "o_proj_columns"),
                        ("down", "down_columns")):
        _same([h[key] for h in held], toy[stored], f"the rows/columns of {key} per rank")
    fused = torch.cat([layer.q_proj, layer.k_proj, layer.v_proj])
    contiguous = [_ints(reference.column_shard(fused, r, tp)[:, 0]) for r in range(tp)]
    _same(contiguous, toy["contiguous_qkv_rows"], "a contiguous slice of the fused qkv")
    Hr, KVHr, D = layout["num_heads"] // tp, layout["num_kv_heads"] // tp, layout["head_dim"]
    Ir = layout["intermediate"] // tp
    rows = []
    for r, h in enumerate(held):
        q, kv = _span(r * Hr, Hr), _span(r * KVHr, KVHr)
        heads = T(f"q heads {q}, kv head{'s' if KVHr > 1 else ''} {kv}", f"q head {q}，kv head {kv}")
        rows.append([str(r), heads, _cell(_parts(h["qkv"], [Hr * D, KVHr * D, KVHr * D], ("q", "k", "v"))),
                     _cell(_parts(h["gate_up"], [Ir, Ir], ("gate", "up"))), h["o_proj"], h["down"],
                     f"{h['heads'][0]}, {h['heads'][1]}"])
    table = Table.of("sharding", [T("rank", "rank"), T("owns", "拥有"), T("qkv_proj rows", "qkv_proj 的行"),
                                  T("gate_up_proj rows", "gate_up_proj 的行"), T("o_proj columns", "o_proj 的列"),
                                  T("down_proj columns", "down_proj 的列"), "num_heads, num_kv_heads"], rows)
    k_rows = toy["qkv_rows"][1][Hr * D:(Hr + KVHr) * D]
    text = T(f"The fused qkv stacks q (rows 0..{layout['num_heads'] * D - 1}), k and v. Rank 1 takes its share of "
             f"each part: its k rows are {vector(k_rows)}, kv head {KVHr}'s. A contiguous slice of the fused matrix "
             f"would give rank 0 rows {vector(contiguous[0])} (all of q) and rank 1 rows {vector(contiguous[1])} "
             "(all of k and v). o_proj and down_proj are split the other way, by the columns that read the rank's "
             "heads and features.",
             f"融合的 qkv 依次叠放 q（第 0..{layout['num_heads'] * D - 1} 行）、k 和 v。rank 1 从每一部分各取自己的"
             f"那一份：它的 k 行是 {vector(k_rows)}，也就是 kv head {KVHr} 的。若把融合矩阵连续地切一刀，rank 0 会拿到"
             f"第 {vector(contiguous[0])} 行（全是 q），rank 1 拿到第 {vector(contiguous[1])} 行（全是 k 和 v）。"
             "o_proj 和 down_proj 则按另一个方向切：按读取本 rank 的 head 和特征的那些列。")
    return Step(T("1. Who holds what", "1. 谁拿哪一块"), table, text)


def _cell(lines: list[str]) -> Cell:
    return Cell(tuple(lines), kind="text")


def _shown(value: torch.Tensor) -> torch.Tensor:
    """A worked tensor as the page prints it: 4 decimals, so that -1 + 0.99999911 (eps at work) reads 0."""
    return value.round(decimals=4)


def _span(start: int, n: int) -> str:
    """Head or feature numbers `start .. start + n - 1`, as '2..3' (or '1' for one)."""
    return str(start) if n == 1 else f"{start}..{start + n - 1}"


def _embedding_step(reference, toy: dict) -> Step:
    vocab, tp = toy["vocab"], toy["world_size"]
    ids = torch.tensor(vocab["ids"])
    blocks = _blocks(toy)
    found = run_ranks(reference.vocab_parallel_embedding, [(ids.clone(), block) for block in blocks], tp)
    embedding = _embedding(toy)
    agree(found[0], embedding[ids], "the embedding of the toy's ids")
    rows, total = [], torch.zeros_like(found[0])
    for r, block in enumerate(blocks):
        start = r * block.shape[0]
        mine = (ids >= start) & (ids < start + block.shape[0])
        local = torch.where(mine, ids - start, 0)
        _same(_ints(local), vocab["local"][r], f"rank {r}'s local ids")
        _same([bool(m) for m in mine], vocab["mine"][r], f"rank {r}'s mask")
        partial = block[local] * mine[:, None].to(block.dtype)
        total = total + partial
        rows.append([str(r), vector(vocab["rows"][r]), _ints(local), _cell(["✓" if m else "·" for m in mine]),
                     partial, found[r]])
    for r in range(tp):
        agree(total, found[r], f"rank {r}'s all_reduce of the partial rows")
    table = Table.of("embedding", [T("rank", "rank"), T("vocabulary block", "词表块"),
                                   T("local ids (ids − block start, else 0)", "本地 id（id − 块起点，否则为 0）"),
                                   T("id in the block", "id 在块内"),
                                   T("partial rows: block[local] · mask", "部分行：block[local] · mask"),
                                   T("after all_reduce", "all_reduce 之后")], rows)
    text = T(f"The ids {vector(vocab['ids'])}, and an embedding whose row v is 10·v + [0, 1, 2, 3]. Rank 0 holds ids "
             f"{vector(vocab['rows'][0])}: id 4 is not in its block, so it looks up its row 0 and zeroes it. Each "
             "row of the sum comes from the one rank that holds its id.",
             f"id 为 {vector(vocab['ids'])}，embedding 的第 v 行是 10·v + [0, 1, 2, 3]。rank 0 拿着 id "
             f"{vector(vocab['rows'][0])}：id 4 不在它的块里，于是它查自己的第 0 行，再把它置零。和里的每一行都只来自"
             "拿着那个 id 的那一个 rank。")
    return Step(T("2. The vocab-parallel embedding", "2. 按词表切分的 embedding"), table, text)


def _rank_attention(reference, shard, normed, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    """The rank's heads' outputs `[T, Hr*D]` and its o_proj partial sum `[T, hidden]`, by m02's attention on the
    rank's shard (with an identity o_proj for the heads, then the rank's o_proj columns)."""
    q_rows, kv_rows = shard.num_heads * shard.head_dim, shard.num_kv_heads * shard.head_dim
    q, k, v = torch.split(shard.qkv_proj, [q_rows, kv_rows, kv_rows])
    weights = SimpleNamespace(q_proj=q, k_proj=k, v_proj=v, o_proj=torch.eye(q_rows), q_norm=shard.q_norm,
                              k_norm=shard.k_norm, eps=shard.eps, num_heads=shard.num_heads,
                              num_kv_heads=shard.num_kv_heads, head_dim=shard.head_dim)
    heads = reference.attention_forward(weights, normed, cos, sin)  # [T, Hr*D]
    partial = heads @ shard.o_proj.T  # [T, hidden]: row-parallel, a partial sum
    weights.o_proj = shard.o_proj
    agree(partial, reference.attention_forward(weights, normed, cos, sin), "the rank's attention through o_proj")
    return heads, partial


def _layer_steps(reference, toy: dict) -> list[Step]:
    tp, eps = toy["world_size"], toy["layout"]["eps"]
    x = _tensor(toy["x"])
    cos, sin = _tables(reference, toy, x.shape[0])
    shards = [reference.shard_layer(_numeric_layer(toy), r, tp) for r in range(tp)]
    outs, noted, _ = _layer_run(reference, toy)
    if any([name for name, _ in calls] != ["all_reduce", "all_reduce"] for calls in noted):
        raise ToyDrift(f"the reference's layer makes {_calls_text(noted).en}, not two all_reduce calls")
    normed = reference.rms_norm(x, shards[0].input_layernorm, eps)
    heads, partials = zip(*(_rank_attention(reference, s, normed, cos, sin) for s in shards), strict=True)
    attention = sum(partials[1:], partials[0])
    for r in range(tp):
        agree(attention, noted[r][0][1], f"rank {r}'s first all_reduce (after o_proj)")
    h = x + attention
    normed2 = reference.rms_norm(h, shards[0].post_attention_layernorm, eps)
    features, mlp_parts = [], []
    for s in shards:
        gate, up = (normed2 @ s.gate_up_proj.T).chunk(2, dim=-1)  # [T, Ir] each
        features.append(torch.nn.functional.silu(gate) * up)
        mlp_parts.append(features[-1] @ s.down_proj.T)  # [T, hidden]: a partial sum
    mlp = sum(mlp_parts[1:], mlp_parts[0])
    for r in range(tp):
        agree(mlp, noted[r][1][1], f"rank {r}'s second all_reduce (after down_proj)")
        agree(h + mlp, outs[r], f"rank {r}'s output")
    stored = _tensor(toy["output"])
    if not torch.allclose(outs[0], stored, atol=STORED, rtol=0):
        raise ToyDrift(f"the layer on {tp} ranks gives {vector(outs[0].flatten())}, toy_cases/ stores "
                       f"{vector(stored.flatten())}")
    layout = toy["layout"]
    Hr, KVHr, Ir = layout["num_heads"] // tp, layout["num_kv_heads"] // tp, layout["intermediate"] // tp
    attention_rows = [[str(r), f"{_span(r * Hr, Hr)} · {_span(r * KVHr, KVHr)}",
                       *(_shown(t) for t in (heads[r], partials[r], noted[r][0][1], x + noted[r][0][1]))]
                      for r in range(tp)]
    first = Table.of("attention", [T("rank", "rank"), T("q heads · kv heads", "q head · kv head"),
                                   T("its heads' outputs [T, Hr·D]", "本 rank 各 head 的输出 [T, Hr·D]"),
                                   T("partial sum: heads · o_proj columnsᵀ", "部分和：heads · o_proj 的列ᵀ"),
                                   T("after all_reduce", "all_reduce 之后"), "h = x + attention"], attention_rows)
    mlp_rows = [[str(r), _span(r * Ir, Ir), *(_shown(t) for t in (features[r], mlp_parts[r], noted[r][1][1], outs[r]))]
                for r in range(tp)]
    second = Table.of("mlp", [T("rank", "rank"), T("features", "特征"),
                              T("silu(gate) · up [T, Ir]", "silu(gate) · up [T, Ir]"),
                              T("partial sum: · down_proj columnsᵀ", "部分和：· down_proj 的列ᵀ"),
                              T("after all_reduce", "all_reduce 之后"), "out = h + mlp"], mlp_rows)
    text_one = T(f"x = {vector(x[0])}, {vector(x[1])} at positions 0 and 1. Each rank runs m02's attention on its "
                 f"{Hr} query heads and {KVHr} kv head{'s' if KVHr > 1 else ''}, with no communication, and its o_proj "
                 f"columns turn them into a partial sum of the whole output: row 0 is {vector(partials[0][0])} on rank "
                 f"0 and {vector(partials[1][0])} on rank 1. The first all_reduce adds them, "
                 f"{vector(attention[0])}, on every rank, and only then is the residual added, once.",
                 f"x = {vector(x[0])}、{vector(x[1])}，位于位置 0 和 1。每个 rank 只在自己的 {Hr} 个 query head 和 "
                 f"{KVHr} 个 kv head 上跑 m02 的 attention，不需要通信；它的 o_proj 列把这些 head 变成整个输出的"
                 f"一个部分和：第 0 行在 rank 0 上是 {vector(partials[0][0])}，"
                 f"在 rank 1 上是 {vector(partials[1][0])}。第一次 all_reduce 把它们加起来，每个 rank 都得到 "
                 f"{vector(attention[0])}，之后才加残差，只加一次。")
    text_two = T(f"Each rank computes {Ir} of the {layout['intermediate']} SwiGLU features from its gate and up rows, "
                 "and its down_proj columns give a partial sum; the second all_reduce completes it. Every rank ends "
                 f"with the same output, {vector(outs[0][0])}, {vector(outs[0][1])}: the toy file's single-process "
                 "output. Each rank made exactly two collectives, both all_reduce.",
                 f"每个 rank 用自己的 gate 行和 up 行算出 {layout['intermediate']} 个 SwiGLU 特征中的 {Ir} 个，它的 "
                 "down_proj 列给出一个部分和；第二次 all_reduce 把它补全。每个 rank 最后得到同样的输出 "
                 f"{vector(outs[0][0])}、{vector(outs[0][1])}：正是 toy 文件里单进程的输出。每个 rank 恰好做了两次"
                 "集合通信，都是 all_reduce。")
    return [Step(T("3. Attention on each rank, then the first all_reduce",
                   "3. 每个 rank 上的 attention，然后第一次 all_reduce"), first, text_one),
            Step(T("4. The MLP on each rank, then the second all_reduce",
                   "4. 每个 rank 上的 MLP，然后第二次 all_reduce"), second, text_two)]


def _head_step(reference, toy: dict) -> Step:
    tp = toy["world_size"]
    x = _tensor(toy["x"])
    blocks = _blocks(toy)
    found = run_ranks(reference.parallel_lm_head, [(x.clone(), block) for block in blocks], tp)
    slices = [x @ block.T for block in blocks]  # [T, Vr] per rank
    agree(torch.cat(slices, dim=-1), found[0], "the gathered logits")
    agree(found[0], x @ _embedding(toy).T, "the logits against the whole embedding")
    rows = [[str(r), vector(toy["vocab"]["rows"][r]), slices[r],
             found[r] if found[r] is not None else "None"] for r in range(tp)]
    table = Table.of("lm_head", [T("rank", "rank"), T("vocabulary block", "词表块"),
                                 T("its logits slice: x · blockᵀ", "它的 logits 切片：x · blockᵀ"),
                                 T("returns", "返回值")], rows)
    text = T(f"The LM head is the embedding again (tied). Each rank scores x against its {blocks[0].shape[0]} rows; "
             "gather brings the slices to rank 0, which puts them side by side in rank order, its own first. The "
             "other ranks return None.",
             f"LM head 又是那个 embedding（共享权重）。每个 rank 用自己的 {blocks[0].shape[0]} 行给 x 打分；gather "
             "把各个切片收到 rank 0，rank 0 按 rank 的顺序把它们并排拼起来，自己的排第一。其他 rank 返回 None。")
    return Step(T("5. The vocab-parallel LM head", "5. 按词表切分的 LM head"), table, text)


def walkthrough(reference, toy: dict) -> list[Step]:
    return [_sharding_step(reference, toy), _embedding_step(reference, toy), *_layer_steps(reference, toy),
            _head_step(reference, toy)]
