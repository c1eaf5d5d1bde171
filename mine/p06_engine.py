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

With `tensor_parallel_size` > 1 (after p07), the engine serves one model from several ranks: each holds
its p07 shard, rank 0 schedules and samples, and every step's batch runs on every rank at once, the
ranks' partial sums meeting in p07's collectives.

Ideas from: nano-vllm (`nanovllm/engine/llm_engine.py`, `model_runner.py`, `layers/sampler.py`); Yu et
al., "Orca: a distributed serving system for Transformer-based generative models" (continuous batching,
OSDI 2022); Kwon et al., "Efficient Memory Management for LLM Serving with PagedAttention" (2023).

Names: B sequences in a step, V vocabulary size, L layers, H / KVH / D as before, block_size slots per
cache block.

Run `./check.sh p06` to check this file.
"""

import atexit
import ctypes
import math
import os
import re
import signal
import socket
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import torch
import torch.distributed as dist

# Your own modules, from this folder (the stub keeps these imports for you, hence the noqa).
from .m01_rmsnorm import add_rms_norm, rms_norm  # noqa: F401
from .m03_rope import apply_rope, inverse_frequencies, rope_cos_sin  # noqa: F401
from .m04_qwen3_model import Qwen3Layer, Qwen3Weights, load_pretrained, mlp_forward  # noqa: F401
from .p01_block_manager import Sequence, decode_metadata, prefill_metadata  # noqa: F401
from .p02_store_kvcache import store_kvcache  # noqa: F401
from .p03_flash_attention import flash_attn_varlen  # noqa: F401
from .p04_paged_decode import paged_decode, paged_prefill  # noqa: F401
from .p05_scheduler import Request, Scheduler  # noqa: F401
from .p07_tensor_parallel import parallel_lm_head, shard_model, vocab_parallel_embedding  # noqa: F401


@dataclass
class SamplingParams:
    """How one request is sampled (given complete). The engine reads these attributes from any object.

    `temperature` 0 is greedy (the argmax); otherwise the logits are divided by it. `top_k` > 0 keeps
    the tokens whose logit is at least the k-th largest (ties at the k-th value all stay; 0, or k >= V: all). `top_p` < 1 keeps the fewest most likely tokens whose
    probabilities reach p. `max_tokens` completion tokens at most; the request also stops at the
    engine's `eos_token_id` unless `ignore_eos`. `seed`: a request with a seed draws from its own
    generator, so its tokens do not depend on what else is in the batch (one object given for several
    prompts: each of those requests has a generator of its own).
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
    `tensor_parallel_size` ranks serve the model (see `TensorParallel`); tp must divide the heads, the kv
    heads, the MLP's features and the vocabulary.
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
    tensor_parallel_size: int = 1


def probabilities(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor) -> torch.Tensor:
    """Each row's sampling distribution, with the top-k and top-p masks applied.

    Args:
        logits: `[B, V]`, any float dtype. Not modified.
        temperature: `[B]` float; 0 means greedy.
        top_k: `[B]` int; 0 keeps every token, k > 0 keeps the tokens whose logit is at least the k-th
            largest (ties at that value are kept; k >= V keeps every token).
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
    and output buffers; `tensor_parallel_size`.

    With `tensor_parallel_size` > 1 the runner is one rank's (p07): `model` is the rank's shard, as m04
    weights with the rank's heads (`rank_weights`), so the caches hold its KVH / tp kv heads, and the
    forward makes p07's collectives: `vocab_parallel_embedding` for the embedding, one `all_reduce` of
    o_proj's output and one of down_proj's in every layer, and `parallel_lm_head` for the logits, which
    only rank 0 gets: `prefill` and `decode` return None on the other ranks. Every rank runs the same
    calls on the same requests.
    """

    def __init__(self, model, num_blocks: int, block_size: int, max_num_seqs: int = 64,
                 max_model_len: int = 4096, cuda_graphs: bool = True, compile_layers: bool = False,
                 tensor_parallel_size: int = 1) -> None:
        self.model = model
        self.tensor_parallel_size = tensor_parallel_size
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
            `[B, V]` float32 logits, row b for request b's last scheduled token (None on a rank other
            than 0).
        """
        raise NotImplementedError("ModelRunner.prefill (mine/p06_engine.py) is not written yet")

    def decode(self, requests: list) -> torch.Tensor:
        """One new token per request: its last token, whose slot `Scheduler.schedule` reserved. Build
        p01's decode metadata, store every layer's keys and values, attend with `paged_decode`. When
        `graphs` holds a graph for some batch size >= B (a GPU), copy the inputs into the graphs'
        buffers instead (padding rows: slot -1 and context length 0), replay the smallest such graph
        and read the first B rows of its output.

        Returns:
            `[B, V]` float32 logits (None on a rank other than 0).
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


def serves_on_gpus() -> bool:
    """Whether the engine's kernels run compiled on GPUs here: a GPU, and TRITON_INTERPRET unset (given complete)."""
    return torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"


def move_weights(model, device) -> None:
    """Move every tensor of `model` and of its layers to `device`, in place (given complete)."""
    for holder in (model, *model.layers):
        for name, value in vars(holder).items():
            if isinstance(value, torch.Tensor):
                setattr(holder, name, value.to(device))


def rank_weights(model, rank: int, world_size: int) -> Qwen3Weights:
    """Rank `rank`'s shard of `model` as m04 weights (given complete): your p07 `shard_model`, each layer's
    fused qkv split back into the rank's q, k and v rows and its gate_up into gate and up, so the runner's
    layers read a shard as they read a whole model. `embed_tokens` is the rank's vocabulary block
    `[V/tp, hidden]`; the layers' head counts are the rank's."""
    shard = shard_model(model, rank, world_size)
    layers = []
    for layer in shard.layers:
        q_rows, kv_rows = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
        q, k, v = torch.split(layer.qkv_proj, [q_rows, kv_rows, kv_rows])  # [Hr*D | KVHr*D | KVHr*D, hidden]
        gate, up = layer.gate_up_proj.chunk(2)  # [Ir, hidden] each
        layers.append(Qwen3Layer(q, k, v, layer.o_proj, layer.q_norm, layer.k_norm, layer.input_layernorm,
                                 layer.post_attention_layernorm, gate, up, layer.down_proj, layer.eps,
                                 layer.num_heads, layer.num_kv_heads, layer.head_dim))
    return Qwen3Weights(shard.embed_tokens, layers, shard.norm, shard.eps, shard.rope_theta, shard.head_dim)


class TensorParallel:
    """The ranks of a tensor-parallel engine, seen from rank 0 (given complete; `LLM` makes it).

    Ranks 1 .. tp-1 are processes of their own: forked on a CPU, so they start with the model's tensors
    (and this folder's code) as they are; started afresh where the ranks use GPUs, since CUDA cannot run
    in a forked process, importing this folder again and getting the model's tensors through shared
    memory. Either way the model must be on the CPU when the engine starts, and with GPUs rank r moves
    its own shard to GPU r. The ranks join one process group (NCCL on GPUs, gloo on CPUs, over the
    loopback device) and a gloo group for the calls. Each rank builds its shard with `rank_weights` (and says
    so, or why it cannot, before rank 0 waits for it to join) and a `ModelRunner` on it; rank 0's `prefill`
    and `decode` send the call and its requests to every rank, then run it on rank 0's shard. When a rank
    fails the engine ends, and rank 0 raises the error of the rank that failed first: an error in a rank's
    own code (the earliest), else a rank that died without a word (a crash), else an error in a collective,
    which only follows from another rank's failure; what rank 0 met then is the error's note.
    """

    GRACE = 1.0  # seconds the other ranks get to end by themselves when one fails
    OWN_CODE, DIED, IN_A_COLLECTIVE = 0, 1, 2  # how a rank failed, the likeliest first cause first

    class AnotherRankFailed(Exception):
        """Rank 0 stops because another rank failed: that rank's error is the one raised."""
    # What a freshly started rank runs: this folder as the same package, then the rank's life.
    STARTED_AFRESH = (
        "import importlib, sys, types\n"
        "sys.dont_write_bytecode = True\n"
        "package = types.ModuleType(PACKAGE)\n"
        "package.__path__ = [FOLDER]\n"
        "sys.modules[PACKAGE] = package\n"
        "engine = importlib.import_module(PACKAGE + '.p06_engine')\n"
        "engine.TensorParallel.serve_afresh(RANK, ADDRESS, MODEL, CONFIG, REPORT)\n"
    )

    def __init__(self, model, config) -> None:
        self.world_size, self.config = config.tensor_parallel_size, config
        if dist.is_initialized():
            raise ValueError("this process is in a process group already: close() the earlier tensor-parallel "
                             "engine first")
        if model.embed_tokens.is_cuda:
            raise ValueError("give a tensor-parallel engine its model on the CPU (a folder is loaded there): each "
                             "rank moves its own shard to its GPU")
        self.use_gpus = serves_on_gpus()
        if self.use_gpus and torch.cuda.device_count() < self.world_size:
            raise ValueError(f"tensor_parallel_size {self.world_size} needs a GPU per rank; this machine has "
                             f"{torch.cuda.device_count()}")
        shard = rank_weights(model, 0, self.world_size)  # rank 0's first: an unfinished p07 stops here
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            address = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
        start = torch.multiprocessing.get_context(self._start_method())
        self._ranks = []  # (process, the end of the pipe its error comes back on)
        for rank in range(1, self.world_size):
            reader, report = start.Pipe(duplex=False)
            if start.get_start_method() == "fork":
                target, args = self._serve, (rank, address, model, report)
            else:  # a fresh interpreter: the model as plain tensors, this folder imported again
                plain = {**vars(model), "layers": [vars(layer) for layer in model.layers]}
                target, args = exec, (self.STARTED_AFRESH, {
                    "PACKAGE": __package__, "FOLDER": os.path.dirname(os.path.abspath(__file__)), "RANK": rank,
                    "ADDRESS": address, "MODEL": plain, "CONFIG": dict(vars(config)), "REPORT": report})
            process = start.Process(target=target, args=args, daemon=True)
            process.start()
            report.close()
            self._ranks.append((process, reader))
        self._said: list[list] = [[] for _ in self._ranks]  # what each rank sent: None once sharded, or its failure
        self.closed = False
        try:
            self._wait_for_shards()  # a rank that cannot make its shard never joins: rank 0 must not wait for it
            self.runner = self._join(0, address, shard)
        except Exception as error:
            self._fail(error)
        self.num_blocks = self.runner.k_caches.shape[1]
        atexit.register(self.close)

    def prefill(self, requests: list) -> torch.Tensor:
        return self._run("prefill", requests)

    def decode(self, requests: list) -> torch.Tensor:
        return self._run("decode", requests)

    def close(self) -> None:
        """End every rank and leave the process groups (once; also at exit)."""
        if not self.closed:
            self.closed = True
            dist.broadcast_object_list([("close", None)], src=0, group=self.calls)
            self._end(kill=False)

    def _start_method(self) -> str:
        return "spawn" if self.use_gpus else "fork"

    def _run(self, kind: str, requests: list):
        if self.closed:
            raise RuntimeError("the tensor-parallel engine is closed")
        try:
            dist.broadcast_object_list([(kind, requests)], src=0, group=self.calls)
            return getattr(self.runner, kind)(requests)
        except Exception as error:
            self._fail(error)

    def _wait_for_shards(self) -> None:
        """Wait until every rank has made its shard; a rank that failed instead (or died) stops rank 0 here."""
        for index, (process, reader) in enumerate(self._ranks):
            while not self._read(index) and process.is_alive():
                time.sleep(0.01)
            if self._said[index][:1] != [None]:
                raise self.AnotherRankFailed()

    def _read(self, index: int) -> list:
        """What rank `index + 1` has sent so far (read from its pipe, kept in `_said`)."""
        process, reader = self._ranks[index]
        try:
            while reader.poll():
                self._said[index].append(reader.recv())
        except (EOFError, OSError):  # the rank has ended: nothing more will come
            pass
        return self._said[index]

    def _fail(self, error: Exception):
        """End every rank, then raise the error of the rank that failed first (rank 0's own included)."""
        self.closed = True
        failures = self._end(kill=True)
        if not isinstance(error, self.AnotherRankFailed):
            in_a_collective = "torch/distributed" in traceback.extract_tb(error.__traceback__)[-1].filename
            failures.append((self.IN_A_COLLECTIVE if in_a_collective else self.OWN_CODE, time.monotonic(), None))
        if not failures:  # a rank said nothing and ended well: rank 0's own error is all there is
            raise error
        _, _, first = min(failures, key=lambda failure: failure[:2])  # the likeliest cause, then the earliest
        if first is None:  # rank 0's own error says the most
            raise error
        raised = RuntimeError(first)
        if not isinstance(error, self.AnotherRankFailed):
            raised.add_note(f"then rank 0: {self._first_sentence(error)}")
        raise raised from None

    @staticmethod
    def _first_sentence(error: BaseException) -> str:
        """An error in a few words: its first sentence, without the C++ file a backend's message starts with."""
        line = (str(error).strip().splitlines() or [""])[0]
        line = re.sub(r"^\[[^\]]*\]\s*", "", line).split(". ")[0]
        return f"{type(error).__name__}: {line[:120]}"

    def _join(self, rank: int, address: str, shard) -> ModelRunner:
        """Join the process groups as `rank` and build the rank's runner on its shard."""
        config = self.config
        if self.use_gpus:
            torch.cuda.set_device(rank)
            move_weights(shard, torch.device("cuda", rank))
        else:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank is on this machine
        dist.init_process_group("nccl" if self.use_gpus else "gloo", init_method=address, rank=rank,
                                world_size=self.world_size, timeout=timedelta(minutes=10),
                                **({"device_id": torch.device("cuda", rank)} if self.use_gpus else {}))
        self.calls = dist.new_group(backend="gloo")
        blocks = torch.tensor([config.num_blocks or LLM._blocks_that_fit(shard, config)])
        dist.all_reduce(blocks, op=dist.ReduceOp.MIN, group=self.calls)  # a cache that fits on every rank
        return ModelRunner(shard, int(blocks), config.block_size, config.max_num_seqs, config.max_model_len,
                           config.cuda_graphs, getattr(config, "compile_layers", False), self.world_size)

    def _serve(self, rank: int, address: str, model, report) -> None:
        """A rank's life: join, then run rank 0's calls until it closes the engine."""
        try:
            torch.set_num_threads(1)  # a forked process has none of OpenMP's threads; one rank, one thread
            try:
                ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: end when rank 0's process does
            except (AttributeError, OSError):
                pass
            shard = rank_weights(model, rank, self.world_size)
            report.send(None)  # sharded: rank 0 may join now
            runner = self._join(rank, address, shard)
            while True:
                message = [None]
                dist.broadcast_object_list(message, src=0, group=self.calls)
                kind, requests = message[0]
                if kind == "close":
                    break
                getattr(runner, kind)(requests)
            dist.destroy_process_group()
        except BaseException as error:  # noqa: BLE001 - sent to rank 0, which raises it
            frame = traceback.extract_tb(error.__traceback__)[-1]
            where = f" ({os.path.basename(frame.filename)}, line {frame.lineno}, in {frame.name})"
            kind = self.IN_A_COLLECTIVE if "torch/distributed" in frame.filename else self.OWN_CODE
            report.send((kind, time.monotonic(), f"rank {rank}: {type(error).__name__}: {error}{where}"[:4000]))
            raise SystemExit(1) from None

    @classmethod
    def serve_afresh(cls, rank: int, address: str, model: dict, config: dict, report) -> None:
        """A freshly started rank (GPUs): the model and config back as objects, then `_serve`."""
        layers = [Qwen3Layer(**layer) for layer in model["layers"]]
        whole = Qwen3Weights(**{**model, "layers": layers})
        ranks = cls.__new__(cls)
        ranks.world_size, ranks.config = config["tensor_parallel_size"], SimpleNamespace(**config)
        ranks.use_gpus = serves_on_gpus()
        ranks._serve(rank, address, whole, report)

    def _end(self, kill: bool) -> list[tuple]:
        """Wait for every other rank to end (after `GRACE` seconds, end it, when `kill`) and leave the
        process groups; returns how each rank that failed did: (kind, when, its error in words)."""
        failures = []
        for index, (process, reader) in enumerate(self._ranks):
            process.join(self.GRACE if kill else 60.0)
            stopped = process.is_alive()  # still running: ended here, so not a failure of its own
            if stopped:
                process.kill()
                process.join()
            said = [message for message in self._read(index) if message is not None]
            reader.close()
            if said:
                failures.append(said[0])
            elif process.exitcode and not stopped:  # it died without a word: a crash, or an exit of its own
                failures.append((self.DIED, time.monotonic(), f"rank {index + 1} {self._ended(process.exitcode)}"))
        self._ranks = []
        if dist.is_initialized():
            dist.destroy_process_group()
        return failures

    @staticmethod
    def _ended(exitcode: int) -> str:
        """An exit code in words: `was killed by SIGSEGV (a crash in native code)`, `exited with status 3`."""
        if exitcode >= 0:
            return f"exited with status {exitcode}"
        name = signal.Signals(-exitcode).name
        crash = " (a crash in native code)" if name in ("SIGSEGV", "SIGBUS", "SIGABRT", "SIGILL", "SIGFPE") else ""
        return f"was killed by {name}{crash}"


class LLM:
    """The engine: a scheduler, a model runner and a sampler in a loop (write `generate` and `step`).

    The state (laid out by `__init__`): `config`; `model` (a `Qwen3Weights` or any object with its
    attributes); `scheduler`, your p05 `Scheduler` over `num_blocks` blocks; `runner`, a `ModelRunner`;
    `generator`, the draws of requests without a seed; `stats`, the counters `step` keeps:
    `prefill_steps`, `decode_steps`, `chunked_prefills` (prefill steps that computed part of a prompt),
    `cached_tokens` (prompt tokens the prefix cache served, counted for each request it served),
    `preemptions`, `tokens_out`.

    With `tensor_parallel_size` > 1, `runner` is a `TensorParallel`, which your `step` calls as it calls a
    `ModelRunner`; `close()` ends its ranks.
    """

    def __init__(self, model, config=None) -> None:
        self.config = config = config if config is not None else EngineConfig()
        tensor_parallel = getattr(config, "tensor_parallel_size", 1) > 1
        if isinstance(model, (str, Path)):
            model = load_pretrained(model)  # a local folder: never downloads; the tensors land on the CPU
            if serves_on_gpus() and not tensor_parallel:  # compiled kernels: serve there (ranks move their shards)
                move_weights(model, torch.device("cuda"))
        self.model = model
        if tensor_parallel:
            self.runner = TensorParallel(model, config)
            num_blocks, device = self.runner.num_blocks, self.runner.runner.k_caches.device
        else:
            num_blocks = config.num_blocks or self._blocks_that_fit(model, config)
            self.runner = ModelRunner(model, num_blocks, config.block_size, config.max_num_seqs, config.max_model_len,
                                      config.cuda_graphs, getattr(config, "compile_layers", False))
            device = model.embed_tokens.device
        self.scheduler = Scheduler(num_blocks, config.block_size, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.eos_token_id)
        self.generator = torch.Generator(device).manual_seed(0)
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
                (or a tuple) of them, one per prompt. Any list or tuple is read as one per prompt, so a
                params object must not itself be one (a namedtuple).

        Returns:
            `outputs[i]`: request i's sampled tokens (its stop token included when it stopped on one), one
            list per request even where two prompts are equal.
            A prompt longer than `max_model_len` with its `max_tokens`, one the cache cannot hold, or a
            list of params whose length is not the number of prompts raises ValueError before anything is queued.
        """
        raise NotImplementedError("LLM.generate (mine/p06_engine.py) is not written yet")

    def close(self) -> None:
        """End a tensor-parallel engine's ranks (given complete; nothing to do on one rank)."""
        if isinstance(self.runner, TensorParallel):
            self.runner.close()

    def step(self) -> list:
        """One step: schedule, run the model, sample, postprocess. Returns the requests that finished.

        Only a request whose prompt is complete after this step gets a draw (a chunk's token is thrown
        away by `postprocess`, so it takes nothing from the request's generator: a seeded request
        gives the same tokens however its prompt is chunked or batched). A step whose rows are all
        greedy takes the argmax and draws no noise."""
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
