"""Checks for P09 · the overlapped engine and its fused kernels (mine/p09_overlap.py), on your m01-p06.

Oracles: Hugging Face's `Qwen3RMSNorm` and decoder-layer residual wiring, and SwiGLU's `silu(gate) * up`
by its definition, in float64 on the kernels' very inputs (a `Qwen3RMSNorm` of the fp32 sum: the fused
norm may normalise the unrounded sum, as nano-vllm's does); Hugging Face's `Qwen3ForCausalLM` in float64
for the engine's greedy tokens (the p06 checks' models and their near-tie rule); your own p06 engine
(`LLM`, in a fresh worker) for seeded sampled requests, whose tokens must not change when the host runs
a step ahead. The block-lifetime check drives the engine one `step` at a time and reads, after each, the
step in flight and the block manager: a request the step in flight computes must still hold its blocks,
a finished request that no launched step reads must hold none, and at the end every block is free.
The kernels run compiled on a GPU and in Triton's interpreter on a CPU.
"""

import pytest
import torch

from checks.harness.compare import Mismatch, expect_close, tolerance
from checks.harness.guard import Returns, Writes, snapshot_of
from checks.harness.interpreter import DEVICE, verified_on  # noqa: F401 - the report reads verified_on
from checks.harness.oracles import hf_decoder_add_norm
from checks.test_p06_engine import (
    ONE_HEAD,
    QWEN3,
    SHAPES,
    Config,
    Params,
    Run,
    counted,
    expect_count,
    expect_greedy,
    on_device,
    random_prompts,
    weights,
)

pytestmark = pytest.mark.p09

TOLERANCE_KIND = "fused"
# What `./check.sh grade` awards: a check's points, shared out over its cases (the module is worth 30).
POINTS = {
    "test_fused_add_rms_norm_matches_hf": 3,
    "test_fused_add_rms_norm_writes_the_residual_back": 3,
    "test_fused_silu_mul_matches_swiglu": 3,
    "test_greedy_matches_hf": 4,
    "test_chunked_prefill_and_preemption_keep_the_tokens": 3,
    "test_no_token_past_a_finished_request": 3,
    "test_prefix_cache_serves_generated_tokens": 3,
    "test_seeded_requests_match_the_synchronous_engine": 3,
    "test_blocks_outlive_the_steps_that_read_them": 3,
    "test_decode_graphs_keep_the_tokens": 2,
}
CONTRACTS = {
    "fused_add_rms_norm": lambda x, residual, weight, eps: Writes(residual),
    "fused_silu_mul": lambda gate_up: Returns((gate_up.shape[0], gate_up.shape[1] // 2), gate_up.dtype,
                                              gate_up.device, "[T, I] in gate_up's dtype"),
}
# Checks that name only some mistakes: each engine run replayed on a mutant runs a whole engine, so the heavier
# runs are replayed for the mistakes only they catch.
NAMED_BY = {
    "test_chunked_prefill_and_preemption_keep_the_tokens": lambda mistake_id: mistake_id == "no-wait-before-preemption",
    "test_prefix_cache_serves_generated_tokens": lambda mistake_id: mistake_id == "placeholder-block-not-rehashed",
    "test_seeded_requests_match_the_synchronous_engine": lambda mistake_id: False,
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
EPS = 1e-6
# (T, N): a width that is not a power of two (the kernel masks the lanes past it), and Qwen3-0.6B's hidden 1024
NORM_SHAPES = {"T5-N40": (5, 40), "T3-N1024": (3, 1024)}
# (T, I): an irregular width, and Qwen3-0.6B's intermediate 3072
MLP_SHAPES = {"T4-I24": (4, 24), "T3-I3072": (3, 3072)}
# The rule a check stands for (RULES in checks/mutants/p09_overlap.py); the counters say theirs (stats-count-once)
RULE_OF = {
    "test_fused_add_rms_norm_matches_hf": "fused-add-rms-norm",
    "test_fused_add_rms_norm_writes_the_residual_back": "fused-add-rms-norm",
    "test_fused_silu_mul_matches_swiglu": "fused-silu-mul",
    "test_greedy_matches_hf": "tokens-of-the-synchronous-engine",
    "test_chunked_prefill_and_preemption_keep_the_tokens": "tokens-of-the-synchronous-engine",
    "test_no_token_past_a_finished_request": "no-token-after-finish",
    "test_prefix_cache_serves_generated_tokens": "prefix-cache-sees-real-tokens",
    "test_seeded_requests_match_the_synchronous_engine": "tokens-of-the-synchronous-engine",
    "test_blocks_outlive_the_steps_that_read_them": "blocks-outlive-their-steps",
    "test_decode_graphs_keep_the_tokens": "tokens-of-the-synchronous-engine",
}


# ---- the fused kernels -------------------------------------------------------------------------------------


def norm_case(gen, shape: str, dtype: torch.dtype, strided: bool):
    """x [T, N] (a slice of a wider buffer when `strided`: rows farther apart than N), a residual of larger
    values, as a residual stream has, and a weight around 1."""
    T, N = NORM_SHAPES[shape]
    wide = torch.randn(T, N + (8 if strided else 0), generator=gen).to(dtype)
    x = wide[:, :N]
    residual = (3 * torch.randn(T, N, generator=gen)).to(dtype)
    weight = (1 + 0.5 * torch.randn(N, generator=gen)).to(dtype)
    return x, residual, weight


NORM_CASES = [(shape, dtype, strided) for shape in NORM_SHAPES for dtype in DTYPES for strided in (False, True)
              if not (strided and shape == "T3-N1024")]
NORM_IDS = [f"{s}-{d}{'-strided' if st else ''}" for s, d, st in NORM_CASES]


def call_norm(impl, x, residual, weight):
    """The learner's call on device copies; returns (normed, residual after the call) on the CPU."""
    residual_device = residual.clone().to(DEVICE)  # the call writes into it (the guard copies the worker's write back)
    normed = impl.fused_add_rms_norm(x.to(DEVICE), residual_device, weight.to(DEVICE), EPS)
    if not isinstance(normed, torch.Tensor):
        raise Mismatch(f"fused_add_rms_norm returned {type(normed).__name__}, expected the normed tensor [T, N]")
    if normed.dtype != x.dtype:
        raise Mismatch(f"fused_add_rms_norm returned {str(normed.dtype).removeprefix('torch.')}, expected x's dtype "
                       f"{str(x.dtype).removeprefix('torch.')}")
    return normed.cpu(), residual_device.cpu()


@pytest.mark.parametrize("shape, dtype, strided", NORM_CASES, ids=NORM_IDS)
def test_fused_add_rms_norm_matches_hf(impl, gen, shape, dtype, strided):
    """fused_add_rms_norm returns HF's RMSNorm of x + residual (Qwen3RMSNorm in float64 on the same inputs), for
    rows of an irregular width, of hidden 1024, and rows of a wider buffer"""
    dtype = DTYPES[dtype]
    x, residual, weight = norm_case(gen, shape, dtype, strided)
    expected, _ = hf_decoder_add_norm(x.double().contiguous(), residual.double(), weight.double(), EPS)
    normed, _ = call_norm(impl, x, residual, weight)
    expect_close(normed, expected, tolerance("fused", dtype), f"fused_add_rms_norm's output ({shape})")


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_writes_the_residual_back(impl, gen, dtype):
    """fused_add_rms_norm leaves x + residual in `residual` (in place: the next sub-layer adds to it), rounded to
    the residual's dtype"""
    dtype = DTYPES[dtype]
    x, residual, weight = norm_case(gen, "T5-N40", dtype, True)
    _, after = call_norm(impl, x, residual, weight)
    exact = x.double() + residual.double()
    if torch.equal(after, residual):
        raise Mismatch("fused_add_rms_norm left `residual` as it was: it must hold x + residual after the call (the "
                       "stream the next sub-layer adds to), written in place by the kernel")
    expect_close(after, exact, tolerance("fused", dtype), "`residual` after the call (x + residual)")


MLP_CASES = [(shape, dtype, strided) for shape in MLP_SHAPES for dtype in DTYPES for strided in (False, True)
             if not (strided and shape == "T3-I3072")]


@pytest.mark.parametrize("shape, dtype, strided", MLP_CASES,
                         ids=[f"{s}-{d}{'-strided' if st else ''}" for s, d, st in MLP_CASES])
def test_fused_silu_mul_matches_swiglu(impl, gen, shape, dtype, strided):
    """fused_silu_mul gives silu(gate) * up (m04's SwiGLU, float64) of each row's two halves, for an irregular
    width, Qwen3-0.6B's intermediate 3072, and rows of a wider buffer"""
    dtype = DTYPES[dtype]
    T, inter = MLP_SHAPES[shape]
    wide = (2 * torch.randn(T, 2 * inter + (6 if strided else 0), generator=gen)).to(dtype)
    gate_up = wide[:, : 2 * inter]
    gate, up = gate_up.double().chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up  # [T, I]
    out = impl.fused_silu_mul(gate_up.to(DEVICE))
    expect_close(out, expected, tolerance("fused", dtype), f"fused_silu_mul's output ({shape}: gate first, then up)")


# ---- the overlapped engine -----------------------------------------------------------------------------------


def overlap_engine(impl, run: Run, watch=None) -> Run:
    """The learner's OverlapLLM on `run`: its outputs' form checked, and no token past a request's end. `watch(llm)`
    runs before `generate` (to instrument the engine)."""
    llm = impl.OverlapLLM(on_device(run.w), run.config)
    if watch is not None:
        watch(llm)
    outputs = llm.generate([list(p) for p in run.prompts], list(run.params))
    if not isinstance(outputs, list) or len(outputs) != len(run.prompts):
        raise Mismatch(f"generate returned {type(outputs).__name__}, expected a list with one list of tokens per "
                       f"prompt ({counted(len(run.prompts), 'prompt')})")
    eos = run.config.eos_token_id
    for i, (out, p) in enumerate(zip(outputs, run.params)):
        if not isinstance(out, list) or not all(type(t) is int for t in out):
            raise Mismatch(f"outputs[{i}] is {type(out).__name__} {str(out)[:40]}, expected a list of ints")
        if any(t < 0 for t in out):
            raise Mismatch(f"request {i}'s tokens {out} hold {min(out)}: a placeholder was emitted instead of the "
                           f"token it stood for")
        stops = [n for n, t in enumerate(out) if eos >= 0 and not p.ignore_eos and t == eos]
        if stops and stops[0] < len(out) - 1:
            raise Mismatch(f"request {i} gave {out}: {counted(len(out) - stops[0] - 1, 'token')} after its stop token "
                           f"{eos} (the token of a step scheduled before the stop was known must be thrown away)")
        if len(out) > p.max_tokens:
            raise Mismatch(f"request {i} gave {counted(len(out), 'token')}, more than its max_tokens {p.max_tokens}: "
                           f"the token of the step scheduled after its last one must be thrown away")
        if len(out) < p.max_tokens and not stops:
            raise Mismatch(f"request {i} has {counted(len(out), 'token')}, expected {p.max_tokens} (its max_tokens; "
                           f"no stop token met)")
    run.outputs, run.stats = outputs, dict(llm.stats)
    return run


GREEDY_LAYOUT = "L2-H2-KVH1-D16"
# layout -> (prompt lengths, new tokens, config): a batch of three on the small model, and Qwen3-0.6B's widths
# (hidden 1024, intermediate 3072, 16 heads on 8 kv heads, head_dim 128) in one layer on blocks of 256
GREEDY_RUNS = {GREEDY_LAYOUT: ((5, 13, 8), 4, Config()),
               QWEN3: ((6,), 3, Config(block_size=256, num_blocks=2, max_model_len=512))}


@pytest.mark.parametrize("layout", GREEDY_RUNS)
def test_greedy_matches_hf(impl, seed, layout):
    """greedy tokens of a batch of prompts of different lengths are HF's, with one prefill step and one decode
    step per further token (and at most one more, whose rows are all thrown away)"""
    lengths, new_tokens, config = GREEDY_RUNS[layout]
    gen = torch.Generator().manual_seed(seed)
    prompts = random_prompts(gen, SHAPES[layout][0], lengths)
    run = overlap_engine(impl, Run(weights(seed, layout), prompts, [Params(max_tokens=new_tokens)] * len(lengths),
                                   config))
    expect_greedy(run, seed, layout, "greedy batch, overlapped")
    expect_count(run, "decode_steps", lambda n: n in (new_tokens - 1, new_tokens),
                 f"{new_tokens - 1} or {new_tokens}: one per further token, and at most one step whose rows are all "
                 f"thrown away")


def test_chunked_prefill_and_preemption_keep_the_tokens(impl, seed):
    """a token budget of 5 (prompts chunked) and then a cache of 6 blocks (requests preempted): HF's tokens"""
    gen = torch.Generator().manual_seed(seed)
    prompts = random_prompts(gen, SHAPES[ONE_HEAD][0], (11, 6, 4))
    chunked = overlap_engine(impl, Run(weights(seed, ONE_HEAD), prompts, [Params(max_tokens=4)] * 3,
                                       Config(max_num_batched_tokens=5)))
    expect_greedy(chunked, seed, ONE_HEAD, "chunked prefill (budget 5), overlapped")
    expect_count(chunked, "chunked_prefills", lambda n: n >= 2, "at least 2: an 11-token prompt under a budget of 5")
    seen = []  # (the preempted request's id, the ids the step in flight reads), at each Scheduler.preempt call

    def watch(llm):
        def preempting(args, in_flight):
            reading = snapshot_of(in_flight, "request_ids", []) if in_flight is not None else []
            seen.append((snapshot_of(args[0], "request_id") if args else None, list(reading)))

        impl.spy(llm.scheduler, "preempt", preempting, llm, "in_flight")

    preempted = overlap_engine(impl, Run(weights(seed, ONE_HEAD), random_prompts(gen, 64, (5, 6, 7)),
                                         [Params(max_tokens=7)] * 3, Config(num_blocks=6)), watch)
    expect_greedy(preempted, seed, ONE_HEAD, "with preemption, overlapped")
    expect_count(preempted, "preemptions", lambda n: n >= 1, "at least 1: three requests needing 3 to 4 blocks each "
                 "share 6 blocks")
    if not seen:
        raise Mismatch("stats counted preemptions, but Scheduler.preempt was never called: the engine's scheduler "
                       "(your p05) sends a request back through preempt, which frees its blocks")
    for request_id, reading in seen:
        if request_id in reading:
            raise Mismatch(f"request {request_id} was preempted (its blocks freed) while the step in flight, which "
                           f"reads requests {reading}, was not resolved yet: the device may still be reading those "
                           f"blocks. When the next decode may preempt, resolve the step in flight first (a wait, "
                           f"stats['waits']), and set in_flight to None")


def test_no_token_past_a_finished_request(impl, seed):
    """a request that meets its stop token while the next step is already scheduled emits nothing after it; the
    requests batched with it go on with HF's tokens"""
    gen = torch.Generator().manual_seed(seed)
    prompts = random_prompts(gen, SHAPES[GREEDY_LAYOUT][0], (7, 5))
    probe = overlap_engine(impl, Run(weights(seed, GREEDY_LAYOUT), prompts[:1], [Params(max_tokens=6)], Config()))
    expect_greedy(probe, seed, GREEDY_LAYOUT, "greedy run, overlapped")
    eos = probe.outputs[0][2]
    stop_at = probe.outputs[0].index(eos)
    run = overlap_engine(impl, Run(probe.w, [prompts[0], prompts[1], prompts[0]],
                                   [Params(max_tokens=6, ignore_eos=False), Params(max_tokens=6),
                                    Params(max_tokens=6)], Config(eos_token_id=eos)))
    if run.outputs[0] != probe.outputs[0][: stop_at + 1]:
        raise Mismatch(f"with eos_token_id {eos}, the request gave {run.outputs[0]}, expected "
                       f"{probe.outputs[0][: stop_at + 1]} (it stops after emitting the stop token)")
    if run.outputs[2] != probe.outputs[0]:
        raise Mismatch(f"with ignore_eos the same prompt gave {run.outputs[2]}, expected all 6 tokens "
                       f"{probe.outputs[0]}")
    expect_greedy(run, seed, GREEDY_LAYOUT, "a batch with a stop token, overlapped")


def test_prefix_cache_serves_generated_tokens(impl, seed):
    """a later prompt made of an earlier request's prompt and generated tokens finds them in the prefix cache: the
    blocks a step filled with tokens still unknown to the host are hashed with the real tokens once they arrive"""
    gen = torch.Generator().manual_seed(seed)
    prompt = random_prompts(gen, SHAPES[GREEDY_LAYOUT][0], (6,))[0]
    w = weights(seed, GREEDY_LAYOUT)
    llm = impl.OverlapLLM(on_device(w), Config())
    first = Run(w, [prompt], [Params(max_tokens=7)], Config())
    first.outputs = llm.generate([list(prompt)], [Params(max_tokens=7)])
    expect_greedy(first, seed, GREEDY_LAYOUT, "the first request, overlapped")
    later = prompt + first.outputs[0][:6] + random_prompts(gen, SHAPES[GREEDY_LAYOUT][0], (2,))[0]  # 14 tokens
    again = Run(w, [later], [Params(max_tokens=2)], Config())
    again.outputs = llm.generate([list(later)], [Params(max_tokens=2)])
    again.stats = dict(llm.stats)
    expect_greedy(again, seed, GREEDY_LAYOUT, "the later prompt, overlapped")
    expect_count(again, "cached_tokens", lambda n: n == 12,
                 "12: the later prompt's first three blocks of 4 (the first prompt's 6 tokens and 6 it generated) are "
                 "in the cache, the third and second filled by tokens the host learnt a step late")


SEEDED_LAYOUT = "L2-H2-KVH1-D16"


def test_seeded_requests_match_the_synchronous_engine(impl, seed):
    """seeded sampled requests, chunked and batched with a greedy one and one that stops early, give exactly the
    tokens of your synchronous p06 engine on the same requests (each draws from its own generator)"""
    gen = torch.Generator().manual_seed(seed)
    prompts = random_prompts(gen, SHAPES[SEEDED_LAYOUT][0], (9, 5, 6))
    params = [Params(temperature=0.9, top_p=0.9, max_tokens=5, seed=seed % 10_000),
              Params(temperature=1.0, max_tokens=3, seed=seed % 10_000 + 1), Params(max_tokens=4)]
    run = Run(weights(seed, SEEDED_LAYOUT), prompts, params, Config(max_num_batched_tokens=6))
    # The overlapped decode step's logits differ from p06's in their last bits (the fused norm): a draw could flip
    # only where two candidates of a row nearly tie (measured: none in 60 seeds of this case).
    overlap_engine(impl, run)
    impl.fresh_worker()  # the runs compared come from two workers: one cannot replay the other's tokens
    synchronous = impl.LLM(on_device(run.w), run.config).generate([list(p) for p in prompts], list(params))
    for i in range(2):
        if run.outputs[i] != synchronous[i]:
            raise Mismatch(f"seeded request {i} gave {run.outputs[i]} overlapped and {synchronous[i]} from your p06 "
                           f"LLM: "
                           f"each seeded row draws from its own generator, once per token it keeps (if p06's tokens "
                           f"look wrong, ./check.sh p06)")


LIFETIME_LAYOUT = ONE_HEAD


def test_blocks_outlive_the_steps_that_read_them(impl, seed):
    """stepping the engine one call at a time: a request in the step in flight still holds its blocks (a finished
    one's are freed once the last step that reads them is resolved), a finished request no step reads holds none,
    and at the end every block is free"""
    gen = torch.Generator().manual_seed(seed)
    w = weights(seed, LIFETIME_LAYOUT)
    prompts = random_prompts(gen, SHAPES[LIFETIME_LAYOUT][0], (6, 9, 3))
    max_tokens = (3, 5, 4)
    config = Config(num_blocks=16)
    llm = impl.OverlapLLM(on_device(w), config)
    requests = [llm.add_request(list(p), Params(max_tokens=n)) for p, n in zip(prompts, max_tokens)]
    ids = [r.request_id for r in requests]
    manager = llm.scheduler.block_manager
    for step in range(1, 40):
        llm.step()
        flight = llm.in_flight
        reading = list(flight.request_ids) if flight is not None else []
        free = set(manager.free_block_ids)
        for i, request in enumerate(requests):
            table = list(request.block_table)
            finished = request.status == "finished"
            if ids[i] in reading and (not table or free & set(table)):
                gone = "its blocks were freed" if not table else f"blocks {sorted(free & set(table))} are free"
                raise Mismatch(f"after step call {step}: request {i} is in the step in flight, but {gone}: a "
                               f"request's blocks may go back only once every launched step that reads them is "
                               f"resolved")
            if finished and ids[i] not in reading and table:
                raise Mismatch(f"after step call {step}: request {i} finished and no step in flight reads it, but it "
                               f"still holds blocks {table}: free them when its last step is resolved")
        if flight is None and all(r.status == "finished" for r in requests):  # attributes: no call to replay
            break
    else:
        raise Mismatch("the engine still had work after 39 step calls (3 requests of at most 5 tokens)")
    free_at_end = len(manager.free_block_ids)
    if free_at_end != config.num_blocks:
        raise Mismatch(f"at the end {counted(config.num_blocks - free_at_end, 'block')} of {config.num_blocks} are "
                       f"still held: every request's blocks are freed once it is done and no step reads it")
    outputs = [list(r.completion_token_ids) for r in requests]
    for i, (out, n) in enumerate(zip(outputs, max_tokens)):
        if len(out) != n:
            raise Mismatch(f"request {i} gave {counted(len(out), 'token')} {out}, expected its max_tokens {n}")
    run = Run(w, prompts, [Params(max_tokens=n) for n in max_tokens], config, outputs)
    expect_greedy(run, seed, LIFETIME_LAYOUT, "stepped one call at a time")



GRAPH_LAYOUT = "L2-H2-KVH1-D16"


def test_decode_graphs_keep_the_tokens(impl, seed):
    """on a GPU, the decode steps replayed from CUDA graphs (3 requests on the graph of 4 rows, then 2 on the graph of
    2): greedy tokens are HF's, and seeded sampled requests draw the tokens the same engine draws without graphs"""
    if DEVICE.type != "cuda":
        pytest.skip("CUDA graphs need a GPU: this check runs where ./check.sh finds one")
    gen = torch.Generator().manual_seed(seed)
    prompts = random_prompts(gen, SHAPES[GRAPH_LAYOUT][0], (5, 9, 7))
    params = [Params(max_tokens=6), Params(temperature=0.9, max_tokens=6, seed=seed % 10_000),
              Params(temperature=0.8, top_k=3, max_tokens=2, seed=seed % 10_000 + 1)]  # top-k: its steps draw eagerly
    graphed = Run(weights(seed, GRAPH_LAYOUT), prompts, params, Config(max_num_seqs=4, cuda_graphs=True))
    overlap_engine(impl, graphed)
    expect_greedy(Run(graphed.w, prompts[:1], params[:1], graphed.config, graphed.outputs[:1]), seed, GRAPH_LAYOUT,
                  "greedy, through the decode graphs")
    impl.fresh_worker()  # the runs compared come from two workers: one cannot replay the other's tokens
    eager = overlap_engine(impl, Run(graphed.w, prompts, params, Config(max_num_seqs=4)))
    for i in (1, 2):
        if graphed.outputs[i] != eager.outputs[i]:
            raise Mismatch(f"seeded request {i} gave {graphed.outputs[i]} through the decode graphs and "
                           f"{eager.outputs[i]} without them (cuda_graphs=False): a graph's draw reads the noise the "
                           f"request's own generator made for this step (fill the noise buffer before every replay), "
                           f"and whatever reads the graph's tokens is queued before the next replay overwrites them")
