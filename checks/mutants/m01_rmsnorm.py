"""Known mistakes in M01 (RMSNorm), each a patch of `solutions/m01_rmsnorm.py`.

Ids match the Pitfalls section of `exercises/m01_rmsnorm.md`.
"""

from checks.harness.mistakes import Broken, Mistake, Variant, append, everyday_breakage, replace

MISTAKES = [
    Mistake(
        "no-fp32-upcast",
        "squares computed in the input dtype",
        "Upcast x to fp32 before squaring: in fp16 any |x| above 256 squares to inf and the row becomes 0.",
        replace("x32 = x.to(torch.float32)", "x32 = x"),
    ),
    Mistake(
        "eps-outside-sqrt",
        "eps added after the square root",
        "eps belongs inside: rsqrt(mean(x**2) + eps), not 1 / (sqrt(mean(x**2)) + eps).",
        replace(
            "normed = x32 * torch.rsqrt(variance + eps)",
            "normed = x32 / (torch.sqrt(variance) + eps)",
        ),
    ),
    Mistake(
        "sum-not-mean",
        "sum of squares instead of their mean",
        "Divide the sum of squares by D (use .mean over the last dim), or every output shrinks by sqrt(D).",
        replace("x32.pow(2).mean(dim=-1, keepdim=True)", "x32.pow(2).sum(dim=-1, keepdim=True)"),
    ),
    Mistake(
        "weight-missing",
        "the per-channel weight is never applied",
        "Multiply the normalised value by `weight` at the end.",
        replace("return weight * normed.to(x.dtype)", "return normed.to(x.dtype)"),
    ),
    Mistake(
        "wrong-reduction-dim",
        "mean taken over the rows instead of the last dim",
        "Reduce over dim=-1 (the D channels of one token), with keepdim=True so it broadcasts back.",
        replace("x32.pow(2).mean(dim=-1, keepdim=True)", "x32.pow(2).mean(dim=0, keepdim=True)"),
    ),
    Mistake(
        "wrong-output-dtype",
        "the fp32 result is returned without casting back",
        "Cast the normalised value back to x.dtype before multiplying by weight.",
        replace("return weight * normed.to(x.dtype)", "return weight.float() * normed"),
    ),
    Mistake(
        "in-place-input",
        "an in-place multiply on the upcast input",
        "For fp32 input `.to(torch.float32)` returns x itself, so `mul_` changes the caller's tensor.",
        replace(
            "normed = x32 * torch.rsqrt(variance + eps)",
            "normed = x32.mul_(torch.rsqrt(variance + eps))",
        ),
    ),
    Mistake(
        "residual-not-updated",
        "add_rms_norm returns the old residual",
        "The second result is the new residual stream, x + residual, not the residual you were given.",
        replace("return rms_norm(new_residual, weight, eps), new_residual", "return rms_norm(new_residual, weight, eps), residual"),
    ),
    Mistake(
        "norm-before-add",
        "add_rms_norm normalises x before adding the residual",
        "Normalise the sum x + residual; normalising x alone loses the residual stream.",
        replace("return rms_norm(new_residual, weight, eps), new_residual", "return rms_norm(x, weight, eps), new_residual"),
    ),
]

VARIANTS = [
    Variant(
        "weight-in-fp32",
        "multiply by weight in fp32, round once at the end",
        replace("return weight * normed.to(x.dtype)", "return (weight.float() * normed).to(x.dtype)"),
    ),
    Variant(
        "fused-add-in-fp32",
        "nano-vllm's fused add: normalise the unrounded fp32 sum, return the rounded sum as the residual",
        append(
            '''
def add_rms_norm(x, residual, weight, eps):
    total = x.float() + residual.float()
    normed = total * torch.rsqrt(total.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype), total.to(x.dtype)
'''
        ),
    ),
]

BROKEN = [
    *everyday_breakage("    x32 = x.to(torch.float32)", "add_rms_norm"),
    Broken("wrong-shape", replace("return weight * normed.to(x.dtype)", "return (weight * normed.to(x.dtype)).flatten()"), "returned shape"),
    Broken("nan", replace("return weight * normed.to(x.dtype)", "return weight * normed.to(x.dtype) * float('nan')"), "NaN"),
    Broken("calls-exit", replace("    x32 = x.to(torch.float32)", "    exit(1)"), "SystemExit"),
]
