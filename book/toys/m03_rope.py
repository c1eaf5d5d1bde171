"""How to run M03's toy: the functions of `solutions/m03_rope.py` on `toy_cases/m03_rope.json`, in fp32.

The inverse frequencies, the cos/sin tables, `rotate_half`, the rotated queries and keys, nano-vllm's
cached table and its `rotary`, and the M-RoPE tables come from the reference. Worked here and tied to
the reference with `agree`: the exponents and powers behind `inv_freq`, the angles behind each table,
the rotation `q * cos + rotate_half(q) * sin`, the slot each M-RoPE frequency reads, and the dot
products that depend only on the distance between positions.
"""

import torch

from book.i18n import T
from book.toys import Field, Scenario, Step, Table, agree, call, inputs_field, number, vector

F32 = torch.float32


def _tensor(value, dtype=F32) -> torch.Tensor:
    return torch.tensor(value, dtype=dtype)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """`[T, heads, D]` as `[T, heads * D]`: one line per token in a cell."""
    return t.reshape(t.shape[0], -1)


# ---- the runs the mistakes are shown on -----------------------------------------------------------


def _inv_freq_fields(module, head_dim: int, theta: float) -> list[Field]:
    return [Field("inv_freq", T("inv_freq", "inv_freq"), module.inverse_frequencies(head_dim, theta))]


def _tables_fields(module, positions, inv_freq, dtype) -> list[Field]:
    (cos, sin), changed = call(module.rope_cos_sin, positions.clone(), inv_freq.clone(), dtype)
    return [Field("cos", T("cos", "cos"), cos), Field("sin", T("sin", "sin"), sin), inputs_field(changed)]


def _rotate_half_fields(module, x) -> list[Field]:
    out, changed = call(module.rotate_half, x.clone())
    return [Field("out", T("rotate_half(x)", "rotate_half(x)"), out), inputs_field(changed)]


def _rotated_fields(result, changed) -> list[Field]:
    q, k = result
    return [Field("q", T("rotated q", "旋转后的 q"), _rows(q)), Field("k", T("rotated k", "旋转后的 k"), _rows(k)),
            inputs_field(changed)]


def _apply_rope_fields(module, q, k, cos, sin) -> list[Field]:
    return _rotated_fields(*call(module.apply_rope, q.clone(), k.clone(), cos.clone(), sin.clone()))


def _rotary_fields(module, head_dim, max_position, theta, positions, q, k) -> list[Field]:
    cache = module.build_rotary_cache(head_dim, max_position, theta)
    return _rotated_fields(*call(module.rotary, cache, positions.clone(), q.clone(), k.clone()))


def _mrope_fields(module, position_ids, inv_freq, section, dtype) -> list[Field]:
    (cos, sin), changed = call(module.mrope_cos_sin, position_ids.clone(), inv_freq.clone(), list(section), dtype)
    return [Field("cos", T("cos", "cos"), cos), Field("sin", T("sin", "sin"), sin), inputs_field(changed)]


def _toy_inputs(toy: dict) -> dict:
    rotation = toy["apply_rope"]
    return {
        "D": toy["inverse_frequencies"]["head_dim"], "theta": toy["inverse_frequencies"]["theta"],
        "inv_freq": _tensor(toy["inverse_frequencies"]["expected"]),
        "positions": torch.tensor(toy["cos_sin"]["positions"]),
        "cos": _tensor(toy["cos_sin"]["cos"]), "sin": _tensor(toy["cos_sin"]["sin"]),
        "x": _tensor(toy["rotate_half"]["x"]), "q": _tensor(rotation["q"]), "k": _tensor(rotation["k"]),
        "position_ids": torch.tensor(toy["mrope"]["position_ids"]), "mrope_inv_freq": _tensor(toy["mrope"]["inv_freq"]),
        "section": list(toy["mrope"]["mrope_section"]),
    }


def _positions_text(positions: torch.Tensor) -> str:
    return ", ".join(str(p) for p in positions.tolist())


def scenarios(toy: dict) -> list[Scenario]:
    t = _toy_inputs(toy)
    D, theta, where = t["D"], t["theta"], _positions_text(t["positions"])
    max_position = int(t["positions"].max()) + 1
    return [
        Scenario("inv-freq", T(f"inverse_frequencies({D}, {number(theta)})",
                               f"inverse_frequencies({D}, {number(theta)})"),
                 lambda module: _inv_freq_fields(module, D, theta)),
        Scenario("tables", T(f"rope_cos_sin at positions {where}", f"rope_cos_sin，位置 {where}"),
                 lambda module: _tables_fields(module, t["positions"], t["inv_freq"], F32)),
        Scenario("rotate-half", T(f"rotate_half({vector(t['x'])})", f"rotate_half({vector(t['x'])})"),
                 lambda module: _rotate_half_fields(module, t["x"])),
        Scenario("apply-rope", T(f"apply_rope with the page's tables (positions {where})",
                                 f"apply_rope，用本页的 cos/sin 表（位置 {where}）"),
                 lambda module: _apply_rope_fields(module, t["q"], t["k"], t["cos"], t["sin"])),
        Scenario("rotary", T(f"rotary(build_rotary_cache({D}, {max_position}, {number(theta)}), positions {where})",
                             f"rotary(build_rotary_cache({D}, {max_position}, {number(theta)})，位置 {where})"),
                 lambda module: _rotary_fields(module, D, max_position, theta, t["positions"], t["q"], t["k"])),
        Scenario("mrope", T(f"mrope_cos_sin, mrope_section {t['section']}",
                            f"mrope_cos_sin，mrope_section {t['section']}"),
                 lambda module: _mrope_fields(module, t["position_ids"], t["mrope_inv_freq"], t["section"], F32)),
    ]


PROBE_CASE = T("a case like the checks' (D = 16, θ = 10⁶, a decode step at positions 1000..1003 and a chunk at "
               "37..47, random q [T, 4, 16] and k [T, 2, 16], bf16 and fp32)",
               "和检查里一样的用例（D = 16、θ = 10⁶，位置 1000..1003 的 decode 步和 37..47 的 chunk，随机的 "
               "q [T, 4, 16] 与 k [T, 2, 16]，bf16 和 fp32）")


def probes() -> list[Scenario]:
    gen = torch.Generator().manual_seed(2026)
    D, theta, H, KVH = 16, 1e6, 4, 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=F32) / D))  # Hugging Face's inv_freq
    decode, chunk = torch.arange(1000, 1004), torch.arange(37, 48)

    def qk(n: int, dtype):
        return torch.randn(n, H, D, generator=gen).to(dtype), torch.randn(n, KVH, D, generator=gen).to(dtype)

    def rotated(module, positions, q, k, dtype):
        cos, sin = module.rope_cos_sin(positions.clone(), inv_freq.clone(), dtype)
        return _apply_rope_fields(module, q, k, cos, sin)

    q_decode, k_decode = qk(len(decode), torch.bfloat16)
    q_chunk, k_chunk = qk(len(chunk), F32)
    return [
        Scenario("probe-tables-bf16", T("rope_cos_sin in bf16 at positions 1000..1003",
                                        "bf16 的 rope_cos_sin，位置 1000..1003"),
                 lambda module: _tables_fields(module, decode, inv_freq, torch.bfloat16)),
        Scenario("probe-rope-bf16", T("rope_cos_sin + apply_rope in bf16 at positions 1000..1003",
                                      "bf16 的 rope_cos_sin + apply_rope，位置 1000..1003"),
                 lambda module: rotated(module, decode, q_decode, k_decode, torch.bfloat16)),
        Scenario("probe-rotary-chunk", T("rotary on a chunk at positions 37..47 (fp32)",
                                         "rotary 处理位置 37..47 的 chunk（fp32）"),
                 lambda module: _rotary_fields(module, D, 1100, theta, chunk, q_chunk, k_chunk)),
    ]


# ---- the walk-through ---------------------------------------------------------------------------------

AXES = ("t", "h", "w")


def _inverse_frequency_step(reference, toy: dict) -> Step:
    rows = []
    for case in (toy["inverse_frequencies"], toy["mrope"]):
        D, theta = case["head_dim"], case["theta"]
        inv_freq = reference.inverse_frequencies(D, theta)
        exponents = torch.arange(0, D, 2, dtype=F32) / D  # [D/2]
        powers = theta**exponents
        agree(1.0 / powers, inv_freq, f"inverse_frequencies({D}, {theta})")
        for i in range(D // 2):
            rows.append([f"D = {D}, θ = {number(theta)}" if i == 0 else "", str(i), exponents[i], powers[i],
                         inv_freq[i]])
    table = Table.of("inv_freq", [T("case", "用例"), "i", "2i / D", "θ^(2i/D)", "inv_freq[i] = 1 / θ^(2i/D)"], rows)
    first = toy["inverse_frequencies"]
    inv_freq = reference.inverse_frequencies(first["head_dim"], first["theta"])
    half = first["head_dim"] // 2
    text = T(f"Channel pair (i, i + D/2) turns inv_freq[i] radians per position. With D = {first['head_dim']} and "
             f"θ = {number(first['theta'])}, inv_freq = {vector(inv_freq)}: the pair (0, {half}) turns "
             f"{number(inv_freq[0])} radian per position, the pair (1, {1 + half}) {number(inv_freq[1])}.",
             f"通道对 (i, i + D/2) 每前进一个位置转 inv_freq[i] 弧度。D = {first['head_dim']}、"
             f"θ = {number(first['theta'])} 时 inv_freq = {vector(inv_freq)}：通道对 (0, {half}) 每个位置转 "
             f"{number(inv_freq[0])} 弧度，通道对 (1, {1 + half}) 转 {number(inv_freq[1])} 弧度。")
    return Step(T("1. Inverse frequencies", "1. 逆频率 inv_freq"), table, text)


def _tables_step(reference, t: dict) -> tuple[Step, torch.Tensor, torch.Tensor]:
    inv_freq = reference.inverse_frequencies(t["D"], t["theta"])
    cos, sin = reference.rope_cos_sin(t["positions"], inv_freq, F32)
    angles = t["positions"].to(F32)[:, None] * inv_freq[None, :]  # [T, D/2]
    agree(torch.cat((angles, angles), dim=-1).cos(), cos, "rope_cos_sin's cos")
    agree(torch.cat((angles, angles), dim=-1).sin(), sin, "rope_cos_sin's sin")
    rows = [[str(p), angles[n], cos[n], sin[n]] for n, p in enumerate(t["positions"].tolist())]
    table = Table.of("tables", [T("position", "位置"), T("angles = position · inv_freq", "角度 = 位置 · inv_freq"),
                                T("cos row [c0, c1, c0, c1]", "cos 行 [c0, c1, c0, c1]"),
                                T("sin row [s0, s1, s0, s1]", "sin 行 [s0, s1, s0, s1]")], rows)
    last = len(rows) - 1
    text = T(f"Each row of angles is written twice, so channel i and channel i + D/2 turn together. Position "
             f"{t['positions'][last].item()}'s slow pair has turned {number(angles[last, 1])} radian; position "
             f"{t['positions'][1].item()}'s fast pair has turned {number(angles[1, 0])}.",
             f"每行角度写两遍，所以通道 i 和通道 i + D/2 一起转。位置 {t['positions'][last].item()} 的慢通道对转了 "
             f"{number(angles[last, 1])} 弧度；位置 {t['positions'][1].item()} 的快通道对转了 "
             f"{number(angles[1, 0])} 弧度。")
    return Step(T("2. Angles and the cos/sin tables", "2. 角度与 cos/sin 表"), table, text), cos, sin


def _rotate_half_step(reference, t: dict) -> Step:
    x = t["x"]
    out = reference.rotate_half(x)
    first, second = x.chunk(2, dim=-1)
    agree(torch.cat((-second, first), dim=-1), out, "rotate_half")
    table = Table.of("rotate_half", ["x", T("first half x1", "前一半 x1"), T("second half x2", "后一半 x2"),
                                     "rotate_half(x) = [−x2, x1]"], [[x, first, second, out]])
    text = T(f"Channel i is paired with channel i + {x.shape[-1] // 2} (the half split), not with its neighbour: "
             f"{vector(x)} becomes {vector(out)}.",
             f"通道 i 与通道 i + {x.shape[-1] // 2} 配对（前后两半切分），而不是和相邻通道配对：{vector(x)} 变成 "
             f"{vector(out)}。")
    return Step(T("3. rotate_half", "3. rotate_half"), table, text)


def _rotation_step(reference, t: dict, cos, sin) -> tuple[Step, torch.Tensor, torch.Tensor]:
    q, k = t["q"], t["k"]
    q_rot, k_rot = reference.apply_rope(q, k, cos, sin)
    half_q, half_k = reference.rotate_half(q), reference.rotate_half(k)
    agree(q * cos[:, None, :] + half_q * sin[:, None, :], q_rot, "apply_rope's q")
    agree(k * cos[:, None, :] + half_k * sin[:, None, :], k_rot, "apply_rope's k")
    length = q_rot.pow(2).sum(-1)[:, 0]  # [T]
    score = (q_rot * k_rot).sum(-1)[:, 0]  # [T]
    agree(score, (q * k).sum(-1)[:, 0], "q·k at equal positions")
    rows = [[str(p), q[n, 0], half_q[n, 0], q_rot[n, 0], k[n, 0], k_rot[n, 0], length[n], score[n]]
            for n, p in enumerate(t["positions"].tolist())]
    table = Table.of("rotation", [T("position", "位置"), "q", "rotate_half(q)", "q′ = q·cos + rotate_half(q)·sin",
                                  "k", "k′ = k·cos + rotate_half(k)·sin", "|q′|²", "q′·k′"], rows)
    text = T(f"A rotation keeps lengths: |q′|² stays {number(length[0])} at every position. q and k of the same token "
             f"turn by the same angles, so q′·k′ stays q·k = {number(score[0])}.",
             f"旋转不改变长度：|q′|² 在每个位置都是 {number(length[0])}。同一个 token 的 q 和 k 转过相同的角度，所以 "
             f"q′·k′ 始终等于 q·k = {number(score[0])}。")
    return Step(T("4. Rotating q and k", "4. 旋转 q 和 k"), table, text), q_rot, k_rot


def _distance_step(reference, t: dict, q_rot, k_rot) -> Step:
    positions = t["positions"].tolist()
    pairs = [(m, n) for m in range(len(positions)) for n in range(m + 1)]  # query at or after key, as in attention
    gaps = sorted({positions[m] - positions[n] for m, n in pairs})
    inv_freq = reference.inverse_frequencies(t["D"], t["theta"])
    cos, sin = reference.rope_cos_sin(torch.tensor(gaps), inv_freq, F32)
    q0, k0 = t["q"][:1].expand(len(gaps), -1, -1), t["k"][:1].expand(len(gaps), -1, -1)
    q_gap, _ = reference.apply_rope(q0, k0, cos, sin)  # q turned by each distance, k left at position 0
    rows = []
    for m, n in pairs:
        score = (q_rot[m, 0] * k_rot[n, 0]).sum()
        relative = (q_gap[gaps.index(positions[m] - positions[n]), 0] * t["k"][n, 0]).sum()
        agree(score, relative, f"q at {positions[m]} · k at {positions[n]}")
        rows.append([str(positions[m]), str(positions[n]), str(positions[m] - positions[n]), score, relative])
    table = Table.of("distance", [T("query at m", "query 位置 m"), T("key at n", "key 位置 n"), "m − n",
                                  "q′(m) · k′(n)", T("q′(m − n) · k (k not turned)", "q′(m − n) · k（k 不旋转）")],
                     rows)
    text = T("Turning both by their own positions gives the same score as turning only q by the distance: "
             "attention sees how far apart two tokens are, not where they sit.",
             "q、k 各按自己的位置旋转后的分数，和只把 q 按两者的距离旋转得到的分数相同：注意力看到的是两个 token "
             "相隔多远，而不是它们各自在哪里。")
    return Step(T("5. Only the distance counts", "5. 只有距离起作用"), table, text)


def _rotary_step(reference, t: dict, q_rot, k_rot) -> Step:
    D, theta, positions = t["D"], t["theta"], t["positions"]
    max_position = int(positions.max()) + 1
    cache = reference.build_rotary_cache(D, max_position, theta)
    got_q, got_k = reference.rotary(cache, positions, t["q"], t["k"])
    inv_freq = reference.inverse_frequencies(D, theta)
    cos, sin = reference.rope_cos_sin(positions, inv_freq, F32)
    half = D // 2
    agree(cache[positions], torch.cat((cos[:, :half], sin[:, :half]), dim=-1), "build_rotary_cache's rows")
    rows = []
    for n, p in enumerate(positions.tolist()):
        same = torch.allclose(got_q[n], q_rot[n], atol=1e-6, rtol=0) and torch.allclose(got_k[n], k_rot[n], atol=1e-6,
                                                                                        rtol=0)
        rows.append([str(p), cache[p], got_q[n, 0], got_k[n, 0], "✓" if same else "✗"])
    table = Table.of("rotary", [T("position", "位置"),
                                T("cache row [cos | sin], half width", "cache 行 [cos | sin]，半宽"),
                                T("rotary → q′", "rotary → q′"), T("rotary → k′", "rotary → k′"),
                                T("= apply_rope", "与 apply_rope 一致")], rows)
    text = T(f"nano-vllm builds the table once, build_rotary_cache({D}, {max_position}, {number(theta)}): row p holds "
             f"cos and sin of p · inv_freq, {half} numbers each. rotary looks up each token's row by position, "
             "duplicates the halves and rotates in fp32.",
             f"nano-vllm 只建一次表，build_rotary_cache({D}, {max_position}, {number(theta)})："
             f"第 p 行是 p · inv_freq 的 "
             f"cos 和 sin，各 {half} 个数。rotary 按位置取出每个 token 的那一行，把两半各复制一份，再在 fp32 里旋转。")
    return Step(T("6. nano-vllm's cached table and rotary", "6. nano-vllm 的缓存表与 rotary"), table, text)


def _mrope_axes(section: list[int], slots: int) -> list[int]:
    """The position row (0 = t, 1 = h, 2 = w) each frequency slot reads: h and w interleaved with stride 3."""
    axes = []
    for i in range(slots):
        row = i % 3
        axes.append(row if row in (1, 2) and i < 3 * section[row] else 0)
    return axes


def _mrope_steps(reference, toy: dict) -> list[Step]:
    case = toy["mrope"]
    inv_freq = reference.inverse_frequencies(case["head_dim"], case["theta"])
    position_ids, section = torch.tensor(case["position_ids"]), list(case["mrope_section"])
    cos, sin = reference.mrope_cos_sin(position_ids, inv_freq, section, F32)
    axes = _mrope_axes(section, inv_freq.shape[0])
    angles = torch.stack([position_ids[axes[i]].to(F32) * inv_freq[i] for i in range(len(axes))], dim=-1)  # [T, D/2]
    agree(torch.cat((angles, angles), dim=-1).cos(), cos, "mrope_cos_sin's cos")
    agree(torch.cat((angles, angles), dim=-1).sin(), sin, "mrope_cos_sin's sin")
    agree(angles, _tensor(case["angles"]), "the toy file's M-RoPE angles")

    slot_rows = [[str(i), inv_freq[i], AXES[a], position_ids[a]] for i, a in enumerate(axes)]
    tokens = position_ids.shape[1]
    slots = Table.of("mrope_slots", [T("slot i", "槽位 i"), "inv_freq[i]", T("reads row", "读取的行"),
                                     T(f"that row's positions (tokens 0..{tokens - 1})",
                                       f"该行的位置（token 0..{tokens - 1}）")], slot_rows)
    by_axis = {name: [str(i) for i, a in enumerate(axes) if a == n] for n, name in enumerate(AXES)}
    reads = "; ".join(f"{name}: {', '.join(found) or '—'}" for name, found in by_axis.items())
    slot_text = T(f"D = {case['head_dim']}, θ = {number(case['theta'])}, mrope_section = {section}: slots 1, 4, 7, ... "
                  f"go to h and 2, 5, 8, ... to w, as many as their sections allow; the rest read t. Here {reads}.",
                  f"D = {case['head_dim']}、θ = {number(case['theta'])}、mrope_section = {section}："
                  "槽位 1, 4, 7, ... 给 h，"
                  f"2, 5, 8, ... 给 w，各自取到 section 规定的个数为止；其余槽位读 t。这里 {reads}。")

    rows = []
    for n in range(tokens):
        ids = position_ids[:, n]
        plain_cos, plain_sin = reference.rope_cos_sin(ids[:1], inv_freq, F32)
        same = torch.allclose(cos[n], plain_cos[0], atol=1e-6, rtol=0) and torch.allclose(sin[n], plain_sin[0],
                                                                                          atol=1e-6, rtol=0)
        text_token = bool((ids == ids[0]).all())
        kind = T("text (t = h = w)", "文本（t = h = w）") if text_token else T("image patch", "图像 patch")
        rows.append([str(n), kind, "(" + ", ".join(str(v) for v in ids.tolist()) + ")", angles[n], cos[n], sin[n],
                     "✓" if same else "✗"])
    table = Table.of("mrope", [T("token", "token"), T("kind", "类型"), "(t, h, w)", T("angles", "角度"), "cos", "sin",
                               T("= plain RoPE at t", "与位置 t 的普通 RoPE 相同")], rows)
    text = T("A token whose three rows agree gets exactly plain RoPE's tables; an image patch mixes its t, h and w "
             "positions slot by slot.",
             "三行位置相同的 token 得到的正是普通 RoPE 的表；图像 patch 则按槽位混用它的 t、h、w 位置。")
    return [Step(T("7. M-RoPE: which position each slot reads", "7. M-RoPE：每个槽位读哪一行位置"), slots, slot_text),
            Step(T("8. M-RoPE tables for an image patch and a text token", "8. 图像 patch 与文本 token 的 M-RoPE 表"),
                 table, text)]


def walkthrough(reference, toy: dict) -> list[Step]:
    t = _toy_inputs(toy)
    tables, cos, sin = _tables_step(reference, t)
    rotation, q_rot, k_rot = _rotation_step(reference, t, cos, sin)
    return [_inverse_frequency_step(reference, toy), tables, _rotate_half_step(reference, t), rotation,
            _distance_step(reference, t, q_rot, k_rot), _rotary_step(reference, t, q_rot, k_rot),
            *_mrope_steps(reference, toy)]
