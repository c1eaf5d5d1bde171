"""Triton kernels as the checks run them: compiled on a GPU, in Triton's CPU interpreter elsewhere.

`./check.sh` sets `TRITON_INTERPRET=1` where there is no GPU, before any kernel is decorated. This
module says which of the two verified a result, and repairs one gap in the interpreter: it stores
bfloat16 values as their raw 16-bit patterns and its `tl.dot` multiplies those patterns as integers, so
every bf16 `tl.dot` returns garbage there (seen with triton 3.9). The repair widens bf16 operands to
fp32 before the product — the arithmetic a GPU's tensor cores do for bf16 (each product of two bf16
values is exact in fp32, and the sum is kept in fp32) — so a kernel is checked on the CPU as it runs
on the GPU. It also spares the interpreter work that changes no result (`loading.prepare_interpreter`:
the language's builtins swapped once per launch, each numpy dtype looked up once). Nothing changes for
compiled kernels, but for one thing the checks do everywhere: an autotuned kernel runs one config
(`loading.one_config_per_kernel`), in the worker as in a replay here.
"""

import os

import torch

from .loading import one_config_per_kernel, prepare_interpreter

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu")


def verified_on() -> str:
    """"CPU (Triton 3.9.0 interpreter)" or "GPU (NVIDIA H200, compiled Triton 3.6.0)"."""
    import triton

    if DEVICE.type == "cuda":
        return f"GPU ({torch.cuda.get_device_name(DEVICE)}, compiled Triton {triton.__version__})"
    return f"CPU (Triton {triton.__version__} interpreter)"


if INTERPRETED:
    prepare_interpreter()
one_config_per_kernel()  # the catalogue's mutants replayed here to name a mistake: one config each, as in the worker
