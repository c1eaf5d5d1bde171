"""How to run P08's toy: `toy_cases/p08_moe.json` (4 tokens of hidden 2, 4 experts of width 1, top-2) through
the reference's `route`, `permute`, `fused_moe` (the Triton kernel: in Triton's interpreter where there is no
GPU, see `_kernels.py`), `moe_block` and, on 2 ranks played by threads (`checks/harness/simdist.py`),
`expert_parallel_moe`.

Worked here and tied to the reference with `agree` (or compared exactly, for the integer tensors): the logits
and the float32 softmax, whose top 2 and renormalised top 2 must be the reference's weights; each pair's expert,
gate, up and SiLU(gate) * up, whose down product must be the kernel's row; each token's weighted sum of its two
rows, which must be the block's output and the toy file's; on 2 ranks, the pairs each rank sends and receives,
read from the toy file and checked against the routing. Where this build cannot run kernels, the steps that
need one say so (`NOT_RUN`).
"""


import torch

from book.i18n import T
from book.toys import Field, Scenario, Step, Table, ToyDrift, _kernels, agree, vector
from checks.harness.simdist import run_ranks
from checks.harness.toys import load_toy

F32 = torch.float32
STORED = 5e-5  # the toy file stores its real numbers to 4 decimals


def _tensor(value, dtype=F32, device=None) -> torch.Tensor:
    return torch.tensor(value, dtype=dtype, device=device)


def _inputs(module, toy: dict, norm: bool = True, device=None):
    x = _tensor(toy["hidden_states"], device=device)
    w = module.MoEWeights(_tensor(toy["router"], device=device), _tensor(toy["gate_up_proj"], device=device),
                          _tensor(toy["down_proj"], device=device), toy["top_k"], norm)
    return x, w


def _permutation(module, toy: dict, device=None):
    """The toy's kernel permutation (block size 16) as the module's `Permutation`, built from the toy file."""
    kp = toy["kernel_permutation"]
    ints = {name: torch.tensor(kp[name], dtype=torch.int64, device=device)
            for name in ("order", "block_expert", "counts", "offsets")}
    return module.Permutation(ints["order"], ints["block_expert"], ints["counts"], ints["offsets"])


def _by_pair(rows: torch.Tensor, order: torch.Tensor, pairs: int) -> torch.Tensor:
    """The rows that hold a pair, put in pair order: `[T*k, hidden]` (a pair no row holds stays NaN)."""
    rows, order = rows.cpu(), order.cpu()
    out = torch.full((pairs, rows.shape[1]), float("nan"), dtype=rows.dtype)
    real = order < pairs
    out[order[real]] = rows[real]
    return out


# ---- the scenarios the mistakes are shown on ---------------------------------------------------------------


def _route_fields(module, toy: dict, norm: bool) -> list[Field]:
    x, w = _inputs(module, toy, norm)
    weights, ids = module.route(x, w.router, toy["top_k"], norm)
    return [Field("expert_ids", T("expert_ids", "expert_ids"), _ints_text(ids.flatten())),
            Field("weights", T("weights", "weights"), weights)]


def _permute_fields(module, toy: dict) -> list[Field]:
    ids = torch.tensor(toy["expert_ids"], dtype=torch.int64)
    perm = module.permute(ids, toy["num_experts"], toy["permutation"]["block_size"])
    return [Field(name, T(name, name), _ints_text(getattr(perm, name)))
            for name in ("order", "block_expert", "counts", "offsets")]


def _ints_text(values) -> str:
    return "[" + ", ".join(str(int(v)) for v in values) + "]"


def _kernel_fields(module, toy: dict) -> list[Field]:
    device = _kernels.device()
    x, w = _inputs(module, toy, device=device)
    perm = _permutation(module, toy, device)
    with _kernels.quiet():
        rows = module.fused_moe(x, w.gate_up_proj, w.down_proj, perm, toy["kernel_permutation"]["block_size"])
        _kernels.synchronize()
    pairs = toy["T"] * toy["top_k"]
    return [Field("rows", T("rows, in pair order", "rows（按 pair 的顺序）"), _by_pair(rows, perm.order, pairs))]


def _block_fields(module, toy: dict, norm: bool) -> list[Field]:
    device = _kernels.device()
    x, w = _inputs(module, toy, norm, device)
    before = x.clone()
    with _kernels.quiet():
        out = module.moe_block(x, w, toy["kernel_permutation"]["block_size"])
        _kernels.synchronize()
    inputs = T("unchanged", "未被修改") if torch.equal(x, before) else T("hidden changed in place", "hidden 被原地修改")
    return [Field("output", T("output", "输出"), out.cpu()), Field("inputs", T("inputs", "输入"), inputs)]


def _ep_run(module, toy: dict) -> list[torch.Tensor]:
    device = _kernels.device()
    x, w = _inputs(module, toy, device=device)
    ranks = toy["expert_parallel"]["world_size"]
    shards = [module.shard_experts(w, r, ranks) for r in range(ranks)]
    tokens = toy["expert_parallel"]["tokens"]
    with _kernels.quiet():  # simdist runs the ranks' interpreted kernels one at a time
        found = run_ranks(module.expert_parallel_moe, [(x[rows].clone(), shard) for rows, shard in
                                                       zip(tokens, shards, strict=True)], ranks)
        _kernels.synchronize()
    return [out.cpu() for out in found]


def _ep_fields(module, toy: dict) -> list[Field]:
    return [Field(f"rank{r}", T(f"rank {r} returns", f"rank {r} 的返回值"), out)
            for r, out in enumerate(_ep_run(module, toy))]


def scenarios(toy: dict) -> list[Scenario]:
    found = [
        Scenario("route-off", T("route(hidden, router, 2, norm_topk_prob=False)",
                                "route(hidden, router, 2, norm_topk_prob=False)"),
                 lambda module: _route_fields(module, toy, False)),
        Scenario("route-on", T("route(hidden, router, 2, norm_topk_prob=True)",
                               "route(hidden, router, 2, norm_topk_prob=True)"),
                 lambda module: _route_fields(module, toy, True)),
        Scenario("permute", T(f"permute(expert_ids, 4, {toy['permutation']['block_size']})",
                              f"permute(expert_ids, 4, {toy['permutation']['block_size']})"),
                 lambda module: _permute_fields(module, toy)),
    ]
    if _kernels.device() is not None:
        bs = toy["kernel_permutation"]["block_size"]
        found += [
            Scenario("kernel", T(f"fused_moe on the toy's permutation with block_size {bs}",
                                 f"在 toy 的排列上调用 fused_moe，block_size 为 {bs}"),
                     lambda module: _kernel_fields(module, toy)),
            Scenario("block", T("moe_block(hidden, w) with norm_topk_prob=True", "moe_block(hidden, w)，norm_topk_prob=True"),
                     lambda module: _block_fields(module, toy, True)),
            Scenario("block-off", T("moe_block(hidden, w) with norm_topk_prob=False",
                                    "moe_block(hidden, w)，norm_topk_prob=False"),
                     lambda module: _block_fields(module, toy, False)),
            Scenario("expert-parallel", T("expert_parallel_moe on 2 ranks, tokens 0, 1 on rank 0 and 2, 3 on rank 1",
                                          "在 2 个 rank 上调用 expert_parallel_moe，rank 0 持有 token 0、1，rank 1 持有 token 2、3"),
                     lambda module: _ep_fields(module, toy)),
        ]
    return found


# ---- probes: what 4 tokens in float32 never exercise --------------------------------------------------------


PROBE_CASE = T("cases like the checks' (40 random tokens of hidden 64 routed over 4 experts of width 32, top-2: in "
               "bfloat16 for the router, in float32 through the block, where most experts fill a 16-row block)",
               "和检查里一样的用例（40 个随机 token，hidden 64，路由到 4 个宽度为 32 的专家，top-2：路由用 bfloat16，"
               "整个块用 float32，大多数专家都能填满一个 16 行的块）")
PROBE_TOKENS, PROBE_HIDDEN, PROBE_EXPERTS, PROBE_WIDTH = 40, 64, 4, 32


def probe_weights(module, dtype=F32, device=None):
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(PROBE_TOKENS, PROBE_HIDDEN, generator=gen)
    router = torch.randn(PROBE_EXPERTS, PROBE_HIDDEN, generator=gen) / 4
    gate_up = torch.randn(PROBE_EXPERTS, 2 * PROBE_WIDTH, PROBE_HIDDEN, generator=gen) / 8
    down = torch.randn(PROBE_EXPERTS, PROBE_HIDDEN, PROBE_WIDTH, generator=gen) / 6
    move = lambda t: t.to(dtype=dtype, device=device).contiguous()  # noqa: E731
    return move(x), module.MoEWeights(move(router), move(gate_up), move(down), 2, True)


def _probe_route(module) -> list[Field]:
    x, w = probe_weights(module, torch.bfloat16)
    weights, ids = module.route(x, w.router, w.top_k, True)
    return [Field("expert_ids", T("expert_ids", "expert_ids"), ids.float()),
            Field("weights", T("weights (bf16, shown in float32)", "weights（bf16，以 float32 显示）"), weights.float())]


def _probe_block(module) -> list[Field]:
    x, w = probe_weights(module, F32, _kernels.device())
    with _kernels.quiet():
        out = module.moe_block(x, w, 16)
        _kernels.synchronize()
    return [Field("output", T("output", "输出"), out.cpu())]


def probes() -> list[Scenario]:
    found = [Scenario("probe-router-bf16", T("route on 40 bfloat16 tokens over 4 experts, top-2, renormalised",
                                             "在 40 个 bfloat16 token、4 个专家上调用 route，top-2，重新归一化"),
                      _probe_route)]
    if _kernels.device() is not None:
        found.append(Scenario("probe-blocks", T("moe_block on 40 tokens over 4 experts, block_size 16",
                                                "在 40 个 token、4 个专家上调用 moe_block，block_size 16"),
                              _probe_block))
    return found


# ---- the walk-through ---------------------------------------------------------------------------------------


def _stored(got: torch.Tensor, stored, what: str) -> None:
    want = _tensor(stored)
    if got.shape != want.shape or not torch.allclose(got.double().cpu(), want.double(), atol=STORED, rtol=0):
        raise ToyDrift(f"{what}: the reference gives {vector(got.flatten())}, toy_cases/p08_moe.json stores "
                       f"{vector(want.flatten())}: the toy file and solutions/ disagree")


def _same(got, want, what: str) -> None:
    if got != want:
        raise ToyDrift(f"{what}: the reference gives {got}, toy_cases/p08_moe.json stores {want}: the toy file and "
                       "solutions/ disagree")


def _router_step(reference, toy: dict) -> Step:
    x, w = _inputs(reference, toy)
    k = toy["top_k"]
    logits = x @ w.router.T  # [T, E]
    probs = torch.softmax(logits.float(), dim=-1)  # [T, E], float32 over all experts
    top, ids = torch.topk(probs, k, dim=-1)
    renormalised = top / top.sum(-1, keepdim=True)
    off, ids_off = reference.route(x, w.router, k, False)
    on, ids_on = reference.route(x, w.router, k, True)
    _same(ids_off.tolist(), ids.tolist(), "the top-2 experts")
    _same(ids_on.tolist(), toy["expert_ids"], "the top-2 experts")
    agree(top, off, "the top-2 probabilities (norm_topk_prob off)")
    agree(renormalised, on, "the renormalised weights (norm_topk_prob on)")
    _stored(logits, toy["logits"], "the logits")
    _stored(probs, toy["probs"], "the probabilities")
    _stored(on, toy["weights"], "the weights")
    _stored(off, toy["top_probs"], "the top-2 probabilities")
    rows = [[str(t), x[t], logits[t], probs[t], _ints_text(ids_on[t]), off[t], on[t]] for t in range(x.shape[0])]
    table = Table.of("router", [T("token", "token"), "hidden", "logits = hidden · routerᵀ",
                                T("softmax (float32)", "softmax（float32）"), T("top-2 experts", "top-2 专家"),
                                T("their probabilities (norm off)", "它们的概率（不归一化）"),
                                T("weights (renormalised)", "weights（重新归一化）")], rows)
    text = T(f"Token 0 = {vector(x[0])} scores {vector(logits[0])} against the 4 router rows. The softmax runs over all "
             f"4 experts; the top 2 are experts {int(ids_on[0, 0])} and {int(ids_on[0, 1])} with "
             f"{vector(off[0])}, which sum to {float(off[0].sum()):.4f}. Divided by that sum they become "
             f"{vector(on[0])}: the two logits differ by 1, so the first is 1 / (1 + e^-1). Expert 1 is in no "
             "token's top 2.",
             f"token 0 = {vector(x[0])} 与 4 行路由权重的打分是 {vector(logits[0])}。softmax 在全部 4 个专家上计算；"
             f"前 2 名是专家 {int(ids_on[0, 0])} 和 {int(ids_on[0, 1])}，概率 {vector(off[0])}，和为 "
             f"{float(off[0].sum()):.4f}。除以这个和之后变成 {vector(on[0])}：两个 logit 相差 1，所以第一个就是 "
             "1 / (1 + e^-1)。专家 1 不在任何 token 的前 2 名里。")
    return Step(T("1. The router", "1. 路由"), table, text)


def _permute_step(reference, toy: dict) -> Step:
    ids = torch.tensor(toy["expert_ids"], dtype=torch.int64)
    E, k, T_ = toy["num_experts"], toy["top_k"], toy["T"]
    rows = []
    for block_size, stored in ((toy["permutation"]["block_size"], toy["permutation"]),
                               (toy["kernel_permutation"]["block_size"], toy["kernel_permutation"])):
        perm = reference.permute(ids, E, block_size)
        for name in ("order", "block_expert", "counts", "offsets"):
            _same([int(v) for v in getattr(perm, name)], stored[name], f"permute(..., {block_size}).{name}")
        flat = ids.flatten().tolist()
        mine = [p for p in range(T_ * k)]
        for e in range(E):
            group = [p for p in mine if flat[p] == e]
            start, end = int(perm.offsets[e]), int(perm.offsets[e + 1])
            order = [int(v) for v in perm.order[start:end]]
            if order[:len(group)] != group or any(v != T_ * k for v in order[len(group):]):
                raise ToyDrift(f"expert {e}'s rows {order} are not its pairs {group} padded with {T_ * k}")
            shown = (_ints_text(order) if len(order) <= 4 else
                     _ints_text(order[:len(group)]) + f" + {len(order) - len(group)} × {T_ * k}")
            blocks = [b for b, v in enumerate(perm.block_expert.tolist()) if v == e]
            rows.append([str(block_size), str(e), _ints_text(group), str(int(perm.counts[e])),
                         f"{start} .. {end}" if end > start else T("none", "无"), shown,
                         _ints_text(blocks) if blocks else T("none", "无")])
    table = Table.of("permute", ["block_size", T("expert", "专家"), T("its pairs t·k + j", "它的 pair（t·k + j）"),
                                 "counts", T("rows offsets[e] .. offsets[e+1]", "行 offsets[e] .. offsets[e+1]"),
                                 T("order on those rows", "这些行上的 order"), T("blocks", "块")], rows)
    small = toy["permutation"]
    text = T(f"Pair t·k + j is token t's j-th choice: the 8 pairs choose experts {_ints_text(ids.flatten())}. With "
             f"block_size {small['block_size']}, order = {_ints_text(small['order'])}, offsets = "
             f"{_ints_text(small['offsets'])}, block_expert = {_ints_text(small['block_expert'])}: each padding row "
             f"holds the sentinel {T_ * k} = T·k, and expert 1, which no token chose, has no row (offsets[1] = "
             f"offsets[2]). The kernel needs blocks of at least 16 rows (the smallest tl.dot tile), so the block runs "
             f"with block_size 16: the same groups, each padded to 16 rows.",
             f"pair t·k + j 是 token t 的第 j 个选择：8 个 pair 选的专家依次是 {_ints_text(ids.flatten())}。"
             f"block_size 为 {small['block_size']} 时，order = {_ints_text(small['order'])}，offsets = "
             f"{_ints_text(small['offsets'])}，block_expert = {_ints_text(small['block_expert'])}：每个补齐的行里是"
             f"哨兵值 {T_ * k} = T·k；没有 token 选中的专家 1 一行也没有（offsets[1] = offsets[2]）。kernel 的块至少要 "
             "16 行（tl.dot 最小的 tile），所以整个 MoE 块用 block_size 16 运行：分组不变，每组补齐到 16 行。")
    return Step(T("2. The pairs, sorted by expert and padded", "2. 按专家排序并补齐的 pair"), table, text)


def _worked_pairs(toy: dict, w) -> list[tuple]:
    """Each pair's (token, expert, gate, up, silu(gate) * up, expert output), worked here from the toy's weights."""
    x, k = _tensor(toy["hidden_states"]), toy["top_k"]
    ids = torch.tensor(toy["expert_ids"]).flatten()
    I = w.down_proj.shape[2]  # noqa: E741 - the experts' width
    worked = []
    for p in range(ids.shape[0]):
        e, t = int(ids[p]), p // k
        g_u = w.gate_up_proj[e] @ x[t]  # [2I]: the gate rows first
        gate, up = g_u[:I], g_u[I:]
        act = torch.nn.functional.silu(gate) * up  # [I]
        worked.append((t, e, gate, up, act, w.down_proj[e] @ act))  # [hidden]
    return worked


def _kernel_step(reference, toy: dict) -> Step:
    _, w = _inputs(reference, toy)
    pairs = toy["T"] * toy["top_k"]
    ids = torch.tensor(toy["expert_ids"]).flatten()
    worked = _worked_pairs(toy, w)
    by_pair = torch.stack([row for *_, row in worked])
    _stored(by_pair, toy["pair_outputs"], "the experts' outputs per pair")
    kp = toy["kernel_permutation"]
    position = {p: i for i, p in enumerate(kp["order"]) if p < pairs}
    ran = _kernels.device() is not None
    if ran:
        got = _kernel_fields(reference, toy)[0].value
        agree(by_pair, got, "the kernel's rows")
    rows = [[str(position[p]), str(p), str(t), str(e), gate, up, act, got[p] if ran else _kernels.NOT_RUN]
            for p, (t, e, gate, up, act, _) in enumerate(worked)]
    rows.sort(key=lambda row: int(row[0]))
    table = Table.of("kernel", [T("row i", "第 i 行"), "order[i]", T("token", "token"), T("expert", "专家"), "gate",
                                "up", "silu(gate) · up", T("rows[i] = down · that", "rows[i] = down · 它")], rows)
    where = _kernels.where()
    text = T(f"One program per block of 16 rows: {len(kp['block_expert'])} programs, for experts "
             f"{_ints_text(kp['block_expert'])}. Row {position[1]} holds pair 1, token 0's second choice, expert "
             f"{int(ids[1])}: gate = 3, up = 2, silu(3) · 2 = 5.7154, times down's column [1, -1]. The rows are not "
             f"weighted yet, and the padding rows (order[i] = {pairs}) are never read. The kernel ran {where.en}.",
             f"每 16 行一个块、一个 program：共 {len(kp['block_expert'])} 个 program，对应专家 "
             f"{_ints_text(kp['block_expert'])}。第 {position[1]} 行是 pair 1，也就是 token 0 的第二个选择、专家 "
             f"{int(ids[1])}：gate = 3，up = 2，silu(3) · 2 = 5.7154，再乘以 down 的那一列 [1, -1]。这些行还没有乘权重；"
             f"补齐的行（order[i] = {pairs}）之后不会被读。kernel {where.zh}运行。")
    return Step(T("3. The kernel: each block through its expert", "3. kernel：每个块过它自己的专家"), table, text)


def _combine_step(reference, toy: dict) -> Step:
    x, w = _inputs(reference, toy)
    k, T_ = toy["top_k"], toy["T"]
    weights, _ = reference.route(x, w.router, k, True)  # step 1 tied these to the worked softmax
    by_pair = torch.stack([row for *_, row in _worked_pairs(toy, w)])  # step 3 tied these to the kernel
    sums = (by_pair.view(T_, k, -1) * weights[:, :, None]).sum(1)  # [T, hidden]
    agree(sums, reference.moe_reference(x, w), "the weighted sums against moe_reference")
    _stored(sums, toy["output"], "the block's output")
    ran = _kernels.device() is not None
    if ran:
        block = _block_fields(reference, toy, True)[0].value
        agree(sums, block, "the weighted sums against moe_block")
        off = _block_fields(reference, toy, False)[0].value
        _stored(off, toy["output_not_renormalised"], "the block's output with norm_topk_prob off")
    ids = toy["expert_ids"]
    rows = [[str(t), _ints_text(ids[t]), weights[t], by_pair[t * k], by_pair[t * k + 1], sums[t],
             block[t] if ran else _kernels.NOT_RUN] for t in range(T_)]
    table = Table.of("combine", [T("token", "token"), T("experts", "专家"), "weights",
                                 T("row of pair t·k", "pair t·k 的行"), T("row of pair t·k + 1", "pair t·k + 1 的行"),
                                 T("weighted sum", "加权和"), T("moe_block returns", "moe_block 的返回值")], rows)
    text = T(f"Token 0: {vector(weights[0])[1:7]} · {vector(by_pair[0])} + {vector(weights[0])[9:-1]} · "
             f"{vector(by_pair[1])} = {vector(sums[0])}. Each weight is applied once. Without the renormalisation "
             f"(norm_topk_prob false) token 0 would get {vector(_tensor(toy['output_not_renormalised'])[0])}: the "
             "weights 0.6623 and 0.2436 sum to less than 1.",
             f"token 0：{vector(weights[0])[1:7]} · {vector(by_pair[0])} + {vector(weights[0])[9:-1]} · "
             f"{vector(by_pair[1])} = {vector(sums[0])}。每个权重只乘一次。不重新归一化（norm_topk_prob 为 false）"
             f"时，token 0 得到的是 {vector(_tensor(toy['output_not_renormalised'])[0])}：权重 0.6623 和 0.2436 "
             "加起来不到 1。")
    return Step(T("4. Back to the tokens, weighted", "4. 加权，回到各个 token"), table, text)


def _ep_step(reference, toy: dict) -> Step:
    ep = toy["expert_parallel"]
    ids = toy["expert_ids"]
    R, E, k = ep["world_size"], toy["num_experts"], toy["top_k"]
    Er = E // R
    for r in range(R):  # what the toy file says each rank sends follows from the routing alone
        mine = [ids[t][j] for t in ep["tokens"][r] for j in range(k)]
        _same(ep["pairs_per_expert"][r], [mine.count(e) for e in range(E)], f"rank {r}'s pairs per expert")
        _same(ep["send_sizes"][r], [sum(1 for e in mine if e // Er == d) for d in range(R)], f"rank {r}'s sends")
    shards = [reference.shard_experts(_inputs(reference, toy)[1], r, R) for r in range(R)]
    _same([s.first_expert for s in shards], [experts[0] for experts in ep["experts"]], "each rank's first expert")
    ran = _kernels.device() is not None
    outs = _ep_run(reference, toy) if ran else [None] * R
    if ran:
        whole = _block_fields(reference, toy, True)[0].value  # the one-rank block, [T, hidden]
        for r in range(R):
            agree(whole[ep["tokens"][r]], outs[r], f"rank {r}'s rows of the one-rank block")
            _stored(outs[r], [toy["output"][t] for t in ep["tokens"][r]], f"rank {r}'s output")
    rows = []
    for r in range(R):
        arrived = ", ".join(f"t{t}→e{e}" for _, t, e in ep["arrivals"][r])
        rows.append([str(r), _ints_text(ep["experts"][r]), _ints_text(ep["tokens"][r]),
                     _ints_text(ep["pairs_per_expert"][r]), _ints_text(ep["send_sizes"][r]),
                     _ints_text(ep["received_per_expert"][r]), arrived, outs[r] if ran else _kernels.NOT_RUN])
    table = Table.of("expert_parallel", [T("rank", "rank"), T("its experts", "它的专家"), T("its tokens", "它的 token"),
                                         T("its pairs per expert", "它发往各专家的 pair 数"),
                                         T("rows sent to rank 0, 1", "发给 rank 0、1 的行数"),
                                         T("counts received", "收到的计数"),
                                         T("rows received (token→expert)", "收到的行（token→专家）"),
                                         T("returns", "返回值")], rows)
    text = T(f"Rank r holds experts {Er}r .. {Er}r + {Er - 1} and the whole router. The first all_to_all sends each "
             "rank's pairs-per-expert counts to the experts' owners; the second the token rows, sorted by expert; the "
             "third the results back in the order they came. Rank 0 runs expert 0 on 3 rows and expert 1 on none; "
             "rank 1 runs 5 rows. Each rank returns its own tokens' rows of the one-rank block.",
             f"rank r 持有专家 {Er}r .. {Er}r + {Er - 1} 和整个路由权重。第一次 all_to_all 把每个 rank 发往各专家的 "
             "pair 数送到专家的所有者手里；第二次送按专家排好序的 token 行；第三次把结果按来时的顺序送回去。rank 0 "
             "让专家 0 算 3 行、专家 1 一行不算；rank 1 算 5 行。每个 rank 返回的是单 rank MoE 块里属于它自己那些 "
             "token 的行。")
    return Step(T("5. The experts on 2 ranks", "5. 专家分在 2 个 rank 上"), table, text)


def walkthrough(reference, toy: dict) -> list[Step]:
    return [_router_step(reference, toy), _permute_step(reference, toy), _kernel_step(reference, toy),
            _combine_step(reference, toy), _ep_step(reference, toy)]


if __name__ == "__main__":  # a quick look: python -m book.toys.p08_moe
    from checks.harness.loader import named

    for step in walkthrough(named("solutions").load("p08_moe"), load_toy("p08_moe")):
        print(step.title.en, step.table.id, len(step.table.rows))
