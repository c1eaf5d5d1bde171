"""Oracles: Hugging Face's own Qwen3 classes, built from tiny random configs (never downloaded).

Every expected value in a check comes from here or from `toy_cases/`. The classes are the real ones
from `transformers.models.qwen3.modeling_qwen3`; only their weights are ours. Running them in float64
gives the "truth" the kit's self-tests use to justify its tolerances.
"""

from dataclasses import dataclass, fields, replace

import torch
from torch import nn
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
