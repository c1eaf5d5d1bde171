"""How to run P05's toy: the scenarios of `toy_cases/p05_scheduler.json`, step by step, on `Scheduler`.

Each step adds the step's requests, calls `schedule()`, then `postprocess()` with the sampled tokens. The
batch (request and num_scheduled_tokens), whether it is a prefill, the finished requests, both queues, the
free list, and every waiting or running request's block table and computed tokens come from the reference,
and must equal what the toy file stores (else `ToyDrift`); every request's status and is_finished() are shown
beside them, not stored. Worked here and tied to the reference: each
prefill request's cost (its tokens minus its computed ones) against the budget left, which must give the
reference's num_scheduled_tokens.
"""

from book.i18n import T
from book.toys import Cell, Field, Scenario, Step, Table, ToyDrift

STATE = ("batch", "is_prefill", "finished", "waiting", "running", "free", "block_tables", "num_computed_tokens")
# Shown beside the state, not stored in the toy file: it follows from the queues (waiting or running).
STATUS = "status"
# Also shown, not stored: is_finished() after the step, which follows from the queues (both empty).
OVER = "is_finished"
LABELS = {
    "batch": T("batch (request num_scheduled_tokens)", "batch（请求 num_scheduled_tokens）"),
    "is_prefill": T("is_prefill", "is_prefill"),
    "finished": T("finished", "完成"),
    "waiting": T("waiting", "waiting"),
    "running": T("running", "running"),
    "free": T("free list", "空闲链表"),
    "block_tables": T("block tables", "块表"),
    "num_computed_tokens": T("computed tokens", "已计算的 token 数"),
    STATUS: T("status", "status"),
    OVER: T("is_finished()", "is_finished()"),
    "completions": T("completion tokens so far", "目前生成的 token"),
    "scheduled_after": T("num_scheduled_tokens after postprocess", "postprocess 之后的 num_scheduled_tokens"),
    "idle_schedule": T("schedule() returns", "schedule() 的返回值"),
    "idle_postprocess": T("postprocess([], []) returns", "postprocess([], []) 的返回值"),
}


NAMES_ZH = {"budget, chunk and prefix hit": "预算、chunk 与前缀命中", "preemption": "抢占"}


def _list(values) -> str:
    return "[" + ", ".join(str(v) for v in values) + "]"


def _batch(batch) -> str:
    return "[" + ", ".join(f"{name} {n}" for name, n in batch) + "]"


def _per_request(values: dict) -> str:
    return ", ".join(f"{name} {_list(v) if isinstance(v, list) else v}" for name, v in values.items()) or "—"


# ---- replaying a scenario ------------------------------------------------------------------------------


def replay(module, scenario: dict, upto: int | None = None) -> tuple[list[dict], dict]:
    """Run the scenario's steps (up to step `upto`) on a fresh `module.Scheduler`: per step the state the toy
    file stores and every waiting or running request's status, and at the end (of the steps run) every request's
    completion tokens."""
    scheduler = module.Scheduler(scenario["num_blocks"], scenario["block_size"], scenario["max_num_seqs"],
                                 scenario["max_num_batched_tokens"], scenario["eos_token_id"])
    requests, names, found = {}, {}, []
    for step in scenario["steps"][:upto]:
        for new in step.get("add", []):
            request = scheduler.add(new["id"], new["prompt"], new["max_tokens"], new.get("ignore_eos", False))
            requests[new["name"]], names[id(request)] = request, new["name"]
        batch, is_prefill = scheduler.schedule()
        seen = [[names[id(r)], r.num_scheduled_tokens] for r in batch]
        finished = scheduler.postprocess(batch, _sampled(step, len(batch)))
        live = sorted([*scheduler.waiting, *scheduler.running], key=lambda r: r.request_id)
        found.append({"batch": seen, "is_prefill": is_prefill, "finished": [names[id(r)] for r in finished],
                      "waiting": [names[id(r)] for r in scheduler.waiting],
                      "running": [names[id(r)] for r in scheduler.running],
                      "free": list(scheduler.block_manager.free_block_ids),
                      "block_tables": {names[id(r)]: list(r.block_table) for r in live},
                      "num_computed_tokens": {names[id(r)]: r.num_computed_tokens for r in live},
                      STATUS: {names[id(r)]: r.status for r in live}, OVER: scheduler.is_finished()})
    completions = {name: list(r.token_ids[r.num_prompt_tokens :]) for name, r in requests.items()}
    return found, completions


FILLER = 99  # sampled for a request a mistake adds to the toy's batch (it is no eos in either scenario)


def _sampled(step: dict, n: int) -> list[int]:
    """The toy's sampled tokens for a batch of n requests: a mistake's batch may be longer or shorter."""
    return (step["sampled"] + [FILLER] * n)[:n]


def _fields(found: dict, completions: dict) -> list[Field]:
    text = {"batch": _batch(found["batch"]), "is_prefill": str(found["is_prefill"]),
            "finished": _list(found["finished"]), "waiting": _list(found["waiting"]),
            "running": _list(found["running"]), "free": _list(found["free"]),
            "block_tables": _per_request(found["block_tables"]),
            "num_computed_tokens": _per_request(found["num_computed_tokens"]), STATUS: _per_request(found[STATUS]),
            OVER: str(found[OVER])}
    return [*(Field(key, LABELS[key], text[key]) for key in (*STATE, STATUS, OVER)),
            Field("completions", LABELS["completions"], _per_request(completions))]


def _added(step: dict) -> T:
    parts = [f"{r['name']} = {_list(r['prompt'])} max {r['max_tokens']}" + (" ignore_eos" * bool(r.get("ignore_eos")))
             for r in step.get("add", [])]
    return T("; ".join(parts) or "—", "；".join(parts) or "—")


def _last(replayed: tuple[list[dict], dict]) -> tuple[dict, dict]:
    found, completions = replayed
    return found[-1], completions


def scenarios(toy: dict) -> list[Scenario]:
    found = []
    for n, scenario in enumerate(toy["scenarios"], 1):
        for step in scenario["steps"]:
            k = step["step"]
            title = T(f"{scenario['name']}, step {k}: schedule, then postprocess {_list(step['sampled'])}",
                      f"场景 {n} 第 {k} 步：schedule，然后 postprocess {_list(step['sampled'])}")
            found.append(Scenario(f"s{n}-step{k}", title,
                                  lambda module, s=scenario, k=k: _fields(*_last(replay(module, s, k)))))
    return found


# ---- probes: what the toy's steps never exercise -------------------------------------------------------


PROBE_CASE = T("cases like the checks': three one-token requests at once with max_num_seqs 2 (block size 2, "
               "10 blocks, a budget of 16), one prefill step, and the same three requests decoded with max_num_seqs 2; three one-token requests decoded together under a budget "
               "of 2; a request preempted with 2 completion tokens and recomputed in chunks under a budget of 2; a "
               "chunk and a finished request, whose num_scheduled_tokens are read after postprocess; a scheduler with "
               "no request, asked for a step and given back its empty batch",
               "和检查里一样的用例：同时来三个单 token 请求，max_num_seqs 为 2（块大小 2，10 个块，预算 16），"
               "做一个 prefill 步，再让这三个请求在 max_num_seqs 为 2 之下 decode；三个单 token 请求在预算 2 之下一起 decode；一个请求带着 2 个已生成的 token "
               "被抢占，再在预算 2 之下分块重算；一个 chunk 和一个完成的请求，在 postprocess 之后读它们的 "
               "num_scheduled_tokens；一个没有任何请求的调度器，先请它排一步，再把空的 batch 交回给它")


def _seats(module) -> list[Field]:
    scheduler = module.Scheduler(10, 2, 2, 16, -1)
    names = {}
    for i in range(3):
        names[id(scheduler.add(i, [i + 1], 2))] = "ABC"[i]
    batch, is_prefill = scheduler.schedule()
    return [Field("batch", LABELS["batch"], _batch([names[id(r)], r.num_scheduled_tokens] for r in batch)),
            Field("waiting", LABELS["waiting"], _list(names[id(r)] for r in scheduler.waiting))]


def _idle(module) -> list[Field]:
    scheduler = module.Scheduler(4, 4, 4, 16, -1)
    got = scheduler.schedule()
    return [Field("idle_schedule", LABELS["idle_schedule"], repr(got)),
            Field("idle_postprocess", LABELS["idle_postprocess"], repr(scheduler.postprocess([], [])))]


def _probe_steps(module, limits: tuple, requests: list[tuple[list[int], int]], sampled: list[dict],
                 scheduled: bool = False) -> list[Field]:
    """Add the requests (A, B, ...), then one schedule and postprocess per entry of `sampled` (name -> token, 9 for
    a request it does not name): the last step's batch and kind, both queues, and every request's computed
    tokens and completion tokens after it (and, with `scheduled`, its num_scheduled_tokens)."""
    scheduler = module.Scheduler(*limits, -1)
    added = {"ABCD"[i]: scheduler.add(i, prompt, max_tokens) for i, (prompt, max_tokens) in enumerate(requests)}
    names = {id(r): name for name, r in added.items()}
    for tokens in sampled:
        batch, is_prefill = scheduler.schedule()
        seen = [[names[id(r)], r.num_scheduled_tokens] for r in batch]
        scheduler.postprocess(batch, [tokens.get(names[id(r)], 9) for r in batch])
    return [Field("batch", LABELS["batch"], _batch(seen)), Field("is_prefill", LABELS["is_prefill"], str(is_prefill)),
            Field("waiting", LABELS["waiting"], _list(names[id(r)] for r in scheduler.waiting)),
            Field("running", LABELS["running"], _list(names[id(r)] for r in scheduler.running)),
            Field("num_computed_tokens", LABELS["num_computed_tokens"],
                  _per_request({name: r.num_computed_tokens for name, r in added.items()})),
            Field("completions", LABELS["completions"],
                  _per_request({name: list(r.token_ids[r.num_prompt_tokens :]) for name, r in added.items()})),
            *([Field("scheduled_after", LABELS["scheduled_after"],
                     _per_request({name: r.num_scheduled_tokens for name, r in added.items()}))] if scheduled else [])]


def probes() -> list[Scenario]:
    return [Scenario("probe-seats", T("add A = [1], B = [2], C = [3] (max_num_seqs 2), then schedule",
                                      "add A = [1]、B = [2]、C = [3]（max_num_seqs 为 2），然后 schedule"), _seats),
            Scenario("probe-decode-seats",
                     T("add A = [1], B = [2], C = [3] max 2 (10 blocks of 2, max_num_seqs 2, a budget of 16), then "
                       "3 steps: prefill A and B, prefill C, decode",
                       "add A = [1]、B = [2]、C = [3]，max 2（10 个大小为 2 的块，max_num_seqs 2，预算 16），然后走 3 步："
                       "prefill A 和 B，prefill C，decode"),
                     lambda module: _probe_steps(module, (10, 2, 2, 16), [([1], 2), ([2], 2), ([3], 2)], [{}, {}, {}])),
            Scenario("probe-decode-preempts",
                     T("add A = [1, 2] max 3, B = [3, 4] max 7, C = [5, 6] max 6, D = [7, 8] max 2 (4 blocks of 2, "
                       "max_num_seqs 2, a budget of 16), then 3 steps: prefill A and B, prefill C and D, decode: A "
                       "preempts D, the newest (though it has the fewest tokens left and this step would finish it), "
                       "and B preempts C",
                       "add A = [1, 2] max 3、B = [3, 4] max 7、C = [5, 6] max 6、D = [7, 8] max 2（4 个大小为 2 的块，"
                       "max_num_seqs 2，预算 16），然后走 3 步：prefill A 和 B，prefill C 和 D，decode：A 抢占最新的 D"
                       "（尽管它剩下的 token 最少，这一步本可以让它完成），B 抢占 C"),
                     lambda module: _probe_steps(module, (4, 2, 2, 16), [([1, 2], 3), ([3, 4], 7), ([5, 6], 6),
                                                                         ([7, 8], 2)], [{}, {}, {}])),
            Scenario("probe-preempt-sharer",
                     T("add A = [7], B = [1, 2, 3], C = [8], D = [1, 2, 5], max 5 each (6 blocks of 2, max_num_seqs 4, "
                       "a budget of 16; D hits B's block [1, 2]), then 3 steps: prefill, decode, decode: A takes the "
                       "free block, B preempts D, the newest, though it shares a block with B; C preempts itself",
                       "add A = [7]、B = [1, 2, 3]、C = [8]、D = [1, 2, 5]，max 都是 5（6 个大小为 2 的块，max_num_seqs 4，"
                       "预算 16；D 命中 B 的块 [1, 2]），然后走 3 步：prefill、decode、decode：A 拿走空闲的块，B 抢占最新的 "
                       "D，尽管 D 和 B 共享一个块；C 抢占自己"),
                     lambda module: _probe_steps(module, (6, 2, 4, 16), [([7], 5), ([1, 2, 3], 5), ([8], 5),
                                                                         ([1, 2, 5], 5)], [{}, {}, {}])),
            Scenario("probe-readmitted-later",
                     T("scenario 2's requests under a budget of 3 (5 blocks of 2, max_num_seqs 4), then 6 steps: B and "
                       "C are preempted and come back; in step 6 C, second, does not fit what B left and ends the step",
                       "场景 2 的请求，预算改为 3（5 个大小为 2 的块，max_num_seqs 4），然后走 6 步：B 和 C 被抢占后回来；"
                       "第 6 步里排第二的 C 放不进 B 剩下的预算，于是这一步在它前面结束"),
                     lambda module: _probe_steps(module, (5, 2, 4, 3), [([1, 2, 3], 3), ([4, 5, 6], 3), ([7], 4)],
                                                 [{}] * 6)),
            Scenario("probe-whole-cache",
                     T("add A = [1 .. 6] max 1 (3 blocks of 2: the prompt fills the whole cache, and its one token "
                       "needs no slot), then schedule",
                       "add A = [1 .. 6] max 1（3 个大小为 2 的块：prompt 正好占满整个 cache，它唯一的 token 不需要 "
                       "slot），然后 schedule"),
                     lambda module: _probe_steps(module, (3, 2, 4, 16), [(list(range(1, 7)), 1)], [{}])),
            Scenario("probe-decode-budget",
                     T("add A = [1], B = [2], C = [3] max 2 (4 blocks of 4, max_num_seqs 4, a budget of 2), then "
                       "3 steps: prefill A and B, prefill C, decode",
                       "add A = [1]、B = [2]、C = [3]，max 2（4 个大小为 4 的块，max_num_seqs 4，预算 2），然后走 3 步："
                       "prefill A 和 B，prefill C，decode"),
                     lambda module: _probe_steps(module, (4, 4, 4, 2), [([1], 2), ([2], 2), ([3], 2)], [{}, {}, {}])),
            Scenario("probe-recompute-chunks",
                     T("add A = [1, 2, 3] max 3, B = [4] max 4 (2 blocks of 4, max_num_seqs 4, a budget of 2), then 5 "
                       "steps: B is preempted in step 4 with completion [21, 22], and step 5 recomputes a chunk of 2",
                       "add A = [1, 2, 3] max 3、B = [4] max 4（2 个大小为 4 的块，max_num_seqs 4，预算 2），然后走 5 步："
                       "B 在第 4 步被抢占，已生成 [21, 22]，第 5 步重算一个 2 token 的 chunk"),
                     lambda module: _probe_steps(module, (2, 4, 4, 2), [([1, 2, 3], 3), ([4], 4)],
                                                 [{"A": 90}, {"A": 11, "B": 21}, {"A": 12, "B": 22}, {"A": 13},
                                                  {"B": 99}])),
            Scenario("probe-no-room",
                     T("add A = [1, 2, 3] max 3, B = [4 .. 8] max 1 (2 blocks of 4, max_num_seqs 4, a budget of 4), "
                       "then 2 steps: prefill A; B cannot get its 2 blocks, so A decodes",
                       "add A = [1, 2, 3] max 3、B = [4 .. 8] max 1（2 个大小为 4 的块，max_num_seqs 4，预算 4），"
                       "然后走 2 步：prefill A；B 分不到它要的 2 个块，于是 A decode"),
                     lambda module: _probe_steps(module, (2, 4, 4, 4), [([1, 2, 3], 3), ([4, 5, 6, 7, 8], 1)],
                                                 [{}, {}])),
            Scenario("probe-scheduled-reset",
                     T("add A = [1 .. 6] max 2, B = [7] max 1 (8 blocks of 4, max_num_seqs 4, a budget of 4), then 2 "
                       "steps: prefill A 4, a chunk; prefill A 2 and B 1, and B finishes",
                       "add A = [1 .. 6] max 2、B = [7] max 1（8 个大小为 4 的块，max_num_seqs 4，预算 4），然后走 2 步："
                       "prefill A 4，一个 chunk；prefill A 2 和 B 1，B 完成"),
                     lambda module: _probe_steps(module, (8, 4, 4, 4), [([1, 2, 3, 4, 5, 6], 2), ([7], 1)], [{}, {}],
                                                 scheduled=True)),
            Scenario("probe-idle", T("no request: schedule(), then postprocess([], [])",
                                     "没有任何请求：schedule()，然后 postprocess([], [])"), _idle)]


# ---- the walk-through ---------------------------------------------------------------------------------


def _same(got, want, what: str) -> None:
    if got != want:
        raise ToyDrift(f"{what}: the reference gives {got}, toy_cases/ stores {want}: the toy file and "
                       "solutions/ disagree")


def _scenario_step(reference, n: int, scenario: dict) -> Step:
    found, completions = replay(reference, scenario)
    rows = []
    for step, got in zip(scenario["steps"], found, strict=True):
        where = f"{scenario['name']} step {step['step']}"
        _same({key: got[key] for key in STATE}, {key: step[key] for key in STATE}, where)
        queued = {name: "running" if name in got["running"] else "waiting" for name in got[STATUS]}
        if got[STATUS] != queued:
            raise ToyDrift(f"{where}: the reference's statuses {got[STATUS]} are not those of its queues, {queued}")
        kind = T("prefill", "prefill") if got["is_prefill"] else T("decode", "decode")
        tables = tuple(f"{name} {_list(table)} · {got['num_computed_tokens'][name]}"
                       for name, table in got["block_tables"].items()) or ("—",)
        rows.append([str(step["step"]), Cell.of(_added(step), "text"), Cell.of(kind, "text"),
                     Cell.of(_batch(got["batch"]), "text"), step["sampled"], Cell.of(_list(got["finished"]), "text"),
                     Cell.of(_list(got["waiting"]), "text"), Cell.of(_list(got["running"]), "text"), got["free"],
                     Cell(tables, kind="text")])
    _same(completions, scenario["completions"], f"{scenario['name']}: the completion tokens")
    columns = [T("step", "步骤"), T("added before it", "此前加入"), T("kind", "类型"),
               T("batch: request num_scheduled_tokens", "batch：请求 num_scheduled_tokens"),
               T("sampled", "采样的 token"), T("finished", "完成"), T("waiting (left first)", "waiting（从左取）"),
               T("running (left first)", "running（从左取）"), T("free list (left first)", "空闲链表（从左取）"),
               T("block table · computed tokens", "块表 · 已计算 token 数")]
    config = (f"{scenario['num_blocks']} blocks of {scenario['block_size']}, max_num_seqs {scenario['max_num_seqs']}, "
              f"max_num_batched_tokens {scenario['max_num_batched_tokens']}, eos_token_id {scenario['eos_token_id']}")
    config_zh = (f"{scenario['num_blocks']} 个大小为 {scenario['block_size']} 的块，max_num_seqs "
                 f"{scenario['max_num_seqs']}，max_num_batched_tokens {scenario['max_num_batched_tokens']}，"
                 f"eos_token_id {scenario['eos_token_id']}")
    done = ", ".join(f"{name} {_list(tokens)}" for name, tokens in completions.items())
    text = T(f"{config}. At the end every request has finished, with completion tokens {done}.",
             f"{config_zh}。最后所有请求都已完成，生成的 token：{done}。")
    name_zh = NAMES_ZH.get(scenario["name"], scenario["name"])
    title = T(f"{n}. Scenario {n}, {scenario['name']}", f"{n}. 场景 {n}：{name_zh}")
    return Step(title, Table.of(f"scenario{n}", columns, rows), text)


def _prefill_turns(reference, scenario: dict) -> list[tuple[int, str, int, int, int, bool]]:
    """Every request a prefill step looked at, right after `schedule()`: (step, name, tokens, computed, scheduled,
    first of its step). Computed is what it starts its turn with: its cached prefix, or its chunks so far. A
    request the step allocated but could not fit has scheduled 0."""
    scheduler = reference.Scheduler(scenario["num_blocks"], scenario["block_size"], scenario["max_num_seqs"],
                                    scenario["max_num_batched_tokens"], scenario["eos_token_id"])
    names, turns = {}, []
    for step in scenario["steps"]:
        for new in step.get("add", []):
            names[id(scheduler.add(new["id"], new["prompt"], new["max_tokens"], new.get("ignore_eos", False)))] = \
                new["name"]
        batch, is_prefill = scheduler.schedule()
        if is_prefill:
            for i, r in enumerate(batch):
                turns.append((step["step"], names[id(r)], len(r), r.num_computed_tokens, r.num_scheduled_tokens,
                              i == 0))
            head = scheduler.waiting[0] if scheduler.waiting else None
            if head is not None and head.block_table and all(head is not r for r in batch):
                turns.append((step["step"], names[id(head)], len(head), head.num_computed_tokens, 0, False))
        scheduler.postprocess(batch, _sampled(step, len(batch)))
    return turns


def _costs_step(reference, toy: dict) -> Step:
    """Scenario 1's prefill steps request by request: cost = tokens - computed, cut only for the first request."""
    scenario = toy["scenarios"][0]
    budget, rows, left, current = scenario["max_num_batched_tokens"], [], 0, None
    for k, name, tokens, computed, scheduled, first in _prefill_turns(reference, scenario):
        if k != current:
            current, left = k, budget
        cost = tokens - computed
        worked = min(cost, left) if first else (cost if cost <= left else 0)  # the rule, worked by hand
        if worked != scheduled:
            raise ToyDrift(f"step {k}: {name} costs {cost} with {left} left, so the rule gives {worked}, but the "
                           f"reference schedules {scheduled}: the adapter in book/toys/ no longer matches solutions/")
        then = (T("whole: to running", "整段：进入 running") if scheduled == cost else
                T("a chunk: stays first in waiting", "一个 chunk：留在 waiting 最前") if scheduled else
                T("does not fit and is not first: the step ends", "放不下又不是第一个：这一步到此为止"))
        rows.append([str(k), name, str(tokens), str(computed), f"{tokens} − {computed} = {cost}", str(left),
                     str(scheduled), Cell.of(then, "text")])
        left -= scheduled
    table = Table.of("costs", [T("step", "步骤"), T("request", "请求"), T("tokens", "token 数"),
                               T("computed at its turn", "轮到它时已计算"), T("cost", "代价"),
                               T("budget left", "剩余预算"), "num_scheduled_tokens", T("then", "结果")], rows)
    text = T(f"Scenario 1's prefill steps, request by request, with a budget of {budget}: a request costs its tokens "
             "minus its computed ones (a cached prefix counts as computed). Only the first request of a step may be "
             "cut to the budget left; a later one that does not fit ends the step, keeping the blocks it was given.",
             f"场景 1 的各个 prefill 步，逐个请求看，预算为 {budget}：一个请求的代价是它的 token 数减去已计算的 token "
             "数（缓存命中的前缀算作已计算）。只有一步中的第一个请求可以被截到剩余预算；后面的请求放不下时，这一步就"
             "结束，它已分到的块仍归它。")
    n = len(toy["scenarios"]) + 1
    return Step(T(f"{n}. What each prefill request costs", f"{n}. 每个 prefill 请求的代价"), table, text)


def walkthrough(reference, toy: dict) -> list[Step]:
    return [*(_scenario_step(reference, n, s) for n, s in enumerate(toy["scenarios"], 1)), _costs_step(reference, toy)]
