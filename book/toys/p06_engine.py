"""How to run P06's toy: the sampler rows of `toy_cases/p06_engine.json` through `probabilities`, then
their noise through `sample`; and, as a probe, a seeded request served by `LLM.generate` with and
without a chunked prompt.

The probabilities and the tokens come from the reference, and must equal the ones the toy file stores
(else `ToyDrift`). Worked here and tied to the reference with `agree`: each row's softmax after top-k,
the mass of the more likely tokens before each token (the top-p test), the renormalised result, and the
race `probabilities / noise` whose argmax is the token.

The probe runs the engine's loop (`LLM.generate`, `step`, the sampler) without a model: its runner
returns a fixed row of logits per last token, so the tokens depend only on the scheduler and the draws.
"""

from types import SimpleNamespace

import torch

from book.i18n import T
from book.toys import Field, Scenario, Step, Table, ToyDrift, agree, call, inputs_field, number, vector

EXACT = 1e-6  # the toy file holds closed-form values to 10 decimals; the reference works in float32


def _rows(toy: dict) -> list[dict]:
    return toy["sampler"]["rows"]


def _inputs(rows: list[dict]) -> tuple[torch.Tensor, ...]:
    """The batch `probabilities` takes: logits [B, V] fp32, temperature [B], top_k [B], top_p [B]."""
    return (torch.tensor([r["logits"] for r in rows], dtype=torch.float32),
            torch.tensor([float(r["temperature"]) for r in rows]),
            torch.tensor([int(r["top_k"]) for r in rows]),
            torch.tensor([float(r["top_p"]) for r in rows]))


def _settings(row: dict) -> str:
    return f"T {number(row['temperature'])} · k {row['top_k']} · p {number(row['top_p'])}"


# ---- the worked steps ---------------------------------------------------------------------------------


def _worked(row: dict) -> dict:
    """One row by hand, in float64: the softmax after top-k, the mass before each token, the result."""
    logits = torch.tensor(row["logits"], dtype=torch.float64)
    V = logits.numel()
    if row["temperature"] <= 0:
        probs = torch.zeros(V, dtype=torch.float64)
        probs[int(logits.argmax())] = 1.0
        return {"greedy": True, "probabilities": probs}
    scaled = logits / row["temperature"]
    k = row["top_k"] if row["top_k"] > 0 else V
    kth = scaled.sort(descending=True).values[min(k, V) - 1]
    softmax = scaled.masked_fill(scaled < kth, float("-inf")).softmax(dim=-1)
    # ranked above token i: more likely, or as likely with a smaller index (how a stable sort orders ties)
    before = torch.tensor([float(sum(softmax[j] for j in range(V) if softmax[j] > softmax[i] or
                                     (softmax[j] == softmax[i] and j < i))) for i in range(V)], dtype=torch.float64)
    kept = softmax * (before < row["top_p"])
    return {"greedy": False, "softmax": softmax, "before": before, "probabilities": kept / kept.sum()}


def _check(reference, toy: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's probabilities and tokens on the toy, which must be the ones the toy file stores."""
    rows = _rows(toy)
    probs = reference.probabilities(*_inputs(rows))
    stored = torch.tensor([r["probabilities"] for r in rows], dtype=torch.float64)
    if not torch.allclose(probs.double(), stored, atol=EXACT, rtol=0):
        raise ToyDrift("toy_cases/p06_engine.json's probabilities are not what solutions/p06_engine.py computes")
    noise = torch.tensor([r["noise"] for r in rows], dtype=torch.float32)
    tokens = reference.sample(probs, noise)
    if tokens.tolist() != [r["token"] for r in rows]:
        raise ToyDrift(f"toy_cases/p06_engine.json's tokens {[r['token'] for r in rows]} are not the reference's "
                       f"{tokens.tolist()}")
    return probs, tokens


def walkthrough(reference, toy: dict) -> list[Step]:
    rows = _rows(toy)
    probs, tokens = _check(reference, toy)
    noise = torch.tensor([r["noise"] for r in rows], dtype=torch.float32)
    greedy = T("greedy: no softmax", "贪心：不算 softmax")
    table_rows = []
    for i, row in enumerate(rows):
        worked = _worked(row)
        agree(worked["probabilities"], probs[i], f"row {i + 1}'s probabilities")
        if worked["greedy"]:
            middle = [greedy, "—"]
        else:
            middle = [worked["softmax"], worked["before"]]
        table_rows.append([str(i + 1), torch.tensor(row["logits"]), _settings(row), *middle, probs[i]])
    first = Table.of("probabilities", [T("row", "行"), "logits", "temperature · top_k · top_p",
                                       T("softmax(logits / T) after top-k", "top-k 之后的 softmax(logits / T)"),
                                       T("mass of the more likely tokens", "排在前面的 token 的概率和"),
                                       "probabilities"], table_rows)
    ratio = probs / noise
    agree(ratio.argmax(dim=-1), tokens, "the race's argmax")
    race_rows = [[str(i + 1), probs[i], noise[i], ratio[i], str(int(tokens[i]))] for i in range(len(rows))]
    second = Table.of("sample", [T("row", "行"), "probabilities", "noise (Exp(1))", "probabilities / noise",
                                 T("token", "token")], race_rows)
    top_p = next(i for i, r in enumerate(rows) if r["top_p"] < 1 and r["top_k"] == 0)
    crossing = _worked(rows[top_p])
    kept = [j for j in range(len(rows[top_p]["logits"])) if crossing["before"][j] < rows[top_p]["top_p"]]
    last = kept[-1]
    reach = float(crossing["before"][last] + crossing["softmax"][last])
    tie = next(i for i, r in enumerate(rows) if r["top_k"] > 0 and r["top_p"] == 1)
    kept_k = int((probs[tie] > 0).sum())
    text_one = T(
        f"Row {top_p + 1}: token {last} is kept, because the mass before it, {number(crossing['before'][last])}, is "
        f"below top_p {number(rows[top_p]['top_p'])}; with it the kept mass reaches {number(reach)}. A token stays "
        f"while the mass before it is below top_p, so the kept mass first reaches p. Row {tie + 1}: top_k "
        f"{rows[tie]['top_k']} keeps {kept_k} tokens, every one whose logit is at least the k-th largest (a tie). "
        "The greedy row is one-hot at the first largest logit.",
        f"第 {top_p + 1} 行：token {last} 被保留，因为排在它前面的概率和 {number(crossing['before'][last])} 小于 "
        f"top_p {number(rows[top_p]['top_p'])}；算上它，保留的概率和达到 {number(reach)}。只要排在前面的概率和"
        f"还小于 top_p，token 就留下，所以保留的概率和恰好第一次达到 p。第 {tie + 1} 行：top_k 为 "
        f"{rows[tie]['top_k']}，却保留了 {kept_k} 个 token：logit 不小于第 k 大值的都要留（这里有并列）。"
        "贪心行在第一个最大 logit 处为 one-hot。")
    beaten = next((i for i in range(len(rows)) if int(tokens[i]) != int(probs[i].argmax())), None)
    if beaten is None:
        text_two = T("Each row's token is the largest ratio probabilities / noise.",
                     "每行的 token 就是 probabilities / noise 最大的那一个。")
    else:
        text_two = T(
            f"The largest ratio wins, not the largest probability: in row {beaten + 1}, token {int(tokens[beaten])} "
            f"(probability {number(probs[beaten, tokens[beaten]])}) wins with ratio "
            f"{number(ratio[beaten, tokens[beaten]])}. noise / probability is an exponential waiting time of rate "
            "probability, and the first of independent clocks to ring is token i with probability exactly probs[i]. "
            "A token of probability 0 has ratio 0, whatever its noise.",
            f"赢的是比值最大的 token，而不是概率最大的：第 {beaten + 1} 行里，token {int(tokens[beaten])}"
            f"（概率 {number(probs[beaten, tokens[beaten]])}）以比值 {number(ratio[beaten, tokens[beaten]])} 胜出。"
            "noise / probability 是一个速率为 probability 的指数分布等待时间，一组独立的闹钟里最先响的恰好以 "
            "probs[i] 的概率是 token i。概率为 0 的 token 比值为 0，noise 再小也赢不了。")
    return [Step(T("1. probabilities, row by row", "1. probabilities，逐行计算"), first, text_one),
            Step(T("2. sample: the exponential race", "2. sample：指数竞赛"), second, text_two)]


# ---- the runs the mistakes are shown on --------------------------------------------------------------------


def _probabilities_fields(module, toy: dict) -> list[Field]:
    probs, changed = call(module.probabilities, *_inputs(_rows(toy)))
    fields = [Field(f"row{i + 1}", T(f"row {i + 1}", f"第 {i + 1} 行"), probs[i : i + 1])
              for i in range(probs.shape[0])]
    return [*fields, inputs_field(changed)]


def _sample_fields(module, toy: dict) -> list[Field]:
    rows = _rows(toy)
    probs = torch.tensor([r["probabilities"] for r in rows], dtype=torch.float32)
    noise = torch.tensor([r["noise"] for r in rows], dtype=torch.float32)
    tokens, changed = call(module.sample, probs, noise)
    return [Field("tokens", T("tokens", "token"), tokens), inputs_field(changed)]


def scenarios(toy: dict) -> list[Scenario]:
    return [
        Scenario("probabilities", T("probabilities over the toy's five rows", "对 toy 的五行调用 probabilities"),
                 lambda module: _probabilities_fields(module, toy)),
        Scenario("sample", T("sample on the toy's probabilities and noise",
                             "用 toy 的 probabilities 和 noise 调用 sample"),
                 lambda module: _sample_fields(module, toy)),
    ]


# ---- probes: what the sampler's toy never exercises ----------------------------------------------------------


PROBE_CASE = T("runs like the checks' (a seeded request served by LLM.generate with a token budget of 3, its 7-token "
               "prompt in chunks of 3, 3 and 1, and of 64, in one piece, on a stand-in model whose logits depend only "
               "on the last token)",
               "和检查里一样的运行（用 LLM.generate 服务一个带 seed 的请求，token 预算分别为 3，7 个 token 的 prompt "
               "分成 3、3、1 三个分块，以及 64，一次算完；模型换成一个 logits 只取决于最后一个 token 的替身）")

VOCAB = 6
PROMPT = [1, 2, 3, 4, 5, 0, 2]


class _TableRunner:
    """Stands in for `ModelRunner`: the logits of a position are row `token % VOCAB` of a fixed table."""

    def __init__(self):
        self.table = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(6))

    def prefill(self, requests):
        last = [r.token_ids[r.num_computed_tokens + r.num_scheduled_tokens - 1] for r in requests]
        return self.table[torch.tensor(last) % VOCAB].clone()

    def decode(self, requests):
        return self.table[torch.tensor([r.token_ids[-1] for r in requests]) % VOCAB].clone()


def _stand_in_model() -> SimpleNamespace:
    layer = SimpleNamespace(num_heads=1, num_kv_heads=1, head_dim=4)
    return SimpleNamespace(embed_tokens=torch.zeros(VOCAB, 4), layers=[layer], head_dim=4, rope_theta=10000.0)


def _served(module, budget: int) -> list[int]:
    config = module.EngineConfig(block_size=4, num_blocks=8, max_num_batched_tokens=budget, max_num_seqs=2,
                                 max_model_len=64, cuda_graphs=False)
    llm = module.LLM(_stand_in_model(), config)
    llm.runner = _TableRunner()
    params = module.SamplingParams(temperature=1.0, max_tokens=6, seed=11)
    return llm.generate([list(PROMPT)], params)[0]


def _chunking_fields(module) -> list[Field]:
    chunked, whole = _served(module, 3), _served(module, 64)
    same = T("yes", "是") if chunked == whole else T("no", "否")
    return [Field("chunked", T("tokens, prompt in chunks of 3", "token（prompt 按 3 分块）"), vector(chunked)),
            Field("same", T("the same as in one piece", "与一次算完相同"), same)]


def probes() -> list[Scenario]:
    return [Scenario("seeded-chunked", T("a seeded request, its prompt chunked and whole",
                                         "带 seed 的请求，prompt 分块与不分块"), _chunking_fields)]
