"""How to run M04's toy: `solutions/m04_qwen3_model.py` on `toy_cases/m04_qwen3_model.json`, in fp32.

Two toys from the file: SwiGLU on one token, and a one-layer model whose attention and MLP output 0
(its `v_proj` and `down_proj` are zero). The MLP output, the layer's sub-steps (read through its
`trace`), the logits with and without `all_logits`, the greedy tokens and the loaded weights come from
the reference. Worked here and tied to the reference with `agree`: SwiGLU's gate, up and product,
the residual adds, the final RMSNorm and the tied head's dot products, and the greedy loop replayed
one `model_forward` call at a time. The loader runs on the toy's weights in bf16, named as in a
Hugging Face state_dict, with the RoPE base inside `config["rope_parameters"]`.
"""

import torch

from book.i18n import T
from book.toys import Field, Scenario, Step, Table, agree, call, inputs_field, number, shape, vector

F32 = torch.float32

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
_NORMS = ("input_layernorm", "post_attention_layernorm")
_MLP = ("gate_proj", "up_proj", "down_proj")


class _Weights:
    """Any object with the attributes `mlp_forward` reads."""

    def __init__(self, **tensors):
        self.__dict__.update(tensors)


def _tensor(value, dtype=F32) -> torch.Tensor:
    return torch.tensor(value, dtype=dtype)


def _mlp_inputs(toy: dict) -> tuple[torch.Tensor, dict]:
    case = toy["mlp"]
    return _tensor(case["x"]), {name: _tensor(case[name]) for name in _MLP}


def _layer(module, spec: dict, dtype=F32):
    tensors = {name: _tensor(value, dtype) for name, value in spec["layer"].items()}
    return module.Qwen3Layer(**tensors, eps=spec["eps"], num_heads=spec["num_heads"],
                             num_kv_heads=spec["num_kv_heads"], head_dim=spec["head_dim"])


def _model(module, spec: dict, dtype=F32):
    """A fresh `Qwen3Weights` of the toy model, built from `module`'s own dataclasses."""
    return module.Qwen3Weights(_tensor(spec["embed_tokens"], dtype), [_layer(module, spec, dtype)],
                               _tensor(spec["norm"], dtype), spec["eps"], spec["rope_theta"], spec["head_dim"])


def _tables(module, spec: dict, positions: torch.Tensor):
    inv_freq = module.inverse_frequencies(spec["head_dim"], spec["rope_theta"])
    return module.rope_cos_sin(positions, inv_freq, F32)


def _tokens(ids) -> str:
    values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    return ", ".join(str(int(v)) for v in values)


def _state_dict(spec: dict, dtype) -> dict:
    """The toy model's weights under Hugging Face's `Qwen3ForCausalLM` names."""
    found = {"model.embed_tokens.weight": _tensor(spec["embed_tokens"], dtype),
             "model.norm.weight": _tensor(spec["norm"], dtype)}
    for name in _ATTENTION:
        found[f"model.layers.0.self_attn.{name}.weight"] = _tensor(spec["layer"][name], dtype)
    for name in _NORMS:
        found[f"model.layers.0.{name}.weight"] = _tensor(spec["layer"][name], dtype)
    for name in _MLP:
        found[f"model.layers.0.mlp.{name}.weight"] = _tensor(spec["layer"][name], dtype)
    return found


def _config(spec: dict, layers: int = 1) -> dict:
    """A `config.json` as transformers 5 writes it: the RoPE base inside `rope_parameters`."""
    return {"num_hidden_layers": layers, "num_attention_heads": spec["num_heads"],
            "num_key_value_heads": spec["num_kv_heads"], "head_dim": spec["head_dim"],
            "rms_norm_eps": spec["eps"], "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": spec["rope_theta"]}}


def _loaded(model) -> dict:
    """The loaded tensors by their place in `Qwen3Weights`."""
    found = {"embed_tokens": model.embed_tokens, "norm": model.norm}
    for i, layer in enumerate(model.layers):
        found |= {f"layers[{i}].{name}": getattr(layer, name) for name in (*_ATTENTION, *_NORMS, *_MLP)}
    return found


def _place(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "embed_tokens"
    if hf_name == "model.norm.weight":
        return "norm"
    parts = hf_name.removeprefix("model.layers.").split(".")
    return f"layers[{parts[0]}].{parts[-2]}"


# ---- the runs the mistakes are shown on -----------------------------------------------------------


def _mlp_fields(module, x, weights) -> list[Field]:
    out, changed = call(module.mlp_forward, _Weights(**{k: v.clone() for k, v in weights.items()}), x.clone())
    return [Field("out", T("MLP output", "MLP 输出"), out), inputs_field(changed)]


def _layer_fields(module, spec: dict, prompt) -> list[Field]:
    hidden = _tensor(spec["embed_tokens"])[prompt]
    cos, sin = _tables(module, spec, torch.arange(len(prompt)))
    out, changed = call(module.decoder_layer_forward, _layer(module, spec), hidden.clone(), cos, sin)
    return [Field("out", T("layer output", "层输出"), out), inputs_field(changed)]


def _logits_fields(module, spec: dict, prompt, all_logits: bool) -> list[Field]:
    logits, changed = call(module.model_forward, _model(module, spec), prompt.clone(), None, all_logits)
    return [Field("logits", T("logits", "logits"), logits), inputs_field(changed)]


def _greedy_fields(module, model, prompt, count: int, chunk) -> list[Field]:
    tokens, changed = call(module.generate_greedy, model, prompt.clone(), count, chunk)
    return [Field("tokens", T("new tokens", "生成的 token"), _tokens(tokens)), inputs_field(changed)]


def _dtypes_text(tensors: dict) -> T:
    groups: dict[str, list[str]] = {}
    for place, t in tensors.items():
        groups.setdefault(str(t.dtype).removeprefix("torch."), []).append(place.split(".")[-1])
    if len(groups) == 1:
        (name, places), = groups.items()
        return T(f"all {len(places)} {name}", f"{len(places)} 个全是 {name}")
    parts = [f"{name} × {len(places)} ({', '.join(places)})" for name, places in groups.items()]
    return T("; ".join(parts), "；".join(parts))


def _kept_text(state_dict: dict, tensors: dict) -> T:
    held = {id(t) for t in state_dict.values()}
    copies = [place for place, t in tensors.items() if id(t) not in held]
    if not copies:
        return T(f"all {len(tensors)} are the state_dict's own", f"{len(tensors)} 个都是 state_dict 里的原张量")
    return T(f"{len(copies)} copies", f"{len(copies)} 个是副本")


def _loader_fields(module, spec: dict, dtype) -> list[Field]:
    state_dict, config = _state_dict(spec, dtype), _config(spec)
    model, changed = call(module.load_state_dict, state_dict, config)
    tensors = _loaded(model)
    return [Field("theta", T("rope_theta", "rope_theta"), number(model.rope_theta)),
            Field("dtypes", T("dtypes", "dtype"), _dtypes_text(tensors)),
            Field("kept", T("tensors", "张量"), _kept_text(state_dict, tensors)), inputs_field(changed)]


def scenarios(toy: dict) -> list[Scenario]:
    x, weights = _mlp_inputs(toy)
    spec = toy["model"]
    prompt, count = torch.tensor(spec["prompt"]), len(spec["greedy"])
    where = _tokens(prompt)
    return [
        Scenario("mlp", T(f"mlp_forward on x = {vector(x[0])}", f"mlp_forward，x = {vector(x[0])}"),
                 lambda module: _mlp_fields(module, x, weights)),
        Scenario("layer", T(f"decoder_layer_forward on the embeddings of the prompt [{where}]",
                            f"decoder_layer_forward，输入是 prompt [{where}] 的 embedding"),
                 lambda module: _layer_fields(module, spec, prompt)),
        Scenario("logits-all", T(f"model_forward([{where}], all_logits=True)",
                                 f"model_forward([{where}], all_logits=True)"),
                 lambda module: _logits_fields(module, spec, prompt, True)),
        Scenario("logits-last", T(f"model_forward([{where}])", f"model_forward([{where}])"),
                 lambda module: _logits_fields(module, spec, prompt, False)),
        Scenario("greedy", T(f"generate_greedy([{where}], {count})", f"generate_greedy([{where}], {count})"),
                 lambda module: _greedy_fields(module, _model(module, spec), prompt, count, None)),
        Scenario("greedy-chunked", T(f"generate_greedy([{where}], {count}, prefill_chunk=1)",
                                     f"generate_greedy([{where}], {count}, prefill_chunk=1)"),
                 lambda module: _greedy_fields(module, _model(module, spec), prompt, count, 1)),
        Scenario("loader", T("load_state_dict on the toy's weights in bf16, rope_theta inside rope_parameters",
                             "load_state_dict 读取 bf16 的 toy 权重，rope_theta 放在 rope_parameters 里"),
                 lambda module: _loader_fields(module, spec, torch.bfloat16)),
    ]


PROBE_CASE = T("a random model like the checks' (2 layers, H = 4, KVH = 2, D = 8, hidden 16, I = 24, V = 32, "
               "rope_theta = 10⁶, live attention and MLP, a 6-token prompt fed whole, as 4 + 2 + a decode step, "
               "and to generate_greedy in chunks of 4)",
               "和检查里一样的随机模型（2 层、H = 4、KVH = 2、D = 8、hidden 16、I = 24、V = 32、rope_theta = 10⁶，"
               "attention 和 MLP 都在起作用；6 个 token 的 prompt 一次喂入、分 4 + 2 再加一步 decode 喂入，"
               "以及按 4 个 token 分块交给 generate_greedy）")


def _probe_model(module, tensors: dict, layers: int, spec: dict):
    return module.Qwen3Weights(
        tensors["embed"].clone(),
        [module.Qwen3Layer(**{name: t.clone() for name, t in layer.items()}, eps=spec["eps"],
                           num_heads=spec["num_heads"], num_kv_heads=spec["num_kv_heads"], head_dim=spec["head_dim"])
         for layer in tensors["layers"][:layers]],
        tensors["norm"].clone(), spec["eps"], spec["rope_theta"], spec["head_dim"])


def probes() -> list[Scenario]:
    gen = torch.Generator().manual_seed(2026)
    L, H, KVH, D, hidden, inter, V = 2, 4, 2, 8, 16, 24, 32
    spec = {"eps": 1e-6, "num_heads": H, "num_kv_heads": KVH, "head_dim": D, "rope_theta": 1e6}

    def normal(*size, std=1.0):
        return torch.randn(*size, generator=gen, dtype=F32) * std

    def layer():
        return {"q_proj": normal(H * D, hidden, std=hidden**-0.5),
                "k_proj": normal(KVH * D, hidden, std=hidden**-0.5),
                "v_proj": normal(KVH * D, hidden, std=hidden**-0.5),
                "o_proj": normal(hidden, H * D, std=(H * D) ** -0.5),
                "q_norm": 1 + 0.3 * normal(D), "k_norm": 1 + 0.3 * normal(D),
                "input_layernorm": 1 + 0.3 * normal(hidden), "post_attention_layernorm": 1 + 0.3 * normal(hidden),
                "gate_proj": normal(inter, hidden, std=hidden**-0.5),
                "up_proj": normal(inter, hidden, std=hidden**-0.5),
                "down_proj": normal(hidden, inter, std=inter**-0.5)}

    tensors = {"embed": normal(V, hidden), "layers": [layer() for _ in range(L)], "norm": 1 + 0.3 * normal(hidden)}
    prompt = torch.randint(0, V, (6,), generator=gen)

    def chunked(module) -> list[Field]:
        model = _probe_model(module, tensors, L, spec)
        caches = [module.KVCache() for _ in model.layers]
        rows = [module.model_forward(model, prompt[:4].clone(), caches, all_logits=True),
                module.model_forward(model, prompt[4:].clone(), caches, all_logits=True)]
        rows.append(module.model_forward(model, rows[-1][-1].argmax()[None], caches, all_logits=True))
        return [Field("logits", T("logits of the three calls", "三次调用的 logits"), torch.cat(rows))]

    return [
        Scenario("probe-whole", T("model_forward on the 6-token prompt in one call, all_logits=True",
                                  "model_forward 一次处理 6 个 token 的 prompt，all_logits=True"),
                 lambda module: _logits_fields_probe(module, _probe_model(module, tensors, L, spec), prompt)),
        Scenario("probe-chunks", T("model_forward with caches: 4 prompt tokens, then 2, then one decode step",
                                   "带 cache 的 model_forward：先 4 个 prompt token，再 2 个，再一步 decode"),
                 chunked),
        Scenario("probe-greedy", T("generate_greedy(prompt, 6, prefill_chunk=4) on the 2-layer model",
                                   "两层模型上的 generate_greedy(prompt, 6, prefill_chunk=4)"),
                 lambda module: _greedy_fields(module, _probe_model(module, tensors, L, spec), prompt, 6, 4)),
    ]


def _logits_fields_probe(module, model, prompt) -> list[Field]:
    logits, changed = call(module.model_forward, model, prompt.clone(), None, True)
    return [Field("logits", T("logits", "logits"), logits), inputs_field(changed)]


# ---- the walk-through ---------------------------------------------------------------------------------


def _mlp_step(reference, toy: dict) -> Step:
    x, weights = _mlp_inputs(toy)
    out = reference.mlp_forward(_Weights(**weights), x)
    gate, up = x @ weights["gate_proj"].T, x @ weights["up_proj"].T  # [T, I]
    sigmoid = torch.sigmoid(gate)
    product = gate * sigmoid * up
    agree(product @ weights["down_proj"].T, out, "mlp_forward")
    agree(out, _tensor(toy["mlp"]["expected"]), "the toy file's MLP output")
    rows = [[x[n], gate[n], up[n], sigmoid[n], gate[n] * sigmoid[n], product[n], out[n]] for n in range(x.shape[0])]
    table = Table.of("mlp", ["x", "gate = x · gate_projᵀ", "up = x · up_projᵀ", "σ(gate)",
                             "silu(gate) = gate · σ(gate)", "silu(gate) · up",
                             T("output = (silu(gate) · up) · down_projᵀ", "输出 = (silu(gate) · up) · down_projᵀ")],
                     rows)
    text = T(f"down_proj's first row is [1, 1], so the first output is the sum {number(product[0, 0])} + "
             f"{number(product[0, 1])} = {number(out[0, 0])}: exactly 2, because 2·σ(1) + 2·σ(−1) = 2. Only the gate "
             "goes through silu; up stays linear.",
             f"down_proj 的第一行是 [1, 1]，所以第一个输出是两项之和 {number(product[0, 0])} + "
             f"{number(product[0, 1])} = {number(out[0, 0])}：恰好是 2，因为 2·σ(1) + 2·σ(−1) = 2。"
             "只有 gate 经过 silu，up 保持线性。")
    return Step(T("1. SwiGLU on one token", "1. 单个 token 上的 SwiGLU"), table, text)


def _layer_step(reference, spec: dict) -> Step:
    prompt = torch.tensor(spec["prompt"])
    embed, layer = _tensor(spec["embed_tokens"]), _layer(reference, spec)
    hidden = embed[prompt]  # [T, hidden]
    cos, sin = _tables(reference, spec, torch.arange(len(prompt)))
    seen = {}
    out = reference.decoder_layer_forward(layer, hidden, cos, sin,
                                          trace=lambda step, value: seen.setdefault(step, value))
    normed = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + spec["eps"]) * layer.input_layernorm
    agree(normed, seen["input_norm"], "the layer's input norm")
    h = hidden + seen["attention"]
    agree(h + seen["mlp"], out, "the layer's two residual adds")
    rows = [[str(n), str(t), hidden[n], seen["input_norm"][n], seen["attention"][n], h[n],
             seen["post_attention_norm"][n], seen["mlp"][n], out[n]] for n, t in enumerate(prompt.tolist())]
    table = Table.of("layer", [T("position", "位置"), "token", T("hidden = embedding", "hidden = embedding"),
                               "input_norm", "attention", "h = hidden + attention", "post_attention_norm", "mlp",
                               "out = h + mlp"], rows)
    text = T("v_proj and down_proj are zero, so attention and the MLP both return 0 and the layer hands its input on "
             f"unchanged: token {prompt[0].item()} leaves as {vector(out[0])}. The residual adds take the layer's "
             f"input, not the normalised {vector(seen['input_norm'][0])}.",
             "v_proj 和 down_proj 都是零，所以 attention 和 MLP 都输出 0，这一层原样传出它的输入："
             f"token {prompt[0].item()} 出来时仍是 {vector(out[0])}。残差加的是这一层的输入，而不是归一化后的 "
             f"{vector(seen['input_norm'][0])}。")
    return Step(T("2. One decoder layer, sub-layers silent", "2. 一个 decoder 层，子层输出为零"), table, text)


def _head_step(reference, spec: dict) -> tuple[Step, torch.Tensor]:
    model = _model(reference, spec)
    vocab = torch.arange(model.embed_tokens.shape[0])
    logits = reference.model_forward(model, vocab, all_logits=True)  # [V, V]: one row per token
    e = model.embed_tokens
    mean_square = e.pow(2).mean(-1)  # [V]
    normed = e * torch.rsqrt(mean_square + model.eps)[:, None]
    weighted = normed * model.norm
    agree(weighted @ e.T, logits, "the final norm and the tied head")
    rows = [[str(t), e[t], mean_square[t], normed[t], weighted[t], logits[t], str(int(logits[t].argmax()))]
            for t in vocab.tolist()]
    table = Table.of("head", ["token t", "e_t", "mean(e_t²)", "e_t / √(mean + eps)",
                              T("× norm weight", "× norm 的 weight"), "logits = · Eᵀ",
                              T("argmax: next token", "argmax：下一个 token")], rows)
    text = T(f"The stream reaches the head as the embedding itself. The final norm (eps = {number(model.eps)}) "
             f"rescales it, its weight {vector(model.norm)} flips the second channel, and the tied head dots the "
             "result with every embedding row: the LM head is embed_tokens again.",
             f"到达输出头时，残差流就是 embedding 本身。最后的 norm（eps = {number(model.eps)}）先缩放它，"
             f"它的 weight {vector(model.norm)} 把第二个通道取反，然后共享权重的输出头把结果与每一行 embedding 做点积："
             "LM head 就是 embed_tokens 本身。")
    return Step(T("3. Final norm and tied head, token by token", "3. 最后的 norm 与共享权重的输出头，逐个 token"),
                table, text), logits


def _prompt_step(reference, spec: dict, by_token: torch.Tensor) -> Step:
    prompt = torch.tensor(spec["prompt"])
    every = reference.model_forward(_model(reference, spec), prompt, all_logits=True)  # [T, V]
    last = reference.model_forward(_model(reference, spec), prompt)  # [1, V]
    agree(every, by_token[prompt], "the prompt's logits, row by row")
    agree(every, _tensor(spec["logits"]), "the toy file's logits")
    rows = [[str(n), str(t), every[n], last[0] if n == len(prompt) - 1 else "—"]
            for n, t in enumerate(prompt.tolist())]
    table = Table.of("prompt", [T("position", "位置"), "token", "all_logits=True",
                                f"all_logits=False → {shape(last.shape)}"], rows)
    text = T(f"all_logits=True gives one row per new token, {shape(every.shape)}; the default keeps only the last "
             f"token's row, {shape(last.shape)}, the one that predicts what comes next: "
             f"argmax {int(last[0].argmax())}.",
             f"all_logits=True 为每个新 token 返回一行，形状 {shape(every.shape)}；默认只保留最后一个 token 的那一行，"
             f"形状 {shape(last.shape)}，它预测接下来的 token：argmax 为 {int(last[0].argmax())}。")
    return Step(T(f"4. The prompt [{_tokens(prompt)}]", f"4. prompt [{_tokens(prompt)}]"), table, text)


def _greedy_step(reference, spec: dict) -> Step:
    prompt, count = torch.tensor(spec["prompt"]), len(spec["greedy"])
    model = _model(reference, spec)
    caches = [reference.KVCache() for _ in model.layers]
    rows, fed, tokens = [], prompt, []
    for n in range(count):  # one model_forward call per new token, as generate_greedy makes them
        past = len(caches[0])
        logits = reference.model_forward(model, fed, caches)  # [1, V]
        tokens.append(int(logits[-1].argmax()))
        rows.append([str(n + 1), _tokens(fed), _tokens(range(past, past + len(fed))), str(past), logits[-1],
                     str(tokens[-1])])
        fed = torch.tensor(tokens[-1:])
    whole = reference.generate_greedy(_model(reference, spec), prompt, count)
    chunked = reference.generate_greedy(_model(reference, spec), prompt, count, prefill_chunk=1)
    agree(torch.tensor(tokens), whole, "generate_greedy")
    agree(chunked, whole, "generate_greedy with prefill_chunk=1")
    agree(whole, torch.tensor(spec["greedy"]), "the toy file's greedy tokens")
    table = Table.of("greedy", [T("call", "调用"), T("feeds", "输入 token"), T("positions", "位置"),
                                T("len(cache) before", "调用前 len(cache)"),
                                T("last row of logits", "logits 的最后一行"),
                                T("argmax → appended", "argmax → 追加")], rows)
    text = T(f"The prefill reads the prompt and predicts {tokens[0]}; each decode step feeds the last new token "
             f"back at the next position. generate_greedy returns the new tokens only: [{_tokens(whole)}], "
             f"and the same [{_tokens(chunked)}] with prefill_chunk=1. The last token is read, never fed.",
             f"prefill 读入 prompt，预测出 {tokens[0]}；之后每一步 decode 把最新的 token 放在下一个位置喂回去。"
             f"generate_greedy 只返回新生成的 token：[{_tokens(whole)}]；prefill_chunk=1 时也是 [{_tokens(chunked)}]。"
             "最后一个 token 只被读出，不再喂入。")
    return Step(T("5. Greedy generation, call by call", "5. 贪心生成，逐次调用"), table, text)


def _loader_step(reference, spec: dict) -> Step:
    state_dict, config = _state_dict(spec, torch.bfloat16), _config(spec)
    model = reference.load_state_dict(state_dict, config)
    tensors = _loaded(model)
    rows = []
    for hf_name, given in state_dict.items():
        got = tensors[_place(hf_name)]
        rows.append([hf_name, _place(hf_name), shape(got.shape), str(got.dtype).removeprefix("torch."),
                     "✓" if got is given else "✗"])
    table = Table.of("loader", [T("state_dict name", "state_dict 中的名字"), T("in Qwen3Weights", "在 Qwen3Weights 中"),
                                T("shape", "形状"), "dtype", T("the same tensor", "同一个张量")], rows)
    text = T(f"The config holds the RoPE base inside rope_parameters, as transformers 5 writes it; the loader reads "
             f"rope_theta = {number(model.rope_theta)} from there. There is no lm_head entry to read: the head is "
             "embed_tokens. Every tensor is kept as given, bf16 stays bf16.",
             "这里的 config 像 transformers 5 那样把 RoPE 底数放在 rope_parameters 里；loader 从那里读出 "
             f"rope_theta = {number(model.rope_theta)}。不需要读 lm_head：输出头就是 embed_tokens。"
             "每个张量都原样保留，bf16 仍是 bf16。")
    return Step(T("6. Loading a Hugging Face state_dict", "6. 加载 Hugging Face 的 state_dict"), table, text)


def walkthrough(reference, toy: dict) -> list[Step]:
    spec = toy["model"]
    head, by_token = _head_step(reference, spec)
    return [_mlp_step(reference, toy), _layer_step(reference, spec), head, _prompt_step(reference, spec, by_token),
            _greedy_step(reference, spec), _loader_step(reference, spec)]
