"""How to run M02's toy: `attention_forward` on the page's three tokens, as one prefill and in calls.

The outputs, the cache lengths and chunk shapes, and the rotated keys and raw values come from the
reference (the keys and values are read out of its cache). The per-query scores and softmax weights
are worked here, from the reference's own keys, and must rebuild its output rows exactly.
"""

from types import SimpleNamespace

import torch

from book.i18n import T
from book.toys import Cell, Field, Scenario, Step, Table, agree, call, inputs_field, number, shape, vector


def _weights(toy: dict) -> SimpleNamespace:
    return SimpleNamespace(**{k: torch.tensor(v, dtype=torch.float32) if isinstance(v, list) else v
                              for k, v in toy["weights"].items()})


def _copy(w: SimpleNamespace) -> SimpleNamespace:
    return SimpleNamespace(**{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in vars(w).items()})


def _title(sizes: list[int]) -> T:
    calls = " + ".join(str(n) for n in sizes)
    return T(f"calls of {calls}, one cache", f"分 {len(sizes)} 次调用（{calls} 个 token），共用一个 cache")


def feed(module, w, x, cos, sin, sizes: list[int] | None) -> dict:
    """Run the tokens through `module` as the checks do: fresh copies of the inputs for every call."""
    if sizes is None:
        out, changed = call(module.attention_forward, _copy(w), x.clone(), cos.clone(), sin.clone())
        return {"calls": [(0, out, None, None)], "changed": changed, "cache": None}
    cache, start, calls, changed = module.KVCache(), 0, [], None
    for size in sizes:
        past = len(cache)
        rows = slice(start, start + size)
        out, changed_now = call(module.attention_forward, _copy(w), x[rows].clone(), cos[rows].clone(),
                                sin[rows].clone(), cache)
        changed = changed or changed_now
        calls.append((past, out, len(cache), [shape(chunk.shape) for chunk in cache.k]))
        start += size
    return {"calls": calls, "changed": changed, "cache": cache}


def _fields(run: dict) -> list[Field]:
    found = [Field("rows", T("output rows", "输出各行"), torch.cat([out for _, out, _, _ in run["calls"]]))]
    if run["cache"] is not None:
        _, _, held, chunks = run["calls"][-1]
        found.append(Field("cache", T("cache after the last call", "最后一次调用后的 cache"),
                           f"len {held} · cache.k {' + '.join(chunks)}"))
    found.append(inputs_field(run["changed"]))
    return found


def _scenario(id: str, title: T, sizes, w, x, cos, sin) -> Scenario:
    return Scenario(id, title, lambda module: _fields(feed(module, w, x, cos, sin, sizes)))


def _toy_inputs(toy: dict):
    return (_weights(toy), *(torch.tensor(toy[k], dtype=torch.float32) for k in ("x", "cos", "sin")))


def _feedings(toy: dict) -> list[tuple[str, T, list[int] | None]]:
    split = list(toy["split"])
    return [("whole", T("one call, no cache", "一次调用，不带 cache"), None), ("split", _title(split), split),
            ("decode", _title([1] * len(toy["x"])), [1] * len(toy["x"]))]


def scenarios(toy: dict) -> list[Scenario]:
    w, x, cos, sin = _toy_inputs(toy)
    return [_scenario(id, title, sizes, w, x, cos, sin) for id, title, sizes in _feedings(toy)]


PROBE_CASE = T("a random case like the checks' (H = 4, KVH = 2, D = 8, 5 tokens, random norm weights, "
               "real RoPE angles)", "和检查里一样的随机用例（H = 4、KVH = 2、D = 8、5 个 token、随机的 norm 权重、"
               "真实的 RoPE 角度）")


def probes() -> list[Scenario]:
    gen = torch.Generator().manual_seed(2026)
    H, KVH, D, hidden, S = 4, 2, 8, 24, 5

    def normal(*size, std=1.0):
        return torch.randn(*size, generator=gen, dtype=torch.float32) * std

    w = SimpleNamespace(q_proj=normal(H * D, hidden, std=hidden**-0.5),
                        k_proj=normal(KVH * D, hidden, std=hidden**-0.5),
                        v_proj=normal(KVH * D, hidden, std=hidden**-0.5),
                        o_proj=normal(hidden, H * D, std=(H * D) ** -0.5),
                        q_norm=1 + 0.3 * normal(D), k_norm=1 + 0.3 * normal(D), eps=1e-6,  # not all ones: QK-norm shows
                        num_heads=H, num_kv_heads=KVH, head_dim=D)
    x = normal(S, hidden)
    inverse_frequencies = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float32) / D)
    angles = torch.arange(S, dtype=torch.float32)[:, None] * inverse_frequencies[None, :]
    angles = torch.cat((angles, angles), dim=-1)  # half-split layout: [S, D]
    cos, sin = angles.cos(), angles.sin()
    feedings = [("whole", T("in one call", "一次调用"), None),
                ("split", T("fed as 3 + 2 tokens", "分 3 + 2 个 token 调用"), [3, 2]),
                ("decode", T("fed as 3 + 1 + 1 tokens", "分 3 + 1 + 1 个 token 调用"), [3, 1, 1])]
    return [_scenario(f"probe-{id}", title, sizes, w, x, cos, sin) for id, title, sizes in feedings]


# ---- the walk-through ---------------------------------------------------------------------------------


def _rms_norm_heads(t: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * t * torch.rsqrt(t.pow(2).mean(dim=-1, keepdim=True) + eps)


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = t.chunk(2, dim=-1)
    return t * cos[:, None, :] + torch.cat((-second, first), dim=-1) * sin[:, None, :]


def walkthrough(reference, toy: dict) -> list[Step]:
    w, x, cos, sin = _toy_inputs(toy)
    T_, H, KVH, D = x.shape[0], w.num_heads, w.num_kv_heads, w.head_dim
    runs = {id: (title, sizes, feed(reference, w, x, cos, sin, sizes)) for id, title, sizes in _feedings(toy)}
    cached = feed(reference, w, x, cos, sin, [T_])["cache"]
    keys, values = torch.cat(cached.k), torch.cat(cached.v)  # [S, KVH, D], from the reference

    q = _rotate(_rms_norm_heads((x @ w.q_proj.T).view(T_, H, D), w.q_norm, w.eps), cos, sin)
    k = _rotate(_rms_norm_heads((x @ w.k_proj.T).view(T_, KVH, D), w.k_norm, w.eps), cos, sin)
    agree(k, keys, "the cached keys")

    inputs = Table.of("inputs", [T("token", "token"), "x", T("q after QK-norm and RoPE", "q（QK-norm + RoPE 之后）"),
                                  T("k as cached", "cache 里的 k"), T("v as cached", "cache 里的 v")],
                      [[str(t), x[t], q[t].flatten(), keys[t].flatten(), values[t].flatten()] for t in range(T_)])

    whole = runs["whole"][2]["calls"][0][1]  # [T, hidden]
    scale = D**-0.5
    group = H // KVH
    rows = []
    for t in range(T_):
        visible = t + 1
        scores = torch.stack([(q[t, h] * keys[:visible, h // group]).sum(-1) * scale for h in range(H)])  # [H, s]
        probs = scores.softmax(dim=-1)
        mixed = torch.einsum("hs,shd->hd", probs, values[:visible].repeat_interleave(group, dim=1))
        agree(mixed.reshape(1, H * D) @ w.o_proj.T, whole[t : t + 1], f"token {t} of the whole prefill")
        mask = " ".join("✓" if s < visible else "·" for s in range(T_))
        rows.append([str(t), Cell.of(mask, "mask"), scores.flatten(), probs.flatten(), whole[t]])
    prefill = Table.of("prefill", [T("token = position", "token = 位置"), T("sees keys", "可见的 key"),
                                   T("scores q·k/√D", "分数 q·k/√D"), T("softmax", "softmax"),
                                   T("output row", "输出行")], rows)

    feeding_rows = []
    for id, (title, sizes, run) in runs.items():
        start = 0
        for n, (past, out, held, chunks) in enumerate(run["calls"], 1):  # one row per call
            same = torch.allclose(out, whole[start : start + out.shape[0]], atol=1e-12, rtol=0)
            feeding_rows.append([title if n == 1 else "", str(past), out, "—" if held is None else str(held),
                                 Cell(("—",) if chunks is None else tuple(chunks)), "✓" if same else "✗"])
            start += out.shape[0]
    feedings = Table.of("feedings", [T("run", "调用方式"), T("past", "past"),
                                     T("rows returned", "返回的行"), T("len(cache) after", "调用后 len(cache)"),
                                     T("cache.k chunks", "cache.k 的分块"), T("= whole", "与整段一致")],
                        feeding_rows)

    norm_text = T(f"QK-norm divides each head of q and k by its own RMS (eps = {number(w.eps)}); here "
                  f"H = {H}, KVH = {KVH}, D = {D}, so every token is one vector of {D} numbers.",
                  f"QK-norm 把 q、k 的每个 head 除以它自己的 RMS（eps = {number(w.eps)}）；这里 H = {H}、KVH = {KVH}、"
                  f"D = {D}，所以每个 token 就是一个 {D} 维向量。")
    prefill_text = T(f"Scale D^-0.5 = {number(scale)}. Query t sits at position t and sees keys 0..t; the scores "
                     f"and weights are listed for the visible keys only.",
                     f"缩放系数 D^-0.5 = {number(scale)}。第 t 个 query 在位置 t，能看见 key 0..t；分数和权重只列出"
                     f"可见的 key。")
    feed_text = T(f"Every run returns the same rows as the whole prefill: {' '.join(vector(r) for r in whole)}. "
                  "past is len(cache) read before the call appends.",
                  f"每种调用方式都得到与整段 prefill 相同的行：{' '.join(vector(r) for r in whole)}。"
                  "past 是调用追加之前读到的 len(cache)。")
    return [
        Step(T("1. The inputs after QK-norm", "1. QK-norm 之后的输入"), inputs, norm_text),
        Step(T("2. Whole prefill, one query at a time", "2. 整段 prefill，逐个 query 看"), prefill, prefill_text),
        Step(T("3. The same tokens, fed three ways", "3. 同样的 token，三种喂法"), feedings, feed_text),
    ]
