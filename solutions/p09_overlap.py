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

# ---- the fused kernels -----------------------------------------------------------------------------------


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,  # [T, N] the sub-layer's output, rows stride_x apart
    residual_ptr,  # [T, N] the residual stream: read, then overwritten with x + residual
    weight_ptr,  # [N]
    out_ptr,  # [T, N] the normed sum, contiguous
    stride_x, stride_residual,
    N,  # the row's width
    eps,
    BLOCK: tl.constexpr,  # the power of two >= N that tl.arange needs; lanes N.. are masked off
):
    """One program per row: the sum in fp32, rounded into the residual; the fp32 sum normalised."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0).to(tl.float32)
    total = x + residual  # fp32: the masked lanes are 0 and add nothing to the sum of squares below
    tl.store(residual_ptr + row * stride_residual + cols, total.to(residual_ptr.dtype.element_ty), mask=mask)
    variance = tl.sum(total * total, axis=0) / N
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    normed = total * tl.rsqrt(variance + eps) * weight  # one rounding, at the store
    tl.store(out_ptr + row * N + cols, normed.to(out_ptr.dtype.element_ty), mask=mask)


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
    T, N = x.shape
    assert residual.shape == x.shape and residual.dtype == x.dtype and weight.shape == (N,)
    assert x.stride(1) == 1 and residual.stride(1) == 1 and weight.is_contiguous()
    out = torch.empty(T, N, dtype=x.dtype, device=x.device)
    if T:
        _add_rms_norm_kernel[(T,)](x, residual, weight, out, x.stride(0), residual.stride(0), N, eps,
                                   BLOCK=triton.next_power_of_2(N))
    return out


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr,  # [T, 2*I]: a row's I gate values, then its I up values
    out_ptr,  # [T, I], contiguous
    stride_gate_up,
    I,  # noqa: E741 - the intermediate size, as the docs name it
    BLOCK: tl.constexpr,  # the power of two >= I
):
    """One program per row: SiLU(gate) * up in fp32, rounded once."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(gate_up_ptr + row * stride_gate_up + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_gate_up + I + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * I + cols, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=mask)


def fused_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's middle step in one Triton kernel: `silu(gate) * up` of m04's `mlp_forward`.

    Args:
        gate_up: `[T, 2*I]` fp32 / bf16 / fp16, last dim contiguous: each row's gate projection (columns
            0 .. I-1) then its up projection (I .. 2I-1), as `x @ cat([gate_proj, up_proj]).T` gives. Not modified.

    Returns:
        `[T, I]` a new tensor in gate_up's dtype: `gate * sigmoid(gate) * up`, computed in fp32 and rounded
        once (m04 rounds silu(gate) first, then the product).
    """
    T, two_I = gate_up.shape
    assert two_I % 2 == 0 and gate_up.stride(1) == 1
    inter = two_I // 2
    out = torch.empty(T, inter, dtype=gate_up.dtype, device=gate_up.device)
    if T:
        _silu_mul_kernel[(T,)](gate_up, out, gate_up.stride(0), inter, BLOCK=triton.next_power_of_2(inter))
    return out


@triton.jit
def _qk_norm_rope_kernel(
    qkv_ptr,  # [T, (H + 2*KVH) * D]: a row's q heads, then its k heads, then its v heads
    q_norm_ptr, k_norm_ptr,  # [D] each
    cos_ptr, sin_ptr,  # [T, D] contiguous, HF's layout (the two halves duplicated)
    q_ptr, k_ptr, v_ptr,  # [T, H, D], [T, KVH, D], [T, KVH, D], contiguous
    stride_qkv,
    H, KVH,
    eps,
    D: tl.constexpr,
    HALF: tl.constexpr,  # D / 2, a power of two
):
    """One program per (row, head): a q or k head RMS-normed with its weight and rotated, in fp32, rounded
    once; a v head copied."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    lo = tl.arange(0, HALF)
    source = qkv_ptr + row * stride_qkv + head * D
    x1 = tl.load(source + lo).to(tl.float32)  # [HALF]: channels 0 .. D/2 - 1
    x2 = tl.load(source + HALF + lo).to(tl.float32)  # channels D/2 .. D - 1, which turn with them
    if head >= H + KVH:
        target = v_ptr + (row * KVH + head - H - KVH) * D
        tl.store(target + lo, x1.to(v_ptr.dtype.element_ty))
        tl.store(target + HALF + lo, x2.to(v_ptr.dtype.element_ty))
    else:
        is_q = head < H
        w1 = tl.where(is_q, tl.load(q_norm_ptr + lo), tl.load(k_norm_ptr + lo)).to(tl.float32)
        w2 = tl.where(is_q, tl.load(q_norm_ptr + HALF + lo), tl.load(k_norm_ptr + HALF + lo)).to(tl.float32)
        scale = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D + eps)
        n1, n2 = x1 * scale * w1, x2 * scale * w2
        c1 = tl.load(cos_ptr + row * D + lo).to(tl.float32)
        c2 = tl.load(cos_ptr + row * D + HALF + lo).to(tl.float32)
        s1 = tl.load(sin_ptr + row * D + lo).to(tl.float32)
        s2 = tl.load(sin_ptr + row * D + HALF + lo).to(tl.float32)
        r1, r2 = n1 * c1 - n2 * s1, n2 * c2 + n1 * s2  # x * cos + rotate_half(x) * sin, half by half
        if is_q:
            target = q_ptr + (row * H + head) * D
            tl.store(target + lo, r1.to(q_ptr.dtype.element_ty))
            tl.store(target + HALF + lo, r2.to(q_ptr.dtype.element_ty))
        else:
            target = k_ptr + (row * KVH + head - H) * D
            tl.store(target + lo, r1.to(k_ptr.dtype.element_ty))
            tl.store(target + HALF + lo, r2.to(k_ptr.dtype.element_ty))


def _qk_norm_rope(qkv: torch.Tensor, layer, cos: torch.Tensor, sin: torch.Tensor):
    """`(q [T, H, D], k [T, KVH, D], v [T, KVH, D])` from one row of `qkv` per token: m04's QK-norm and m03's
    RoPE in one kernel (fp32 inside, rounded once), v copied out. D / 2 must be a power of two."""
    T, H, KVH, D = qkv.shape[0], layer.num_heads, layer.num_kv_heads, layer.head_dim
    q = torch.empty(T, H, D, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(T, KVH, D, dtype=qkv.dtype, device=qkv.device)
    v = torch.empty(T, KVH, D, dtype=qkv.dtype, device=qkv.device)
    if T:
        _qk_norm_rope_kernel[(T, H + 2 * KVH)](qkv, layer.q_norm, layer.k_norm, cos, sin, q, k, v, qkv.stride(0), H,
                                               KVH, layer.eps, D=D, HALF=D // 2)
    return q, k, v


@triton.jit
def _race_kernel(
    logits_ptr,  # [B, V] fp32, rows stride_logits apart
    noise_ptr,  # [B, V] fp32 Exp(1) draws, rows stride_noise apart
    temperature_ptr,  # [B] fp32; 0: greedy
    tokens_ptr,  # [B] int64
    V, stride_logits, stride_noise,
    BLOCK: tl.constexpr,
):
    """One program per row, one pass over it: the exponential race `argmax(softmax(l / t) / noise)`, taken as
    `argmax(l / t - log(noise))` (the softmax's sum is the same for every token of the row), or the argmax of
    the logits where t is 0; the first index wins a tie, as torch's argmax."""
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(temperature_ptr + row)
    greedy = t <= 0
    scale = 1.0 / tl.where(greedy, 1.0, t)
    best = tl.full([BLOCK], float("-inf"), tl.float32)  # each lane's best score so far, and where it was
    at = tl.zeros([BLOCK], tl.int64)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < V
        logit = tl.load(logits_ptr + row * stride_logits + cols, mask=mask, other=float("-inf"))
        noise = tl.load(noise_ptr + row * stride_noise + cols, mask=mask, other=1.0)
        score = tl.where(greedy, logit, logit * scale - tl.log(noise))
        better = mask & (score > best)  # a later column takes a lane only when strictly better
        best = tl.where(better, score, best)
        at = tl.where(better, cols, at)
    top = tl.max(best, axis=0)
    tl.store(tokens_ptr + row, tl.min(tl.where(best == top, at, V), axis=0))


def _race(logits: torch.Tensor, noise: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """`[B]` int64: p06's draw for rows without top-k or top-p (`sample(probabilities(...), noise)`, the argmax
    where the temperature is 0) in one kernel that reads each row once."""
    B, V = logits.shape
    tokens = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B:
        _race_kernel[(B,)](logits, noise, temperature, tokens, V, logits.stride(0), noise.stride(0), BLOCK=1024)
    return tokens


# ---- the overlapped engine ---------------------------------------------------------------------------------


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
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        for prompt, p in zip(prompts, params):  # refuse before anything is queued
            if len(prompt) + p.max_tokens > self.config.max_model_len:
                raise ValueError(f"a prompt of {len(prompt)} tokens and max_tokens {p.max_tokens} exceed "
                                 f"max_model_len {self.config.max_model_len}")
        requests = [self.add_request(prompt, p) for prompt, p in zip(prompts, params)]
        while not self.scheduler.is_finished() or self.in_flight is not None:
            self.step()
        for request in requests:
            self._params.pop(request.request_id)
            self._generators.pop(request.request_id, None)
        return [list(request.completion_token_ids) for request in requests]

    def step(self) -> list:
        """Schedule and launch step n+1, then resolve step n (the one in flight). Returns the requests that
        finished in this call, their last token applied.

        When the next step might preempt (fewer free blocks than the running requests could open), step n
        is resolved first, and the next step is scheduled after it, as p06 does."""
        finished = []
        if self.in_flight is not None and self._may_preempt():
            finished += self._resolve(self.in_flight, None)
            self.in_flight = None
            self.stats["waits"] += 1
        running_before = {id(r) for r in self.scheduler.running}
        requests, is_prefill = self.scheduler.schedule()
        self.stats["preemptions"] += sum(id(r) in running_before for r in self.scheduler.waiting)
        if not requests and self.in_flight is None and not finished:
            raise RuntimeError("the scheduler returned an empty step while requests remain")
        launched = self._launch(requests, is_prefill) if requests else None
        if self.in_flight is not None:
            finished += self._resolve(self.in_flight, launched)
        self.in_flight = launched
        return finished

    def _may_preempt(self) -> bool:
        manager, size = self.scheduler.block_manager, self.scheduler.block_manager.block_size
        decoded = list(self.scheduler.running)[: self.scheduler.max_num_seqs]
        opening = sum((len(r) - 1) % size == 0 for r in decoded)  # their next slot opens a new block
        return opening > len(manager.free_block_ids)

    def _launch(self, requests: list, is_prefill: bool) -> Launched:
        """Run the step and draw its tokens without waiting for them; give each drawing row a placeholder."""
        previous = self.in_flight
        if is_prefill:
            self.stats["prefill_steps"] += 1
            self.stats["cached_tokens"] += sum(r.num_cached_tokens for r in requests
                                               if r.num_computed_tokens == r.num_cached_tokens)
            self.stats["chunked_prefills"] += any(
                r.num_computed_tokens + r.num_scheduled_tokens < len(r) for r in requests)
            logits = self.runner.prefill(requests)  # a prompt holds no placeholder: its tokens are on the host
            drawn = None
        else:
            self.stats["decode_steps"] += 1
            logits, drawn = self._decode(requests, None if previous is None else previous.tokens)
        sampled = [r.num_computed_tokens + r.num_scheduled_tokens == len(r) for r in requests]
        rows = [b for b, s in enumerate(sampled) if s]
        if drawn is None and rows:
            drawn = self._sample(logits[rows], [requests[b] for b in rows])  # p06's sampler, on the device
        if len(rows) == len(requests):  # every row draws (a decode step always): no index to send
            tokens = drawn
        else:
            tokens = torch.full((len(requests),), -1, dtype=torch.int64, device=logits.device)
            if rows:
                tokens[torch.tensor(rows).to(logits.device, non_blocking=True)] = drawn
        positions = []
        for b, request in enumerate(requests):  # the host's part of postprocess: it needs no token
            request.num_computed_tokens += request.num_scheduled_tokens
            request.num_scheduled_tokens = 0
            positions.append(len(request) if sampled[b] else -1)
            if sampled[b]:
                request.token_ids.append(-1 - b)  # step n's row b: read on the device by the next decode
        launched = Launched(list(requests), [r.request_id for r in requests], sampled, positions, tokens, is_prefill)
        if tokens.is_cuda:  # the copy the host waits for, queued now: behind this step, ahead of the next
            launched.host_tokens = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            launched.host_tokens.copy_(tokens, non_blocking=True)
            launched.ready = torch.cuda.Event()
            launched.ready.record()
        return launched

    def _resolve(self, step: Launched, following: Launched | None) -> list:
        """Wait for `step`'s tokens and apply them; free what no launched step reads any more."""
        if step.ready is not None:  # the one synchronisation with the device: this step's tokens, copied
            step.ready.synchronize()
            tokens = step.host_tokens.tolist()
        else:
            tokens = step.tokens.tolist()
        manager, eos = self.scheduler.block_manager, self.scheduler.eos_token_id
        finished = []
        for b, request in enumerate(step.requests):
            if not step.sampled[b] or request.status == FINISHED:
                continue  # a chunk's row, or the wasted row of a request that finished a step ago
            token, position = tokens[b], step.positions[b]
            request.token_ids[position] = token
            self._reseal(request, position)
            self.stats["tokens_out"] += 1
            count = position + 1 - request.num_prompt_tokens
            if (not request.ignore_eos and token == eos) or count >= request.max_tokens:
                request.status = FINISHED
                del request.token_ids[position + 1 :]  # the next step's placeholder: never emitted
                self.scheduler.running.remove(request)
                if following is not None and any(r is request for r in following.requests):
                    following.free_after.append(request)  # the step in flight still reads its blocks
                else:
                    manager.free(request)
                finished.append(request)
        for request in step.free_after:
            manager.free(request)
        return finished

    def _reseal(self, request, position: int) -> None:
        """The placeholder at `position` filled its block and the manager hashed it as it was: hash it again
        with the real token, so the prefix cache can serve it."""
        manager = self.scheduler.block_manager
        size, j = manager.block_size, position // manager.block_size
        if (position + 1) % size or j >= len(request.block_table):
            return  # not the last slot of a block, or no slot yet: nothing was hashed with the placeholder
        block = manager.blocks[request.block_table[j]]
        if block.hash == -1:
            return
        if manager.hash_to_block_id.get(block.hash) == block.block_id:
            del manager.hash_to_block_id[block.hash]
        prefix_hash = manager.blocks[request.block_table[j - 1]].hash if j > 0 else -1
        tokens = request.block(j)
        block.hash, block.token_ids = manager.hash_block(tokens, prefix_hash), list(tokens)
        manager.hash_to_block_id[block.hash] = block.block_id

    def _decode(self, requests: list, previous: torch.Tensor | None):
        """One decode step, its input tokens read on the device where the host holds a placeholder:
        `(logits [B, V] float32, tokens [B] int64 or None)`. A recorded graph of some size >= B replays the
        step with its draw (tokens); eager, or when a row asks for top-k or top-p, the caller draws."""
        meta = decode_metadata(requests)
        B = len(requests)
        size = next((s for s in sorted(self.graphs) if s >= B), None)
        device = self.runner.k_caches.device
        if size is None:  # eager
            meta = meta._replace(**{name: value.to(device, non_blocking=True)
                                    for name, value in meta._asdict().items()})
            ids = meta.input_ids  # [B]: a placeholder -1 - b stands for row b of the step before
            if previous is not None:
                ids = torch.where(ids < 0, previous[(-1 - ids).clamp(min=0)], ids)
            return self._decode_logits(ids, meta.positions, meta.slot_mapping, meta.block_tables,
                                       meta.context_lens), None
        buffers, width = self._buffers, meta.block_tables.shape[1]
        params = [self._params[r.request_id] for r in requests]
        plain = all(int(p.top_k) == 0 and float(p.top_p) >= 1 for p in params)  # the graph draws without masks
        temperature = [float(p.temperature) for p in params]
        # Host -> device through pinned memory: a copy from pageable memory may wait for the device to reach it,
        # which would hold the host until step n is done. Two staging sets, used in turn: the one written now was
        # last copied from before the step being resolved, so the device is done with it.
        staging, self._staging = self._staging[0], self._staging[::-1]
        inputs = {"input_ids": meta.input_ids, "positions": meta.positions, "slot_mapping": meta.slot_mapping,
                  "context_lens": meta.context_lens, "temperature": torch.tensor(temperature)}
        for name, value in inputs.items():
            buffers[name][:B].copy_(staging[name][:B].copy_(value), non_blocking=True)
        tables = staging["block_tables"][:B, :width].copy_(meta.block_tables)
        buffers["block_tables"][:B, :width].copy_(tables, non_blocking=True)
        buffers["slot_mapping"][B:size].fill_(-1)  # padding rows store nothing ...
        buffers["context_lens"][B:size].zero_()  # ... and read nothing
        if previous is not None:
            buffers["previous"][: len(previous)].copy_(previous)
        if plain and any(t > 0 for t in temperature):  # p06's draws: the shared generator's [B, V], then own rows
            noise = buffers["noise"][:B].exponential_(generator=self.generator)
            for b, request in enumerate(requests):
                own = self._generators.get(request.request_id)
                if own is not None:
                    noise[b].exponential_(generator=own)
        self.graphs[size].replay()
        logits = self._graph_logits[size][:B]
        # (`tokens` may stay a view of the graph's output: the copies that read it, the host's and the next step's
        # `previous`, are queued before the next replay writes it again)
        return logits, self._graph_tokens[size][:B] if plain else None

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
        device, n = self.runner.k_caches.device, max_num_seqs
        vocab = self.model.embed_tokens.shape[0]
        buffers = self._buffers = {
            "input_ids": torch.zeros(n, dtype=torch.int64, device=device),
            "previous": torch.zeros(n, dtype=torch.int64, device=device),
            "positions": torch.zeros(n, dtype=torch.int64, device=device),
            "slot_mapping": torch.full((n,), -1, dtype=torch.int32, device=device),
            "context_lens": torch.zeros(n, dtype=torch.int32, device=device),
            "block_tables": torch.full((n, max_blocks), -1, dtype=torch.int32, device=device),
            "temperature": torch.zeros(n, dtype=torch.float32, device=device),
            "noise": torch.ones(n, vocab, dtype=torch.float32, device=device),
        }
        self._staging = [{name: torch.empty(buffers[name].shape, dtype=buffers[name].dtype).pin_memory()
                          for name in ("input_ids", "positions", "slot_mapping", "context_lens", "block_tables",
                                       "temperature")} for _ in range(2)]  # host copies in pinned memory, in turn
        self._graph_logits, self._graph_tokens = {}, {}
        sizes = sorted({s for s in (1, 2, 4, 8) if s < n} | set(range(16, n, 16)) | {n}, reverse=True)
        num_blocks, block_size = self.runner.k_caches.shape[1:3]
        pool = None
        for size in sizes:  # the largest first: the smaller ones reuse its memory
            context = max(1, min(max_blocks * block_size, (1 << 16) // size))  # keys per row in the warm-up
            width = -(-context // block_size)
            buffers["context_lens"][:size].fill_(context)
            blocks = torch.arange(size * width, device=device).view(size, width) % num_blocks  # distinct per row
            buffers["block_tables"][:size, :width] = blocks
            self._graph_step(size)  # slots -1: compiles and tunes the kernels on real reads, stores nothing
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._graph_logits[size], self._graph_tokens[size] = self._graph_step(size)
            pool = graph.pool() if pool is None else pool
            self.graphs[size] = graph
        buffers["context_lens"].zero_()
        buffers["block_tables"].fill_(-1)
        torch.cuda.synchronize()

    def _graph_step(self, size: int):
        """The recorded step on the first `size` rows of the buffers: `(logits [size, V], tokens [size])`."""
        buffers = {name: value[:size] for name, value in self._buffers.items()}
        ids = buffers["input_ids"]  # [size]: a placeholder -1 - b reads row b of `previous`
        ids = torch.where(ids < 0, self._buffers["previous"][(-1 - ids).clamp(min=0)], ids)
        logits = self._decode_logits(ids, buffers["positions"], buffers["slot_mapping"], buffers["block_tables"],
                                     buffers["context_lens"])
        return logits, _race(logits, buffers["noise"], buffers["temperature"])

    def _decode_logits(self, input_ids, positions, slot_mapping, block_tables, context_lens) -> torch.Tensor:
        """The layers of a decode step with the fused kernels; the residual stream is carried, so each add
        is fused into the norm that follows it (the last into the final norm). `[B, V]` float32."""
        model, runner = self.model, self.runner
        cos, sin = rope_cos_sin(positions, runner.inv_freq, model.embed_tokens.dtype)  # [B, D] each
        hidden = model.embed_tokens[input_ids]  # [B, hidden]
        residual = None
        for index, layer in enumerate(model.layers):
            B, H, KVH, D = hidden.shape[0], layer.num_heads, layer.num_kv_heads, layer.head_dim
            if residual is None:
                residual, normed = hidden, rms_norm(hidden, layer.input_layernorm, layer.eps)
            else:
                normed = fused_add_rms_norm(hidden, residual, layer.input_layernorm, layer.eps)
            if (D // 2) & (D // 2 - 1) == 0:  # one projection, then one kernel for the QK-norm and RoPE
                q, k, v = _qk_norm_rope(normed @ self.qkv[index].T, layer, cos, sin)  # [B, (H + 2*KVH)*D] -> ...
            else:
                q = rms_norm((normed @ layer.q_proj.T).view(B, H, D), layer.q_norm, layer.eps)  # [B, H, D]
                k = rms_norm((normed @ layer.k_proj.T).view(B, KVH, D), layer.k_norm, layer.eps)  # [B, KVH, D]
                v = (normed @ layer.v_proj.T).view(B, KVH, D)
                q, k = apply_rope(q, k, cos, sin)
            store_kvcache(k, v, runner.k_caches[index], runner.v_caches[index], slot_mapping)
            attended = paged_decode(q, runner.k_caches[index], runner.v_caches[index], block_tables, context_lens)
            hidden = attended.reshape(B, -1) @ layer.o_proj.T  # [B, H*D] -> [B, hidden]
            normed = fused_add_rms_norm(hidden, residual, layer.post_attention_layernorm, layer.eps)
            hidden = fused_silu_mul(normed @ self.gate_up[index].T) @ layer.down_proj.T  # [B, 2I] -> [B, hidden]
        normed = fused_add_rms_norm(hidden, residual, model.norm, model.eps)
        return (normed @ model.embed_tokens.T).float()  # [B, V]
