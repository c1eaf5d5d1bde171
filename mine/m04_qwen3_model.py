"""M04 · The Qwen3 model: decoder layers built from m01–m03, a tied LM head, and greedy generation.

A Qwen3 decoder layer is pre-norm: `h = x + attention(norm(x))`, then `out = h + mlp(norm(h))`, with a
SwiGLU MLP `down(silu(gate(x)) * up(x))`. The model looks up token embeddings, runs the layers (one
`KVCache` each), normalises once more, and multiplies by the embedding matrix again (tied LM head) to
get one logit per vocabulary entry. Greedy generation prefills the prompt, optionally in chunks, then
feeds back the most likely token one step at a time. Semantics follow Hugging Face's
`Qwen3ForCausalLM`; the weight names are its `state_dict`'s, so real Qwen3-0.6B weights load from a
local folder. This file imports your own m01–m03 from the same folder.

Names: T new tokens in a call, V vocabulary size, I the MLP's intermediate size, L layers.

Run `./check.sh m04` to check this file.
"""

from dataclasses import dataclass
from pathlib import Path

import torch

# Your own modules, from this folder (the stub keeps these imports for you, hence the noqa).
from .m01_rmsnorm import add_rms_norm, rms_norm  # noqa: F401
from .m02_thinker_attention import KVCache, attention_forward  # noqa: F401
from .m03_rope import inverse_frequencies, rope_cos_sin  # noqa: F401


@dataclass(eq=False)  # compared by identity: == on tensors is elementwise
class Qwen3Layer:
    """One decoder layer's weights (given complete). It is also the `w` m02's `attention_forward` reads.

    Matrices use `nn.Linear`'s `[out, in]` layout: a projection is `x @ W.T`.
    """

    q_proj: torch.Tensor  # [H*D, hidden]
    k_proj: torch.Tensor  # [KVH*D, hidden]
    v_proj: torch.Tensor  # [KVH*D, hidden]
    o_proj: torch.Tensor  # [hidden, H*D]
    q_norm: torch.Tensor  # [D]
    k_norm: torch.Tensor  # [D]
    input_layernorm: torch.Tensor  # [hidden], the norm before attention
    post_attention_layernorm: torch.Tensor  # [hidden], the norm before the MLP
    gate_proj: torch.Tensor  # [I, hidden]
    up_proj: torch.Tensor  # [I, hidden]
    down_proj: torch.Tensor  # [hidden, I]
    eps: float
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass(eq=False)
class Qwen3Weights:
    """The whole model's weights (given complete). The LM head is `embed_tokens` itself (tied)."""

    embed_tokens: torch.Tensor  # [V, hidden]
    layers: list[Qwen3Layer]
    norm: torch.Tensor  # [hidden], the final norm before the LM head
    eps: float
    rope_theta: float
    head_dim: int


def mlp_forward(w, x: torch.Tensor) -> torch.Tensor:
    """The SwiGLU MLP: `down_proj(silu(gate_proj(x)) * up_proj(x))`.

    Args:
        w: any object with `gate_proj [I, hidden]`, `up_proj [I, hidden]`, `down_proj [hidden, I]`.
        x: `[T, hidden]`, same dtype as the weights. Not modified.

    Returns:
        `[T, hidden]` in `x.dtype`, every step in `x.dtype` (Hugging Face's rounding).
    """
    raise NotImplementedError("mlp_forward (mine/m04_qwen3_model.py) is not written yet")


def decoder_layer_forward(w, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          cache: KVCache | None = None, trace=None) -> torch.Tensor:
    """One pre-norm decoder layer: `h = hidden + attention(norm(hidden))`, `out = h + mlp(norm(h))`.

    Args:
        w: the layer's weights, a `Qwen3Layer` or any object with its attributes.
        hidden: `[T, hidden]` the residual stream of the T new tokens. Not modified.
        cos, sin: `[T, D]` RoPE tables for the new tokens' absolute positions (m03).
        cache: as in m02's `attention_forward`: `None`, or this layer's `KVCache`, which gains T tokens.
        trace: `None`, or a function called as `trace(step, value)` once per sub-step, in this order,
            with `value` `[T, hidden]`: `"input_norm"` (the normalised input), `"attention"` (the
            attention output, before the residual add), `"post_attention_norm"` (the normalised sum),
            `"mlp"` (the MLP output, before the residual add). The checks use it to find the first
            sub-step that differs from Hugging Face's.

    Returns:
        `[T, hidden]` in `hidden.dtype`. The residual adds run in that dtype, as in Hugging Face.
    """
    raise NotImplementedError("decoder_layer_forward (mine/m04_qwen3_model.py) is not written yet")


def model_forward(model, token_ids: torch.Tensor, caches: list[KVCache] | None = None,
                  all_logits: bool = False, trace=None) -> torch.Tensor:
    """Run the model over T new tokens and return logits (the tied LM head).

    Args:
        model: a `Qwen3Weights` or any object with its attributes.
        token_ids: `[T]` int64 token ids, the new tokens only. Not modified.
        caches: `None` for a plain prefill (nothing is stored), or one `KVCache` per layer, each holding
            the same `past` tokens; the new tokens sit at absolute positions `past .. past+T-1`, and each
            cache gains them.
        all_logits: return the logits of every new token (`[T, V]`) instead of the last one's (`[1, V]`).
        trace: `None`, or a function called as `trace(layer, step, value)` for every layer (0 .. L-1) and
            sub-step, as documented in `decoder_layer_forward`.

    Returns:
        `[T, V]` or `[1, V]` in the model's dtype: `final_norm(hidden) @ embed_tokens.T`.
    """
    raise NotImplementedError("model_forward (mine/m04_qwen3_model.py) is not written yet")


def generate_greedy(model, prompt_ids: torch.Tensor, max_new_tokens: int,
                    prefill_chunk: int | None = None) -> torch.Tensor:
    """Greedy decoding: prefill the prompt (in chunks of `prefill_chunk` tokens if given), then append
    the argmax token and feed it back, one decode step at a time.

    Args:
        model: as in `model_forward`.
        prompt_ids: `[P]` int64, P >= 1. Not modified.
        max_new_tokens: how many tokens to generate, >= 1 (no stop token: always exactly this many).
        prefill_chunk: `None` to prefill in one call, or the number of prompt tokens per prefill call.

    Returns:
        `[max_new_tokens]` int64: the new tokens only, the same whatever `prefill_chunk` is.
    """
    raise NotImplementedError("generate_greedy (mine/m04_qwen3_model.py) is not written yet")


def load_state_dict(state_dict: dict[str, torch.Tensor], config: dict) -> Qwen3Weights:
    """Map a Hugging Face `Qwen3ForCausalLM` state_dict onto `Qwen3Weights`.

    Args:
        state_dict: HF names -> tensors: `model.embed_tokens.weight`, `model.norm.weight`, and per layer i
            `model.layers.{i}.self_attn.{q,k,v,o}_proj.weight`, `...self_attn.{q,k}_norm.weight`,
            `...{input,post_attention}_layernorm.weight`, `...mlp.{gate,up,down}_proj.weight`.
            `lm_head.weight`, if present, is the embedding matrix itself (tied) and is not needed.
        config: the model's `config.json` as a dict: `num_hidden_layers`, `num_attention_heads`,
            `num_key_value_heads`, `head_dim`, `rms_norm_eps`, and the RoPE base as `rope_theta` or inside
            `rope_parameters`. Untied LM heads are not supported (`tie_word_embeddings` must be true).

    Returns:
        A `Qwen3Weights` holding the state_dict's tensors themselves (no copies, dtype unchanged).
    """
    raise NotImplementedError("load_state_dict (mine/m04_qwen3_model.py) is not written yet")


def load_pretrained(folder: str | Path, dtype: torch.dtype = torch.bfloat16) -> Qwen3Weights:
    """Load real weights from a local folder (`config.json` + `*.safetensors`); never downloads.

    Args:
        folder: a folder holding a Qwen3 checkpoint, e.g. a local copy of Qwen3-0.6B.
        dtype: the dtype every tensor is converted to.

    Returns:
        `load_state_dict` of the folder's tensors (converted to `dtype`) and its config.
    """
    raise NotImplementedError("load_pretrained (mine/m04_qwen3_model.py) is not written yet")
