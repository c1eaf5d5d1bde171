"""Known mistakes in M04 (the Qwen3 model), each a patch of `solutions/m04_qwen3_model.py`.

The patched file imports the reference's m01-m03, so each mutant differs from the reference in exactly
one place. Ids match the Pitfalls section of `exercises/m04_qwen3_model.md`.
"""

from checks.harness.mistakes import Broken, Mistake, Variant, chain, everyday_breakage, replace

_POST_NORM = "normed, hidden = add_rms_norm(attended, hidden, w.post_attention_layernorm, w.eps)  # hidden += attention"
_HEAD = "return rms_norm(hidden, model.norm, model.eps) @ model.embed_tokens.T  # [T or 1, V]"
_GATE = "gate = torch.nn.functional.silu(x @ w.gate_proj.T)  # [T, I]"

MISTAKES = [
    Mistake(
        "residual-from-normed",
        "the residual stream continues from the normalised input instead of the layer's input",
        "Keep the un-normalised hidden state for the residual: h = hidden + attention(norm(hidden)), not "
        "norm(hidden) + attention(norm(hidden)).",
        replace(_POST_NORM, _POST_NORM.replace("add_rms_norm(attended, hidden,", "add_rms_norm(attended, normed,")),
    ),
    Mistake(
        "no-final-norm",
        "the LM head reads the last layer's output without the final RMSNorm",
        "After the last layer, apply model.norm (RMSNorm with model.eps) before multiplying by embed_tokens.T.",
        replace(_HEAD, "return hidden @ model.embed_tokens.T"),
    ),
    Mistake(
        "gate-up-swapped",
        "SwiGLU's activation applied to up_proj instead of gate_proj",
        "silu goes on gate_proj(x); up_proj(x) is the linear factor: down(silu(gate(x)) * up(x)).",
        chain(
            replace(_GATE, "gate = torch.nn.functional.silu(x @ w.up_proj.T)  # [T, I]"),
            replace("return (gate * (x @ w.up_proj.T)) @ w.down_proj.T", "return (gate * (x @ w.gate_proj.T)) @ w.down_proj.T"),
        ),
    ),
    Mistake(
        "positions-restart-per-call",
        "every call's positions start at 0 instead of at the tokens already cached",
        "A chunk or decode step continues the sequence: positions are past .. past+T-1 with past = len(caches[0]).",
        replace("positions = torch.arange(past, past + T)", "positions = torch.arange(T)"),
    ),
    Mistake(
        "cache-shared-across-layers",
        "one KVCache shared by every layer ([KVCache()] * L)",
        "Each layer has its own keys and values: build the list with a comprehension, "
        "[KVCache() for _ in model.layers]; [KVCache()] * L repeats one object L times.",
        replace("caches = [KVCache() for _ in model.layers]", "caches = [KVCache()] * len(model.layers)"),
    ),
    Mistake(
        "logits-from-first-position",
        "the next token is read from the first position of the call instead of the last",
        "Only the last token of a prompt or chunk predicts the next one: keep hidden[-1:], not hidden[:1].",
        replace("hidden = hidden[-1:]  # [1, hidden]", "hidden = hidden[:1]  # [1, hidden]"),
    ),
    Mistake(
        "rope-theta-default",
        "RoPE built with the base 10,000 instead of the model's rope_theta",
        "Pass model.rope_theta (1,000,000 for Qwen3) to inverse_frequencies; 10,000 is only HF's config default.",
        replace("inverse_frequencies(model.head_dim, model.rope_theta)", "inverse_frequencies(model.head_dim, 10_000.0)"),
    ),
    Mistake(
        "theta-top-level-only",
        "the loader reads rope_theta from the top level only, falling back to 10,000",
        "transformers 5 writes the base inside config['rope_parameters']; published Qwen3 checkpoints have it "
        "at the top level: read either, never a default.",
        replace('theta = config.get("rope_theta") or config["rope_parameters"]["rope_theta"]',
                'theta = config.get("rope_theta", 10_000.0)'),
    ),
    Mistake(
        "loader-casts-to-fp32",
        "the loader converts the tensors to float32 instead of keeping them",
        "load_state_dict keeps the state_dict's tensors as they are (a bf16 checkpoint stays bf16); only "
        "load_pretrained converts, to its dtype argument.",
        replace('tensors = {name: state_dict[f"{prefix}self_attn.{name}.weight"] for name in _ATTENTION}',
                'tensors = {name: state_dict[f"{prefix}self_attn.{name}.weight"].float() for name in _ATTENTION}'),
    ),
    Mistake(
        "pretrained-dtype-ignored",
        "load_pretrained ignores its dtype argument: every tensor keeps the checkpoint's dtype",
        "Convert each tensor to the dtype asked as you read it (`t.to(dtype)`): Qwen3's checkpoints are bf16, and "
        "a caller that asks for float32 (to compare with HF in fp32, or to run on a CPU) must get float32.",
        replace("state_dict.update({name: t.to(dtype) for name, t in load_file(shard).items()})",
                "state_dict.update(load_file(shard))"),
    ),
    Mistake(
        "embeddings-scaled",
        "the embeddings multiplied by sqrt(hidden), as Gemma does",
        "Qwen3 feeds the embedding rows to the first layer as they are; only some other families scale them.",
        replace("    hidden = model.embed_tokens[token_ids]  # [T, hidden]",
                "    hidden = model.embed_tokens[token_ids] * model.embed_tokens.shape[1] ** 0.5  # [T, hidden]"),
    ),
    Mistake(
        "token-not-fed-back",
        "every decode step feeds the prompt's last token again instead of the token just chosen",
        "Each decode step's input is the token the previous step chose: append it, then run the model on it.",
        replace("logits = model_forward(model, new_tokens[-1][None], caches)",
                "logits = model_forward(model, prompt_ids[-1:], caches)"),
    ),
    Mistake(
        "positions-per-layer",
        "each layer's positions read from the first layer's cache, which layer 0 has already grown",
        "Read past once, before any layer runs: every layer's new tokens sit at the same positions past .. past+T-1.",
        replace("    for index, layer in enumerate(model.layers):\n",
                "    for index, layer in enumerate(model.layers):\n"
                "        if caches is not None:\n"
                "            past = len(caches[0])\n"
                "            cos, sin = rope_cos_sin(torch.arange(past, past + T),\n"
                "                                    inverse_frequencies(model.head_dim, model.rope_theta), model.norm.dtype)\n"),
    ),
]

VARIANTS = [
    Variant(
        "fused-add-in-fp32",
        "nano-vllm's fused residual add: normalise the unrounded fp32 sum, keep the rounded sum as the stream",
        replace(
            _POST_NORM,
            "total = attended.float() + hidden.float()\n"
            "    normed = rms_norm(total, w.post_attention_layernorm.float(), w.eps).to(hidden.dtype)\n"
            "    hidden = total.to(hidden.dtype)",
        ),
    ),
    Variant(
        "mlp-in-fp32",
        "the MLP computed in fp32 and rounded once",
        chain(
            replace(_GATE, "x32 = x.float()\n    gate = torch.nn.functional.silu(x32 @ w.gate_proj.float().T)"),
            replace(
                "return (gate * (x @ w.up_proj.T)) @ w.down_proj.T",
                "return ((gate * (x32 @ w.up_proj.float().T)) @ w.down_proj.float().T).to(x.dtype)",
            ),
        ),
    ),
    Variant(
        "head-in-fp32",
        "the final norm and LM head in fp32, logits rounded once",
        replace(_HEAD, "return (rms_norm(hidden.float(), model.norm.float(), model.eps) @ model.embed_tokens.float().T)"
                       ".to(model.embed_tokens.dtype)"),
    ),
]

BROKEN = [
    *everyday_breakage("    T = token_ids.shape[0]", "generate_greedy"),
    Broken("all-logits-always", replace("    if not all_logits:\n", "    if False:\n"), "returned shape"),
    Broken("tokens-as-list", replace("return torch.stack(new_tokens)", "return [int(t) for t in new_tokens]"),
           "returned a list"),
    Broken("nan", replace(_HEAD, "return rms_norm(hidden, model.norm, model.eps) @ model.embed_tokens.T * float('nan')"), "NaN"),
    Broken("sibling-import-error", replace("from .m03_rope import inverse_frequencies", "from .m03_rope import inverse_frequency"),
           "ImportError"),
]
