"""P06 · The engine: your modules serving a batch of requests, as nano-vllm does.

Everything so far was a part; this file puts them to work. `LLM.generate` takes many prompts and runs
a loop of steps: your p05 `Scheduler` picks each step's batch, the model runner computes it on a paged
KV cache, and the sampler turns the last position's logits into each request's next token. The model
runner is Qwen3 again (m04), but batched and paged: p01's metadata says where every new token's keys
and values go, p02's `store_kvcache` writes them into one cache per layer, p03's `flash_attn_varlen`
attends over a prefill, p04's `paged_prefill` does so when part of a prompt is already in the cache
(a prefix hit or an earlier chunk), and p04's `paged_decode` reads the whole history of every sequence
for a decode step. The layers use your m01 norms, m03's RoPE and m04's MLP and weights.

On a GPU, a decode step is dozens of small kernel launches per layer; CPU time spent launching them
is a large part of a step for a small model. The runner records one decode step per batch size as a
CUDA graph and replays it: a batch pads to the next recorded size with slot -1 (nothing stored) and
context length 0 (nothing read). Prefill runs eagerly.

Ideas from: nano-vllm (`nanovllm/engine/llm_engine.py`, `model_runner.py`, `layers/sampler.py`); Yu et
al., "Orca: a distributed serving system for Transformer-based generative models" (continuous batching,
OSDI 2022); Kwon et al., "Efficient Memory Management for LLM Serving with PagedAttention" (2023).

Names: B sequences in a step, V vocabulary size, L layers, H / KVH / D as before, block_size slots per
cache block.

Run `./check.sh p06` to check this file.
"""

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

# Your own modules, from this folder (the stub keeps these imports for you, hence the noqa).
from .m01_rmsnorm import add_rms_norm, rms_norm  # noqa: F401
from .m03_rope import apply_rope, inverse_frequencies, rope_cos_sin  # noqa: F401
from .m04_qwen3_model import Qwen3Weights, load_pretrained, mlp_forward  # noqa: F401
from .p01_block_manager import Sequence, decode_metadata, prefill_metadata  # noqa: F401
from .p02_store_kvcache import store_kvcache  # noqa: F401
from .p03_flash_attention import flash_attn_varlen  # noqa: F401
from .p04_paged_decode import paged_decode, paged_prefill  # noqa: F401
from .p05_scheduler import Request, Scheduler  # noqa: F401


@dataclass
class SamplingParams:
    """How one request is sampled (given complete). The engine reads these attributes from any object.

    `temperature` 0 is greedy (the argmax); otherwise the logits are divided by it. `top_k` > 0 keeps
    the k most likely tokens (0: all). `top_p` < 1 keeps the fewest most likely tokens whose
    probabilities reach p. `max_tokens` completion tokens at most; the request also stops at the
    engine's `eos_token_id` unless `ignore_eos`. `seed`: a request with a seed draws from its own
    generator, so its tokens do not depend on what else is in the batch.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False
    seed: int | None = None


@dataclass
class EngineConfig:
    """The engine's limits (given complete). The engine reads these attributes from any object.

    `num_blocks` cache blocks of `block_size` slots; `None` on a GPU sizes the cache from
    `memory_fraction` of the memory free after loading the weights (and never more than
    `max_num_seqs` sequences of `max_model_len` tokens need). `max_num_batched_tokens` and
    `max_num_seqs` bound one step (p05). `eos_token_id` -1: no stop token. `cuda_graphs`: record
    decode steps on a GPU (ignored on a CPU). `compile_layers`: on a GPU, fuse each layer's steps around
    the attention (your norms, RoPE, MLP and residual adds) with `torch.compile`, as nano-vllm does; it
    costs a compilation when the engine starts, so the checks leave it off and the benchmark turns it on.
    """

    block_size: int = 16
    num_blocks: int | None = None
    memory_fraction: float = 0.8
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int = 4096
    eos_token_id: int = -1
    cuda_graphs: bool = True
    compile_layers: bool = False


def probabilities(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor) -> torch.Tensor:
    """Each row's sampling distribution, with the top-k and top-p masks applied.

    Args:
        logits: `[B, V]`, any float dtype. Not modified.
        temperature: `[B]` float; 0 means greedy.
        top_k: `[B]` int; 0 keeps every token, k > 0 keeps the tokens whose logit is at least the k-th
            largest (ties at that value are kept).
        top_p: `[B]` float in (0, 1]; keeps, in order of probability, every token whose predecessors'
            probabilities sum to less than p (so the kept set's sum first reaches p), computed on the
            distribution after top-k. 1 keeps every token.

    Returns:
        `[B, V]` float32: a greedy row is one-hot at its first argmax; any other row is
        `softmax(logits / temperature)` with masked tokens exactly 0, renormalised to sum to 1.
    """
    raise NotImplementedError("probabilities (mine/p06_engine.py) is not written yet")


def sample(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """One exact draw per row from `probs` with the exponential race: `argmax(probs / noise)`.

    Args:
        probs: `[B, V]` float32, rows summing to 1 (from `probabilities`). Not modified.
        noise: `[B, V]` float32, independent Exp(1) draws (`torch.empty(...).exponential_()`). Not modified.

    Returns:
        `[B]` int64. Token i wins with probability exactly `probs[i]`: `noise[i] / probs[i]` is an
        exponential of rate `probs[i]`, and the smallest of independent exponentials is i with
        probability proportional to its rate. A token of probability 0 never wins.
    """
    raise NotImplementedError("sample (mine/p06_engine.py) is not written yet")


class ModelRunner:
    """Qwen3 over a paged KV cache: one batched forward per step (write `prefill` and `decode`).

    The state (laid out by `__init__`): `model`; `k_caches`, `v_caches`: `[L, num_blocks, block_size,
    KVH, D]` in the model's dtype on its device, layer l's cache being `k_caches[l]`; `inv_freq`; and,
    on a GPU with `cuda_graphs`, the recorded decode graphs (`graphs`, by batch size) and their input
    and output buffers.
    """

    def __init__(self, model, num_blocks: int, block_size: int, max_num_seqs: int = 64,
                 max_model_len: int = 4096, cuda_graphs: bool = True, compile_layers: bool = False) -> None:
        self.model = model
        embed = model.embed_tokens
        first = model.layers[0]
        shape = (len(model.layers), num_blocks, block_size, first.num_kv_heads, model.head_dim)
        self.k_caches = torch.zeros(shape, dtype=embed.dtype, device=embed.device)
        self.v_caches = torch.zeros(shape, dtype=embed.dtype, device=embed.device)
        self.inv_freq = inverse_frequencies(model.head_dim, model.rope_theta).to(embed.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.compile_layers = compile_layers and embed.device.type == "cuda"  # the reference's `_forward` reads it
        if cuda_graphs and embed.device.type == "cuda":
            self.capture_decode_graphs(max_num_seqs, -(-max_model_len // block_size))

    def prefill(self, requests: list) -> torch.Tensor:
        """Compute the scheduled chunk of every request and return the logits of each chunk's last token.

        Request b's chunk is its tokens `num_computed_tokens .. num_computed_tokens +
        num_scheduled_tokens - 1`; the blocks are already allocated. Build p01's metadata for exactly
        those tokens (a `Sequence` holding the first `num_computed_tokens + num_scheduled_tokens`
        tokens, the request's block table, and `num_cached_tokens = num_computed_tokens`), store every
        layer's new keys and values, and attend with `flash_attn_varlen` when nothing is in the cache
        yet, or with `paged_prefill` through the block tables when something is.

        Returns:
            `[B, V]` float32 logits, row b for request b's last scheduled token.
        """
        raise NotImplementedError("ModelRunner.prefill (mine/p06_engine.py) is not written yet")

    def decode(self, requests: list) -> torch.Tensor:
        """One new token per request: its last token, whose slot `Scheduler.schedule` reserved. Build
        p01's decode metadata, store every layer's keys and values, attend with `paged_decode`. When
        `graphs` holds a graph for some batch size >= B (a GPU), copy the inputs into the graphs'
        buffers instead (padding rows: slot -1 and context length 0), replay the smallest such graph
        and read the first B rows of its output.

        Returns:
            `[B, V]` float32 logits.
        """
        raise NotImplementedError("ModelRunner.decode (mine/p06_engine.py) is not written yet")

    def capture_decode_graphs(self, max_num_seqs: int, max_blocks: int) -> None:
        """Record one decode step as a CUDA graph per batch size (GPU only; `__init__` calls it).

        Sizes 1, 2, 4, 8, then every multiple of 16, up to `max_num_seqs`, the largest first, all in one
        memory pool. The graphs read static input buffers (`input_ids`, `positions`, `slot_mapping`,
        `context_lens`, `block_tables [max_num_seqs, max_blocks]`) and write a static output; run each
        step once before recording it, so the kernels are compiled and tuned outside the recording. That
        warm-up step reads real keys (about 64k in all, through distinct blocks, storing nothing): the
        autotuner then times its configs on the reads a decode step makes, not on empty rows.
        Fills `graphs` (batch size -> graph) for `decode` to replay.
        """
        raise NotImplementedError("ModelRunner.capture_decode_graphs (mine/p06_engine.py) is not written yet")


class LLM:
    """The engine: a scheduler, a model runner and a sampler in a loop (write `generate` and `step`).

    The state (laid out by `__init__`): `config`; `model` (a `Qwen3Weights` or any object with its
    attributes); `scheduler`, your p05 `Scheduler` over `num_blocks` blocks; `runner`, a `ModelRunner`;
    `generator`, the draws of requests without a seed; `stats`, the counters `step` keeps:
    `prefill_steps`, `decode_steps`, `chunked_prefills` (prefill steps that computed part of a prompt),
    `cached_tokens` (prompt tokens the prefix cache served), `preemptions`, `tokens_out`.
    """

    def __init__(self, model, config=None) -> None:
        if isinstance(model, (str, Path)):
            model = load_pretrained(model)  # a local folder: never downloads; the tensors land on the CPU
            if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":  # compiled kernels: serve there
                for holder in (model, *model.layers):
                    for name, value in vars(holder).items():
                        if isinstance(value, torch.Tensor):
                            setattr(holder, name, value.cuda())
        self.config = config = config if config is not None else EngineConfig()
        self.model = model
        num_blocks = config.num_blocks or self._blocks_that_fit(model, config)
        self.scheduler = Scheduler(num_blocks, config.block_size, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.eos_token_id)
        self.runner = ModelRunner(model, num_blocks, config.block_size, config.max_num_seqs, config.max_model_len,
                                  config.cuda_graphs, getattr(config, "compile_layers", False))
        self.generator = torch.Generator(model.embed_tokens.device).manual_seed(0)
        self.stats = dict.fromkeys(("prefill_steps", "decode_steps", "chunked_prefills", "cached_tokens",
                                    "preemptions", "tokens_out"), 0)
        self._params: dict[int, object] = {}  # request id -> its SamplingParams
        self._generators: dict[int, torch.Generator] = {}  # request id -> its own, when it has a seed
        self._next_id = 0

    def generate(self, prompts: list[list[int]], sampling_params) -> list[list[int]]:
        """Serve every prompt and return each one's completion tokens, in the prompts' order.

        Args:
            prompts: token ids, one list per request (not modified).
            sampling_params: one object with `SamplingParams`' attributes for every request, or a list
                of them, one per prompt.

        Returns:
            `outputs[i]`: request i's sampled tokens (its stop token included when it stopped on one).
            A prompt longer than `max_model_len` with its `max_tokens`, or one the cache cannot hold,
            raises ValueError before anything runs.
        """
        raise NotImplementedError("LLM.generate (mine/p06_engine.py) is not written yet")

    def step(self) -> list:
        """One step: schedule, run the model, sample, postprocess. Returns the requests that finished.

        Only a request whose prompt is complete after this step gets a draw (a chunk's token is thrown
        away by `postprocess`, so it takes nothing from the request's generator: a seeded request
        gives the same tokens however its prompt is chunked or batched)."""
        raise NotImplementedError("LLM.step (mine/p06_engine.py) is not written yet")

    @staticmethod
    def _blocks_that_fit(model, config) -> int:
        """Cache blocks for `memory_fraction` of the free GPU memory, capped at what the limits can use."""
        embed = model.embed_tokens
        if embed.device.type != "cuda":
            raise ValueError("on a CPU, give EngineConfig.num_blocks")
        first = model.layers[0]
        per_slot = first.num_kv_heads * model.head_dim * embed.element_size()  # one token's K (or V) in one layer
        block_bytes = 2 * len(model.layers) * config.block_size * per_slot
        free, _ = torch.cuda.mem_get_info(embed.device)
        usable = int(free * config.memory_fraction) // block_bytes
        most = config.max_num_seqs * math.ceil(config.max_model_len / config.block_size)
        return max(1, min(usable, most))
