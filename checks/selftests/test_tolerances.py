"""The tolerances are justified, not tuned: the oracle's own error in each dtype, measured against the
same computation in float64, uses at most half of the bound the checks allow.

(The other half is room for a correct learner who rounds in another order; the accepted variants in
the catalogue prove that room is enough, and the mutants prove the bound still rejects every mistake.)
"""

import pytest
import torch

from checks.harness.compare import Tolerance, close_enough, tolerance
from checks.harness.oracles import (
    QWEN3_ROPE_THETA,
    AttentionWeights,
    hf_apply_rope,
    hf_attention,
    hf_causal_lm,
    hf_decoder_add_norm,
    hf_logits_and_steps,
    hf_rms_norm,
    rope_tables,
)
from checks.test_m02_thinker_attention import LAYOUTS, QWEN3, SHAPES
from checks.test_m04_qwen3_model import LAYOUTS as M04_LAYOUTS
from checks.test_m04_qwen3_model import QWEN3 as M04_QWEN3
from checks.test_m04_qwen3_model import random_weights

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def half(tol: Tolerance) -> Tolerance:
    return Tolerance(rtol=tol.rtol / 2, atol=tol.atol / 2)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_rmsnorm_oracle_within_half_the_tolerance(seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(7, 96, generator=gen).to(dtype)
    residual = (4 * torch.randn(7, 96, generator=gen)).to(dtype)
    weight = (1 + 0.5 * torch.randn(96, generator=gen)).to(dtype)
    tol = half(tolerance("elementwise", dtype))
    truth = hf_rms_norm(x.double(), weight.double(), 1e-6)
    assert close_enough(hf_rms_norm(x, weight, 1e-6), truth, tol)
    normed, new_residual = hf_decoder_add_norm(x, residual, weight, 1e-6)
    truth_normed = hf_rms_norm((x.double() + residual.double()), weight.double(), 1e-6)
    assert close_enough(normed, truth_normed, tol)


# every layout the checks use in both dtypes, and Qwen3's own sizes in fp32 (the only dtype its cases use; one
# seed: its float64 oracle is the costly part)
ATTENTION_CASES = [(layout, dtype, seed) for seed in range(3) for layout in LAYOUTS for dtype in ("fp32", "bf16")]
ATTENTION_CASES.append((QWEN3, "fp32", 0))
DTYPE_OF = {"fp32": torch.float32, "bf16": torch.bfloat16}


def case_ids(cases) -> list[str]:
    return [f"{layout}-{dtype}-{seed}" for layout, dtype, seed in cases]


@pytest.mark.parametrize("layout, dtype, seed", ATTENTION_CASES, ids=case_ids(ATTENTION_CASES))
def test_attention_oracle_within_half_the_tolerance(seed, dtype, layout):
    gen = torch.Generator().manual_seed(seed)
    dtype = DTYPE_OF[dtype]
    H, KVH, D, hidden = SHAPES[layout]
    w = AttentionWeights.random(gen, hidden, H, KVH, D).to(dtype)
    x = torch.randn(13, hidden, generator=gen).to(dtype)
    cos, sin = rope_tables(D, torch.arange(13), dtype)
    truth = hf_attention(w.to(torch.float64), x.double(), cos.double(), sin.double())  # the same given inputs
    assert close_enough(hf_attention(w, x, cos, sin), truth, half(tolerance("attention", dtype)))


# ---- m03 RoPE and m04 the whole model -------------------------------------------------------------

ROPE_POSITIONS = torch.cat((torch.arange(0, 48), torch.arange(1000, 1100)))  # the ranges the m03 checks use


def exact_angles(head_dim: int, positions: torch.Tensor) -> torch.Tensor:
    """positions * inv_freq in float64 (theta 1e6), [T, D/2]: the truth the fp32 tables approximate."""
    inv_freq = 1.0 / QWEN3_ROPE_THETA ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    return positions.double()[:, None] * inv_freq[None, :]


@pytest.mark.parametrize("head_dim", [16, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rope_tables_within_half_the_tolerance(dtype, head_dim):
    """HF's tables (fp32 angles, then cos/sin and a cast) against cos/sin of exact angles."""
    angles = exact_angles(head_dim, ROPE_POSITIONS)
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = rope_tables(head_dim, ROPE_POSITIONS, dtype)
    tol = half(tolerance("rope", dtype))
    assert close_enough(cos, angles.cos(), tol) and close_enough(sin, angles.sin(), tol)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rope_rotation_within_half_the_tolerance(seed, dtype):
    """HF's apply_rotary_pos_emb in `dtype` against the same inputs in float64."""
    gen = torch.Generator().manual_seed(seed)
    positions = ROPE_POSITIONS[torch.randperm(len(ROPE_POSITIONS), generator=gen)[:13]]
    q, k = torch.randn(13, 6, 64, generator=gen).to(dtype), torch.randn(13, 2, 64, generator=gen).to(dtype)
    cos, sin = rope_tables(64, positions, dtype)
    truth = hf_apply_rope(q.double(), k.double(), cos.double(), sin.double())
    tol = half(tolerance("rope", dtype))
    assert all(close_enough(got, exact, tol) for got, exact in zip(hf_apply_rope(q, k, cos, sin), truth))


MODEL_CASES = [(layout, dtype, seed) for seed in range(2) for layout in M04_LAYOUTS for dtype in ("fp32", "bf16")]
MODEL_CASES.append((M04_QWEN3, "fp32", 0))


@pytest.mark.parametrize("layout, dtype, seed", MODEL_CASES, ids=case_ids(MODEL_CASES))
def test_model_oracle_within_half_the_tolerance(seed, dtype, layout):
    """HF Qwen3ForCausalLM in `dtype` against the same weights and tokens in float64: logits and every
    sub-step the diagnosis compares."""
    gen = torch.Generator().manual_seed(seed)
    dtype = DTYPE_OF[dtype]
    w = random_weights(gen, layout).to(dtype)
    tokens = torch.randint(0, w.embed_tokens.shape[0], (12,), generator=gen)
    truth, truth_steps = hf_logits_and_steps(hf_causal_lm(w.to(torch.float64), torch.float64), tokens)
    logits, steps = hf_logits_and_steps(hf_causal_lm(w, dtype), tokens)
    tol = half(tolerance("model", dtype))
    assert close_enough(logits, truth, tol)
    assert all(close_enough(steps[key], truth_steps[key], tol) for key in truth_steps)


# ---- p03 / p04 FlashAttention-style kernels -------------------------------------------------------


def flash_inputs(seed: int, dtype: torch.dtype):
    """One sequence with a cached prefix (37 queries, 53 keys), 4 query heads on 2 kv heads, D 64."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(37, 4, 64, generator=gen).to(dtype)
    k, v = torch.randn(53, 2, 64, generator=gen).to(dtype), torch.randn(53, 2, 64, generator=gen).to(dtype)
    return q, k, v


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_flash_oracle_within_half_the_tolerance(seed, causal, dtype):
    """torch SDPA in fp16/bf16 (the kernels' second oracle) against the definition in float64 on the same
    inputs: within half the bound the kernels are held to."""
    from checks.harness.attention_oracles import naive_attention, sdpa_attention

    q, k, v = flash_inputs(seed, dtype)
    truth, _ = naive_attention(q, k, v, causal=causal)
    assert close_enough(sdpa_attention(q, k, v, causal=causal), truth, half(tolerance("flash", dtype)))


@pytest.mark.parametrize("seed", range(3))
def test_flash_fp32_within_half_the_tolerance(seed):
    """The definition computed in fp32 (scores, softmax, log-sum-exp) against float64: the fp32 bound that
    the LSE and p03's PyTorch steps are held to."""
    from checks.harness.attention_oracles import naive_attention

    q, k, v = flash_inputs(seed, torch.float32)
    truth_out, truth_lse = naive_attention(q, k, v, causal=True)
    keys, values = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * 64**-0.5
    mask = torch.arange(53)[None, :] > torch.arange(37)[:, None] + 16
    scores = scores.masked_fill(mask, float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), values)
    tol = half(tolerance("flash", torch.float32))
    assert close_enough(out, truth_out, tol) and close_enough(torch.logsumexp(scores, dim=-1), truth_lse, tol)


@pytest.mark.parametrize("seed", range(4))
def test_sampler_oracle_within_half_the_tolerance(seed):
    """The sampling masks computed in float32 (softmax, renormalisation) against the float64 definition."""
    from checks.test_p06_engine import expected_probabilities, sampler_case

    logits, temperature, top_k, top_p = sampler_case(torch.Generator().manual_seed(seed))
    truth = expected_probabilities(logits, temperature, top_k, top_p)
    rows = []
    for b in range(logits.shape[0]):
        scaled = logits[b] / (temperature[b] if temperature[b] > 0 else 1.0)
        probs = scaled.masked_fill(truth[b] == 0, float("-inf")).softmax(0)  # float32 on the true kept set
        rows.append(probs / probs.sum())
    assert close_enough(torch.stack(rows), truth, half(tolerance("sampler", torch.float32)))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["E4-k2-h40-I24", "E8-k2-h48-I16", "E8-k3-h32-I20"])
def test_moe_oracle_within_half_the_tolerance(seed, dtype, layout):
    """HF's Qwen3MoeSparseMoeBlock run in the dtype itself, against the same block in float64 (p08's cases: tokens
    whose experts are well apart, both settings of norm_topk_prob)."""
    from checks.harness.oracles import hf_moe
    from checks.test_p08_moe import moe_weights, tokens

    gen = torch.Generator().manual_seed(seed)
    w = moe_weights(gen, layout, dtype, norm_topk_prob=seed % 2 == 0)
    x = tokens(gen, w, 9, dtype)
    assert close_enough(hf_moe(w, x, dtype), hf_moe(w.to(torch.float64), x), half(tolerance("moe", dtype)))


# ---- p09 fused kernels ------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_oracle_within_half_the_tolerance(seed, dtype):
    """The two roundings a fused add + norm may take, HF's decoder wiring in `dtype` (the sum rounded, then
    normalised) and nano-vllm's (the fp32 sum normalised, the product with the weight rounded once), and
    SwiGLU's silu(gate) * up in `dtype` (m04's two roundings), against float64 on the same inputs (the rows
    of the p09 checks: a width of 40 and hidden 1024)."""
    gen = torch.Generator().manual_seed(seed)
    tol = half(tolerance("fused", dtype))
    for width in (40, 1024):
        x = torch.randn(5, width, generator=gen).to(dtype)
        residual = (3 * torch.randn(5, width, generator=gen)).to(dtype)
        weight = (1 + 0.5 * torch.randn(width, generator=gen)).to(dtype)
        truth = hf_rms_norm(x.double() + residual.double(), weight.double(), 1e-6)
        hf_normed, _ = hf_decoder_add_norm(x, residual, weight, 1e-6)
        total = x.float() + residual.float()
        fp32_sum = (total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()).to(dtype)
        assert close_enough(hf_normed, truth, tol) and close_enough(fp32_sum, truth, tol)
        assert close_enough((x + residual), x.double() + residual.double(), tol)
        gate_up = (2 * torch.randn(4, 2 * width, generator=gen)).to(dtype)
        gate, up = gate_up.chunk(2, dim=-1)
        exact = torch.nn.functional.silu(gate.double()) * up.double()
        assert close_enough(torch.nn.functional.silu(gate) * up, exact, tol)
