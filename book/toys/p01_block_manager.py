"""How to run P01's toy: the steps of `toy_cases/p01_block_manager.json` on `BlockManager`, then one prefill
and one decode batch through `prefill_metadata` and `decode_metadata`.

The block tables, cached tokens, free list, ref counts and cache entries after each step, the chained
hashes, and every metadata field come from the reference; each step's state must also equal the one the
toy file stores (else `ToyDrift`). Worked here and tied to the reference with `agree`: each token's slot
`block_table[p // block_size] * block_size + p % block_size`, and the per-sequence slices of the batch
tensors cut at the reference's own `cu_seqlens_q`.
"""

import torch

from book.i18n import T
from book.toys import Cell, Field, Scenario, Step, Table, ToyDrift, agree

STATE = ("block_tables", "num_cached_tokens", "free", "ref_counts", "cached_blocks")


def _list(values) -> str:
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    return "[" + ", ".join(_list(v) if isinstance(v, (list, tuple)) else str(v) for v in values) + "]"


def _tokens(tokens: list[int]) -> str:
    """A token list as the page writes it: `[1 .. 9]` for a run of consecutive ids, else every id."""
    run = len(tokens) > 4 and all(b == a + 1 for a, b in zip(tokens, tokens[1:]))
    return f"[{tokens[0]} .. {tokens[-1]}]" if run else _list(tokens)


# ---- replaying a scenario ------------------------------------------------------------------------------


def _state(manager, live: dict) -> dict:
    return {"block_tables": {n: list(s.block_table) for n, s in live.items()},
            "num_cached_tokens": {n: s.num_cached_tokens for n, s in live.items()},
            "free": list(manager.free_block_ids), "ref_counts": [b.ref_count for b in manager.blocks],
            "cached_blocks": sorted(manager.hash_to_block_id.values())}


def replay(module, block_size: int, scenario: dict, upto: int | None = None):
    """Run the scenario's steps (up to step `upto`) on a fresh manager of `module`: the manager, the live
    sequences, and per step the answer of a question or the state after a call."""
    manager, live, found = module.BlockManager(scenario["num_blocks"], block_size), {}, []
    for step in scenario["steps"][:upto]:
        if step["do"] == "can_allocate":
            found.append({"answer": manager.can_allocate(module.Sequence(step["tokens"], block_size))})
            continue
        if step["do"] == "can_append":
            found.append({"answer": manager.can_append(live[step["seq"]])})
            continue
        if step["do"] == "allocate":
            live[step["seq"]] = module.Sequence(step["tokens"], block_size)
            manager.allocate(live[step["seq"]])
        elif step["do"] == "append":
            manager.append(live[step["seq"]], step["token"])
        else:
            manager.free(live.pop(step["seq"]))
        found.append(_state(manager, live))
    return manager, live, found


def _per_seq(values: dict, suffix: str = "") -> str:
    return ", ".join(f"{n} {_list(v) if isinstance(v, list) else v}{suffix}" for n, v in values.items()) or "—"


LABELS = {
    "answer": T("answer", "返回值"),
    "block_tables": T("block tables", "块表"),
    "num_cached_tokens": T("cached tokens", "缓存命中的 token 数"),
    "free": T("free list", "空闲链表"),
    "ref_counts": T("ref counts", "引用计数"),
    "cached_blocks": T("blocks in the cache", "缓存中的块"),
}


def _state_fields(found: dict) -> list[Field]:
    if "answer" in found:
        return [Field("answer", LABELS["answer"], str(found["answer"]))]
    text = {"block_tables": _per_seq(found["block_tables"]), "num_cached_tokens": _per_seq(found["num_cached_tokens"]),
            "free": _list(found["free"]), "ref_counts": _list(found["ref_counts"]),
            "cached_blocks": _list(found["cached_blocks"])}
    return [Field(key, LABELS[key], text[key]) for key in STATE]


def _call(step: dict) -> T:
    seq, do = step.get("seq"), step["do"]
    if do == "allocate":
        return T(f"allocate {seq} = {_tokens(step['tokens'])}", f"allocate {seq} = {_tokens(step['tokens'])}")
    if do == "append":
        return T(f"append {step['token']} to {seq}", f"向 {seq} append {step['token']}")
    if do == "free":
        return T(f"free {seq}", f"free {seq}")
    if do == "can_allocate":
        return T(f"can_allocate {_tokens(step['tokens'])}", f"can_allocate {_tokens(step['tokens'])}")
    return T(f"can_append {seq}", f"can_append {seq}")


def _sequences(module, toy: dict, kind: str) -> list:
    return [module.Sequence(r["tokens"], toy["block_size"], r["block_table"], r["num_cached_tokens"])
            for r in toy[kind]["sequences"]]


def _metadata(module, toy: dict, kind: str) -> dict:
    function = module.prefill_metadata if kind == "prefill" else module.decode_metadata
    result = function(_sequences(module, toy, kind))
    return {name: v.tolist() if isinstance(v, torch.Tensor) else v for name, v in result._asdict().items()}


def _metadata_fields(module, toy: dict, kind: str) -> list[Field]:
    found = _metadata(module, toy, kind)
    return [Field(name, T(name, name), _list(v) if isinstance(v, list) else str(v)) for name, v in found.items()]


def scenarios(toy: dict) -> list[Scenario]:
    found, size = [], toy["block_size"]
    for n, scenario in enumerate(toy["scenarios"], 1):
        for step in scenario["steps"]:
            k, call = step["step"], _call(step)
            title = T(f"{scenario['name']} ({scenario['num_blocks']} blocks), step {k}: {call.en}",
                      f"场景 {n}（{scenario['num_blocks']} 个块）第 {k} 步：{call.zh}")
            found.append(Scenario(f"s{n}-step{k}", title,
                                  lambda module, s=scenario, k=k: _state_fields(replay(module, size, s, k)[2][-1])))
    for kind, names in (("prefill", "prefill_metadata"), ("decode", "decode_metadata")):
        seqs = ", ".join(r["name"] for r in toy[kind]["sequences"])
        found.append(Scenario(kind, T(f"{names} over {seqs}", f"{names}，序列 {seqs}"),
                              lambda module, kind=kind: _metadata_fields(module, toy, kind)))
    return found


# ---- probes: what the toy's steps never exercise -------------------------------------------------------


PROBE_CASE = T("cases like the checks' (the same prompt of whole blocks allocated twice, so its last block is "
               "in the cache; a hash under which every block collides, as the checks pass to BlockManager)",
               "和检查里一样的用例（同一个恰好占满整块的 prompt 分配两次，于是它的最后一块已在缓存里；"
               "以及检查传给 BlockManager 的、让所有块都冲突的哈希函数）")


def _collide(token_ids, prefix_hash=-1) -> int:
    return 7  # every full block gets the same hash


def _probe_run(module, num_blocks: int, block_size: int, prompts: list[list[int]], hash_block=None) -> list[Field]:
    extra = () if hash_block is None else (hash_block,)
    manager, live = module.BlockManager(num_blocks, block_size, *extra), {}
    for n, tokens in enumerate(prompts):
        live[chr(ord("A") + n)] = seq = module.Sequence(tokens, block_size)
        manager.allocate(seq)
    return _state_fields(_state(manager, live))


def probes() -> list[Scenario]:
    whole = [1, 2, 3, 4, 5, 6, 7, 8]
    return [
        Scenario("probe-last-block", T(f"allocate {_list(whole)} twice (block size 4, 6 blocks)",
                                       f"allocate {_list(whole)} 两次（块大小 4，6 个块）"),
                 lambda module: _probe_run(module, 6, 4, [whole, whole])),
        Scenario("probe-collisions", T("allocate [1, 2, 3, 4, 5], then [5, 6, 7], with a hash that is 7 for every "
                                       "block (block size 2, 9 blocks)",
                                       "先 allocate [1, 2, 3, 4, 5]，再 allocate [5, 6, 7]，哈希函数对每个块都返回 7"
                                       "（块大小 2，9 个块）"),
                 lambda module: _probe_run(module, 9, 2, [[1, 2, 3, 4, 5], [5, 6, 7]], _collide)),
    ]


# ---- the walk-through ---------------------------------------------------------------------------------


def _same(got, want, what: str) -> None:
    if got != want:
        raise ToyDrift(f"{what}: the reference gives {got}, toy_cases/ stores {want}: the toy file and "
                       "solutions/ disagree")


def _cache_entries(manager) -> list[str]:
    entries = sorted(manager.hash_to_block_id.values())
    return [f"{b} ← {_list(manager.blocks[b].token_ids)}" for b in entries] or ["—"]


def _scenario_step(reference, toy: dict, n: int, scenario: dict, title: T, text) -> Step:
    size = toy["block_size"]
    rows = []
    for step in scenario["steps"]:
        k = step["step"]
        manager, _, found = replay(reference, size, scenario, k)
        got = found[-1]
        _same(got, {key: step[key] for key in got}, f"{scenario['name']} step {k}")
        if "answer" in got:
            rows.append([str(k), Cell.of(_call(step), "text"), Cell((str(got["answer"]),), kind="text"),
                         "", "", "", ""])
            continue
        tables = tuple(f"{name} {_list(table)} · {got['num_cached_tokens'][name]}"
                       for name, table in got["block_tables"].items()) or ("—",)
        rows.append([str(k), Cell.of(_call(step), "text"), Cell(tables, kind="text"), got["free"], got["ref_counts"],
                     got["cached_blocks"], Cell(tuple(_cache_entries(manager)), kind="text")])
    columns = [T("step", "步骤"), T("call", "调用"),
               T("answer, or block tables · cached tokens", "返回值，或 块表 · 缓存命中的 token 数"),
               T("free list (left first)", "空闲链表（从左取）"), T("ref counts, block 0 on", "引用计数（从块 0 起）"),
               T("blocks in the cache", "缓存中的块"), T("cache entries: block ← tokens", "缓存项：块 ← token")]
    table = Table.of(f"scenario{n}", columns, rows)
    return Step(title, table, text)


def _hash(value: int) -> str:
    return f"{value:016x}"


def _hashes_step(reference, toy: dict) -> Step:
    """Scenario 1 after step 3: every full block's chained hash, and what the cache maps it to."""
    scenario = toy["scenarios"][0]
    size = toy["block_size"]
    manager, live, _ = replay(reference, size, scenario, 3)
    rows = []
    for name, seq in live.items():
        prefix = -1
        for j in range(seq.num_blocks):
            tokens = seq.block(j)
            if len(tokens) < size:
                rows.append([name, str(j), tokens, "", "", str(seq.block_table[j]),
                             T("partial: no hash", "未满：无哈希")])
                continue
            chained = reference.Block.chained_hash(tokens, prefix)
            block = seq.block_table[j]
            if manager.blocks[block].hash != chained:
                raise ToyDrift(f"block {block} holds hash {manager.blocks[block].hash}, the chain gives {chained}")
            entry = manager.hash_to_block_id.get(chained)
            rows.append([name, str(j), tokens, "—" if prefix == -1 else _hash(prefix), _hash(chained), str(block),
                         T(f"→ block {entry}", f"→ 块 {entry}")])
            prefix = chained
    full = [r for r in rows if len(r[2]) == size]
    same = next(((x, y) for i, x in enumerate(full) for y in full[i + 1:] if x[2] == y[2] and x[4] != y[4]), None)
    if same is None:
        raise ToyDrift("scenario 1 after step 3 has no equal blocks at different depths to show")
    (a_name, a_j, tokens, _, a_hash, a_block, _), (c_name, c_j, _, _, c_hash, c_block, _) = same
    table = Table.of("hashes", [T("sequence", "序列"), "j", T("block j's tokens", "第 j 块的 token"),
                                T("prefix hash (block j − 1's)", "前缀哈希（第 j − 1 块的）"),
                                T("chained hash", "链式哈希"), T("block", "块"),
                                T("hash_to_block_id", "hash_to_block_id")], rows)
    text = T(f"Scenario 1 after step 3. {a_name}'s block {a_j} and {c_name}'s block {c_j} both hold {_list(tokens)}, "
             f"but their chained hashes differ ({a_hash} and {c_hash}): each hash stands for the whole prefix up to "
             f"its block, so the cache holds two entries, blocks {a_block} and {c_block}. Sequences that share a "
             "block show the same hash and block on their rows.",
             f"场景 1 第 3 步之后。{a_name} 的第 {a_j} 块和 {c_name} 的第 {c_j} 块都是 {_list(tokens)}，但链式哈希不同"
             f"（{a_hash} 与 {c_hash}）：每个哈希代表到该块为止的整个前缀，所以缓存里有两个缓存项，分别指向块 "
             f"{a_block} 和块 {c_block}。共享同一块的序列，在各自的行上显示相同的哈希和块号。")
    return Step(T("3. Chained hashes: the same tokens at another depth", "3. 链式哈希：相同的 token，不同的深度"),
                table, text)


def _slots(seq, positions: range) -> torch.Tensor:
    return torch.tensor([seq.block_table[p // seq.block_size] * seq.block_size + p % seq.block_size
                         for p in positions])


def _prefill_steps(reference, toy: dict) -> list[Step]:
    seqs = _sequences(reference, toy, "prefill")
    names = [r["name"] for r in toy["prefill"]["sequences"]]
    meta = reference.prefill_metadata(seqs)
    _same(_metadata(reference, toy, "prefill"), toy["prefill"]["expected"], "prefill_metadata")
    cu_q, cu_k = meta.cu_seqlens_q.tolist(), meta.cu_seqlens_k.tolist()
    rows = []
    for i, (name, seq) in enumerate(zip(names, seqs)):
        rows_q = slice(cu_q[i], cu_q[i + 1])
        positions = meta.positions[rows_q]
        agree(positions, torch.arange(seq.num_cached_tokens, len(seq)), f"{name}'s prefill positions")
        agree(_slots(seq, range(seq.num_cached_tokens, len(seq))), meta.slot_mapping[rows_q],
              f"{name}'s slot_mapping")
        agree(meta.input_ids[rows_q], torch.tensor(seq.token_ids[seq.num_cached_tokens:]), f"{name}'s input_ids")
        rows.append([name, _tokens(seq.token_ids), seq.block_table, str(seq.num_cached_tokens),
                     f"{cu_q[i]} .. {cu_q[i + 1]}", f"{cu_k[i]} .. {cu_k[i + 1]}", meta.input_ids[rows_q].tolist(),
                     positions.tolist(), meta.slot_mapping[rows_q].tolist()])
    per_seq = Table.of("prefill", [T("sequence", "序列"), T("tokens", "token"), T("block table", "块表"),
                                   T("cached", "已缓存"),
                                   T("rows of the batch (cu_seqlens_q)", "batch 中的行（cu_seqlens_q）"),
                                   T("keys (cu_seqlens_k)", "key 范围（cu_seqlens_k）"), "input_ids", "positions",
                                   "slot_mapping"], rows)
    fields = []
    for name, value in meta._asdict().items():
        if isinstance(value, torch.Tensor):
            kind = str(value.dtype).removeprefix("torch.")
            fields.append([name, Cell.of(value.tolist()), f"[{', '.join(map(str, value.shape))}] {kind}"])
        else:
            fields.append([name, Cell.of(str(value)), type(value).__name__])
    batch = Table.of("prefill_fields", [T("field", "字段"), T("value", "值"), T("shape, dtype", "形状、dtype")], fields)
    b = next(i for i, seq in enumerate(seqs) if seq.num_cached_tokens)  # a sequence with a cached prefix
    seq_b = seqs[b]
    p = seq_b.num_cached_tokens
    j, offset = p // seq_b.block_size, p % seq_b.block_size
    slot = meta.slot_mapping[cu_q[b]].item()
    text = T(f"Only the tokens after a cached prefix are computed: {names[b]} has {seq_b.num_cached_tokens} cached, so "
             f"its one row is token {seq_b.token_ids[p]} at position {p}, in block {seq_b.block_table[j]} offset "
             f"{offset}: slot {seq_b.block_table[j]} · {seq_b.block_size} + {offset} = {slot}. Token p of a "
             "sequence is stored in slot block_table[p // block_size] · block_size + p % block_size.",
             f"只计算缓存前缀之后的 token：{names[b]} 已缓存 {seq_b.num_cached_tokens} 个，所以它只占一行——位置 "
             f"{p} 上的 token {seq_b.token_ids[p]}，位于块 {seq_b.block_table[j]} 的偏移 {offset}：slot = "
             f"{seq_b.block_table[j]} · {seq_b.block_size} + {offset} = {slot}。位置 p 的 token 存在 slot "
             "block_table[p // block_size] · block_size + p % block_size。")
    batch_text = T(f"cu_seqlens_q = {_list(cu_q)} counts new tokens and cu_seqlens_k = {_list(cu_k)} whole lengths, "
                   f"both from 0. A prefix is cached, so block_tables is there, each row padded with -1 to "
                   f"{meta.block_tables.shape[1]} blocks.",
                   f"cu_seqlens_q = {_list(cu_q)} 累计新 token 数，cu_seqlens_k = {_list(cu_k)} 累计完整长度，"
                   f"都从 0 开始。有前缀命中缓存，所以要给 block_tables，每行用 -1 补齐到 "
                   f"{meta.block_tables.shape[1]} 个块。")
    return [Step(T("4. A prefill batch, sequence by sequence", "4. 一个 prefill batch，逐个序列看"), per_seq, text),
            Step(T("5. The prefill metadata", "5. prefill 元数据"), batch, batch_text)]


def _decode_step(reference, toy: dict) -> Step:
    seqs = _sequences(reference, toy, "decode")
    names = [r["name"] for r in toy["decode"]["sequences"]]
    meta = reference.decode_metadata(seqs)
    _same(_metadata(reference, toy, "decode"), toy["decode"]["expected"], "decode_metadata")
    rows = []
    for i, (name, seq) in enumerate(zip(names, seqs)):
        p = meta.positions[i].item()
        j, offset = p // seq.block_size, p % seq.block_size
        agree(_slots(seq, range(p, p + 1)), meta.slot_mapping[i : i + 1], f"{name}'s decode slot")
        rows.append([name, _tokens(seq.token_ids), str(len(seq)), str(meta.input_ids[i].item()), str(p),
                     f"{seq.block_table[j]} · {seq.block_size} + {offset}", str(meta.slot_mapping[i].item()),
                     str(meta.context_lens[i].item()), meta.block_tables[i].tolist()])
    table = Table.of("decode", [T("sequence", "序列"), T("tokens", "token"), "len", "input_ids", "positions",
                                T("block · block_size + offset", "块 · block_size + 偏移"), "slot_mapping",
                                "context_lens", T("block_tables row", "block_tables 的行")], rows)
    text = T(f"The token being decoded is already appended: its position is len − 1 "
             f"({_list(meta.positions)}) and the context, len tokens ({_list(meta.context_lens)}), includes it. "
             "Short rows of block_tables are padded with -1, never 0: block 0 is a real block.",
             f"正在 decode 的 token 已经 append 进序列：它的位置是 len − 1（{_list(meta.positions)}），"
             f"上下文是 len 个 token（{_list(meta.context_lens)}），包括它自己。block_tables 中较短的行用 -1 "
             "补齐，不能用 0：块 0 是真实存在的块。")
    return Step(T("6. A decode batch", "6. 一个 decode batch"), table, text)


def _first(scenario: dict, found: list[dict], test) -> dict:
    """The first step of a scenario (the toy file's step, joined with the reference's state) that passes `test`."""
    return next({**step, **got} for step, got in zip(scenario["steps"], found) if test(step, got))


def _cached(step: dict, got: dict) -> bool:
    return step["do"] == "allocate" and got["num_cached_tokens"][step["seq"]] > 0


def walkthrough(reference, toy: dict) -> list[Step]:
    one, two = toy["scenarios"]
    size = toy["block_size"]
    first, second = replay(reference, size, one)[2], replay(reference, size, two)[2]
    hit = _first(one, first, _cached)
    frees = [step["step"] for step in one["steps"] if step["do"] == "free"]
    shared = sorted(set(hit["block_tables"][hit["seq"]]) & {b for n, t in hit["block_tables"].items()
                                                             if n != hit["seq"] for b in t})
    text_one = T(f"Block size {size}, {one['num_blocks']} blocks. Step {hit['step']}: {hit['seq']} starts with blocks "
                 f"already in the cache, so it shares blocks {_list(shared)} (ref counts "
                 f"{_list([hit['ref_counts'][b] for b in shared])}) and {hit['num_cached_tokens'][hit['seq']]} of its "
                 f"tokens are cached. Steps {', '.join(map(str, frees))} free tables backwards: the free list ends as "
                 f"{_list(first[-1]['free'])}, and the freed full blocks stay in the cache.",
                 f"块大小 {size}，共 {one['num_blocks']} 个块。第 {hit['step']} 步：{hit['seq']} 开头的块已在缓存里，"
                 f"于是共享块 {_list(shared)}（引用计数 {_list([hit['ref_counts'][b] for b in shared])}），"
                 f"{hit['num_cached_tokens'][hit['seq']]} 个 token 命中缓存。第 {'、'.join(map(str, frees))} 步"
                 f"倒序释放块表：空闲链表最后是 {_list(first[-1]['free'])}，释放掉的满块仍留在缓存里。")
    before = [{}, *second[:-1]]
    # the states before and after each call
    around = {step["step"]: (prev, got) for step, prev, got in zip(two["steps"], before, second)
              if "cached_blocks" in got and "cached_blocks" in prev}
    sealed = _first(two, second, lambda s, g: s["do"] == "append" and len(g["cached_blocks"]) > len(
        around[s["step"]][0]["cached_blocks"]))
    revived = _first(two, second, lambda s, g: _cached(s, g) and s["step"] > sealed["step"])
    dropped = next(step["step"] for step in two["steps"] if step["step"] in around
                   and set(around[step["step"]][0]["cached_blocks"]) - set(around[step["step"]][1]["cached_blocks"]))
    last = {**two["steps"][-1], **second[-1]}
    text_two = T(f"Block size {size}, {two['num_blocks']} blocks. Step {sealed['step']}: token {sealed['token']} "
                 f"fills a block, which enters the cache. Step {revived['step']} revives freed blocks from the cache; "
                 f"step {dropped} takes a cached block for other tokens and drops its entry, so at step {last['step']} "
                 f"{last['seq']} gets {last['num_cached_tokens'][last['seq']]} cached tokens and table "
                 f"{_list(last['block_tables'][last['seq']])}.",
                 f"块大小 {size}，共 {two['num_blocks']} 个块。第 {sealed['step']} 步：token {sealed['token']} "
                 f"填满一块，这一块进入缓存。第 {revived['step']} 步从缓存里复活已释放的块；"
                 f"第 {dropped} 步把一个缓存中的块拿去装别的 token，并删掉它的缓存项，"
                 f"所以第 {last['step']} 步 {last['seq']} 命中 "
                 f"{last['num_cached_tokens'][last['seq']]} 个 token，块表为 "
                 f"{_list(last['block_tables'][last['seq']])}。")
    return [
        _scenario_step(reference, toy, 1, one, T(f"1. Scenario 1, {one['name']}", "1. 场景 1：共享前缀"), text_one),
        _scenario_step(reference, toy, 2, two, T(f"2. Scenario 2, {two['name']}", "2. 场景 2：复活与复用"), text_two),
        _hashes_step(reference, toy),
        *_prefill_steps(reference, toy),
        _decode_step(reference, toy),
    ]
