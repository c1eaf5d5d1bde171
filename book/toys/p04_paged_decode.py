"""How to run P04's toy: p03's row in the paged cache of `toy_cases/p04_paged_decode.json`, through the
Triton kernel `paged_decode` (float16), whole and in two splits, and each split's keys alone.

The outputs come from the reference, run in Triton's interpreter where there is no GPU (see
`_kernels.py`); a build that cannot run kernels shows the toy file's walk and splits without them. The
walk through the block table (page, block, offset and slot of every key), the splits' outputs,
log-sum-exps and weights, and the merged and averaged outputs are the toy file's; they must agree
with each other (else `ToyDrift`), and with the reference's float16 outputs within the checks'
float16 tolerance: the whole row, and each split's keys run alone. The same keys laid out in order
(block table [0, 1]) must give the paged layout's output bit for bit (the table only moves blocks).
"""

import torch

from book.i18n import T
from book.toys import Cell, Field, Scenario, Step, Table, ToyDrift, _kernels, call, inputs_field, number, vector
from checks.harness.compare import close_enough, tolerance

F16, I32 = torch.float16, torch.int32
EXACT = 1e-6  # the toy file holds float64 values to 10 decimals


def _drift(what: str) -> ToyDrift:
    return ToyDrift(f"{what}: toy_cases/p04_paged_decode.json and solutions/p04_paged_decode.py disagree")


def paged_cache(toy: dict, placement: list[dict], num_blocks: int | None = None, device=None):
    """A NaN cache `[num_blocks, block_size, 1, D]` with key j (k_j = key_scale * s_j e0, v_j = v_j e0) in the
    block and offset `placement` gives it: every other slot NaN. Also q = e0. All float16."""
    D, size = toy["head_dim"], toy["block_size"]
    shape = (num_blocks or toy["num_blocks"], size, 1, D)
    k_cache, v_cache = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    for step in placement:
        k_cache[step["block"], step["offset"]] = 0.0
        v_cache[step["block"], step["offset"]] = 0.0
        k_cache[step["block"], step["offset"], 0, 0] = toy["key_scale"] * toy["scores"][step["key"]]
        v_cache[step["block"], step["offset"], 0, 0] = toy["values"][step["key"]]
    q = torch.zeros(1, 1, D)
    q[0, 0, 0] = 1.0
    return tuple(x.to(F16).to(device) for x in (q, k_cache, v_cache))


def decode(module, toy: dict, placement: list[dict], table: list[list[int]], seqlens: list[int], num_splits: int,
           num_blocks: int | None = None):
    """`module.paged_decode` on the row in a cache laid out by `placement`: (output [1, 1, D] on the CPU,
    the name of an input it changed or None)."""
    device = _kernels.device()
    q, k_cache, v_cache = paged_cache(toy, placement, num_blocks, device)
    block_table = torch.tensor(table, dtype=I32, device=device)
    cache_seqlens = torch.tensor(seqlens, dtype=I32, device=device)
    with _kernels.quiet():
        out, changed = call(module.paged_decode, q, k_cache, v_cache, block_table, cache_seqlens,
                            num_splits=num_splits)
        _kernels.synchronize()
    return out.cpu(), changed


def _toy_decode(module, toy: dict, num_splits: int):
    return decode(module, toy, toy["walk"], toy["block_table"], toy["cache_seqlens"], num_splits)


def _in_order(toy: dict) -> tuple[list[dict], list[list[int]]]:
    """The same keys in blocks 0, 1, ... (logical block i in physical block i)."""
    size = toy["block_size"]
    placement = [{"key": j, "block": j // size, "offset": j % size} for j in range(len(toy["scores"]))]
    return placement, [list(range(-(-len(toy["scores"]) // size)))]


def _split_alone(toy: dict, start: int, stop: int) -> tuple[list[dict], list[list[int]], list[int]]:
    """Keys start..stop-1 as a sequence of their own, in the blocks the toy gives them."""
    size = toy["block_size"]
    if start % size:
        raise _drift(f"split {start}..{stop - 1} does not start on a block boundary")
    walk = [step for step in toy["walk"] if start <= step["key"] < stop]  # its key i is the row's key start + i
    blocks = [toy["block_table"][0][page] for page in range(start // size, -(-stop // size))]
    return walk, [blocks + [-1]], [stop - start]


# ---- the runs the mistakes are shown on -----------------------------------------------------------


def _decode_fields(module, toy: dict, num_splits: int) -> list[Field]:
    out, changed = _toy_decode(module, toy, num_splits)
    return [Field("output0", T("output[0, 0, 0]", "output[0, 0, 0]"), out[0, 0, 0]), inputs_field(changed)]


def scenarios(toy: dict) -> list[Scenario]:
    if _kernels.device() is None:
        return []
    table, seqlens = toy["block_table"], toy["cache_seqlens"]
    return [Scenario(f"decode-{n}", T(f"paged_decode on the toy (block table {table}, cache_seqlens {seqlens}), "
                                      f"num_splits = {n}",
                                      f"对 toy 调用 paged_decode（block table {table}，cache_seqlens {seqlens}），"
                                      f"num_splits = {n}"),
                     lambda module, n=n: _decode_fields(module, toy, n)) for n in (1, 2)]


# ---- probes: what one sequence of one head, ending on a block boundary, never exercises -----------------


PROBE_CASE = T("cases like the checks' (three sequences of 17, 49 and 33 keys in shuffled blocks of 16, random garbage "
               "in every slot they do not own, block tables padded with -1, H = 4 query heads on KVH = 2, D = 16, "
               "random fp16; and one sequence of 300 keys cut into 2 splits)",
               "和检查里一样的用例（三个序列，分别有 17、49、33 个 key，放在打乱顺序的、每块 16 个 slot 的 block 里；"
               "不属于它们的 slot 全是随机垃圾值，block table 用 -1 补齐；H = 4 个 query head 对 KVH = 2，D = 16，"
               "随机 fp16；以及一个 300 个 key 的序列，切成 2 个 split）")

H, KVH, D, BLOCK = 4, 2, 16, 16


def _paged_batch(gen, lengths: list[int]) -> dict:
    """Random keys and values for `lengths` scattered over shuffled blocks of BLOCK slots (3 spare blocks);
    every slot no sequence owns holds finite garbage; each table row padded with -1 (one column more)."""
    needed = [-(-n // BLOCK) for n in lengths]
    num_blocks = sum(needed) + 3
    order = torch.randperm(num_blocks, generator=gen)
    k_cache = (4 * torch.randn(num_blocks, BLOCK, KVH, D, generator=gen)).to(F16)
    v_cache = (4 * torch.randn(num_blocks, BLOCK, KVH, D, generator=gen)).to(F16)
    table = torch.full((len(lengths), max(needed) + 1), -1, dtype=I32)
    taken = 0
    for b, n in enumerate(lengths):
        keys, values = torch.randn(n, KVH, D, generator=gen).to(F16), torch.randn(n, KVH, D, generator=gen).to(F16)
        for i in range(needed[b]):
            block, start = int(order[taken]), i * BLOCK
            taken += 1
            table[b, i] = block
            stop = min(n, start + BLOCK)
            k_cache[block, : stop - start] = keys[start:stop]
            v_cache[block, : stop - start] = values[start:stop]
    q = torch.randn(len(lengths), H, D, generator=gen).to(F16)
    return {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_table": table,
            "cache_seqlens": torch.tensor(lengths, dtype=I32)}


def _probe_fields(module, batch: dict, num_splits: int) -> list[Field]:
    device = _kernels.device()
    args = [batch[k].clone().to(device) for k in ("q", "k_cache", "v_cache", "block_table", "cache_seqlens")]
    with _kernels.quiet():
        out, changed = call(module.paged_decode, *args, num_splits=num_splits)
        _kernels.synchronize()
    return [Field("out", T("out", "out"), out.cpu()), inputs_field(changed)]


def probes() -> list[Scenario]:
    if _kernels.device() is None:
        return []
    gen = torch.Generator().manual_seed(2026)
    batch, long = _paged_batch(gen, [17, 49, 33]), _paged_batch(gen, [300])
    return [
        Scenario("probe-batch", T("paged_decode on three sequences of 17, 49 and 33 keys, H = 4 on KVH = 2",
                                  "paged_decode 处理 17、49、33 个 key 的三个序列，H = 4 对 KVH = 2"),
                 lambda module: _probe_fields(module, batch, 1)),
        Scenario("probe-split", T("paged_decode on one sequence of 300 keys, num_splits = 2",
                                  "paged_decode 处理一个 300 个 key 的序列，num_splits = 2"),
                 lambda module: _probe_fields(module, long, 2)),
    ]


# ---- the walk-through ---------------------------------------------------------------------------------


def _check_walk(toy: dict) -> None:
    size, table = toy["block_size"], toy["block_table"][0]
    for step in toy["walk"]:
        j = step["key"]
        if (step["page"], step["offset"]) != (j // size, j % size) or step["block"] != table[step["page"]] or \
                step["slot"] != step["block"] * size + step["offset"]:
            raise _drift(f"the walk's row for key {j} is not block_table[j // {size}], j % {size}")
    if toy["poisoned_block"] in table:
        raise _drift("the poisoned block is in the block table")


def _walk_step(reference, toy: dict, runs: dict) -> Step:
    _check_walk(toy)
    size = toy["block_size"]
    rows = [[str(s["key"]), str(s["page"]), str(s["block"]), str(s["offset"]),
             f"{s['block']} · {size} + {s['offset']} = {s['slot']}", torch.tensor(toy["scores"][s["key"]]),
             torch.tensor(toy["values"][s["key"]])] for s in toy["walk"]]
    table = Table.of("walk", [T("key j", "key j"), f"page = j // {size}", "block = table[page]", f"offset = j % {size}",
                              f"slot = block · {size} + offset", "s_j", "v_j"], rows)
    used = {s["slot"] for s in toy["walk"]}
    poisoned = toy["poisoned_block"]
    spare = [poisoned * size + i for i in range(size)]
    unused = [i for i, b in enumerate(toy["block_table"][0]) if b == -1]
    en = (f"Block size {size}, {toy['num_blocks']} blocks, block table {toy['block_table'][0]}, cache_seqlens "
          f"{toy['cache_seqlens'][0]}. Slots {', '.join(map(str, spare))} (block {poisoned}) belong to nobody and hold "
          f"NaN; the table's entry {', '.join(map(str, unused))} (-1) is padding. Neither is ever read: ")
    zh = (f"块大小 {size}，共 {toy['num_blocks']} 个 block，block table 为 {toy['block_table'][0]}，cache_seqlens 为 "
          f"{toy['cache_seqlens'][0]}。slot {'、'.join(map(str, spare))}（block {poisoned}）不属于任何人，存的是 "
          f"NaN；table 的第 {'、'.join(map(str, unused))} 项（-1）是补齐用的。这两处都不会被读到：")
    if runs:
        out = runs["toy-1"][0, 0, 0]
        en += f"paged_decode returns {number(out)}, p03's {number(toy['output0'])} in fp16, not NaN."
        zh += f"paged_decode 返回 {number(out)}，即 p03 的 {number(toy['output0'])} 的 fp16 值，而不是 NaN。"
    else:
        en += f"the output is p03's {number(toy['output0'])}. (paged_decode {_kernels.NOT_RUN.en}.)"
        zh += f"输出就是 p03 的 {number(toy['output0'])}。（paged_decode {_kernels.NOT_RUN.zh}。）"
    if used & set(spare):
        raise _drift("the walk reads the poisoned block")
    return Step(T("1. The walk through the block table", "1. 透过 block table 走一遍"), table, T(en, zh))


def _runs(reference, toy: dict) -> dict:
    """The reference's outputs on the toy (none where this build cannot run kernels), checked."""
    if _kernels.device() is None:
        return {}
    fp16 = tolerance("flash", F16)
    found = {}
    for n in (1, 2):
        found[f"toy-{n}"], changed = _toy_decode(reference, toy, n)
        if changed is not None:
            raise _drift(f"paged_decode changed {changed}")
    placement, table = _in_order(toy)
    found["in-order"], _ = decode(reference, toy, placement, table, toy["cache_seqlens"], 1)
    for name, out in found.items():
        if not close_enough(out[0, 0, :1].float(), torch.tensor([toy["output0"]]), fp16):
            raise _drift(f"paged_decode ({name}) gives {number(out[0, 0, 0])}, the toy file {toy['output0']}")
        if out[0, 0, 1:].any():
            raise _drift(f"paged_decode ({name}) writes more than dim 0")
    if not torch.equal(found["in-order"], found["toy-1"]):
        raise _drift("the paged layout and the same keys in order give different outputs")
    for n, (start, stop) in enumerate(toy["splits"]["ranges"]):
        placement, table, seqlens = _split_alone(toy, start, stop)
        # key numbers within the split: the cache holds the row's keys start..stop-1 at their toy slots
        found[f"split-{n}"], _ = decode(reference, toy, placement, table, seqlens, 1)
        want = toy["splits"]["partial_output0"][n]
        if not close_enough(found[f"split-{n}"][0, 0, :1].float(), torch.tensor([want]), fp16):
            raise _drift(f"paged_decode on keys {start}..{stop - 1} alone gives {number(found[f'split-{n}'][0, 0, 0])}"
                         f", the toy file's partial output {want}")
    return found


def _decode_step(toy: dict, runs: dict, n: int) -> Step:
    table, seqlens = toy["block_table"], toy["cache_seqlens"]
    placement, in_order = _in_order(toy)
    rows = []
    for name, en, zh, blocks, splits in (
            ("toy-1", "the toy", "toy", table, 1), ("toy-2", "the toy", "toy", table, 2),
            ("in-order", "the same keys in order", "同样的 key 按顺序存放", in_order, 1)):
        out = runs[name]
        rest = T("all 0", "全为 0") if not out[0, 0, 1:].any() else vector(out[0, 0, 1:])
        rows.append([Cell.of(T(en, zh), "text"), str(blocks[0]), str(seqlens[0]), str(splits), out[0, 0, 0],
                     Cell.of(rest, "text")])
    rows.append([Cell.of(T("the toy file, float64", "toy 文件里的 float64 值"), "text"), "", "", "",
                 torch.tensor(toy["output0"]), ""])
    result = Table.of("paged_decode", [T("layout", "布局"), "block_table", "cache_seqlens", "num_splits",
                                       "output[0, 0, 0]", "output[0, 0, 1:]"], rows)
    text = T(f"The block table only says where the blocks are: the same keys in blocks {in_order[0]} give the same "
             f"output, bit for bit. With num_splits = 2 the output does not change either: the kernel splits by tiles "
             f"of keys, and its tile holds all {len(toy['scores'])} keys, so the second range is empty. The kernel ran "
             f"{_kernels.where().en}.",
             f"block table 只说明各个 block 在哪里：同样的 key 放进 block {in_order[0]}，输出逐位相同。num_splits = 2 "
             f"时输出也不变：kernel 按 key 的 tile 切分，而一个 tile 就装下了全部 {len(toy['scores'])} 个 key，"
             f"所以第二段是空的。kernel {_kernels.where().zh}运行。")
    return Step(T(f"{n}. paged_decode on the toy", f"{n}. 在 toy 上调用 paged_decode"), result, text)


def _splits_step(toy: dict, runs: dict, n: int) -> Step:
    splits = toy["splits"]
    outs, lses, weights = splits["partial_output0"], splits["partial_lse"], splits["weights"]
    # the toy file's own arithmetic holds: weights exp(lse_s - max), merged = sum w o / sum w = the unsplit output
    top = max(lses)
    if not torch.allclose(torch.tensor([2.718281828459045 ** (x - top) for x in lses], dtype=torch.float64),
                          torch.tensor(weights, dtype=torch.float64), atol=EXACT, rtol=0):
        raise _drift("the splits' weights are not exp(lse - max lse)")
    merged = sum(w * o for w, o in zip(weights, outs)) / sum(weights)
    if abs(merged - splits["merged0"]) > EXACT or abs(splits["merged0"] - toy["output0"]) > EXACT or \
            abs(sum(outs) / len(outs) - splits["averaged0"]) > EXACT:
        raise _drift("the merged or averaged split outputs")
    rows = []
    for i, (start, stop) in enumerate(splits["ranges"]):
        alone = runs[f"split-{i}"][0, 0, 0] if runs else Cell.of(_kernels.NOT_RUN, "text")
        rows.append([chr(ord("A") + i), f"{start}..{stop - 1}", vector(toy["scores"][start:stop]), alone,
                     torch.tensor(outs[i]), torch.tensor(lses[i]), torch.tensor(weights[i])])
    rows.append([Cell.of(T("merged: Σ w·o / Σ w", "合并：Σ w·o / Σ w"), "text"), "", "", "",
                 torch.tensor(splits["merged0"]), "", ""])
    rows.append([Cell.of(T("averaged (wrong)", "直接平均（错误）"), "text"), "", "", "",
                 torch.tensor(splits["averaged0"]), "", ""])
    table = Table.of("splits", [T("split", "split"), T("keys", "key"), T("scores", "分数"),
                                T("paged_decode on these keys alone (fp16)", "只对这些 key 调用 paged_decode（fp16）"),
                                "o_s", "lse_s = m + ln(sum_exp)", "w_s = exp(lse_s − max lse)"], rows)
    text = T(f"Each split's output is normalised by its own sum, so the merge weights split s by exp(lse_s − max "
             f"lse): {number(weights[0])} and {number(weights[1])}. Weighted, the partials give "
             f"{number(splits['merged0'])}, the unsplit value; averaged, {number(splits['averaged0'])}. The reference "
             f"kernel does this merge whenever both ranges hold keys (a long context, the checks' split-K cases); on "
             f"this toy its one tile holds every key.",
             f"每个 split 的输出都是用它自己的和归一化的，所以合并时给 split s 的权重是 exp(lse_s − max lse)："
             f"{number(weights[0])} 和 {number(weights[1])}。加权后得到 {number(splits['merged0'])}，与不切分时相同；"
             f"直接平均则是 {number(splits['averaged0'])}。只要两段都有 key（长上下文，检查里的 split-K 用例），"
             f"参考实现的 kernel 就做这样的合并；在这个 toy 上，它的一个 tile 装下了所有 key。")
    return Step(T(f"{n}. Split-K by hand, one block per split", f"{n}. 手算 split-K，每个 split 一个 block"), table,
                text)


def walkthrough(reference, toy: dict) -> list[Step]:
    runs = _runs(reference, toy)
    steps = [_walk_step(reference, toy, runs)]
    if runs:
        steps.append(_decode_step(toy, runs, len(steps) + 1))
    steps.append(_splits_step(toy, runs, len(steps) + 1))
    return steps
