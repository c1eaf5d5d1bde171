"""How to run P09's toy: the row of `toy_cases/p09_overlap.json` through the reference's `fused_add_rms_norm`, its
gate/up row through `fused_silu_mul` (the Triton kernels: in Triton's interpreter where there is no GPU, see
`_kernels.py`), and the toy's two requests through the reference's `OverlapLLM`, one `step` call at a time.

Worked here and tied to the reference with `agree`: the sum x + residual (which must be what `residual` holds after
the call), its mean square and the normed row; each gate's sigmoid and SiLU, times up. The engine's bookkeeping after
each call (the step in flight, the requests that finished, each request's tokens with the placeholders still in
them, the blocks each holds) must be the toy file's (else `ToyDrift`): it does not depend on the tokens, because
every request runs to its max_tokens, so a small random model (the checks' one-head layout, seed 0) serves it.

The probes run the checks' two engine cases the toy cannot show: three requests sharing 6 blocks (preemption), and
a later prompt made of an earlier request's prompt and generated tokens (the prefix cache).
"""

import torch

from book.i18n import T
from book.toys import Field, Scenario, Step, Table, ToyDrift, _kernels, agree, number, vector
from checks.harness.oracles import ModelWeights

F32 = torch.float32
STORED = 5e-5  # the toy file stores its real numbers to 10 decimals; the kernels work in float32
# The checks' one-head layout (vocab 64, hidden 32, intermediate 48, 1 layer, 1 head on 1 kv head, head_dim 16), in
# the engine's float16; seed 0 as the toy's self-test uses.
MODEL = (64, 32, 48, 1, 1, 1, 16)
ENGINE_DTYPE = torch.float16


def _tensor(value, device=None) -> torch.Tensor:
    return torch.tensor(value, dtype=F32, device=device)


# ---- the kernels -----------------------------------------------------------------------------------------


def _norm_run(module, toy: dict):
    """(normed, residual after the call) of `fused_add_rms_norm` on the toy row, on the CPU; None without kernels."""
    device = _kernels.device()
    if device is None:
        return None
    norm = toy["fused_add_rms_norm"]
    residual = _tensor(norm["residual"], device)
    with _kernels.quiet():
        normed = module.fused_add_rms_norm(_tensor(norm["x"], device), residual, _tensor(norm["weight"], device),
                                           norm["eps"])
        _kernels.synchronize()
    return normed.cpu(), residual.cpu()


def _silu_run(module, toy: dict):
    device = _kernels.device()
    if device is None:
        return None
    with _kernels.quiet():
        out = module.fused_silu_mul(_tensor(toy["fused_silu_mul"]["gate_up"], device))
        _kernels.synchronize()
    return out.cpu()


def _norm_fields(module, toy: dict) -> list[Field]:
    found = _norm_run(module, toy)
    if found is None:
        return [Field("normed", T("returns", "返回值"), _kernels.NOT_RUN)]
    normed, residual = found
    return [Field("normed", T("returns", "返回值"), normed),
            Field("residual", T("residual after the call", "调用之后的 residual"), residual)]


def _silu_fields(module, toy: dict) -> list[Field]:
    found = _silu_run(module, toy)
    return [Field("out", T("returns", "返回值"), _kernels.NOT_RUN if found is None else found)]


# ---- the engine --------------------------------------------------------------------------------------------


def _model(seed: int = 0) -> ModelWeights:
    w = ModelWeights.random(torch.Generator().manual_seed(seed), *MODEL).to(ENGINE_DTYPE)
    device = _kernels.device()
    return ModelWeights(embed_tokens=w.embed_tokens.to(device), layers=tuple(
        type(layer)(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(layer).items()})
        for layer in w.layers), norm=w.norm.to(device), eps=w.eps, rope_theta=w.rope_theta, head_dim=w.head_dim)


def _config(module, **changes):
    settings = dict(block_size=4, num_blocks=64, max_num_batched_tokens=256, max_num_seqs=8, max_model_len=128,
                    cuda_graphs=False)
    return module.EngineConfig(**{**settings, **changes})


def _greedy(module, max_tokens: int):
    return module.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _ints_text(values) -> str:
    return "[" + ", ".join(str(v) for v in values) + "]"


def _tokens_text(tokens) -> str:
    return " ".join(_ints_text(t) for t in tokens)


def _timeline(module, toy: dict) -> tuple[list[dict], list[list[int]]]:
    """Each step call's bookkeeping, as the toy file writes it, and the requests' tokens at the end."""
    timeline = toy["timeline"]
    with _kernels.quiet():
        llm = module.OverlapLLM(_model(), _config(module, block_size=timeline["block_size"]))
        requests = [llm.add_request(list(r["prompt"]), _greedy(module, r["max_tokens"])) for r in timeline["requests"]]
        calls = []
        for _ in timeline["calls"]:
            finished = [r.request_id for r in llm.step()]
            flight = llm.in_flight
            calls.append({
                "in_flight": None if flight is None else list(flight.request_ids),
                "kind": None if flight is None else ("prefill" if flight.is_prefill else "decode"),
                "finished": finished,
                "tokens": [[t if t < 0 else "t" for t in r.token_ids[r.num_prompt_tokens:]] for r in requests],
                "blocks": [len(r.block_table) for r in requests],
            })
        _kernels.synchronize()
    return calls, [list(r.completion_token_ids) for r in requests]


def _timeline_fields(module, toy: dict) -> list[Field]:
    if _kernels.device() is None:
        return [Field("calls", T("step calls", "step 调用"), _kernels.NOT_RUN)]
    calls, outputs = _timeline(module, toy)
    fields = []
    for i, call in enumerate(calls, start=1):
        flight = "none" if call["in_flight"] is None else f"{call['kind']} {_ints_text(call['in_flight'])}"
        fields += [Field(f"call{i}-flight", T(f"in flight after call {i}", f"第 {i} 次调用后在途的步骤"), flight),
                   Field(f"call{i}-finished", T(f"finished in call {i}", f"第 {i} 次调用完成的请求"),
                         _ints_text(call["finished"])),
                   Field(f"call{i}-tokens", T(f"tokens after call {i}", f"第 {i} 次调用后的 token"),
                         _tokens_text(call["tokens"])),
                   Field(f"call{i}-blocks", T(f"blocks held after call {i}", f"第 {i} 次调用后持有的块数"),
                         _ints_text(call["blocks"]))]
    return [*fields, Field("outputs", T("the tokens returned", "返回的 token"),
                           " ".join(_ints_text(out) for out in outputs))]


def scenarios(toy: dict) -> list[Scenario]:
    return [
        Scenario("norm", T("fused_add_rms_norm on the toy row", "对 toy 的那一行调用 fused_add_rms_norm"),
                 lambda module: _norm_fields(module, toy)),
        Scenario("silu", T("fused_silu_mul on the toy row", "对 toy 的那一行调用 fused_silu_mul"),
                 lambda module: _silu_fields(module, toy)),
        Scenario("timeline", T("two requests stepped one call at a time", "两个请求，一次一个 step 调用"),
                 lambda module: _timeline_fields(module, toy)),
    ]


# ---- probes: what the toy's two requests never exercise ------------------------------------------------------


PROBE_CASE = T("engine runs like the checks', on the toy's one-head model: three greedy requests of 5, 6 and 7 "
               "prompt tokens and 7 new tokens each sharing 6 blocks of 4 (they preempt each other), and a request "
               "of a 6-token prompt and 7 new tokens followed by a 14-token prompt made of that prompt, the first 6 "
               "tokens it generated and 2 more",
               "和检查里一样的两种引擎运行，用 toy 的单 head 模型：三个贪心请求，prompt 分别为 5、6、7 个 "
               "token，各生成 7 个，共用 6 个大小为 4 的块（彼此会抢占）；以及一个 6 token prompt、生成 7 个 "
               "token 的请求，随后一个 14 token 的 prompt，由那个 prompt、它生成的前 6 个 token 和另外 2 个 "
               "token 组成")


def _prompts(lengths, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, MODEL[0], (n,), generator=gen).tolist() for n in lengths]


def _preemption_fields(module) -> list[Field]:
    with _kernels.quiet():
        llm = module.OverlapLLM(_model(), _config(module, num_blocks=6))
        outputs = llm.generate(_prompts((5, 6, 7)), [_greedy(module, 7)] * 3)
        _kernels.synchronize()
    return [Field("outputs", T("the tokens returned", "返回的 token"), " ".join(_ints_text(o) for o in outputs)),
            Field("waits", T("stats['waits']", "stats['waits']"), str(llm.stats["waits"])),
            Field("preempted", T("preempted at least once", "至少抢占过一次"),
                  T("yes", "是") if llm.stats["preemptions"] >= 1 else T("no", "否"))]


def _prefix_fields(module) -> list[Field]:
    prompt, tail = _prompts((6, 2))
    with _kernels.quiet():
        llm = module.OverlapLLM(_model(), _config(module))
        first = llm.generate([list(prompt)], [_greedy(module, 7)])[0]
        later = llm.generate([prompt + first[:6] + tail], [_greedy(module, 2)])[0]
        _kernels.synchronize()
    cached = T("stats['cached_tokens'] after the later prompt", "后一个 prompt 之后的 stats['cached_tokens']")
    return [Field("cached", cached, str(llm.stats["cached_tokens"])),
            Field("later", T("the later prompt's tokens", "后一个 prompt 生成的 token"), _ints_text(later))]


def probes() -> list[Scenario]:
    if _kernels.device() is None:
        return []
    return [Scenario("preemption", T("three requests sharing 6 blocks", "三个请求共用 6 个块"), _preemption_fields),
            Scenario("prefix-cache", T("a later prompt that repeats generated tokens",
                                       "后一个 prompt 重复了前一个请求生成的 token"), _prefix_fields)]


# ---- the worked steps -------------------------------------------------------------------------------------


def _stored(got: torch.Tensor, stored, what: str) -> None:
    if not torch.allclose(got.double(), torch.tensor(stored, dtype=torch.float64), atol=STORED, rtol=0):
        raise ToyDrift(f"{what}: the reference gives {vector(got.flatten())}, toy_cases/p09_overlap.json stores "
                       f"{stored}")


def _norm_step(reference, toy: dict) -> Step:
    norm = toy["fused_add_rms_norm"]
    x, residual, weight = (torch.tensor(norm[k], dtype=torch.float64) for k in ("x", "residual", "weight"))
    s = x + residual  # [1, N]
    mean_square = s.pow(2).mean(-1)  # [1]
    scaled = s / torch.sqrt(mean_square[:, None] + norm["eps"])  # [1, N]
    normed = scaled * weight
    found = _norm_run(reference, toy)
    if found is not None:
        agree(normed, found[0], "the normed row")
        agree(s, found[1], "the residual after the call")
        _stored(found[0], norm["expected_normed"], "fused_add_rms_norm's output")
        _stored(found[1], norm["expected_residual"], "the residual after the call")
    returns, after = (found if found is not None else (_kernels.NOT_RUN, _kernels.NOT_RUN))
    rows = [[x[0], residual[0], s[0], mean_square, scaled[0], weight, returns, after]]
    table = Table.of("fused_add_rms_norm", ["x", "residual", "s = x + residual", "mean(s²)",
                                            "s / sqrt(mean(s²) + eps)", "weight",
                                            T("returns", "返回值"),
                                            T("residual after the call", "调用之后的 residual")], rows)
    where = _kernels.where()
    text = T(f"One program per row. It adds in float32, stores the sum into residual (rounded to its dtype: here "
             f"float32, so exactly {vector(s[0])}), and normalises the unrounded sum: the mean of squares over the "
             f"row's N = {s.shape[1]} lanes, its reciprocal square root, the weight. The kernel ran {where.en}.",
             f"每行一个 program。它在 float32 里相加，把和写回 residual（舍入到它的 dtype：这里是 float32，所以正好是 "
             f"{vector(s[0])}），再对未舍入的和做归一化：行内 N = {s.shape[1]} 个 lane 的平方均值、它的平方根倒数、"
             f"乘以 weight。kernel {where.zh}运行。")
    return Step(T("1. fused_add_rms_norm: one row", "1. fused_add_rms_norm：一行"), table, text)


def _silu_step(reference, toy: dict) -> Step:
    gate_up = torch.tensor(toy["fused_silu_mul"]["gate_up"], dtype=torch.float64)
    gate, up = gate_up.chunk(2, dim=-1)  # [1, I] each: gate first, then up
    sigmoid = torch.sigmoid(gate)
    silu = gate * sigmoid
    product = silu * up
    found = _silu_run(reference, toy)
    if found is not None:
        agree(product, found, "silu(gate) * up")
        _stored(found, toy["fused_silu_mul"]["expected"], "fused_silu_mul's output")
    rows = [[gate_up[0], gate[0], up[0], sigmoid[0], silu[0], _kernels.NOT_RUN if found is None else found]]
    table = Table.of("fused_silu_mul", ["gate_up", T("gate (first half)", "gate（前一半）"),
                                        T("up (second half)", "up（后一半）"), "sigmoid(gate)",
                                        "silu(gate) = gate · sigmoid(gate)", T("returns", "返回值")], rows)
    I = gate.shape[1]  # noqa: E741 - the intermediate size, as the docs name it
    j = int(product[0].argmax())  # the row's largest output
    text = T(f"The row's first I = {I} values are the gate, the next {I} the up projection. A gate of 0 gives 0 "
             f"whatever up is; the largest output, {number(product[0, j])}, is silu({number(gate[0, j])}) · "
             f"{number(up[0, j])}.",
             f"这一行的前 I = {I} 个值是 gate，后 {I} 个是 up。gate 为 0 时结果就是 0，与 up 无关；最大的输出 "
             f"{number(product[0, j])} 是 silu({number(gate[0, j])}) · {number(up[0, j])}。")
    return Step(T("2. fused_silu_mul: one row", "2. fused_silu_mul：一行"), table, text)


def _timeline_step(reference, toy: dict) -> Step:
    timeline = toy["timeline"]
    ran = _kernels.device() is not None
    calls = timeline["calls"]
    if ran:
        got, _ = _timeline(reference, toy)
        for n, (mine, stored) in enumerate(zip(got, calls, strict=True), start=1):
            if mine != stored:
                raise ToyDrift(f"step call {n}: the reference's OverlapLLM gives {mine}, toy_cases/p09_overlap.json "
                               f"stores {stored}")
    rows, before = [], None
    for n, call in enumerate(calls, start=1):
        launched = "—" if call["kind"] is None else f"{call['kind']} {_ints_text(call['in_flight'])}"
        resolved = "—" if before is None else f"{before['kind']} {_ints_text(before['in_flight'])}"
        rows.append([str(n), launched, resolved, _ints_text(call["finished"]), _tokens_text(call["tokens"][:1]),
                     _tokens_text(call["tokens"][1:]), _ints_text(call["blocks"])])
        before = call if call["kind"] is not None else None
    table = Table.of("timeline", [T("step call", "step 调用"), T("launched (in flight after)", "launch 的（之后在途）"),
                                  T("resolved", "resolve 的"), T("finished", "完成的请求"),
                                  T("request 0's tokens", "请求 0 的 token"),
                                  T("request 1's tokens", "请求 1 的 token"), T("blocks held", "持有的块数")], rows)
    sizes = [f"{len(r['prompt'])} + {r['max_tokens']}" for r in timeline["requests"]]
    checked = (T("The reference's OverlapLLM gave exactly these rows, " + _kernels.where().en + ".",
                 "参考实现的 OverlapLLM 给出的正是这些行（kernel " + _kernels.where().zh + "运行）。") if ran
               else _kernels.NOT_RUN)
    block_size = timeline["block_size"]
    text = T(f"Two greedy requests (prompt + max_tokens: {', '.join(sizes)}) in blocks of {block_size}. t is a "
             "token the host has applied; -1 - b is the placeholder for row b of the step in flight. " + checked.en,
             f"两个贪心请求（prompt + max_tokens：{'、'.join(sizes)}），块大小 {block_size}。t 是 host 已经写入的 "
             "token；-1 - b 是在途步骤第 b 行的占位符。" + checked.zh)
    return Step(T("3. The overlapped engine, one step call at a time", "3. 重叠执行的引擎，一次一个 step 调用"),
                table, text)


def walkthrough(reference, toy: dict) -> list[Step]:
    return [_norm_step(reference, toy), _silu_step(reference, toy), _timeline_step(reference, toy)]


if __name__ == "__main__":  # a quick look: python -m book.toys.p09_overlap
    from checks.harness.loader import named
    from checks.harness.toys import load_toy

    for step in walkthrough(named("solutions").load("p09_overlap"), load_toy("p09_overlap")):
        print(step.title.en, step.table.id, len(step.table.rows))
        for row in step.table.rows:
            print("  ", [" ".join(str(x) for x in c.lines) for c in row])
