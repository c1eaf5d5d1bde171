"""P09 · An engine that hides the host: fused layer kernels, and step n+1 scheduled while step n runs.

p06's engine does everything in one line of work: schedule a step, build its metadata, launch the model,
wait for the sampled tokens, apply them, schedule the next. On a GPU a decode step of a small model takes
a few milliseconds, and the host's part (the scheduler, the metadata, the launches, the wait) is a large
share of that: the GPU sits idle while the host works. This module takes that time back twice.

First, fewer and cheaper launches: the residual add and the RMSNorm that follows it become one Triton
kernel (`fused_add_rms_norm`, one read of each row, the new residual written back in place), and the
MLP's SiLU(gate) * up another (`fused_silu_mul`). Second, overlap: `OverlapLLM.step` schedules step n+1
and launches it BEFORE it waits for step n's tokens. Step n+1's decode rows need step n's tokens as their
inputs; the host does not have them yet, so a request's next token is a placeholder (-1 - b for row b of
step n) that the decode step replaces on the device, reading step n's sampled tokens where they lie. The
host learns the tokens one step late and applies them then: a request that finished at step n (its stop
token, or its last allowed token) was scheduled once more in step n+1, and that wasted row's token is
thrown away, never emitted. Its blocks are freed only when step n+1, which still reads them, is resolved.

What is guaranteed: greedy requests and seeded requests choose as p06's synchronous engine does (a seeded
request draws from its own generator, one draw per row it keeps, so other batches around it and its own
wasted row change none of its draws); a request without a seed shares the engine's generator with its whole
batch, so its draws follow the same distribution, not the same numbers. The decode step's logits may differ
from p06's in their last bits (the fused norm normalises the unrounded fp32 sum), so only a choice between
two nearly tied candidates can differ.

Ideas from: nano-vllm (`nanovllm/layers/layernorm.py`, `activation.py`: the fused add + norm and SiLU *
up); SGLang's overlap scheduler ("future" token ids resolved on the device) and vLLM's asynchronous
scheduling, which both schedule step n+1 while step n runs.

Names: T rows, N the normalised width (hidden), I the MLP's intermediate size, B requests in a step,
block_size slots per cache block.

Run `./check.sh p09` to check this file.
"""

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
import triton
import triton.language as tl

# Your own modules, from this folder (the stub keeps these imports for you, hence the noqa).
from .m01_rmsnorm import add_rms_norm, rms_norm  # noqa: F401
from .m03_rope import apply_rope, rope_cos_sin  # noqa: F401
from .m04_qwen3_model import mlp_forward  # noqa: F401
from .p01_block_manager import decode_metadata  # noqa: F401
from .p02_store_kvcache import store_kvcache  # noqa: F401
from .p04_paged_decode import paged_decode  # noqa: F401
from .p05_scheduler import FINISHED, Request  # noqa: F401
from .p06_engine import LLM, EngineConfig, SamplingParams, probabilities, sample  # noqa: F401


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """m01's `add_rms_norm` in one Triton kernel, the new residual written back IN PLACE.

    Args:
        x: `[T, N]` the sub-layer's output, fp32 / bf16 / fp16, last dim contiguous. Not modified.
        residual: `[T, N]` the residual stream, x's dtype and device, last dim contiguous. Overwritten with
            `x + residual` (computed in fp32, rounded once to its dtype): the stream the next sub-layer adds to.
        weight: `[N]` the norm's scale, x's dtype. Not modified.
        eps: added to the mean of squares.

    Returns:
        `[T, N]` a new tensor in x's dtype: `weight * s / sqrt(mean(s**2) + eps)` where s is the UNROUNDED fp32
        sum (nano-vllm's rounding; HF's decoder layer normalises the sum rounded to x's dtype: the two differ
        by about one rounding of the sum), the product with the weight in fp32, rounded once.
    """
    raise NotImplementedError("fused_add_rms_norm (mine/p09_overlap.py) is not written yet")


def fused_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's middle step in one Triton kernel: `silu(gate) * up` of m04's `mlp_forward`.

    Args:
        gate_up: `[T, 2*I]` fp32 / bf16 / fp16, last dim contiguous: each row's gate projection (columns
            0 .. I-1) then its up projection (I .. 2I-1), as `x @ cat([gate_proj, up_proj]).T` gives. Not modified.

    Returns:
        `[T, I]` a new tensor in gate_up's dtype: `gate * sigmoid(gate) * up`, computed in fp32 and rounded
        once (m04 rounds silu(gate) first, then the product).
    """
    raise NotImplementedError("fused_silu_mul (mine/p09_overlap.py) is not written yet")


@dataclass(eq=False)
class Launched:
    """A step the engine launched and has not resolved yet (given complete).

    Row b of the step is `requests[b]`; `sampled[b]` says whether it draws a token (its prompt is complete
    after this step; a chunk's row does not); its token goes to `token_ids[positions[b]]` of its request,
    where the placeholder `-1 - b` stands until then. `tokens` `[B]` int64 on the model's device holds the
    sampled tokens (-1 for a row that draws none) once the device is done with the step. `free_after`:
    requests that finished already but that this step still reads, freed when it is resolved. On a GPU,
    `host_tokens` (pinned host memory) receives a copy of `tokens` queued right after the step, and `ready`
    (a CUDA event recorded after that copy) says when it has arrived: resolving waits for this step only.
    (`tokens.tolist()` would queue its copy behind every step launched since, the next one included.)
    """

    requests: list
    request_ids: list[int]
    sampled: list[bool]
    positions: list[int]
    tokens: torch.Tensor
    is_prefill: bool
    free_after: list = field(default_factory=list)
    host_tokens: torch.Tensor | None = None
    ready: object = None


class OverlapLLM(LLM):
    """p06's engine with the host one step ahead of the device (write `generate` and `step`).

    The state (laid out by `__init__`): p06's, plus `in_flight`, the `Launched` step not yet resolved (None
    when none), `gate_up`, each layer's `cat([gate_proj, up_proj])` `[2*I, hidden]` for the fused MLP, and
    `qkv`, each layer's `cat([q_proj, k_proj, v_proj])` `[(H + 2*KVH)*D, hidden]` for one projection; on a
    GPU with `cuda_graphs`, `graphs`, the recorded decode steps by batch size (p06's runner, built without
    graphs, serves the prefills).
    `stats` gains `waits`: the steps the engine resolved before scheduling the next one (it does so when
    the next decode might have to preempt: a preempted request gives its blocks back at once, and a step in
    flight must not lose blocks it reads).
    """

    def __init__(self, model, config=None) -> None:
        config = config if config is not None else EngineConfig()
        super().__init__(model, SimpleNamespace(**{**vars(config), "cuda_graphs": False}))  # p06's runner: eager
        self.config = config
        self.in_flight: Launched | None = None
        self.gate_up = [torch.cat([layer.gate_proj, layer.up_proj]) for layer in self.model.layers]
        self.qkv = [torch.cat([layer.q_proj, layer.k_proj, layer.v_proj]) for layer in self.model.layers]
        self.stats["waits"] = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if getattr(config, "cuda_graphs", True) and self.runner.k_caches.device.type == "cuda":
            self.capture_decode_graphs(config.max_num_seqs, -(-config.max_model_len // config.block_size))

    def add_request(self, prompt: list[int], sampling_params) -> Request:
        """Queue one request (as `generate` does for each prompt) and return it; `step` serves it."""
        p = sampling_params
        if len(prompt) + p.max_tokens > self.config.max_model_len:
            raise ValueError(f"a prompt of {len(prompt)} tokens and max_tokens {p.max_tokens} exceed "
                             f"max_model_len {self.config.max_model_len}")
        request = self.scheduler.add(self._next_id, list(prompt), p.max_tokens, p.ignore_eos)
        self._params[request.request_id] = p
        if p.seed is not None:
            self._generators[request.request_id] = torch.Generator(self.generator.device).manual_seed(p.seed)
        self._next_id += 1
        return request

    def generate(self, prompts: list[list[int]], sampling_params) -> list[list[int]]:
        """p06's `generate` (same arguments, same outputs), stepping with the overlap; once every request
        has finished, the last step in flight (wasted rows only) is resolved and its blocks freed."""
        raise NotImplementedError("OverlapLLM.generate (mine/p09_overlap.py) is not written yet")

    def step(self) -> list:
        """Schedule and launch step n+1, then resolve step n (the one in flight). Returns the requests that
        finished in this call, their last token applied.

        When the next step might preempt (fewer free blocks than the running requests could open), step n
        is resolved first, and the next step is scheduled after it, as p06 does."""
        raise NotImplementedError("OverlapLLM.step (mine/p09_overlap.py) is not written yet")

    def capture_decode_graphs(self, max_num_seqs: int, max_blocks: int) -> None:
        """Record the whole decode step, its draw included, as a CUDA graph per batch size (GPU only;
        `__init__` calls it). p06's `ModelRunner.capture_decode_graphs` records the model; this one records
        what `_launch` does for a decode step: the placeholders read from the step before, the layers with
        the fused kernels, the logits, and the exponential race for rows without top-k or top-p (a greedy
        row takes its argmax). The static inputs (`_buffers`): p06's five, plus `previous` `[max_num_seqs]`
        (the tokens of the step before), `temperature` `[max_num_seqs]` and `noise` `[max_num_seqs, V]`
        (Exp(1) draws, made outside the graph by the generators). Sizes as p06's, in one memory pool, each
        run once before it is recorded. The host's inputs reach the buffers through two sets of pinned host
        buffers (`_staging`), used in turn: a copy from pageable memory can hold the host until the device
        reaches it, which would undo the overlap."""
        raise NotImplementedError("OverlapLLM.capture_decode_graphs (mine/p09_overlap.py) is not written yet")
