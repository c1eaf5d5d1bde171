"""M01 · RMSNorm and the fused residual add + RMSNorm.

Qwen3 normalises activations with RMSNorm (no mean subtraction, no bias) before attention and before
the MLP, and inside attention on every head of q and k. This module is the building block for all of
them. Semantics follow Hugging Face's `Qwen3RMSNorm`; the fused variant follows the pre-norm decoder
layer, where each sub-layer's output is added to a running residual stream and the sum is normalised.

Run `./check.sh m01` to check this file.
"""

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Root-mean-square normalisation over the last dimension, then a per-channel scale.

    Args:
        x: `[..., D]` activations, any float dtype (fp32, bf16, fp16). Not modified.
        weight: `[D]` per-channel scale, same dtype as `x`. Not modified.
        eps: added to the mean of squares, inside the square root.

    Returns:
        `[..., D]` in `x.dtype`: `weight * (x / sqrt(mean(x**2, over D) + eps))`, where the statistics
        and the division are computed in fp32 and the result is cast back to `x.dtype` before it is
        multiplied by `weight` (Hugging Face's rounding order).
    """
    raise NotImplementedError("rms_norm (mine/m01_rmsnorm.py) is not written yet")


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Add a sub-layer's output to the residual stream, then RMSNorm the sum.

    This is the pre-norm decoder layer's wiring in one call: `new_residual = x + residual` is what the
    next sub-layer adds to, and `normed = rms_norm(new_residual)` is what it reads.

    Rounding rule (this implementation): the sum is computed in `x.dtype` and that rounded sum is
    normalised, exactly as Hugging Face's decoder layer does. Normalising the unrounded fp32 sum instead
    (nano-vllm's fused kernel) is also accepted: the two differ by one rounding of the sum.

    Args:
        x: `[..., D]` the sub-layer's output. Not modified.
        residual: `[..., D]` the residual stream so far, same dtype as `x`. Not modified.
        weight: `[D]` the norm's per-channel scale. Not modified.
        eps: as in `rms_norm`.

    Returns:
        `(normed, new_residual)`, both `[..., D]` in `x.dtype`.
    """
    raise NotImplementedError("add_rms_norm (mine/m01_rmsnorm.py) is not written yet")
