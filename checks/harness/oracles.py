"""Oracles: Hugging Face's own Qwen3 classes, built from tiny random configs (never downloaded).

Every expected value in a check comes from here or from `toy_cases/`. The classes are the real ones
from `transformers.models.qwen3.modeling_qwen3`; only their weights are ours. Running them in float64
gives the "truth" the kit's self-tests use to justify its tolerances.
"""

from collections import namedtuple
from dataclasses import dataclass, fields, replace
from functools import cache

import torch
from torch import nn
from transformers import DynamicCache
from transformers.models.qwen3 import configuration_qwen3, modeling_qwen3

QWEN3_ROPE_THETA = 1_000_000.0  # Qwen3's value; HF's config default is 10,000, so it is always passed


def qwen3_config(hidden: int, heads: int = 1, kv_heads: int = 1, head_dim: int = 8, eps: float = 1e-6):
    config = configuration_qwen3.Qwen3Config(
        vocab_size=64,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=eps,
        max_position_embeddings=8192,
        attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": QWEN3_ROPE_THETA},
    )
    config._attn_implementation = "eager"
    assert config.rope_parameters["rope_theta"] == QWEN3_ROPE_THETA
    return config


# ---- RMSNorm --------------------------------------------------------------------------------------


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = modeling_qwen3.Qwen3RMSNorm(x.shape[-1], eps=eps).to(weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        return norm(x.clone())


class _Returns(nn.Module):
    """Stands in for the attention sub-layer: returns a fixed output, whatever it is given."""

    def __init__(self, output: torch.Tensor):
        super().__init__()
        self.output = output

    def forward(self, *args, **kwargs):
        return self.output, None


class _Records(nn.Module):
    """Stands in for the MLP: records its input (the post-attention norm's output), returns zeros."""

    def forward(self, hidden):
        self.seen = hidden.clone()
        return torch.zeros_like(hidden)


def hf_decoder_add_norm(x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's `Qwen3DecoderLayer` wiring: residual + attention output, then post_attention_layernorm.

    The layer runs for real with its attention replaced by "return x" and its MLP by "record input,
    return 0", so its output is the new residual and the MLP's input is the normalised sum.
    Shapes `[T, D]` (a batch of one is added and removed here).
    """
    layer = modeling_qwen3.Qwen3DecoderLayer(qwen3_config(hidden=x.shape[-1], head_dim=2, eps=eps), 0)
    layer = layer.to(x.dtype)
    layer.self_attn = _Returns(x[None].clone())
    layer.mlp = _Records()
    with torch.no_grad():
        layer.post_attention_layernorm.weight.copy_(weight)
        out = layer(hidden_states=residual[None].clone(), attention_mask=None, position_embeddings=None)
    out = out[0] if isinstance(out, tuple) else out
    return layer.mlp.seen[0], out[0]


# ---- Attention ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionWeights:
    """The `w` a learner's `attention_forward` receives (plain tensors, shapes as in HF's Linear)."""

    q_proj: torch.Tensor  # [H*D, hidden]
    k_proj: torch.Tensor  # [KVH*D, hidden]
    v_proj: torch.Tensor  # [KVH*D, hidden]
    o_proj: torch.Tensor  # [hidden, H*D]
    q_norm: torch.Tensor  # [D]
    k_norm: torch.Tensor  # [D]
    eps: float
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def hidden(self) -> int:
        return self.q_proj.shape[1]

    def to(self, dtype: torch.dtype) -> "AttentionWeights":
        return replace(self, **{name: t.to(dtype) for name, t in self.tensors().items()})

    def clone(self) -> "AttentionWeights":
        return replace(self, **{n: t.clone() for n, t in self.tensors().items()})

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}

    @classmethod
    def random(cls, gen: torch.Generator, hidden: int, heads: int, kv_heads: int, head_dim: int, eps=1e-6):
        """Weights that keep activations O(1): projections ~ N(0, 1/fan_in); norm weights around 1
        but far enough from it (and from each other) that putting QK-norm after RoPE shows."""

        def normal(*shape, std):
            return torch.randn(*shape, generator=gen, dtype=torch.float64).mul(std).float()

        return cls(
            q_proj=normal(heads * head_dim, hidden, std=hidden**-0.5),
            k_proj=normal(kv_heads * head_dim, hidden, std=hidden**-0.5),
            v_proj=normal(kv_heads * head_dim, hidden, std=hidden**-0.5),
            o_proj=normal(hidden, heads * head_dim, std=(heads * head_dim) ** -0.5),
            q_norm=1 + normal(head_dim, std=0.4),
            k_norm=1 + normal(head_dim, std=0.4),
            eps=eps,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
        )


def hf_attention_module(w: AttentionWeights, dtype: torch.dtype) -> modeling_qwen3.Qwen3Attention:
    config = qwen3_config(w.hidden, w.num_heads, w.num_kv_heads, w.head_dim, w.eps)
    attention = modeling_qwen3.Qwen3Attention(config, layer_idx=0).to(dtype).eval()
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
            getattr(attention, name).weight.copy_(getattr(w, name))
    return attention


def rope_tables(head_dim: int, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """HF `Qwen3RotaryEmbedding` (theta 1e6) for absolute `positions` [S] -> cos, sin [S, D] in dtype."""
    rotary = modeling_qwen3.Qwen3RotaryEmbedding(qwen3_config(hidden=head_dim, head_dim=head_dim))
    cos, sin = rotary(torch.empty(0, dtype=dtype), positions[None])
    return cos[0], sin[0]


def hf_attention(w: AttentionWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF `Qwen3Attention` (eager) over a whole sequence with a causal mask: [S, hidden] -> [S, hidden]."""
    S = x.shape[0]
    attention = hf_attention_module(w, x.dtype)
    blocked = torch.ones(S, S, dtype=torch.bool).triu(1)
    mask = torch.zeros(S, S, dtype=x.dtype).masked_fill(blocked, torch.finfo(x.dtype).min)[None, None]
    with torch.no_grad():
        out, _ = attention(x[None].clone(), position_embeddings=(cos[None], sin[None]), attention_mask=mask)
    return out[0]


def hf_cache_contents(w: AttentionWeights, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys (k_norm, then RoPE) and raw values HF feeds to attention: each [S, KVH, D]."""
    attention = hf_attention_module(w, x.dtype)
    S = x.shape[0]
    with torch.no_grad():
        k = attention.k_norm(attention.k_proj(x).view(S, w.num_kv_heads, w.head_dim))
        _, k = modeling_qwen3.apply_rotary_pos_emb(k, k, cos, sin, unsqueeze_dim=1)  # cos [S, D] -> [S, 1, D]
        v = attention.v_proj(x).view(S, w.num_kv_heads, w.head_dim)
    return k, v


# ---- RoPE (m03) -----------------------------------------------------------------------------------


def hf_inverse_frequencies(head_dim: int) -> torch.Tensor:
    """HF `Qwen3RotaryEmbedding`'s `inv_freq` [D/2] (fp32) for theta 1e6."""
    return modeling_qwen3.Qwen3RotaryEmbedding(qwen3_config(hidden=head_dim, head_dim=head_dim)).inv_freq


def hf_apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """HF `apply_rotary_pos_emb` on q [T, H, D], k [T, KVH, D] with cos, sin [T, D] (-> [T, 1, D])."""
    return modeling_qwen3.apply_rotary_pos_emb(q.clone(), k.clone(), cos, sin, unsqueeze_dim=1)


def hf_mrope_tables(head_dim: int, mrope_section: tuple[int, int, int], position_ids: torch.Tensor,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """HF `Qwen3OmniMoeThinkerTextRotaryEmbedding` (theta 1e6) for (t, h, w) `position_ids` [3, T] ->
    cos, sin [T, D] in dtype."""
    from transformers.models.qwen3_omni_moe import configuration_qwen3_omni_moe, modeling_qwen3_omni_moe  # m03 only

    config = configuration_qwen3_omni_moe.Qwen3OmniMoeTextConfig(
        hidden_size=head_dim, num_attention_heads=1, num_key_value_heads=1,
        rope_parameters={"rope_type": "default", "rope_theta": QWEN3_ROPE_THETA, "mrope_section": list(mrope_section)},
    )
    rotary = modeling_qwen3_omni_moe.Qwen3OmniMoeThinkerTextRotaryEmbedding(config)
    assert rotary.inv_freq.shape == (head_dim // 2,) and rotary.mrope_section == list(mrope_section)
    cos, sin = rotary(torch.empty(0, dtype=dtype), position_ids[:, None, :].clone())  # [3, 1, T]: batch of one
    return cos[0], sin[0]


# ---- The whole model (m04) ------------------------------------------------------------------------

SUB_STEPS = ("input_norm", "attention", "post_attention_norm", "mlp")  # in the order a layer runs them


@dataclass(frozen=True)
class LayerWeights(AttentionWeights):
    """One decoder layer's weights: the attention's (so it is m02's `w` as it is), the two norms, the MLP."""

    input_layernorm: torch.Tensor  # [hidden]
    post_attention_layernorm: torch.Tensor  # [hidden]
    gate_proj: torch.Tensor  # [I, hidden]
    up_proj: torch.Tensor  # [I, hidden]
    down_proj: torch.Tensor  # [hidden, I]

    @property
    def intermediate(self) -> int:
        return self.gate_proj.shape[0]


@dataclass(frozen=True)
class ModelWeights:
    """The `model` a learner's `model_forward` receives; the LM head is `embed_tokens` (tied)."""

    embed_tokens: torch.Tensor  # [V, hidden]
    layers: tuple[LayerWeights, ...]
    norm: torch.Tensor  # [hidden]
    eps: float
    rope_theta: float
    head_dim: int

    def to(self, dtype: torch.dtype) -> "ModelWeights":
        return replace(self, embed_tokens=self.embed_tokens.to(dtype), norm=self.norm.to(dtype),
                       layers=tuple(layer.to(dtype) for layer in self.layers))

    def clone(self) -> "ModelWeights":
        return replace(self, embed_tokens=self.embed_tokens.clone(), norm=self.norm.clone(),
                       layers=tuple(layer.clone() for layer in self.layers))

    @classmethod
    def random(cls, gen: torch.Generator, vocab: int, hidden: int, intermediate: int, layers: int, heads: int,
               kv_heads: int, head_dim: int, eps: float = 1e-6) -> "ModelWeights":
        """Weights that keep every layer's output O(1) (projections ~ N(0, 1/fan_in), norm weights around 1)
        and the logits spread over several units, so greedy choices are rarely close calls."""

        def normal(*shape, std):
            return torch.randn(*shape, generator=gen, dtype=torch.float64).mul(std).float()

        built = []
        for _ in range(layers):
            attention = AttentionWeights.random(gen, hidden, heads, kv_heads, head_dim, eps)
            built.append(LayerWeights(
                **{name: getattr(attention, name) for name in attention.tensors()},
                eps=eps, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                input_layernorm=1 + normal(hidden, std=0.3),
                post_attention_layernorm=1 + normal(hidden, std=0.3),
                gate_proj=normal(intermediate, hidden, std=hidden**-0.5),
                up_proj=normal(intermediate, hidden, std=hidden**-0.5),
                down_proj=normal(hidden, intermediate, std=intermediate**-0.5),
            ))
        return cls(embed_tokens=normal(vocab, hidden, std=0.1), layers=tuple(built),
                   norm=1 + normal(hidden, std=0.3), eps=eps, rope_theta=QWEN3_ROPE_THETA, head_dim=head_dim)


def frozen(layer):
    """A namedtuple of a layer's attributes (`Frozen` + its class's name): the same layer, as an object no one can
    write to, which crosses to the worker as such (what a learner's code keeps on its input is refused there)."""
    return namedtuple(f"Frozen{type(layer).__name__}", vars(layer))(**vars(layer))


def hf_model_config(w: ModelWeights) -> configuration_qwen3.Qwen3Config:
    """The `Qwen3Config` of these weights (tied embeddings, no stop token), as a config.json would hold it."""
    first = w.layers[0]
    config = configuration_qwen3.Qwen3Config(
        vocab_size=w.embed_tokens.shape[0], hidden_size=first.hidden, intermediate_size=first.intermediate,
        num_hidden_layers=len(w.layers), num_attention_heads=first.num_heads, num_key_value_heads=first.num_kv_heads,
        head_dim=w.head_dim, rms_norm_eps=w.eps, max_position_embeddings=8192, attention_bias=False,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": w.rope_theta},
    )
    config._attn_implementation = "eager"
    return config


def hf_state_dict(w: ModelWeights) -> dict[str, torch.Tensor]:
    """The weights under Hugging Face's `Qwen3ForCausalLM` names (what `model.state_dict()` holds)."""
    names = {"model.embed_tokens.weight": w.embed_tokens, "model.norm.weight": w.norm}
    for i, layer in enumerate(w.layers):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
            names[f"model.layers.{i}.self_attn.{name}.weight"] = getattr(layer, name)
        for name in ("input_layernorm", "post_attention_layernorm"):
            names[f"model.layers.{i}.{name}.weight"] = getattr(layer, name)
        for name in ("gate_proj", "up_proj", "down_proj"):
            names[f"model.layers.{i}.mlp.{name}.weight"] = getattr(layer, name)
    return names


def hf_mlp(layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
    """HF `Qwen3MLP` (SwiGLU) with this layer's gate/up/down weights: [T, hidden] -> [T, hidden]."""
    config = qwen3_config(hidden=layer.hidden)
    config.intermediate_size = layer.intermediate
    mlp = modeling_qwen3.Qwen3MLP(config).to(x.dtype)
    with torch.no_grad():
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(mlp, name).weight.copy_(getattr(layer, name))
        return mlp(x.clone())


def hf_causal_lm(w: ModelWeights, dtype: torch.dtype) -> modeling_qwen3.Qwen3ForCausalLM:
    """HF `Qwen3ForCausalLM` (eager attention) holding exactly these weights, in `dtype`."""
    model = modeling_qwen3.Qwen3ForCausalLM(hf_model_config(w)).to(dtype).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight, "the LM head must be tied"
    with torch.no_grad():
        for name, value in hf_state_dict(w).items():
            model.get_parameter(name).copy_(value)
    return model


def hf_logits_and_steps(model: modeling_qwen3.Qwen3ForCausalLM, token_ids: torch.Tensor):
    """Logits [T, V] for one prefill of `token_ids` [T], and every layer's sub-step outputs, read with
    forward hooks: {(layer, step): [T, hidden]} for the steps in `SUB_STEPS` and "output" (the layer's)."""
    steps, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        modules = (layer.input_layernorm, layer.self_attn, layer.post_attention_layernorm, layer.mlp)
        for step, module in zip(SUB_STEPS + ("output",), modules + (layer,)):
            def keep(module, args, output, key=(i, step)):
                steps[key] = (output[0] if isinstance(output, tuple) else output)[0].detach().clone()

            hooks.append(module.register_forward_hook(keep))
    try:
        with torch.no_grad():
            logits = model(token_ids[None], use_cache=False).logits[0]
    finally:
        for hook in hooks:
            hook.remove()
    return logits, steps


def hf_first_layer_keys(w: ModelWeights, token_ids: torch.Tensor, start: int = 0) -> torch.Tensor:
    """Layer 0's keys [T, KVH, D] in float64 as HF's Qwen3 computes them for one prefill of `token_ids` [T] (normed,
    then rotated at positions start .. start+T-1): what a layer-0 KV cache holds after it (a layer-0 key depends on
    its token and position only)."""
    model = hf_causal_lm(w.to(torch.float64), torch.float64)
    layer, T = model.model.layers[0], token_ids.shape[0]
    with torch.no_grad():
        normed = layer.input_layernorm(model.model.embed_tokens(token_ids[None]))  # [1, T, hidden]
        k = layer.self_attn.k_norm(layer.self_attn.k_proj(normed).view(1, T, -1, w.head_dim)).transpose(1, 2)
        cos, sin = model.model.rotary_emb(k, torch.arange(start, start + T)[None])
        _, k = modeling_qwen3.apply_rotary_pos_emb(k, k, cos, sin)  # [1, KVH, T, D]
    return k[0].transpose(0, 1)


def hf_logits_after_zeros(w: ModelWeights, token_ids: torch.Tensor, start: int) -> torch.Tensor:
    """Logits [T, V] in float64 of HF's Qwen3 for `token_ids` [T] at positions start .. start+T-1, after a cache of
    `start` zero keys and values in every layer (what a chunk far into a sequence computes, without the sequence)."""
    model = hf_causal_lm(w.to(torch.float64), torch.float64)
    cache, T = DynamicCache(), token_ids.shape[0]
    zeros = torch.zeros(1, w.layers[0].num_kv_heads, start, w.head_dim, dtype=torch.float64)
    for i in range(len(w.layers)):
        cache.update(zeros, zeros, i)
    with torch.no_grad():
        return model(token_ids[None], past_key_values=cache, position_ids=torch.arange(start, start + T)[None],
                     use_cache=True).logits[0]


@dataclass(frozen=True)
class ModelCase:
    """Random weights and a prompt with HF's float64 logits and sub-steps on them (m04's and p07's checks)."""

    w: ModelWeights  # in the case's dtype
    prompt: torch.Tensor  # [P] int64
    logits: torch.Tensor  # [P, V] float64: HF on these very weights and tokens
    steps: dict  # (layer, step) -> [P, hidden] float64: HF's sub-step outputs ("output": the layer's), for diagnoses


@cache
def model_case(seed: int, dims: tuple, dtype: torch.dtype, P: int, eps: float = 1e-6,
               rope_theta: float = QWEN3_ROPE_THETA) -> ModelCase:
    """`ModelWeights.random` of `dims` (V, hidden, I, L, H, KVH, D) in `dtype` and a prompt of P tokens from
    `seed` (Qwen3's norm eps and RoPE base unless given); HF's logits and sub-steps in float64 (once per case)."""
    gen = torch.Generator().manual_seed(seed)
    w = replace(ModelWeights.random(gen, *dims, eps=eps), rope_theta=rope_theta).to(dtype)
    prompt = torch.randint(0, w.embed_tokens.shape[0], (P,), generator=gen)
    logits, steps = hf_logits_and_steps(hf_causal_lm(w.to(torch.float64), torch.float64), prompt)
    return ModelCase(w, prompt, logits, steps)


def hf_greedy(model: modeling_qwen3.Qwen3ForCausalLM, prompt_ids: torch.Tensor, new_tokens: int):
    """HF `generate(do_sample=False)`: the new tokens [new_tokens], and at each step the gap between the
    best and second-best logit (a small gap means a rounding difference could flip the choice)."""
    with torch.no_grad():
        out = model.generate(prompt_ids[None], max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, num_beams=1, output_logits=True, return_dict_in_generate=True)
    logits = torch.stack(out.logits)[:, 0]  # [new_tokens, V]
    top2 = logits.topk(2, dim=-1).values
    return out.sequences[0, prompt_ids.shape[0]:], top2[:, 0] - top2[:, 1]


# ---- the sparse MoE block (p08) ---------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class MoEBlockWeights:
    """A `MoEWeights` as the checks hold it: Hugging Face's `Qwen3MoeExperts` layout."""

    router: torch.Tensor  # [E, hidden]
    gate_up_proj: torch.Tensor  # [E, 2*I, hidden]: gate rows, then up rows
    down_proj: torch.Tensor  # [E, hidden, I]
    top_k: int
    norm_topk_prob: bool

    @property
    def num_experts(self) -> int:
        return self.router.shape[0]

    def to(self, dtype: torch.dtype) -> "MoEBlockWeights":
        return replace(self, router=self.router.to(dtype), gate_up_proj=self.gate_up_proj.to(dtype),
                       down_proj=self.down_proj.to(dtype))

    @classmethod
    def random(cls, gen: torch.Generator, experts: int, hidden: int, intermediate: int, top_k: int,
               norm_topk_prob: bool) -> "MoEBlockWeights":
        """Experts whose outputs are O(1) (projections ~ N(0, 1/fan_in)) and a router whose logits spread over
        a few units (std 2), so that most tokens' k-th and (k+1)-th experts are far apart."""

        def normal(*shape, std):
            return torch.randn(*shape, generator=gen, dtype=torch.float64).mul(std).float()

        return cls(router=normal(experts, hidden, std=2 * hidden**-0.5),
                   gate_up_proj=normal(experts, 2 * intermediate, hidden, std=hidden**-0.5),
                   down_proj=normal(experts, hidden, intermediate, std=intermediate**-0.5),
                   top_k=top_k, norm_topk_prob=norm_topk_prob)


def qwen3_moe_config(w: MoEBlockWeights):
    """The `Qwen3MoeConfig` of one sparse block (eager experts: the loop the checks trust, not a fused kernel)."""
    from transformers.models.qwen3_moe import configuration_qwen3_moe

    config = configuration_qwen3_moe.Qwen3MoeConfig(
        hidden_size=w.router.shape[1], moe_intermediate_size=w.down_proj.shape[2], num_experts=w.num_experts,
        num_experts_per_tok=w.top_k, norm_topk_prob=w.norm_topk_prob, num_hidden_layers=1, vocab_size=64)
    config._experts_implementation = "eager"
    return config


def hf_moe_module(w: MoEBlockWeights, dtype: torch.dtype):
    """HF `Qwen3MoeSparseMoeBlock` holding exactly these weights, in `dtype`."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    block = modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(qwen3_moe_config(w)).to(dtype).eval()
    with torch.no_grad():
        block.gate.weight.copy_(w.router)
        block.experts.gate_up_proj.copy_(w.gate_up_proj)
        block.experts.down_proj.copy_(w.down_proj)
    return block


def hf_moe(w: MoEBlockWeights, x: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """HF `Qwen3MoeSparseMoeBlock` on `x` `[T, hidden]` (or `[B, S, hidden]`), computed in `dtype`: x's shape."""
    block = hf_moe_module(w, dtype)
    with torch.no_grad():
        return block(x.to(dtype).reshape(-1, *x.shape[-2:]) if x.dim() == 3 else x.to(dtype)[None])\
            .reshape(x.shape)


def hf_route(w: MoEBlockWeights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF `Qwen3MoeTopKRouter` on `x` `[T, hidden]` in x's dtype: (weights [T, k] in x's dtype, expert ids [T, k])."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    router = modeling_qwen3_moe.Qwen3MoeTopKRouter(qwen3_moe_config(w)).to(x.dtype)
    with torch.no_grad():
        router.weight.copy_(w.router)
        _, weights, expert_ids = router(x)
    return weights, expert_ids
