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
}


def tolerance(kind: str, dtype: torch.dtype) -> Tolerance:
    return TOLERANCES[(kind, dtype)]


class Mismatch(AssertionError):
    """A learner's value is not the expected one; the message is the report's one-line reason."""


def close_enough(actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance) -> bool:
    if actual.shape != expected.shape:
        return False
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if a.numel() == 0:
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
