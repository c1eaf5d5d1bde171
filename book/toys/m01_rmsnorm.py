"""How to run M01's toy: `rms_norm` on each row of `toy_cases/m01_rmsnorm.json`, then `add_rms_norm`.

Outputs come from the reference. The mean of squares and the scale factor in between are worked here
and must rebuild the reference's output exactly.
"""

import torch

from book.i18n import T
from book.toys import Field, Scenario, Step, Table, agree, call, inputs_field, number, vector


def _tensor(value, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(value, dtype=dtype)


def _rms_fields(module, x, weight, eps) -> list[Field]:
    out, changed = call(module.rms_norm, x.clone(), weight.clone(), eps)
    return [Field("out", T("output", "输出"), out), inputs_field(changed)]


def _add_fields(module, x, residual, weight, eps) -> list[Field]:
    (normed, new_residual), changed = call(module.add_rms_norm, x.clone(), residual.clone(), weight.clone(), eps)
    return [Field("normed", T("normed", "normed"), normed), Field("residual", T("new_residual", "new_residual"),
                                                                    new_residual), inputs_field(changed)]


def _rms_scenario(id: str, title: T, x, weight, eps) -> Scenario:
    return Scenario(id, title, lambda module: _rms_fields(module, x, weight, eps))


def scenarios(toy: dict) -> list[Scenario]:
    found = []
    for n, case in enumerate(toy["rms_norm"], 1):
        x, weight = _tensor(case["x"]), _tensor(case["weight"])
        found.append(_rms_scenario(f"rms-{n}", T(f"rms_norm, {case['name']}", f"rms_norm：{case['name']}"),
                                   x, weight, case["eps"]))
    for n, case in enumerate(toy["add_rms_norm"], 1):
        t = {k: _tensor(case[k]) for k in ("x", "residual", "weight")}
        found.append(Scenario(f"add-{n}", T("add_rms_norm, " + case["name"], "add_rms_norm：" + case["name"]),
                              lambda module, t=t, eps=case["eps"]: _add_fields(module, t["x"], t["residual"],
                                                                                t["weight"], eps)))
    return found


def probes() -> list[Scenario]:
    gen = torch.Generator().manual_seed(2026)
    batch = torch.randn(4, 8, generator=gen)
    weight = 1 + 0.5 * torch.randn(8, generator=gen)
    return [
        _rms_scenario("fp16-large", T("an fp16 row [300, 400] (weight [1, 1])",
                                      "一行 fp16 的 [300, 400]（weight [1, 1]）"),
                      _tensor([[300.0, 400.0]], torch.float16), _tensor([1.0, 1.0], torch.float16), 1e-6),
        _rms_scenario("fp32-batch", T("a random fp32 batch [4, 8] with a random weight",
                                      "随机的 fp32 输入 [4, 8] 加随机 weight"), batch, weight, 1e-6),
        _rms_scenario("bf16-batch", T("the same batch in bf16", "同一批输入换成 bf16"),
                      batch.bfloat16(), weight.bfloat16(), 1e-6),
    ]


def walkthrough(reference, toy: dict) -> list[Step]:
    rows = []
    for case in toy["rms_norm"]:
        x, weight, eps = _tensor(case["x"]), _tensor(case["weight"]), case["eps"]
        out = reference.rms_norm(x, weight, eps)
        mean_square = x.pow(2).mean(dim=-1)  # [rows]
        factor = torch.rsqrt(mean_square + eps)
        agree(weight * x * factor[:, None], out, f"rms_norm on {case['name']!r}")
        for i in range(x.shape[0]):
            rows.append([case["name"] if i == 0 else "", x[i], weight if i == 0 else "", mean_square[i], factor[i],
                         out[i]])
    norms = Table.of("rms_norm", [T("case", "用例"), "x", "weight", "mean(x²)", "1/√(mean + eps)", T("output", "输出")],
                     rows)

    add_rows = []
    for case in toy["add_rms_norm"]:
        t = {k: _tensor(case[k]) for k in ("x", "residual", "weight")}
        normed, new_residual = reference.add_rms_norm(t["x"], t["residual"], t["weight"], case["eps"])
        agree(t["x"] + t["residual"], new_residual, f"add_rms_norm's new_residual on {case['name']!r}")
        agree(reference.rms_norm(new_residual, t["weight"], case["eps"]), normed, "add_rms_norm's normed")
        add_rows.append([case["name"], t["x"], t["residual"], t["weight"], new_residual, normed])
    fused = Table.of("add_rms_norm", [T("case", "用例"), "x", "residual", "weight", "new_residual = x + residual",
                                      "normed = rms_norm(new_residual)"], add_rows)

    first = toy["rms_norm"][0]
    eps = " / ".join(sorted({number(case["eps"]) for case in toy["rms_norm"]}))
    first_out = reference.rms_norm(_tensor(first["x"]), _tensor(first["weight"]), first["eps"])
    return [
        Step(T("1. rms_norm, row by row", "1. rms_norm，逐行计算"), norms,
             T(f"Each row is divided by its own root mean square, then scaled by weight (eps = {eps}): "
               f"{vector(first['x'][0])} becomes {vector(first_out[0])}. The row of 0.001s shows eps at work: it "
               "doubles the mean square.",
               f"每一行除以它自己的均方根，再乘以 weight（eps = {eps}）：{vector(first['x'][0])} 变成 "
               f"{vector(first_out[0])}。0.001 那一行能看出 eps 的作用：它让均方值翻了一倍。")),
        Step(T("2. add_rms_norm: add, then normalise the sum", "2. add_rms_norm：先相加，再对和做归一化"), fused,
             T("The call returns (normed, new_residual): the next sub-layer reads the first, the one after it adds "
               "to the second.", "返回值是 (normed, new_residual)：下一个子层读前者，再下一个子层往后者上累加。")),
    ]
