"""How to run P02's toy: `store_kvcache_torch` and the Triton kernel `store_kvcache` on
`toy_cases/p02_store_kvcache.json`, each into NaN caches.

The caches after each call come from the reference (the kernel's run in Triton's interpreter where
there is no GPU, see `_kernels.py`; where this build cannot run kernels, the PyTorch version's only),
and must equal the rows the toy file stores (else `ToyDrift`). The kernel's caches sit inside a NaN
buffer with guard rows before and after them, as in the checks, so a write to slot -1 or past the end
shows (and stays inside memory the book owns). Worked here and tied to the reference with `agree`: each
program's element offsets, `token * key.stride(0) + lanes` and `slot * k_cache.stride(1) + lanes`, read
back from the reference's caches, and which token each slot's row came from.
"""

import torch

from book.i18n import T
from book.toys import Cell, Field, Scenario, Step, Table, ToyDrift, _kernels, agree, inputs_field

F32 = torch.float32


def _toy_inputs(toy: dict) -> dict:
    return {"key": torch.tensor(toy["key"], dtype=F32), "value": torch.tensor(toy["value"], dtype=F32),
            "slot_mapping": torch.tensor(toy["slot_mapping"], dtype=torch.int32),
            "num_blocks": toy["num_blocks"], "block_size": toy["block_size"], "KVH": toy["KVH"], "D": toy["D"]}


class Caches:
    """A NaN k_cache and v_cache `[num_blocks, block_size, KVH, D]`, each a contiguous view into a NaN buffer
    `[rows, ROW]` with `block_size` guard rows before it (slot -1 lands there) and `slots * block_size`
    after it (a slot taken for a block id lands there), as the checks build them."""

    def __init__(self, num_blocks: int, block_size: int, kvh: int, d: int, dtype=F32, device=None):
        self.slots, self.before, self.row = num_blocks * block_size, block_size, kvh * d
        rows = self.before + self.slots + self.slots * block_size
        self.buffers = {name: torch.full((rows, kvh * d), float("nan"), dtype=dtype, device=device)
                        for name in ("k_cache", "v_cache")}
        self.views = {name: b[self.before : self.before + self.slots].view(num_blocks, block_size, kvh, d)
                      for name, b in self.buffers.items()}

    def rows(self, name: str) -> torch.Tensor:
        """The cache as `[slots, ROW]`: row s is slot s."""
        return self.views[name].reshape(self.slots, self.row).cpu()

    def around(self, name: str) -> list[tuple[int, torch.Tensor]]:
        """The guard rows something wrote, as (row counted from the cache's row 0, values)."""
        buffer = self.buffers[name].cpu()
        return [(r - self.before, buffer[r]) for r in range(buffer.shape[0])
                if not (self.before <= r < self.before + self.slots) and not buffer[r].isnan().all()]


def _named_rows(key: torch.Tensor, value: torch.Tensor) -> list[tuple[T, torch.Tensor]]:
    """Each token's key row and value row `[ROW]`, with the words a summary names them by."""
    N = key.shape[0]
    keys, values = key.reshape(N, -1).cpu(), value.reshape(N, -1).cpu()
    return [(T(f"token {t}'s keys", f"token {t} 的 key"), keys[t]) for t in range(N)] + \
        [(T(f"token {t}'s values", f"token {t} 的 value"), values[t]) for t in range(N)]


def _describe(row: torch.Tensor, named: list[tuple[T, torch.Tensor]]) -> T:
    if row.isnan().all():
        return T("NaN", "NaN")
    for label, candidate in named:
        if torch.equal(row, candidate):
            return label
    return T("other values", "别的值")


def _around_text(caches: Caches, name: str, named: list[tuple[T, torch.Tensor]]) -> T:
    """What was written outside cache `name`: "row 4 ← token 3's keys, row 8 ← ... (past its end)"."""
    written = caches.around(name)
    if not written:
        return T("untouched", "未被改动")
    parts = []
    for side, en_side, zh_side in (("before", "before the cache", "缓存之前"), ("after", "past its end", "越过末尾")):
        rows = [(r, v) for r, v in written if (r < 0) == (side == "before")]
        if rows:
            what = [(r, _describe(v, named)) for r, v in rows]
            parts.append(T(", ".join(f"row {r} ← {w.en}" for r, w in what) + f" ({en_side})",
                           "，".join(f"第 {r} 行 ← {w.zh}" for r, w in what) + f"（{zh_side}）"))
    return T("; ".join(p.en for p in parts), "；".join(p.zh for p in parts))


def store(module, function: str, key, value, slot_mapping, shape: tuple, device=None) -> tuple[Caches, bool]:
    """Run `module.<function>` on (key, value, slot_mapping), fresh tensors on `device` (None: the CPU), into
    fresh NaN caches inside guard rows; also say whether the inputs stayed as they were."""
    caches = Caches(*shape, dtype=key.dtype, device=device)
    before = [t.clone() for t in (key, value, slot_mapping)]
    with _kernels.quiet():
        getattr(module, function)(key, value, caches.views["k_cache"], caches.views["v_cache"], slot_mapping)
        _kernels.synchronize()
    unchanged = all(torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip((key, value, slot_mapping), before))
    return caches, unchanged


def _toy_fields(module, function: str, toy: dict) -> list[Field]:
    t = _toy_inputs(toy)
    device = _kernels.device() if function == "store_kvcache" else None
    caches, unchanged = store(module, function, *(t[k].to(device) for k in ("key", "value", "slot_mapping")),
                              (t["num_blocks"], t["block_size"], t["KVH"], t["D"]), device)
    named = _named_rows(t["key"], t["value"])
    return [Field("k_cache", T("k_cache rows (slots 0..)", "k_cache 各行（slot 0 起）"), caches.rows("k_cache")),
            Field("v_cache", T("v_cache rows (slots 0..)", "v_cache 各行（slot 0 起）"), caches.rows("v_cache")),
            Field("around_k", T("memory around k_cache", "k_cache 前后的内存"), _around_text(caches, "k_cache", named)),
            Field("around_v", T("memory around v_cache", "v_cache 前后的内存"), _around_text(caches, "v_cache", named)),
            inputs_field(None if unchanged else "key, value or slot_mapping")]


def scenarios(toy: dict) -> list[Scenario]:
    found = [Scenario("torch", T("store_kvcache_torch on the toy", "对 toy 调用 store_kvcache_torch"),
                      lambda module: _toy_fields(module, "store_kvcache_torch", toy))]
    if _kernels.device() is not None:
        found.append(Scenario("kernel", T("store_kvcache (the Triton kernel) on the toy, the caches inside NaN guard "
                                          "rows", "对 toy 调用 store_kvcache（Triton kernel），缓存前后有 NaN 保护行"),
                              lambda module: _toy_fields(module, "store_kvcache", toy)))
    return found


# ---- probes: what the toy's contiguous keys never exercise ----------------------------------------------


QKV = {"H": 4, "KVH": 2, "D": 6}  # the checks' fused qkv: rows of (H + 2 * KVH) * D = 48, ROW = 12

PROBE_CASE = T("a case like the checks' (7 tokens whose keys and values are column slices of one fused qkv output "
               "[7, 48]: H = 4, KVH = 2, D = 6, so ROW = 12 and key.stride(0) = 48; 3 blocks of 4 slots inside NaN "
               "guard rows, one token with slot -1; fp32, through the kernel)",
               "和检查里一样的用例（7 个 token，key 和 value 是同一个融合 qkv 输出 [7, 48] 的列切片：H = 4、KVH = 2、"
               "D = 6，所以 ROW = 12，key.stride(0) = 48；3 个 block、每个 4 个 slot，前后有 NaN 保护行，"
               "有一个 token 的 slot 是 -1；fp32，走 kernel）")


def _summary(caches: Caches, name: str, rows: dict[str, torch.Tensor], slot_mapping: torch.Tensor) -> T:
    """Which rows of the buffer (cache and guards) are not what the mapping asks for, and what they hold.
    `rows`: "keys" and "values", each `[N, ROW]`; cache `name` should hold the first for k_cache."""
    kind = "keys" if name == "k_cache" else "values"
    mine, zh_kind = rows[kind], {"keys": "key", "values": "value"}
    named = _named_rows(rows["keys"], rows["values"])
    want = {int(s): t for t, s in enumerate(slot_mapping.tolist()) if s != -1}
    buffer = caches.buffers[name].cpu()
    en, zh = [], []
    for r in range(buffer.shape[0]):
        s = r - caches.before
        got = buffer[r]
        if (got.isnan().all() if s not in want else torch.equal(got, mine[want[s]])):
            continue
        where = (T(f"row {s} (before the cache)", f"第 {s} 行（缓存之前）") if s < 0 else
                 T(f"row {s} (past its end)", f"第 {s} 行（越过末尾）") if s >= caches.slots else
                 T(f"slot {s}", f"slot {s} "))
        what = _describe(got, named)
        en.append(f"{where.en} holds {what.en}" + (f", not token {want[s]}'s {kind}" if s in want else ""))
        zh.append(f"{where.zh}存的是{' ' if what.zh[0].isascii() else ''}{what.zh}"
                  + (f"，而不是 token {want[s]} 的 {zh_kind[kind]}" if s in want else ""))
    if not en:
        return T("each mapped slot holds its token's row, every other row NaN",
                 "每个映射到的 slot 存着对应 token 的行，其余各行都是 NaN")
    if len(en) > 3:
        more = len(en) - 3
        en, zh = en[:3] + [f"{more} more rows wrong"], zh[:3] + [f"另有 {more} 行不对"]
    return T("; ".join(en), "；".join(zh))


def _qkv_probe() -> dict:
    gen = torch.Generator().manual_seed(2026)
    N = 7
    qkv = torch.randn(N, (QKV["H"] + 2 * QKV["KVH"]) * QKV["D"], generator=gen)
    slots = torch.randperm(12, generator=gen)[:N]
    slots[3] = -1
    return {"qkv": qkv, "slot_mapping": slots.to(torch.int32), "shape": (3, 4, QKV["KVH"], QKV["D"])}


def _slices(qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as column slices of the qkv rows: stride(0) is the whole qkv row, not KVH * D."""
    H, KVH, D = QKV["H"], QKV["KVH"], QKV["D"]
    N = qkv.shape[0]
    return qkv[:, H * D : (H + KVH) * D].view(N, KVH, D), qkv[:, (H + KVH) * D :].view(N, KVH, D)


def _probe_fields(module, case: dict) -> list[Field]:
    device = _kernels.device()
    key, value = _slices(case["qkv"].clone().to(device))  # fresh for every run, strided like the checks'
    caches, unchanged = store(module, "store_kvcache", key, value, case["slot_mapping"].to(device), case["shape"],
                              device)
    rows = {kind: tensor.reshape(tensor.shape[0], -1) for kind, tensor in zip(("keys", "values"),
                                                                               _slices(case["qkv"]))}
    return [Field(name, T(name, name), _summary(caches, name, rows, case["slot_mapping"]))
            for name in ("k_cache", "v_cache")] + [inputs_field(None if unchanged else "key, value or slot_mapping")]


def probes() -> list[Scenario]:
    if _kernels.device() is None:
        return []
    case = _qkv_probe()
    return [Scenario("probe-qkv", T("store_kvcache with K and V sliced from a fused qkv [7, 48] (token stride 48)",
                                    "store_kvcache，K 和 V 切自融合的 qkv [7, 48]（token 步长 48）"),
                     lambda module: _probe_fields(module, case))]


# ---- the walk-through ---------------------------------------------------------------------------------


def _reference_caches(reference, toy: dict) -> dict:
    """Both versions' caches on the toy (the kernel's where this build runs kernels), checked against the file."""
    t = _toy_inputs(toy)
    shape = (t["num_blocks"], t["block_size"], t["KVH"], t["D"])
    found = {}
    for function, device in (("store_kvcache_torch", None), ("store_kvcache", _kernels.device())):
        if function == "store_kvcache" and device is None:
            continue
        caches, unchanged = store(reference, function, *(t[k].to(device) for k in ("key", "value", "slot_mapping")),
                                  shape, device)
        for name in ("k_cache", "v_cache"):
            got = [None if r.isnan().all() else r.tolist() for r in caches.rows(name)]
            if got != toy[f"{name}_rows"]:
                raise ToyDrift(f"{function}'s {name} rows are {got}, toy_cases/p02_store_kvcache.json stores "
                               f"{toy[f'{name}_rows']}: the toy file and solutions/ disagree")
            if caches.around(name):
                raise ToyDrift(f"{function} wrote outside {name} on the toy")
        if not unchanged:
            raise ToyDrift(f"{function} changed its inputs on the toy")
        found[function] = caches
    return found


def _inputs_step(toy: dict, t: dict, key, value) -> Step:
    N, ROW = key.shape[0], t["KVH"] * t["D"]
    rows = [[f"t{n}", key[n].reshape(-1), value[n].reshape(-1), str(int(t["slot_mapping"][n]))] for n in range(N)]
    table = Table.of("inputs", [T("token", "token"), T("key[t] as [ROW]", "key[t]（视为 [ROW]）"),
                                T("value[t] as [ROW]", "value[t]（视为 [ROW]）"), "slot_mapping[t]"], rows)
    slots = t["num_blocks"] * t["block_size"]
    text = T(f"N = {N} tokens, KVH = {t['KVH']}, D = {t['D']} (ROW = {ROW}), {t['num_blocks']} block of "
             f"{t['block_size']} slots ({slots} rows of {ROW}), filled with NaN. Token t's keys are t·10 + "
             f"[0, 1, 2, 3], so the tens digit names the token; its values are its keys + 100. key.stride(0) = "
             f"{key.stride(0)} and k_cache.stride(1) = {ROW}: a token's keys and a slot are both {ROW} elements long.",
             f"N = {N} 个 token，KVH = {t['KVH']}，D = {t['D']}（ROW = {ROW}），{t['num_blocks']} 个 block、"
             f"{t['block_size']} 个 slot（{slots} 行，每行 {ROW} 个数），全部填 NaN。token t 的 key 是 t·10 + "
             f"[0, 1, 2, 3]，十位数就是 token 编号；value 是 key + 100。key.stride(0) = {key.stride(0)}，"
             f"k_cache.stride(1) = {ROW}：一个 token 的 key 和一个 slot 都是 {ROW} 个元素。")
    return Step(T("1. The inputs", "1. 输入"), table, text)


def _span(offsets: torch.Tensor) -> str:
    """Consecutive element offsets as `12..15`."""
    return f"{int(offsets[0])}..{int(offsets[-1])}"


def _programs_step(t: dict, key, value, caches: Caches, ran: str) -> Step:
    N, ROW = key.shape[0], t["KVH"] * t["D"]
    lanes = torch.arange(ROW)
    k_flat, v_flat = caches.rows("k_cache").reshape(-1), caches.rows("v_cache").reshape(-1)
    key_flat, value_flat = key.reshape(-1), value.reshape(-1)
    rows = []
    for n in range(N):
        slot = int(t["slot_mapping"][n])
        if slot == -1:
            rows.append([str(n), str(slot), Cell.of(T("return: nothing loaded, nothing stored",
                                                      "return：什么都不读，什么都不写"), "text"), "", ""])
            continue
        source = n * key.stride(0) + lanes  # [ROW] element offsets of token n's keys (values alike)
        stride = caches.views["k_cache"].stride(1)
        target = slot * stride + lanes  # [ROW] element offsets of slot `slot`
        agree(k_flat[target], key_flat[source], f"program {n}'s key row in slot {slot}")
        agree(v_flat[target], value_flat[source], f"program {n}'s value row in slot {slot}")
        rows.append([str(n), str(slot), f"{n} · {key.stride(0)} + lanes = {_span(source)}",
                     f"{slot} · {stride} + lanes = {_span(target)}", Cell.of(torch.stack((k_flat[target],
                                                                                      v_flat[target])))])
    table = Table.of("programs", [T("program = token", "program = token"), "slot",
                                  T("key (and value) elements: token · key.stride(0) + lanes",
                                    "key（和 value）的元素：token · key.stride(0) + lanes"),
                                  T("cache elements: slot · k_cache.stride(1) + lanes",
                                    "缓存的元素：slot · k_cache.stride(1) + lanes"),
                                  T("k_cache, v_cache row slot ← (read back)",
                                    "k_cache、v_cache 第 slot 行 ←（读回）")],
                     rows)
    skipped = [n for n in range(N) if int(t["slot_mapping"][n]) == -1]
    text = T(f"One program per token, lanes = [0 .. {ROW - 1}] (BLOCK = ROW = {ROW}, all inside). Program "
             f"{skipped[0]} loads -1 and returns before touching anything. The last column is read back from the "
             f"caches {ran.en} wrote, at the cache elements on its left.",
             f"每个 token 一个 program，lanes = [0 .. {ROW - 1}]（BLOCK = ROW = {ROW}，全部在范围内）。program "
             f"{skipped[0]} 读到 -1，什么都没碰就返回。最后一列是按左边的缓存元素偏移，"
             f"从 {ran.zh} 写好的缓存里读回来的 k_cache 行和 v_cache 行。")
    return Step(T("2. The programs, one per token", "2. 每个 token 一个 program"), table, text)


def _caches_step(t: dict, key, value, found: dict) -> Step:
    torch_caches, kernel = found["store_kvcache_torch"], found.get("store_kvcache")
    k_rows, v_rows = torch_caches.rows("k_cache"), torch_caches.rows("v_cache")
    owner = {int(s): n for n, s in enumerate(t["slot_mapping"].tolist()) if s != -1}
    N = key.shape[0]
    rows = []
    for s in range(torch_caches.slots):
        if s in owner:
            agree(k_rows[s], key[owner[s]].reshape(-1), f"slot {s}'s keys")
            agree(v_rows[s], value[owner[s]].reshape(-1), f"slot {s}'s values")
            who = T(f"token {owner[s]}", f"token {owner[s]}")
        else:
            who = T("nobody: stays NaN", "没有人：保持 NaN")
        if kernel is None:
            same = _kernels.NOT_RUN
        else:
            equal = all(torch.equal(kernel.rows(name)[s].nan_to_num(), torch_caches.rows(name)[s].nan_to_num())
                        for name in ("k_cache", "v_cache"))
            if not equal:
                raise ToyDrift(f"store_kvcache and store_kvcache_torch disagree on slot {s} of the toy")
            same = "✓"
        rows.append([str(s), Cell.of(who, "text"), k_rows[s], v_rows[s], Cell.of(same, "text")])
    table = Table.of("caches", [T("slot", "slot"), T("written by", "写入者"), "k_cache", "v_cache",
                                T("store_kvcache (kernel) gives the same", "store_kvcache（kernel）结果相同")], rows)
    empty = [s for s in range(torch_caches.slots) if s not in owner]
    skipped = ", ".join(str(n) for n in range(N) if int(t["slot_mapping"][n]) == -1)
    guard = T(" The kernel's caches sit inside NaN guard rows, which it leaves untouched.",
              "kernel 的缓存前后是 NaN 保护行，它一行也没碰。") if kernel is not None else T(
        f" The kernel's column is empty: {_kernels.NOT_RUN.en}.", f"kernel 那一列是空的：{_kernels.NOT_RUN.zh}。")
    text = T(f"Slot {empty[0]} is nobody's: it keeps its NaN. A row's tens digit tells which token it came from, and a "
             f"missing 100 would tell that the keys went into the value cache. Token {skipped} (slot -1) stores "
             "nothing." + guard.en,
             f"slot {empty[0]} 不属于任何 token：它保留着 NaN。看一行的十位数就知道它来自哪个 token；要是少了那个 "
             f"100，就说明 key 被写进了 value cache。token {skipped}（slot -1）什么都不存。" + guard.zh)
    return Step(T("3. The caches after the call (rows = slots)", "3. 调用之后的缓存（每行是一个 slot）"), table, text)


def walkthrough(reference, toy: dict) -> list[Step]:
    t = _toy_inputs(toy)
    key, value = t["key"], t["value"]
    found = _reference_caches(reference, toy)
    ran = T("the kernel", "kernel") if "store_kvcache" in found else T("store_kvcache_torch", "store_kvcache_torch")
    caches = found.get("store_kvcache", found["store_kvcache_torch"])
    return [_inputs_step(toy, t, key, value), _programs_step(t, key, value, caches, ran),
            _caches_step(t, key, value, found)]
