"""How to run P03's toy: the seed article's row of `toy_cases/p03_flash_attention.json` through
`online_softmax_step` and `online_softmax` (float64), shifted by -302 (float32), then as one query over four
keys through `tiled_attention` and the Triton kernel `flash_attn_varlen` (float16).

The running states, the outputs and the log-sum-exps come from the reference (the kernel's in Triton's
interpreter where there is no GPU, see `_kernels.py`; where this build cannot run kernels, the PyTorch
steps only), and must equal the ones the toy file stores (else `ToyDrift`; the float16 rows within the
checks' float16 tolerance). Worked here and tied to the reference with `agree`: the one-shot softmax
(`exp(s - max)`, its sum, the weights, the weighted values, the LSE), and, per block, the rescaling
factor `exp(m_old - m_new)`, the rescaled old sums and the block's own terms.
"""

import math

import torch

from book.i18n import T
from book.toys import Cell, Field, Scenario, Step, Table, ToyDrift, _kernels, agree, call, inputs_field, number, vector
from checks.harness.compare import close_enough, tolerance

F64, F16 = torch.float64, torch.float16
EXACT = 1e-6  # the toy file holds float64 values to 10 decimals


def _row(toy: dict, dtype=F64) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(toy["scores"], dtype=dtype), torch.tensor(toy["values"], dtype=dtype)


def _start(dtype=F64, m: float = float("-inf")):
    """The state before the first block: m (-inf, or what a mistake starts from), sum_exp 0, acc 0."""
    return torch.tensor(m, dtype=dtype), torch.tensor(0.0, dtype=dtype), torch.zeros(1, dtype=dtype)


def _same(got, want, what: str, atol: float = EXACT) -> None:
    got = got.detach().double().cpu() if isinstance(got, torch.Tensor) else torch.tensor(got, dtype=F64)
    want = torch.tensor(want, dtype=F64)
    if got.shape != want.shape or not torch.allclose(got, want, atol=atol, rtol=0):
        raise ToyDrift(f"{what}: the reference gives {vector(got.flatten())}, toy_cases/p03_flash_attention.json "
                       f"stores {vector(want.flatten())}: the toy file and solutions/ disagree")


def _steps(module, toy: dict, dtype=F64, m: float = float("-inf")) -> list[tuple]:
    """The state after each of the toy's blocks, through `online_softmax_step`."""
    state, found = _start(dtype, m), []
    for step in toy["steps"]:
        state = module.online_softmax_step(*state, torch.tensor(step["block"], dtype=dtype),
                                           torch.tensor(step["block_values"], dtype=dtype))
        found.append(state)
    return found


def kernel_inputs(toy: dict, device=None) -> tuple:
    """The row as one query over four keys: q = e0, k_j = key_scale * s_j e0, v_j = v_j e0, float16. With
    the scale 1/sqrt(D), q . k_j * scale = s_j."""
    t = toy["kernel"]
    D = t["head_dim"]
    scores, values = _row(toy, torch.float32)
    q, k, v = torch.zeros(1, 1, D), torch.zeros(len(scores), 1, D), torch.zeros(len(scores), 1, D)
    q[0, 0, 0] = 1.0
    k[:, 0, 0] = t["key_scale"] * scores
    v[:, 0, 0] = values[:, 0]
    return tuple(x.to(F16).to(device) for x in (q, k, v))


def _kernel_row(module, toy: dict):
    device = _kernels.device()
    q, k, v = kernel_inputs(toy, device)
    cu_q = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, k.shape[0]], dtype=torch.int32, device=device)
    with _kernels.quiet():
        (out, lse), changed = call(module.flash_attn_varlen, q, k, v, cu_q, cu_k, q.shape[0], k.shape[0],
                                   return_lse=True)
        _kernels.synchronize()
    return out.cpu(), lse.cpu(), changed


def _tiled_row(module, toy: dict):
    q, k, v = kernel_inputs(toy)
    (out, lse), changed = call(module.tiled_attention, q, k, v, 1, 2)
    return out, lse, changed


# ---- the runs the mistakes are shown on -----------------------------------------------------------


def _steps_fields(module, toy: dict) -> list[Field]:
    scores, values = _row(toy)
    m, sum_exp, acc = _steps(module, toy)[-1]
    out, changed = call(module.online_softmax, scores, values, toy["block_size"])
    return [Field("sum_exp", T("sum_exp after block B", "block B 之后的 sum_exp"), sum_exp),
            Field("acc", T("acc after block B", "block B 之后的 acc"), acc[0]),
            Field("output", T(f"online_softmax, blocks of {toy['block_size']}",
                              f"online_softmax，每块 {toy['block_size']} 个"), out[0]),
            inputs_field(changed)]


def _shifted_fields(module, toy: dict) -> list[Field]:
    shifted = torch.tensor(toy["shifted"]["scores"], dtype=torch.float32)
    _, values = _row(toy, torch.float32)
    out, changed = call(module.online_softmax, shifted, values, toy["block_size"])
    return [Field("output", T("output", "输出"), out[0]), inputs_field(changed)]


def _attention_fields(out, lse, changed) -> list[Field]:
    return [Field("output0", T("output[0, 0, 0]", "output[0, 0, 0]"), out[0, 0, 0]),
            Field("lse", T("LSE", "LSE"), lse[0, 0]),
            inputs_field(changed)]


def scenarios(toy: dict) -> list[Scenario]:
    blocks = " and ".join(vector(step["block"]) for step in toy["steps"])
    blocks_zh = " 和 ".join(vector(step["block"]) for step in toy["steps"])
    found = [
        Scenario("steps", T(f"online_softmax_step on {blocks}, then online_softmax (float64)",
                            f"对 {blocks_zh} 调用 online_softmax_step，再调用 online_softmax（float64）"),
                 lambda module: _steps_fields(module, toy)),
        Scenario("shifted", T(f"online_softmax on the row shifted by -302, {vector(toy['shifted']['scores'])} (fp32)",
                              f"online_softmax，整行平移 -302 后的 {vector(toy['shifted']['scores'])}（fp32）"),
                 lambda module: _shifted_fields(module, toy)),
    ]
    if _kernels.device() is not None:
        found.append(Scenario("kernel", T("flash_attn_varlen with return_lse on the kernel toy (1 query, 4 keys, fp16)",
                                          "flash_attn_varlen（return_lse）跑 kernel toy（1 个 query、4 个 key，fp16）"),
                              lambda module: _attention_fields(*_kernel_row(module, toy))))
    found.append(Scenario("tiled", T("tiled_attention on the kernel toy's q, k, v (tiles of 1 query × 2 keys)",
                                     "tiled_attention 跑 kernel toy 的 q、k、v（tile 为 1 个 query × 2 个 key）"),
                          lambda module: _attention_fields(*_tiled_row(module, toy))))
    return found


# ---- probes: what one row of one head never exercises --------------------------------------------------


PROBE_CASE = T("cases like the checks' (three sequences of 3, 5 and 2 queries over 7, 5 and 9 keys packed into one "
               "batch, H = 4 query heads on KVH = 2, D = 16, random fp16, through flash_attn_varlen; and the same "
               "heads through tiled_attention)",
               "和检查里一样的用例（三个序列打包成一个 batch：query 数 3、5、2，key 数 7、5、9；H = 4 个 query head 对 "
               "KVH = 2，D = 16，随机 fp16，走 flash_attn_varlen；以及同样的 head 配置走 tiled_attention）")

LENGTHS = [(3, 7), (5, 5), (2, 9)]  # (queries, keys) per sequence: a cached prefix, a plain prefill, a long prefix
H, KVH, D = 4, 2, 16


def _probe_tensors():
    gen = torch.Generator().manual_seed(2026)
    total_q, total_k = sum(q for q, _ in LENGTHS), sum(k for _, k in LENGTHS)
    return (torch.randn(total_q, H, D, generator=gen).to(F16), torch.randn(total_k, KVH, D, generator=gen).to(F16),
            torch.randn(total_k, KVH, D, generator=gen).to(F16))


def _varlen_fields(module, tensors) -> list[Field]:
    device = _kernels.device()
    q, k, v = (x.clone().to(device) for x in tensors)
    cu_q = torch.tensor([0, *torch.tensor([n for n, _ in LENGTHS]).cumsum(0).tolist()], dtype=torch.int32,
                        device=device)
    cu_k = torch.tensor([0, *torch.tensor([n for _, n in LENGTHS]).cumsum(0).tolist()], dtype=torch.int32,
                        device=device)
    with _kernels.quiet():
        (out, lse), changed = call(module.flash_attn_varlen, q, k, v, cu_q, cu_k, max(n for n, _ in LENGTHS),
                                   max(n for _, n in LENGTHS), return_lse=True)
        _kernels.synchronize()
    return [Field("out", T("out", "out"), out.cpu()), Field("lse", T("LSE", "LSE"), lse.cpu()), inputs_field(changed)]


def _tiled_fields(module, tensors) -> list[Field]:
    q, k, v = (x.clone() for x in tensors)
    Tq, Tk = LENGTHS[0]
    (out, lse), changed = call(module.tiled_attention, q[:Tq], k[:Tk], v[:Tk], 2, 4)
    return [Field("out", T("out", "out"), out), Field("lse", T("LSE", "LSE"), lse), inputs_field(changed)]


def probes() -> list[Scenario]:
    tensors = _probe_tensors()
    found = []
    if _kernels.device() is not None:
        found.append(Scenario("probe-varlen", T("flash_attn_varlen on three packed sequences, H = 4 on KVH = 2",
                                                "flash_attn_varlen 处理三个打包的序列，H = 4 对 KVH = 2"),
                              lambda module: _varlen_fields(module, tensors)))
    Tq, Tk = LENGTHS[0]
    found.append(Scenario("probe-tiled", T(f"tiled_attention on {Tq} queries over {Tk} keys, H = 4 on KVH = 2",
                                           f"tiled_attention：{Tq} 个 query 对 {Tk} 个 key，H = 4 对 KVH = 2"),
                          lambda module: _tiled_fields(module, tensors)))
    return found


# ---- the walk-through ---------------------------------------------------------------------------------


def _one_shot_step(reference, toy: dict) -> Step:
    scores, values = _row(toy)
    one = toy["one_shot"]
    out = reference.online_softmax(scores, values, len(scores))  # one block: the one-shot softmax
    m = scores.max()
    exps = torch.exp(scores - m)  # [S]
    sum_exp = exps.sum()
    weights = exps / sum_exp
    weighted = weights * values[:, 0]
    agree(weighted.sum()[None], out, "the one-shot output")
    state = _steps(reference, {"steps": [{"block": toy["scores"], "block_values": toy["values"]}]})[-1]
    lse = m + torch.log(sum_exp)
    agree(lse, state[0] + torch.log(state[1]), "the LSE, m + log(sum_exp) of the reference's state")
    agree(lse, torch.logsumexp(scores, 0), "the LSE")
    for got, name in ((m, "max"), (exps, "exp"), (sum_exp, "sum_exp"), (weights, "weights"), (out, "output"),
                      (lse, "lse")):
        _same(got, one[name], f"the one-shot {name}")
    rows = [[str(j), scores[j], values[j, 0], scores[j] - m, exps[j], weights[j], weighted[j]]
            for j in range(len(scores))]
    rows.append([T("sum", "合计"), "", "", "", sum_exp, weights.sum(), out[0]])
    table = Table.of("one_shot", ["j", "s_j", "v_j", "s_j − m", "exp(s_j − m)", T("weight", "权重"),
                                  T("weight · v_j", "权重 · v_j")], rows)
    text = T(f"m = max(s) = {number(m)}. The weights sum to 1 and the output is their mix of the values, "
             f"{number(out[0])}; the LSE is m + ln(sum_exp) = {number(m)} + ln({number(sum_exp)}) = {number(lse)}. "
             f"online_softmax with one block of {len(scores)} is exactly this.",
             f"m = max(s) = {number(m)}。权重之和为 1，输出就是按权重混合的 value：{number(out[0])}；LSE = m + "
             f"ln(sum_exp) = {number(m)} + ln({number(sum_exp)}) = {number(lse)}。online_softmax 用一个 "
             f"{len(scores)} 个分数的块，算的正是这些。")
    return Step(T("1. One shot", "1. 一次性计算"), table, text)


def _blocks_step(reference, toy: dict) -> Step:
    one = _row(toy)
    states = _steps(reference, toy)
    m_old, sum_old, acc_old = _start()
    columns, rescaled = [], []
    for n, (step, (m, sum_exp, acc)) in enumerate(zip(toy["steps"], states)):
        block = torch.tensor(step["block"], dtype=F64)
        block_values = torch.tensor(step["block_values"], dtype=F64)[:, 0]
        alpha = torch.exp(m_old - m)  # exp(m_old - m_new): 0 for the first block (m_old = -inf)
        terms = torch.exp(block - m)  # [n] this block's exp(s - m_new)
        agree(alpha * sum_old + terms.sum(), sum_exp, f"block {n + 1}'s sum_exp")
        agree(alpha * acc_old + (terms * block_values).sum(), acc, f"block {n + 1}'s acc")
        for got, name in ((m, "m"), (sum_exp, "sum_exp"), (acc, "acc")):
            _same(got, step[name], f"block {n + 1}'s {name}")
        if "alpha" in step:
            _same(alpha, step["alpha"], f"block {n + 1}'s alpha")
            _same(alpha * sum_old, step["rescaled_sum_exp"], f"block {n + 1}'s rescaled sum_exp")
            _same(alpha * acc_old, step["rescaled_acc"], f"block {n + 1}'s rescaled acc")
        rescaled.append((alpha, alpha * sum_old, alpha * acc_old))
        name = chr(ord("A") + n)
        columns.append([block, block_values, f"{number(m_old)} → {number(m)}", alpha, alpha * sum_old,
                        (alpha * acc_old)[0], terms, (terms * block_values).sum(), sum_exp, acc[0]])
        m_old, sum_old, acc_old = m, sum_exp, acc
    out = reference.online_softmax(*one, toy["block_size"])
    agree(acc_old / sum_old, out, "acc / sum_exp after the last block")
    _same(out, toy["output"], "the blocked output")
    names = [T("scores s", "分数 s"), T("values v", "value v"), "m_old → m_new", "alpha = exp(m_old − m_new)",
             T("alpha · sum_exp (the old sum, moved to the new max)", "alpha · sum_exp（旧的和，换算到新的最大值）"),
             T("alpha · acc (likewise)", "alpha · acc（同上）"), "exp(s − m_new)", "Σ exp(s − m_new) · v",
             "sum_exp = alpha · sum_exp + Σ exp(s − m_new)", "acc = alpha · acc + Σ exp(s − m_new) · v"]
    rows = [[Cell.of(name, "text"), *(column[i] for column in columns)] for i, name in enumerate(names)]
    table = Table.of("blocks", [T("quantity", "项"),
                                *(T(f"block {chr(ord('A') + n)}", f"block {chr(ord('A') + n)}")
                                  for n in range(len(toy["steps"])))], rows)
    scores, values = one
    exps = torch.exp(scores - scores.max())
    size = len(toy["steps"][0]["block"])
    alpha, sum_b, acc_b = rescaled[1]
    agree(sum_b, exps[:size].sum(), "block A's rescaled sum, the one-shot sum's first terms")
    agree(acc_b, (exps[:size] * values[:size, 0]).sum()[None], "block A's rescaled acc, the one-shot acc's first terms")
    m_a, m_b = toy["steps"][0]["m"], toy["steps"][1]["m"]
    text = T(f"From m = -inf, sum_exp = 0, acc = 0, blocks of {size}. Block B raises the max from {number(m_a)} to "
             f"{number(m_b)}: alpha = exp({number(m_a)} − {number(m_b)}) = {number(alpha)} moves block A's sums to "
             f"{number(sum_b)} and {number(acc_b[0])}, exactly the first {size} terms of the one-shot sums "
             f"({' + '.join(number(e) for e in exps[:size])} and "
             f"{' + '.join(f'{number(e)}·{number(v)}' for e, v in zip(exps[:size], values[:size, 0]))}). Then "
             f"acc / sum_exp = {number(acc_old[0])} / {number(sum_old)} = {number(out[0])}, the one-shot value.",
             f"从 m = -inf、sum_exp = 0、acc = 0 开始，每块 {size} 个。block B 把最大值从 {number(m_a)} 抬到 "
             f"{number(m_b)}：alpha = exp({number(m_a)} − {number(m_b)}) = {number(alpha)}，把 block A 的两个和挪到 "
             f"{number(sum_b)} 和 {number(acc_b[0])}，恰好是一次算完时两个和的前 {size} 项"
             f"（{' + '.join(number(e) for e in exps[:size])} 与 "
             f"{' + '.join(f'{number(e)}·{number(v)}' for e, v in zip(exps[:size], values[:size, 0]))}）。最后 "
             f"acc / sum_exp = {number(acc_old[0])} / {number(sum_old)} = {number(out[0])}，与一次算完的结果相同。")
    return Step(T("2. Block by block", "2. 逐块计算"), table, text)


def _block_sizes_step(reference, toy: dict) -> Step:
    scores, values = _row(toy)
    rows = []
    for size in range(1, len(scores) + 1):
        out = reference.online_softmax(scores, values, size)
        _same(out, toy["output"], f"online_softmax with blocks of {size}")
        blocks = " ".join(vector(scores[i : i + size]) for i in range(0, len(scores), size))
        rows.append([str(size), blocks, out[0]])
    table = Table.of("block_sizes", ["block_size", T("blocks", "分块"), "online_softmax"], rows)
    text = T("Any block size gives the same output: the rescaling is exact, not an approximation.",
             "无论块多大，输出都一样：rescale 是精确的，不是近似。")
    return Step(T("3. Any block size", "3. 块的大小无关紧要"), table, text)


def _shifted_step(reference, toy: dict) -> Step:
    shifted = torch.tensor(toy["shifted"]["scores"], dtype=torch.float32)
    _, values = _row(toy, torch.float32)
    out = reference.online_softmax(shifted, values, toy["block_size"])
    _same(out, toy["shifted"]["output"], "the shifted row's output", 1e-4)
    shifted_toy = {"steps": [{"block": shifted[i : i + toy["block_size"]].tolist(),
                              "block_values": values[i : i + toy["block_size"]].tolist()}
                             for i in range(0, len(shifted), toy["block_size"])]}
    from_inf = _steps(reference, shifted_toy, torch.float32)[-1]
    from_zero = _steps(reference, shifted_toy, torch.float32, 0.0)[-1]
    agree(from_inf[2] / from_inf[1], out, "the shifted row's acc / sum_exp")
    if from_zero[1].item() != 0 or from_zero[2].abs().max().item() != 0:
        raise ToyDrift("from m = 0 the shifted row's sums should underflow to 0 in fp32")
    rows = [["-inf", from_inf[0], from_inf[1], from_inf[2][0], out[0]],
            [T("0 (a mistake)", "0（错误做法）"), from_zero[0], from_zero[1], from_zero[2][0],
             Cell.of(T("0 / 0", "0 / 0"), "text")]]
    table = Table.of("shifted", [T("m starts at", "m 的初值"), T("m after", "之后的 m"),
                                 T("sum_exp after", "之后的 sum_exp"), T("acc after", "之后的 acc"),
                                 "acc / sum_exp"], rows)
    text = T(f"The scores {vector(shifted)} (fp32): softmax does not care, the output is {number(out[0])} again. "
             f"online_softmax_step from m = 0 instead of -inf computes exp(s − 0) for every score: it underflows to 0 "
             f"in fp32, so sum_exp and acc stay 0 and the output is 0 / 0.",
             f"分数为 {vector(shifted)}（fp32）：softmax 不在乎整体平移，输出仍是 {number(out[0])}。若 "
             f"online_softmax_step 从 m = 0 而不是 -inf 开始，每个分数都算 exp(s − 0)：在 fp32 里下溢为 0，"
             f"于是 sum_exp 和 acc 一直是 0，输出成了 0 / 0。")
    return Step(T("4. The same row, shifted by -302", "4. 同一行，整体平移 -302"), table, text)


def _kernel_step(reference, toy: dict) -> Step:
    t = toy["kernel"]
    fp16 = tolerance("flash", F16)
    tiled = _tiled_row(reference, toy)
    runs = [(T("tiled_attention (PyTorch, tiles of 1 × 2)", "tiled_attention（PyTorch，tile 为 1 × 2）"), tiled)]
    if _kernels.device() is not None:
        runs.append((T("flash_attn_varlen (the Triton kernel)", "flash_attn_varlen（Triton kernel）"),
                     _kernel_row(reference, toy)))
    rows = []
    for name, (out, lse, _) in runs:
        if not close_enough(out[0, 0, :1].float(), torch.tensor([t["output0"]]), fp16):
            raise ToyDrift(f"{name.en} gives {number(out[0, 0, 0])} on the kernel toy, the toy file {t['output0']}")
        _same(lse[0, 0], t["lse"], f"{name.en}'s LSE on the kernel toy", 1e-4)
        rest = T("all 0", "全为 0") if not out[0, 0, 1:].any() else vector(out[0, 0, 1:])
        rows.append([Cell.of(name, "text"), out[0, 0, 0], Cell.of(rest, "text"), lse[0, 0]])
    if _kernels.device() is None:
        rows.append([Cell.of(T("flash_attn_varlen (the Triton kernel)", "flash_attn_varlen（Triton kernel）"), "text"),
                     Cell.of(_kernels.NOT_RUN, "text"), "", ""])
    rows.append([Cell.of(T("the toy file, float64", "toy 文件里的 float64 值"), "text"), torch.tensor(t["output0"]),
                 "", torch.tensor(t["lse"])])
    q, k, v = kernel_inputs(toy)
    table = Table.of("kernel", [T("run", "调用"), "output[0, 0, 0]", "output[0, 0, 1:]", "LSE"], rows)
    out = runs[-1][1][0]
    ran = T("", "") if _kernels.device() is None else _kernels.where()
    text = T(f"One sequence with 1 query and {k.shape[0]} keys, H = KVH = 1, D = {t['head_dim']} (tl.dot's smallest "
             f"tile), fp16: q = e0, k_j = {number(t['key_scale'])} s_j e0 = {vector(k[:, 0, 0])} in dim 0, v_j = "
             f"{vector(v[:, 0, 0])} in dim 0, and the scale 1/√{t['head_dim']} makes the scores exactly s. Causal and "
             f"aligned bottom-right, the single query is the last of its sequence and sees all {k.shape[0]} keys: "
             f"{number(out[0, 0, 0])} is {number(t['output0'])} rounded to fp16. "
             + (f"The kernel ran {ran.en}." if ran.en else f"The kernel's row is empty: {_kernels.NOT_RUN.en}."),
             f"一个序列，1 个 query、{k.shape[0]} 个 key，H = KVH = 1，D = {t['head_dim']}（tl.dot 最小的 tile），"
             f"fp16：q = e0，k_j = {number(t['key_scale'])} s_j e0，第 0 维为 {vector(k[:, 0, 0])}，v_j 的第 0 维为 "
             f"{vector(v[:, 0, 0])}，缩放 1/√{t['head_dim']} 让分数恰好等于 s。causal 且右下对齐时，唯一的 query "
             f"是序列的最后一个 token，能看到全部 {k.shape[0]} 个 key：{number(out[0, 0, 0])} 是 "
             f"{number(t['output0'])} 舍入到 fp16 的结果。"
             + (f"kernel {ran.zh}运行。" if ran.zh else f"kernel 那一行是空的：{_kernels.NOT_RUN.zh}。"))
    return Step(T("5. Through the kernel", "5. 走一遍 kernel"), table, text)


def walkthrough(reference, toy: dict) -> list[Step]:
    if not math.isclose(toy["kernel"]["key_scale"] * toy["kernel"]["head_dim"] ** -0.5, 1.0):
        raise ToyDrift("the kernel toy's key_scale · 1/sqrt(D) must be 1, so that its scores are the row's")
    return [_one_shot_step(reference, toy), _blocks_step(reference, toy), _block_sizes_step(reference, toy),
            _shifted_step(reference, toy), _kernel_step(reference, toy)]
