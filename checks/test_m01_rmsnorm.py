"""Checks for M01 · RMSNorm and the fused residual add (mine/m01_rmsnorm.py).

Oracles: the hand-computed rows in toy_cases/m01_rmsnorm.json, Hugging Face's `Qwen3RMSNorm`, and
HF's `Qwen3DecoderLayer` run for real for the residual wiring.
"""

from functools import cache

import pytest
import torch

from checks.harness.compare import expect_close, tolerance
from checks.harness.guard import Returns
from checks.harness.oracles import hf_decoder_add_norm, hf_rms_norm
from checks.harness.toys import load_toy

pytestmark = pytest.mark.m01

TOLERANCE_KIND = "elementwise"
# What `./check.sh grade` awards: a check's points, shared out over its cases (a module is worth the sum,
# 20). An optional oracle's check (absent on most machines) is worth nothing.
POINTS = {
    "test_toy_rows": 2,
    "test_toy_add_rms_norm": 2,
    "test_matches_hf_rmsnorm": 4,
    "test_fp16_large_values": 2,
    "test_tiny_rows_where_eps_matters": 2,
    "test_eps_is_used": 2,
    "test_add_rms_norm_matches_hf_decoder_layer": 4,
    "test_fp32_inputs_are_not_modified": 2,
}
CONTRACTS = {
    "rms_norm": lambda x, weight, eps: Returns.like(x, "[..., D] like x"),
    "add_rms_norm": lambda x, residual, weight, eps: (
        Returns.like(x, "[..., D] like x (normed)"),
        Returns.like(x, "[..., D] like x (new_residual)"),
    ),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Qwen3-0.6B's widths: q_norm / k_norm normalise each of 16 (8) heads over head_dim 128, the layer norms a
# token's hidden 1024. The random shapes stay small; these cases are the real ones.
HEADS, HEAD_DIM, HIDDEN = 16, 128, 1024
# name -> (leading dims, D): None draws 1-6 per leading dim, and D from 3 to 96
SHAPES = {
    "rows": ((None,), None),
    "batch-rows": ((None, None), None),
    "3d": ((None, None, None), None),
    "qk-norm-T-16-128": ((None, HEADS), HEAD_DIM),
    "hidden-1024": ((None,), HIDDEN),
}
TOY = load_toy("m01_rmsnorm")


def random_rows(gen, dtype, *, lead_dims: int = 1, scale: float = 1.0, shape: str | None = None):
    """x [..., D] with 1-3 irregular leading dims (or one of SHAPES), and a weight around 1 (never all ones)."""
    lead, D = SHAPES[shape] if shape is not None else ((None,) * lead_dims, None)
    dims = [int(torch.randint(1, 7, (), generator=gen)) if n is None else n for n in lead]
    D = int(torch.randint(3, 97, (), generator=gen)) if D is None else D
    x = (torch.randn(*dims, D, generator=gen) * scale).to(dtype)
    weight = (1 + 0.5 * torch.randn(D, generator=gen)).to(dtype)
    return x, weight


@pytest.mark.parametrize("case", TOY["rms_norm"], ids=lambda c: c["name"])
def test_toy_rows(impl, case):
    """rms_norm gives the hand-computed toy rows"""
    x, weight = torch.tensor(case["x"]), torch.tensor(case["weight"])
    out = impl.rms_norm(x, weight, case["eps"])
    expect_close(out, torch.tensor(case["expected"]), tolerance("toy", torch.float32), "output")


def test_toy_add_rms_norm(impl):
    """add_rms_norm gives the hand-computed toy sum and norm"""
    case = TOY["add_rms_norm"][0]
    normed, residual = impl.add_rms_norm(
        torch.tensor(case["x"]), torch.tensor(case["residual"]), torch.tensor(case["weight"]), case["eps"]
    )
    tol = tolerance("toy", torch.float32)
    expect_close(residual, torch.tensor(case["expected_residual"]), tol, "new_residual")
    expect_close(normed, torch.tensor(case["expected_normed"]), tol, "normed")


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_hf_rmsnorm(impl, gen, dtype, shape):
    """rms_norm matches HF Qwen3RMSNorm on random shapes and Qwen3's own widths (head_dim 128, hidden 1024)"""
    x, weight = random_rows(gen, dtype, shape=shape)
    expected = hf_rms_norm(x, weight, 1e-6)
    expect_close(impl.rms_norm(x, weight, 1e-6), expected, tolerance("elementwise", dtype), f"output {list(x.shape)}")


@pytest.mark.parametrize("shape", ["rows", "hidden-1024"])
def test_fp16_large_values(impl, gen, shape):
    """fp16 rows with |x| in the hundreds (their squares overflow fp16) match HF"""
    x, weight = random_rows(gen, torch.float32, shape=shape)
    x = (x.sign() * (200 + 800 * x.abs().clamp(max=1))).to(torch.float16)  # |x| in [200, 1000]
    weight = weight.to(torch.float16)
    expected = hf_rms_norm(x, weight, 1e-6)
    expect_close(impl.rms_norm(x, weight, 1e-6), expected, tolerance("elementwise", torch.float16), "output")


@pytest.mark.parametrize("eps", [1e-6, 1e-5])
def test_tiny_rows_where_eps_matters(impl, gen, eps):
    """rows whose mean square is close to eps match HF (eps sits inside the square root)"""
    x, weight = random_rows(gen, torch.float32, lead_dims=1)
    x = x / x.pow(2).mean(-1, keepdim=True).sqrt() * eps**0.5  # mean square == eps in every row
    expected = hf_rms_norm(x, weight, eps)
    expect_close(impl.rms_norm(x, weight, eps), expected, tolerance("elementwise", torch.float32), "output")


def test_eps_is_used(impl, gen):
    """the eps argument is used, not a hard-coded constant"""
    x, weight = random_rows(gen, torch.float32, lead_dims=1, scale=1e-3)
    for eps in (1e-2, 1e-7):
        expected = hf_rms_norm(x, weight, eps)
        expect_close(impl.rms_norm(x, weight, eps), expected, tolerance("elementwise", torch.float32), f"eps={eps}")


@cache
def decoder_layer_case(seed: int, shape: str, dtype: torch.dtype):
    """x, residual, weight and HF's (normed, new residual) for them, once per case rather than once per
    implementation checked (HF's layer at hidden 1024 takes a tenth of a second to build). Calls get copies."""
    gen = torch.Generator().manual_seed(seed)  # what the `gen` fixture gives this case
    x, weight = random_rows(gen, dtype, shape=shape)
    residual = (4 * torch.randn(x.shape, generator=gen)).to(dtype)  # the stream is larger than one update
    return x, residual, weight, *hf_decoder_add_norm(x, residual, weight, 1e-6)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", ["rows", "hidden-1024"])
def test_add_rms_norm_matches_hf_decoder_layer(impl, seed, shape, dtype):
    """add_rms_norm matches HF Qwen3DecoderLayer's residual add + post-attention norm"""
    x, residual, weight, expected_normed, expected_residual = decoder_layer_case(seed, shape, dtype)
    normed, new_residual = impl.add_rms_norm(x, residual, weight, 1e-6)
    tol = tolerance("elementwise", dtype)
    expect_close(new_residual, expected_residual, tol, "new_residual")
    expect_close(normed, expected_normed, tol, "normed")


@pytest.mark.parametrize("function", ["rms_norm", "add_rms_norm"])
def test_fp32_inputs_are_not_modified(impl, gen, function):
    """fp32 inputs are left untouched (`.float()` of an fp32 tensor is the tensor itself)"""
    x, weight = random_rows(gen, torch.float32, lead_dims=2)
    if function == "rms_norm":
        impl.rms_norm(x, weight, 1e-6)  # the guard compares every input with its copy after the call
    else:
        impl.add_rms_norm(x, torch.randn(x.shape, generator=gen), weight, 1e-6)
