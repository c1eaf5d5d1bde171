"""The tolerances are justified, not tuned: the oracle's own error in each dtype, measured against the
same computation in float64, uses at most half of the bound the checks allow.

(The other half is room for a correct learner who rounds in another order; the accepted variants in
the catalogue prove that room is enough, and the mutants prove the bound still rejects every mistake.)
"""

import pytest
import torch

from checks.harness.compare import Tolerance, close_enough, tolerance
from checks.harness.oracles import AttentionWeights, hf_attention, hf_decoder_add_norm, hf_rms_norm, rope_tables
from checks.test_m02_thinker_attention import LAYOUTS

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


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_attention_oracle_within_half_the_tolerance(seed, dtype, layout):
    gen = torch.Generator().manual_seed(seed)
    H, KVH, D, hidden = LAYOUTS[layout]
    w = AttentionWeights.random(gen, hidden, H, KVH, D).to(dtype)
    x = torch.randn(13, hidden, generator=gen).to(dtype)
    cos, sin = rope_tables(D, torch.arange(13), dtype)
    truth = hf_attention(w.to(torch.float64), x.double(), cos.double(), sin.double())  # the same given inputs
    assert close_enough(hf_attention(w, x, cos, sin), truth, half(tolerance("attention", dtype)))
