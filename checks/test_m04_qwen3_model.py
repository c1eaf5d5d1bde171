"""Checks for M04 · the Qwen3 model and greedy generation (mine/m04_qwen3_model.py).

Oracles: the hand-computed toys (toy_cases/m04_qwen3_model.json), Hugging Face's `Qwen3MLP` and
`Qwen3DecoderLayer`, and `Qwen3ForCausalLM` built from tiny random configs (2-4 layers, H != KVH,
tied embeddings) holding the very weights the learner gets: logits from HF in float64 on the learner's
inputs, and the tokens of HF's own `generate(do_sample=False)`. Your m04 runs on your m01-m03 (the same
folder); when the logits differ, the report names the first layer and sub-step that differs from HF's.
An optional check runs real Qwen3 weights from a local folder named by KVLAB_QWEN3_DIR.
"""

import dataclasses
import os
import shutil
from functools import cache
from types import SimpleNamespace

import pytest
import torch

from checks.harness.cases import checkpoint_folder
from checks.harness.compare import Mismatch, Tolerance, close_enough, expect_close, tolerance
from checks.harness.guard import Returns
from checks.harness.oracles import (
    SUB_STEPS,
    LayerWeights,
    ModelCase,
    ModelWeights,
    hf_causal_lm,
    hf_greedy,
    hf_mlp,
    hf_model_config,
    hf_state_dict,
    model_case,
    rope_tables,
)
from checks.harness.toys import load_toy

pytestmark = pytest.mark.m04

TOLERANCE_KIND = "model"
CPU = torch.device("cpu")
# What `./check.sh grade` awards: a check's points, shared out over its cases (a module is worth the sum,
# 44). An optional oracle's check (absent on most machines) is worth nothing.
POINTS = {
    "test_toy_mlp": 1,
    "test_toy_logits": 2,
    "test_toy_greedy": 1,
    "test_mlp_matches_hf": 2,
    "test_decoder_layer_matches_hf": 4,
    "test_logits_match_hf": 6,
    "test_trace_reports_every_layer_and_step": 2,
    "test_last_position_logits": 2,
    "test_chunked_calls_match_hf": 4,
    "test_greedy_matches_hf_generate": 4,
    "test_greedy_with_chunked_prefill": 4,
    "test_load_state_dict_maps_hf_names": 3,
    "test_load_state_dict_keeps_bf16_and_reads_both_config_layouts": 3,
    "test_loaded_model_matches_hf": 3,
    "test_load_pretrained_reads_a_sharded_bf16_checkpoint": 2,
    "test_load_pretrained_converts_to_the_dtype_asked": 1,
    "test_real_weights_match_hf": 0,
}
CONTRACTS = {
    "mlp_forward": lambda w, x: Returns.like(x, "[T, hidden] like x"),
    "decoder_layer_forward": lambda w, hidden, cos, sin, cache=None, trace=None: Returns.like(
        hidden, "[T, hidden] like hidden"),
    "model_forward": lambda model, token_ids, caches=None, all_logits=False, trace=None: Returns(
        (token_ids.shape[0] if all_logits else 1, model.embed_tokens.shape[0]), model.embed_tokens.dtype, CPU,
        "[T, V] (all_logits)" if all_logits else "[1, V] (the last position)"),
    "generate_greedy": lambda model, prompt_ids, max_new_tokens, prefill_chunk=None: Returns(
        (max_new_tokens,), torch.int64, CPU, "[max_new_tokens] int64, the new tokens only"),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# (V, hidden, I, L, H, KVH, D): H != KVH everywhere, hidden != H*D, H / KVH = 3 and 4 in two of them
LAYOUTS = {
    "L2-H4-KVH2-D16": (96, 48, 80, 2, 4, 2, 16),
    "L3-H6-KVH2-D8": (80, 40, 72, 3, 6, 2, 8),
    "L4-H4-KVH1-D8": (64, 24, 56, 4, 4, 1, 8),
}
# Qwen3-0.6B's widths (hidden 1024, intermediate 3072, 16 heads on 8 KV heads, head_dim 128) in one layer over a
# small vocabulary. Its fp32 layer is 61 MB, sent with every call: it gets one (a prompt's logits, with the trace
# that names the first sub-step to differ), in fp32, where the tolerance is tight.
QWEN3 = "Qwen3-L1-H16-KVH8-D128-hidden1024-I3072"
SHAPES = {**LAYOUTS, QWEN3: (96, 1024, 3072, 1, 16, 8, 128)}
NEW_TOKENS = 20
STEP_NAMES = {"input_norm": "input norm", "attention": "attention", "post_attention_norm": "post-attention norm",
              "mlp": "MLP"}
TOY = load_toy("m04_qwen3_model")


def random_weights(gen, layout: str) -> ModelWeights:
    return ModelWeights.random(gen, *SHAPES[layout])  # (V, hidden, I, L, H, KVH, D)


def hf_case(seed: int, layout: str, dtype: torch.dtype, P: int) -> ModelCase:
    return model_case(seed, SHAPES[layout], dtype, P)


@cache
def greedy_case(seed: int, layout: str) -> tuple[ModelCase, torch.Tensor]:
    """An fp32 case and HF generate's NEW_TOKENS greedy tokens for its prompt.

    Greedy tokens are a fair demand only when no step is a near-tie that an fp32 rounding could flip:
    a case whose best and second-best logits ever come within 1e-4 (fp32 sums differ by ~1e-6) is
    replaced by the next seed's, deterministically."""
    for attempt in range(20):
        case = hf_case(seed * 100 + attempt, layout, torch.float32, 9)
        tokens, margins = hf_greedy(hf_causal_lm(case.w, torch.float32), case.prompt, NEW_TOKENS)
        if margins.min() > 1e-4:
            return case, tokens
    raise RuntimeError(f"no well-separated greedy case for seed {seed}")


class StepRecorder:
    """The `trace` the checks pass to model_forward: keeps every (layer, step) value the model reports."""

    def __init__(self):
        self.seen: dict[tuple[int, str], object] = {}

    def __call__(self, layer, step, value):
        if isinstance(value, torch.Tensor):
            value = value.detach().clone()
        self.seen.setdefault((layer, step), value)


def first_difference(recorder: StepRecorder, case: ModelCase, layers: int | None = None) -> str:
    """Where the learner's model first leaves HF's, from the values their trace reported (all layers, or
    the first `layers`)."""
    if not recorder.seen:
        return "trace was never called, so the first layer that differs is unknown"
    tol = tolerance("model", case.w.embed_tokens.dtype)
    for layer in range(len(case.w.layers) if layers is None else layers):
        for step in SUB_STEPS:
            got = recorder.seen.get((layer, step))
            expected = case.steps[(layer, step)]
            if not isinstance(got, torch.Tensor):
                return f"trace never reported layer {layer}'s {STEP_NAMES[step]} (step name {step!r})"
            if not close_enough(got, expected, tol):
                return f"first to differ from HF: layer {layer}, {STEP_NAMES[step]}"
    return "every layer matches HF, so the difference comes after the last one (final norm or LM head)"


def expect_model_close(actual, expected, dtype, what: str, diagnose=None) -> None:
    """expect_close with the model tolerance; on a mismatch, `diagnose()` adds where the model left HF's."""
    try:
        expect_close(actual, expected, tolerance("model", dtype), what)
    except Mismatch as mismatch:
        if diagnose is None:
            raise
        raise Mismatch(f"{mismatch} · {diagnose()}") from None


def expect_tokens(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    if torch.equal(got, expected):
        return
    step = int((got != expected).nonzero()[0])
    pattern = {0: " · the first token already differs: the prompt's logits are off (the logits checks say where)",
               1: " · only the first token agrees: is each chosen token fed back as the next step's input, at the "
                  "next position?"}.get(step, "")
    raise Mismatch(f"{what}: token {step} of {len(expected)} is {int(got[step])}, HF generate chose "
                   f"{int(expected[step])} (first {step} tokens agree; HF: {expected[: step + 3].tolist()} …){pattern}")


def toy_model() -> ModelWeights:
    spec = TOY["model"]
    layer = {name: torch.tensor(value) for name, value in spec["layer"].items()}
    numbers = {"eps": spec["eps"], "num_heads": spec["num_heads"], "num_kv_heads": spec["num_kv_heads"],
               "head_dim": spec["head_dim"]}
    return ModelWeights(embed_tokens=torch.tensor(spec["embed_tokens"]), layers=(LayerWeights(**layer, **numbers),),
                        norm=torch.tensor(spec["norm"]), eps=spec["eps"], rope_theta=spec["rope_theta"],
                        head_dim=spec["head_dim"])


# ---- the toys -------------------------------------------------------------------------------------


def test_toy_mlp(impl):
    """the toy: SwiGLU of x = [1, -1] gives the page's [2, 0.5379]"""
    case = TOY["mlp"]
    w = SimpleNamespace(**{name: torch.tensor(case[name]) for name in ("gate_proj", "up_proj", "down_proj")})
    out = impl.mlp_forward(w, torch.tensor(case["x"]))
    expect_close(out, torch.tensor(case["expected"]), tolerance("toy", torch.float32), "output")


def test_toy_logits(impl):
    """the toy model: logits for the prompt [2, 0] are the page's rows (final norm, tied head)"""
    spec = TOY["model"]
    logits = impl.model_forward(toy_model(), torch.tensor(spec["prompt"]), all_logits=True)
    expect_close(logits, torch.tensor(spec["logits"]), tolerance("toy", torch.float32), "logits")


def test_toy_greedy(impl):
    """the toy model: greedy generation after [2, 0] is 1, 0, 1, 0, 1"""
    spec = TOY["model"]
    tokens = impl.generate_greedy(toy_model(), torch.tensor(spec["prompt"]), len(spec["greedy"]))
    expect_tokens(tokens, torch.tensor(spec["greedy"]), "tokens")


# ---- the pieces against Hugging Face --------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_mlp_matches_hf(impl, gen, dtype):
    """mlp_forward matches HF Qwen3MLP (SwiGLU)"""
    layer = random_weights(gen, "L2-H4-KVH2-D16").layers[0].to(dtype)
    x = torch.randn(int(torch.randint(2, 9, (), generator=gen)), layer.hidden, generator=gen).to(dtype)
    expected = hf_mlp(layer.to(torch.float64), x.double())  # HF in float64 on these very inputs
    expect_close(impl.mlp_forward(layer.clone(), x.clone()), expected, tolerance("model", dtype), "output")


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("layout", ["L2-H4-KVH2-D16", "L3-H6-KVH2-D8"])
def test_decoder_layer_matches_hf(impl, seed, layout, dtype):
    """decoder_layer_forward (pre-norm, residual adds) matches layer 0 of HF Qwen3ForCausalLM"""
    case = hf_case(seed, layout, dtype, 7)
    hidden = case.w.embed_tokens[case.prompt]  # [P, hidden]: what layer 0 receives
    cos, sin = rope_tables(case.w.head_dim, torch.arange(7), dtype)
    recorder = StepRecorder()
    out = impl.decoder_layer_forward(case.w.layers[0].clone(), hidden.clone(), cos, sin, None,
                                     lambda step, value: recorder(0, step, value))
    expect_model_close(out, case.steps[(0, "output")], dtype, "layer 0 output",
                  lambda: first_difference(recorder, case, layers=1))


# ---- the whole model ------------------------------------------------------------------------------


LOGITS_CASES = [(layout, dtype) for dtype in DTYPES for layout in LAYOUTS] + [(QWEN3, "fp32")]


@pytest.mark.parametrize("layout, dtype", LOGITS_CASES, ids=[f"{layout}-{dtype}" for layout, dtype in LOGITS_CASES])
def test_logits_match_hf(impl, seed, gen, layout, dtype):
    """the logits of every prompt position match HF Qwen3ForCausalLM"""
    P = int(torch.randint(5, 13, (), generator=gen))
    dtype = DTYPES[dtype]
    case = hf_case(seed, layout, dtype, P)
    recorder = StepRecorder()
    logits = impl.model_forward(case.w.clone(), case.prompt.clone(), all_logits=True, trace=recorder)
    expect_model_close(logits, case.logits, dtype, f"logits ({P} tokens, one prefill)",
                  lambda: first_difference(recorder, case))


def test_trace_reports_every_layer_and_step(impl, seed):
    """the trace of a passing model: every layer's four sub-steps, in order, each equal to HF's"""
    case = hf_case(seed, "L3-H6-KVH2-D8", torch.float32, 6)
    recorder = StepRecorder()
    impl.model_forward(case.w.clone(), case.prompt.clone(), all_logits=True, trace=recorder)
    expected = [(layer, step) for layer in range(len(case.w.layers)) for step in SUB_STEPS]
    if list(recorder.seen) != expected:
        raise Mismatch(f"trace reported {list(recorder.seen)[:6]} …, expected every layer's steps in order: "
                       f"{expected[:6]} … ({len(expected)} in all)")
    tol = tolerance("model", torch.float32)
    for key in expected:
        expect_close(recorder.seen[key], case.steps[key], tol, f"trace of layer {key[0]}, {STEP_NAMES[key[1]]}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_last_position_logits(impl, seed, layout):
    """without all_logits, model_forward returns the last position's logits only, [1, V]"""
    case = hf_case(seed, layout, torch.float32, 8)
    logits = impl.model_forward(case.w.clone(), case.prompt.clone())
    expect_model_close(logits, case.logits[-1:], torch.float32, "logits of the last position")


SPLITS = {"3+5": [3, 5], "1+7": [1, 7], "4+1+1+1+1": [4, 1, 1, 1, 1], "2+2+2+2": [2, 2, 2, 2]}


@pytest.mark.parametrize("split", SPLITS)
def test_chunked_calls_match_hf(impl, seed, split):
    """8 prompt tokens fed in chunks through one KVCache per layer give HF's whole-prefill logits"""
    layout = list(LAYOUTS)[list(SPLITS).index(split) % len(LAYOUTS)]
    case = hf_case(seed, layout, torch.float32, 8)
    caches = [impl.KVCache() for _ in case.w.layers]
    start = 0
    for n, size in enumerate(SPLITS[split], 1):
        tokens = case.prompt[start : start + size].clone()
        logits = impl.model_forward(case.w, tokens, caches, all_logits=True)
        what = f"call {n} of {len(SPLITS[split])} (tokens {start}..{start + size - 1}): logits"
        expect_model_close(logits, case.logits[start : start + size], torch.float32, what)
        start += size
        held = [len(c) for c in caches]
        if held != [start] * len(caches):
            raise Mismatch(f"after call {n}: the layers' caches hold {held} tokens, expected {start} each")


# ---- greedy generation ----------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_greedy_matches_hf_generate(impl, seed, layout):
    """generate_greedy gives the 20 tokens of HF generate(do_sample=False)"""
    case, expected = greedy_case(seed, layout)
    tokens = impl.generate_greedy(case.w.clone(), case.prompt.clone(), NEW_TOKENS)
    expect_tokens(tokens, expected, f"greedy tokens after a {len(case.prompt)}-token prompt")


CHUNKED = {"chunks-of-1": ("L2-H4-KVH2-D16", 1), "chunks-of-4": ("L3-H6-KVH2-D8", 4),
           "chunks-of-2": ("L4-H4-KVH1-D8", 2)}  # 9 prompt tokens: 9 x 1, 4 + 4 + 1, 2 + 2 + 2 + 2 + 1


@pytest.mark.parametrize("chunking", CHUNKED)
def test_greedy_with_chunked_prefill(impl, seed, chunking):
    """generate_greedy with the prompt prefilled in chunks gives the same 20 tokens as HF generate"""
    layout, chunk = CHUNKED[chunking]
    case, expected = greedy_case(seed, layout)
    tokens = impl.generate_greedy(case.w.clone(), case.prompt.clone(), NEW_TOKENS, prefill_chunk=chunk)
    expect_tokens(tokens, expected, f"greedy tokens (prefill in chunks of {chunk})")


# ---- loading Hugging Face weights -----------------------------------------------------------------

def attribute_path(hf_name: str) -> str:
    """Where a Hugging Face weight lives in Qwen3Weights: model.layers.3.mlp.up_proj.weight -> layers[3].up_proj."""
    parts = hf_name.removeprefix("model.").removesuffix(".weight").split(".")
    return f"layers[{parts[1]}].{parts[-1]}" if parts[0] == "layers" else parts[0]


def read(obj, path: str):
    value = obj
    for part in path.replace("[", ".").replace("]", "").split("."):
        try:
            value = value[int(part)] if part.isdigit() else getattr(value, part)
        except (AttributeError, IndexError, KeyError, TypeError):
            raise Mismatch(f"load_state_dict's result has no `{path}`") from None
    return value


def test_load_state_dict_maps_hf_names(impl, seed):
    """load_state_dict puts every tensor of an HF Qwen3ForCausalLM state_dict in its place"""
    w = random_weights(torch.Generator().manual_seed(seed), "L3-H6-KVH2-D8")
    loaded = impl.load_state_dict(hf_state_dict(w), hf_model_config(w).to_dict())
    if len(read(loaded, "layers")) != len(w.layers):
        raise Mismatch(f"`layers` has {len(read(loaded, 'layers'))} entries, expected {len(w.layers)}")
    for hf_name, tensor in hf_state_dict(w).items():
        got = read(loaded, attribute_path(hf_name))
        if not isinstance(got, torch.Tensor) or not torch.equal(got, tensor):
            raise Mismatch(f"`{attribute_path(hf_name)}` is not HF's {hf_name}")
    first = w.layers[0]
    numbers = {"eps": w.eps, "rope_theta": w.rope_theta, "head_dim": w.head_dim, "layers[0].eps": first.eps,
               "layers[0].num_heads": first.num_heads, "layers[0].num_kv_heads": first.num_kv_heads,
               "layers[0].head_dim": first.head_dim}
    for path, number in numbers.items():
        if read(loaded, path) != number:
            raise Mismatch(f"`{path}` is {read(loaded, path)!r}, expected {number!r}")


CONFIG_LAYOUTS = ["rope_parameters", "top-level rope_theta"]  # transformers 5 writes the first; checkpoints the second


@pytest.mark.parametrize("layout", CONFIG_LAYOUTS)
def test_load_state_dict_keeps_bf16_and_reads_both_config_layouts(impl, seed, layout):
    """a bf16 state_dict loads as bf16, unchanged, with rope_theta read from either config layout"""
    w = random_weights(torch.Generator().manual_seed(seed), "L2-H4-KVH2-D16").to(torch.bfloat16)
    w = dataclasses.replace(w, rope_theta=5_000_000.0)  # neither HF's default nor Qwen3's: it must be read
    config = hf_model_config(w).to_dict()
    if layout == "top-level rope_theta":  # as Qwen3's published config.json has it
        config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
    else:
        config.pop("rope_theta", None)
    state = hf_state_dict(w)
    loaded = impl.load_state_dict(state, config)
    if read(loaded, "rope_theta") != w.rope_theta:
        raise Mismatch(f"`rope_theta` is {read(loaded, 'rope_theta')!r}, expected {w.rope_theta!r} "
                       f"(config with {layout})")
    for hf_name, tensor in state.items():
        got = read(loaded, attribute_path(hf_name))
        if not isinstance(got, torch.Tensor) or got.dtype != torch.bfloat16:
            kind = got.dtype if isinstance(got, torch.Tensor) else type(got).__name__
            raise Mismatch(f"`{attribute_path(hf_name)}` is {kind}, expected HF's bf16 tensor unchanged")
        if not torch.equal(got, tensor):
            raise Mismatch(f"`{attribute_path(hf_name)}` is not HF's {hf_name}")


def test_loaded_model_matches_hf(impl, seed):
    """a model from load_state_dict gives HF's logits"""
    case = hf_case(seed, "L2-H4-KVH2-D16", torch.float32, 6)
    loaded = impl.load_state_dict(hf_state_dict(case.w.clone()), hf_model_config(case.w).to_dict())
    logits = impl.model_forward(loaded, case.prompt.clone(), all_logits=True)
    expect_model_close(logits, case.logits, torch.float32, "logits of the loaded model")


def saved_checkpoint(request, tmp_path, w: ModelWeights, **save_options) -> tuple[str, list]:
    """HF's save_pretrained of `w`, in its own dtype, into a fresh checkpoint folder the worker can read: the
    folder and its shards. The folder goes when the check's teardown does, after its report: naming a failure
    replays the learner's load_pretrained(folder) on the mistake catalogue, which reads it again."""
    from transformers.utils import logging as hf_logging

    folder = checkpoint_folder(request, tmp_path)
    request.addfinalizer(lambda: shutil.rmtree(folder, ignore_errors=True))
    hf_logging.disable_progress_bar()  # no "Writing model shards" bar in the learner's report
    hf_causal_lm(w, w.embed_tokens.dtype).save_pretrained(folder, **save_options)
    for path in folder.iterdir():
        path.chmod(0o644)  # safetensors writes 0600; under `grade` the worker runs as another user
    return str(folder), sorted(folder.glob("*.safetensors"))


def test_load_pretrained_reads_a_sharded_bf16_checkpoint(impl, seed, request, tmp_path):
    """load_pretrained reads a bf16 checkpoint that HF's save_pretrained wrote in several shards: HF's tensors"""
    gen = torch.Generator().manual_seed(seed)
    w = random_weights(gen, "L2-H4-KVH2-D16").to(torch.bfloat16)
    folder, shards = saved_checkpoint(request, tmp_path, w, max_shard_size="20KB")
    assert len(shards) >= 2, f"save_pretrained wrote {len(shards)} shard(s): the check wants several"
    loaded = impl.load_pretrained(folder, torch.bfloat16)
    expected = hf_state_dict(w)
    got = hf_state_dict(loaded)  # the loaded model's tensors under HF's names (read from the worker)
    for hf_name, tensor in expected.items():
        mine = got.get(hf_name)
        if not isinstance(mine, torch.Tensor) or mine.dtype != torch.bfloat16 or not torch.equal(mine, tensor):
            shown = f"{mine.dtype} {list(mine.shape)}" if isinstance(mine, torch.Tensor) else type(mine).__name__
            raise Mismatch(f"`{attribute_path(hf_name)}` from {len(shards)} shards is {shown}, not HF's bf16 "
                           f"{list(tensor.shape)} {hf_name}")


def test_load_pretrained_converts_to_the_dtype_asked(impl, seed, request, tmp_path):
    """load_pretrained converts every tensor to its dtype argument: a bf16 checkpoint asked for in float32"""
    w = random_weights(torch.Generator().manual_seed(seed), "L2-H4-KVH2-D16").to(torch.bfloat16)
    folder, _ = saved_checkpoint(request, tmp_path, w)  # one shard: the sharding is the check above's
    loaded = impl.load_pretrained(folder, torch.float32)
    got = hf_state_dict(loaded)  # the loaded model's tensors under HF's names (read from the worker)
    for hf_name, tensor in hf_state_dict(w).items():
        mine = got.get(hf_name)
        if not isinstance(mine, torch.Tensor) or mine.dtype != torch.float32:
            shown = mine.dtype if isinstance(mine, torch.Tensor) else type(mine).__name__
            raise Mismatch(f"`{attribute_path(hf_name)}` is {shown}: load_pretrained(folder, torch.float32) on a "
                           f"bf16 checkpoint must give every tensor in float32")
        if not torch.equal(mine, tensor.float()):  # bf16 -> fp32 is exact
            raise Mismatch(f"`{attribute_path(hf_name)}` is not HF's {hf_name} converted to float32")


# ---- optional: real weights -----------------------------------------------------------------------

REAL_WEIGHTS = os.environ.get("KVLAB_QWEN3_DIR")


NO_REAL_WEIGHTS = ("set KVLAB_QWEN3_DIR to a local folder with a Qwen3 checkpoint (config.json + *.safetensors) "
                   "to run it; nothing is downloaded")


@pytest.mark.skipif(not REAL_WEIGHTS, reason=NO_REAL_WEIGHTS)
def test_real_weights_match_hf(impl):
    """real Qwen3 weights from KVLAB_QWEN3_DIR: logits and 8 greedy tokens match HF (fp32)"""
    from transformers import Qwen3ForCausalLM

    model = impl.load_pretrained(REAL_WEIGHTS, torch.float32)
    hf = Qwen3ForCausalLM.from_pretrained(REAL_WEIGHTS, dtype=torch.float64, local_files_only=True,
                                          attn_implementation="eager").eval()  # the truth for these weights
    prompt = torch.tensor([785, 6722, 315, 9625, 374]) % hf.config.vocab_size  # "The capital of France is"
    with torch.no_grad():
        expected = hf(prompt[None]).logits[0]
        hf = hf.float()
        hf_own = hf(prompt[None]).logits[0].double()
    # 28 real layers round far more than the tiny random ones: the bound is twice HF's own fp32 error on
    # these very weights and tokens (measured here), and never tighter than the fp32 model tolerance.
    own = ((hf_own - expected).abs() / (expected.pow(2).mean().sqrt() + expected.abs())).max().item()
    base = tolerance("model", torch.float32)
    tol = Tolerance(rtol=max(base.rtol, 2 * own), atol=max(base.atol, 2 * own))
    expect_close(impl.model_forward(model, prompt, all_logits=True), expected, tol, "logits")
    tokens, margins = hf_greedy(hf, prompt, 8)
    noise = 10 * (hf_own - expected).abs().max().item()  # a closer call than this could flip either way
    clear = int((margins <= noise).nonzero()[0]) if (margins <= noise).any() else 8
    got = impl.generate_greedy(model, prompt, 8)
    expect_tokens(got[:clear], tokens[:clear], f"greedy tokens (the first {clear} of 8, before any near-tie)")
