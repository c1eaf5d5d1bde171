"""Numerical comparison: the kit's tolerances (all of them, in one place) and `expect_close`.

An element passes when `|actual - expected| <= atol * scale + rtol * |expected|`, where `scale` is the
root-mean-square of `expected`. Scaling `atol` by the output's typical magnitude makes one number fit
outputs of any size, and keeps near-zero elements from demanding impossible relative precision.

How the numbers were chosen. With a unit roundoff u (fp32 2^-24, fp16 2^-11, bf16 2^-8), one correct
implementation differs from the fp64 truth by a few u, and two correct implementations that round in
a different order (Hugging Face's order vs nano-vllm's, say) differ by the sum of theirs. Each bound
below leaves room for that and no more; the kit's self-tests hold it from both sides:
- every accepted variant (a correct implementation with another rounding order) passes every check,
- the oracle's own error against an fp64 computation stays under half the bound,
- every mutant in the mistake catalogue is rejected.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float  # in units of rms(expected)

    def __str__(self) -> str:
        return f"atol {self.atol:.1e}·rms + rtol {self.rtol:.1e}"


TOLERANCES: dict[tuple[str, torch.dtype], Tolerance] = {
    # Exact toy values written to 6+ decimals (the book page shows 4).
    ("toy", torch.float32): Tolerance(rtol=1e-4, atol=1e-4),
    # Elementwise ops with one reduction (RMSNorm): fp32 sums of <= 1k terms stay near 1e-6.
    ("elementwise", torch.float32): Tolerance(rtol=1e-5, atol=1e-5),
    # fp16/bf16: the oracle rounds twice (normalised value, then times weight) and so may a learner, in
    # another order, or once: 4u covers the worst pair.
    ("elementwise", torch.float16): Tolerance(rtol=2**-9, atol=2**-9),
    ("elementwise", torch.bfloat16): Tolerance(rtol=2**-6, atol=2**-6),
    # Attention (expected values: HF in float64 on the learner's very inputs). It chains projections,
    # QK-norm, RoPE, a softmax and o_proj. In fp32 orders of summation differ by ~1e-6 relative; 2e-5
    # still rejects every mistake in the catalogue (the self-tests prove it).
    ("attention", torch.float32): Tolerance(rtol=2e-5, atol=2e-5),
    # bf16: Hugging Face's own eager path rounds QK^T to bf16 before the softmax (logit error ~u·|s|,
    # |s| up to ~sqrt(D)) and rounds the probabilities and P@V again: measured up to 2.6% of rms
    # from the float64 truth, i.e. under half of 2^-4. Mistakes are told apart by the fp32 cases.
    ("attention", torch.bfloat16): Tolerance(rtol=2**-4, atol=2**-4),
    # RoPE tables and rotations (expected: HF's fp32-angle tables; rotations in float64 on the learner's
    # inputs). An fp32 angle p * inv_freq is off by up to ~2^-24 * p, and two correct ways of computing
    # inv_freq differ by an ulp, which position p multiplies: at the checked positions (up to ~1100) that
    # is up to 1e-4 of the table's rms (measured). 4e-4 admits both; every mistake is off by O(1).
    ("rope", torch.float32): Tolerance(rtol=1e-5, atol=4e-4),
    # bf16: a table entry rounds once (2^-9 relative), a correct learner may land one ulp (2^-8 to 2^-7)
    # away; a rotation in bf16 rounds two products and their sum: 2^-6 covers both, as for RMSNorm.
    ("rope", torch.bfloat16): Tolerance(rtol=2**-6, atol=2**-6),
    # The whole model (expected: HF Qwen3ForCausalLM in float64 on the same weights and tokens): 2-4
    # layers of attention, MLP and residual adds, then the final norm and the tied head. In fp32 HF's
    # own logits and every sub-step stay within 4e-6 of the truth (measured); 2e-5 as for attention.
    ("model", torch.float32): Tolerance(rtol=2e-5, atol=2e-5),
    # bf16: every sub-step and the residual stream round to 8 bits, layer after layer; HF's own bf16
    # logits are measured up to 7.1% (of rms + |expected|) from the truth, the reference's 9.7%, so the
    # bound is 2^-2. Mistakes are told apart by the fp32 cases (every one is rejected there).
    ("model", torch.bfloat16): Tolerance(rtol=2**-2, atol=2**-2),
    # FlashAttention-style kernels (p03, p04; expected: attention by its definition in float64 on the
    # kernel's very fp16/bf16 inputs). Scores are exact products summed in fp32, so two roundings remain:
    # each probability is rounded to the input dtype for the P @ V product on the tensor cores (up to u
    # of every term, a few u of rms in the sum), and the output is rounded once (up to u·|expected|).
    # 4u relative + 8u·rms leaves room for a learner who rounds elsewhere; the reference kernel is measured
    # at under 0.45 of it, torch SDPA (the second oracle) under 0.35. Every mistake is off by O(1).
    ("flash", torch.float16): Tolerance(rtol=2**-9, atol=2**-8),
    ("flash", torch.bfloat16): Tolerance(rtol=2**-6, atol=2**-5),
    # fp32 results: the log-sum-exp (fp32 sums of exact scores: ~1e-6 relative) and the PyTorch steps run
    # in fp32 (orders of summation differ by ~1e-6); 2e-5 as for attention.
    ("flash", torch.float32): Tolerance(rtol=2e-5, atol=2e-5),
    # The sparse MoE block (p08; expected: HF Qwen3MoeSparseMoeBlock in float64 on the same rounded weights
    # and tokens, each token's experts well apart, so no rounding can change them). In fp32 the router's
    # float32 softmax and the experts' GEMMs are off by ~5e-7 of (rms + |expected|) (measured, HF and the
    # fused kernel alike); 2e-5 as for attention.
    ("moe", torch.float32): Tolerance(rtol=2e-5, atol=2e-5),
    # bf16: the routing weights round once, each expert's gate/up, SiLU * up and down round to 8 bits,
    # and the weighted sum twice more: HF's own bf16 block is measured up to 1.6% of (rms + |expected|)
    # from the truth, the fused kernel (fp32 accumulation) 1.3%; 2^-4 keeps the oracle under half.
    # Mistakes are told apart by the fp32 cases and the router's exact checks.
    ("moe", torch.bfloat16): Tolerance(rtol=2**-4, atol=2**-4),
    # The fused kernels (p09; expected: HF's Qwen3RMSNorm of the float64 sum, SwiGLU's silu(gate) * up, in
    # float64 on the same inputs). A fused kernel may normalise the unrounded fp32 sum (nano-vllm's rounding) or
    # the sum rounded to the input's dtype (HF's), and round its output once or twice (and Triton's CPU
    # interpreter rounds bf16 toward zero, not to nearest: up to one ulp, 2^-7 relative): in fp32 every such
    # order is within ~1e-6, so 1e-5 as for RMSNorm; in bf16 one rounding of the sum plus up to two of the output
    # is a few units of 2^-8: 2^-6, as for RMSNorm, with HF's own bf16 wiring measured under half of it.
    ("fused", torch.float32): Tolerance(rtol=1e-5, atol=1e-5),
    ("fused", torch.bfloat16): Tolerance(rtol=2**-6, atol=2**-6),
    # Sampling distributions (p06; expected: the masks by their definition in float64 on the same
    # logits). A float32 softmax over <= 100 logits and one renormalisation are off by a few u (~1e-7)
    # relative; 2e-5 as for attention. The kept set is compared exactly, before any tolerance.
    ("sampler", torch.float32): Tolerance(rtol=2e-5, atol=2e-5),
}


def tolerance(kind: str, dtype: torch.dtype) -> Tolerance:
    return TOLERANCES[(kind, dtype)]


class Mismatch(AssertionError):
    """A learner's value is not the expected one; the message is the report's one-line reason. `rule`: the id of
    the contract's rule the value breaks, where the check can tell (the module's `RULES` in its catalogue)."""

    def __init__(self, message: str = "", rule: str = ""):
        super().__init__(message)
        self.rule = rule


def close_enough(actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance) -> bool:
    if actual.shape != expected.shape:
        return False
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if a.numel() == 0:
        return True
    finite = torch.isfinite(e)
    if not bool(finite.all()):
        # A non-finite expected value (the -inf log-sum-exp of a query that sees no key; a NaN in a learner's
        # output that a mistake is matched against) is met only by the same value; the rest as usual.
        special = ~finite
        if not bool(((a[special] == e[special]) | (a[special].isnan() & e[special].isnan())).all()):
            return False
        a, e = a[finite], e[finite]
        if e.numel() == 0:
            return True
    scale = e.pow(2).mean().sqrt()
    allowed = tol.atol * scale + tol.rtol * e.abs()
    return bool(((a - e).abs() <= allowed).all())


def expect_close(actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance, what: str) -> None:
    """Raise `Mismatch` with max/mean error, where, and the tolerance when `actual` is off."""
    if tuple(actual.shape) != tuple(expected.shape):
        raise Mismatch(f"{what}: shape {list(actual.shape)}, expected {list(expected.shape)}")
    if close_enough(actual, expected, tol):
        return
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    diff = (a - e).abs().nan_to_num(nan=float("inf"))
    worst = divmod_index(int(diff.argmax()), tuple(e.shape))
    raise Mismatch(
        f"{what}: max error {diff.max().item():.3g} at {list(worst)} "
        f"(got {a[worst].item():.5g}, expected {e[worst].item():.5g}), mean error "
        f"{diff.mean().item():.3g}; allowed {tol}"
    )


def divmod_index(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        flat, rest = divmod(flat, size)
        index.append(rest)
    return tuple(reversed(index))
