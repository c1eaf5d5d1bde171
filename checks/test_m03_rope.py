"""Checks for M03 · RoPE and Qwen3-Omni's M-RoPE (mine/m03_rope.py).

Oracles: the hand-computed toy (toy_cases/m03_rope.json); Hugging Face's `Qwen3RotaryEmbedding` (theta
1e6, passed explicitly) for the inverse frequencies and the cos/sin tables; HF's
`apply_rotary_pos_emb` run in float64 on the learner's very inputs for the rotation; HF's
`Qwen3OmniMoeThinkerTextRotaryEmbedding` for M-RoPE. Positions never start at 0 only: chunks start at
37, decode steps sit near position 1000.
"""

import pytest
import torch

from checks.harness.compare import expect_close, tolerance
from checks.harness.guard import Returns
from checks.harness.oracles import (
    QWEN3_ROPE_THETA,
    hf_apply_rope,
    hf_inverse_frequencies,
    hf_mrope_tables,
    rope_tables,
)
from checks.harness.toys import load_toy

pytestmark = pytest.mark.m03

TOLERANCE_KIND = "rope"


def _tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[Returns, Returns]:
    shape = (positions.shape[-1], 2 * inv_freq.shape[0])
    return tuple(Returns(shape, dtype, positions.device, "[T, D]") for _ in ("cos", "sin"))


# What `./check.sh grade` awards: a check's points, shared out over its cases (a module is worth the sum,
# 26). An optional oracle's check (absent on most machines) is worth nothing.
POINTS = {
    "test_toy_inverse_frequencies": 1,
    "test_toy_tables": 1,
    "test_toy_rotation": 1,
    "test_toy_mrope": 1,
    "test_inverse_frequencies_match_hf": 2,
    "test_tables_match_hf": 3,
    "test_rotation_matches_hf": 3,
    "test_rotary_cache_matches_hf": 2,
    "test_cached_rotary_matches_hf": 2,
    "test_chunks_rotate_like_one_call": 2,
    "test_mrope_matches_hf": 4,
    "test_mrope_unequal_sections_and_far_positions": 2,
    "test_mrope_of_text_is_plain_rope": 2,
}
CONTRACTS = {
    "inverse_frequencies": lambda head_dim, theta: Returns((head_dim // 2,), torch.float32, torch.device("cpu"),
                                                           "[D/2] fp32"),
    "rope_cos_sin": lambda positions, inv_freq, dtype: _tables(positions, inv_freq, dtype),
    "rotate_half": lambda x: Returns.like(x, "[..., D] like x"),
    "apply_rope": lambda q, k, cos, sin: (Returns.like(q, "[T, H, D] like q"), Returns.like(k, "[T, KVH, D] like k")),
    "build_rotary_cache": lambda head_dim, max_position, theta: Returns(
        (max_position, head_dim), torch.float32, torch.device("cpu"), "[max_position, D] fp32 (cos | sin)"),
    "rotary": lambda cos_sin_cache, positions, q, k: (Returns.like(q, "[T, H, D] like q"),
                                                      Returns.like(k, "[T, KVH, D] like k")),
    "mrope_cos_sin": lambda position_ids, inv_freq, mrope_section, dtype: _tables(position_ids, inv_freq, dtype),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
HEAD_DIMS = [8, 16, 64, 128]
# (H, KVH, D): H != KVH everywhere, H / KVH = 3 in two of them, Qwen3's D = 128 in two; the last is Qwen3-0.6B's
# own heads (16 query heads, 8 KV heads, head_dim 128)
LAYOUTS = {"H4-KVH2-D16": (4, 2, 16), "H6-KVH2-D8": (6, 2, 8), "H3-KVH1-D128": (3, 1, 128),
           "Qwen3-H16-KVH8-D128": (16, 8, 128)}
THETA = QWEN3_ROPE_THETA
TOY = load_toy("m03_rope")


CHUNK_START = 37  # where a chunk's positions start (a prefill's start at 0)
DECODE_NEAR = 1000  # a decode step's position: DECODE_NEAR .. DECODE_NEAR + 39
WHERE = ["prefill", f"chunk-at-{CHUNK_START}", f"decode-at-{DECODE_NEAR}"]


def positions_for(where: str, gen: torch.Generator) -> torch.Tensor:
    """Absolute positions of one call: a prefill from 0, a chunk from 37, or a decode step near 1000."""
    T = int(torch.randint(3, 12, (), generator=gen))
    if where == "prefill":
        return torch.arange(T)
    if where == f"chunk-at-{CHUNK_START}":
        return torch.arange(CHUNK_START, CHUNK_START + T)
    if where == f"decode-at-{DECODE_NEAR}":
        return torch.tensor([DECODE_NEAR + int(torch.randint(0, 40, (), generator=gen))])
    raise ValueError(where)


def random_qk(gen, layout: str, T: int, dtype: torch.dtype):
    H, KVH, D = LAYOUTS[layout]
    return torch.randn(T, H, D, generator=gen).to(dtype), torch.randn(T, KVH, D, generator=gen).to(dtype)


def exact_rotation(q, k, positions, D):
    """HF's rotation in float64 on these inputs, with HF's fp32-angle tables (the convention)."""
    cos, sin = rope_tables(D, positions, torch.float32)
    return hf_apply_rope(q.double(), k.double(), cos.double(), sin.double())


# ---- the toy --------------------------------------------------------------------------------------


def test_toy_inverse_frequencies(impl):
    """the toy: D = 4, theta = 100 gives inv_freq [1, 0.1]"""
    case = TOY["inverse_frequencies"]
    got = impl.inverse_frequencies(case["head_dim"], case["theta"])
    expect_close(got, torch.tensor(case["expected"]), tolerance("toy", torch.float32), "inv_freq")


def test_toy_tables(impl):
    """the toy: positions 0, 1, 10 give the page's cos and sin rows (halves duplicated)"""
    case = TOY["cos_sin"]
    cos, sin = impl.rope_cos_sin(torch.tensor(case["positions"]), torch.tensor([1.0, 0.1]), torch.float32)
    tol = tolerance("toy", torch.float32)
    expect_close(cos, torch.tensor(case["cos"]), tol, "cos")
    expect_close(sin, torch.tensor(case["sin"]), tol, "sin")


def test_toy_rotation(impl):
    """the toy: rotate_half([1, 2, 3, 4]) = [-3, -4, 1, 2], and q, k rotate to the page's rows"""
    tol = tolerance("toy", torch.float32)
    expect_close(impl.rotate_half(torch.tensor(TOY["rotate_half"]["x"])), torch.tensor(TOY["rotate_half"]["expected"]),
                 tol, "rotate_half")
    case = TOY["apply_rope"]
    cos, sin = torch.tensor(TOY["cos_sin"]["cos"]), torch.tensor(TOY["cos_sin"]["sin"])
    q, k = impl.apply_rope(torch.tensor(case["q"]), torch.tensor(case["k"]), cos, sin)
    expect_close(q, torch.tensor(case["expected_q"]), tol, "q")
    expect_close(k, torch.tensor(case["expected_k"]), tol, "k")


def test_toy_mrope(impl):
    """the toy: an image patch at (t, h, w) = (5, 3, 2) and a text token at 7 give the page's M-RoPE rows"""
    case = TOY["mrope"]
    cos, sin = impl.mrope_cos_sin(torch.tensor(case["position_ids"]), torch.tensor(case["inv_freq"]),
                                  case["mrope_section"], torch.float32)
    tol = tolerance("toy", torch.float32)
    expect_close(cos, torch.tensor(case["cos"]), tol, "cos")
    expect_close(sin, torch.tensor(case["sin"]), tol, "sin")


# ---- plain RoPE against Hugging Face --------------------------------------------------------------


@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=[f"D{d}" for d in HEAD_DIMS])
def test_inverse_frequencies_match_hf(impl, head_dim):
    """inverse frequencies match HF Qwen3RotaryEmbedding with theta 1e6"""
    got = impl.inverse_frequencies(head_dim, THETA)
    expect_close(got, hf_inverse_frequencies(head_dim), tolerance("rope", torch.float32), "inv_freq")


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("head_dim", [16, 128], ids=["D16", "D128"])
def test_tables_match_hf(impl, gen, head_dim, where, dtype):
    """cos/sin for absolute positions match HF Qwen3RotaryEmbedding (fp32 angles, halves duplicated)"""
    positions = positions_for(where, gen)
    inv_freq = hf_inverse_frequencies(head_dim)
    cos, sin = impl.rope_cos_sin(positions.clone(), inv_freq.clone(), dtype)
    expected_cos, expected_sin = rope_tables(head_dim, positions, dtype)
    tol = tolerance("rope", dtype)
    span = f"positions {positions[0].item()}..{positions[-1].item()}"
    expect_close(cos, expected_cos, tol, f"cos ({span})")
    expect_close(sin, expected_sin, tol, f"sin ({span})")


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_rotation_matches_hf(impl, gen, layout, where, dtype):
    """apply_rope matches HF apply_rotary_pos_emb on q [T, H, D] and k [T, KVH, D]"""
    D = LAYOUTS[layout][2]
    positions = positions_for(where, gen)
    q, k = random_qk(gen, layout, positions.shape[0], dtype)
    cos, sin = rope_tables(D, positions, dtype)
    got_q, got_k = impl.apply_rope(q.clone(), k.clone(), cos.clone(), sin.clone())
    expected_q, expected_k = hf_apply_rope(q.double(), k.double(), cos.double(), sin.double())
    tol = tolerance("rope", dtype)
    expect_close(got_q, expected_q, tol, f"q (positions from {positions[0].item()})")
    expect_close(got_k, expected_k, tol, f"k (positions from {positions[0].item()})")


# ---- nano-vllm's cached rotary --------------------------------------------------------------------


@pytest.mark.parametrize("head_dim", [16, 128], ids=["D16", "D128"])
def test_rotary_cache_matches_hf(impl, head_dim):
    """build_rotary_cache holds HF's fp32 cos | sin (half width) for every position below max_position"""
    max_position = 1100
    got = impl.build_rotary_cache(head_dim, max_position, THETA)
    cos, sin = rope_tables(head_dim, torch.arange(max_position), torch.float32)
    half = head_dim // 2
    expected = torch.cat((cos[:, :half], sin[:, :half]), dim=-1)  # [max_position, D]: cos | sin
    expect_close(got, expected, tolerance("rope", torch.float32), f"cache [{max_position}, {head_dim}]")


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("layout", ["H4-KVH2-D16", "H3-KVH1-D128"])
def test_cached_rotary_matches_hf(impl, gen, layout, where, dtype):
    """rotary(cache, positions, q, k) matches HF's rotation at those absolute positions"""
    D = LAYOUTS[layout][2]
    positions = positions_for(where, gen)
    q, k = random_qk(gen, layout, positions.shape[0], dtype)
    cache = impl.build_rotary_cache(D, 1100, THETA)
    got_q, got_k = impl.rotary(cache, positions.clone(), q.clone(), k.clone())
    expected_q, expected_k = exact_rotation(q, k, positions, D)
    tol = tolerance("rope", dtype)
    expect_close(got_q, expected_q, tol, f"q (positions from {positions[0].item()})")
    expect_close(got_k, expected_k, tol, f"k (positions from {positions[0].item()})")


def test_chunks_rotate_like_one_call(impl, gen):
    """rotating 11 tokens as chunks 4 + 6 + 1 (positions 37..47) gives the rows of one call"""
    D = 16
    positions = torch.arange(CHUNK_START, CHUNK_START + 11)
    q, k = random_qk(gen, "H4-KVH2-D16", 11, torch.float32)
    cache = impl.build_rotary_cache(D, 64, THETA)
    inv_freq = impl.inverse_frequencies(D, THETA)
    expected_q, expected_k = exact_rotation(q, k, positions, D)
    start = 0
    for size in (4, 6, 1):
        rows = slice(start, start + size)
        cos, sin = impl.rope_cos_sin(positions[rows].clone(), inv_freq, torch.float32)
        got_q, got_k = impl.apply_rope(q[rows].clone(), k[rows].clone(), cos, sin)
        cached_q, cached_k = impl.rotary(cache, positions[rows].clone(), q[rows].clone(), k[rows].clone())
        tol = tolerance("rope", torch.float32)
        what = f"chunk of {size} at positions {start + CHUNK_START}..{start + CHUNK_START + size - 1}"
        for name, got, cached, expected in (("q", got_q, cached_q, expected_q), ("k", got_k, cached_k, expected_k)):
            expect_close(got, expected[rows], tol, f"{what}: {name} from rope_cos_sin + apply_rope")
            expect_close(cached, expected[rows], tol, f"{what}: {name} from rotary")
        start += size


# ---- M-RoPE (Qwen3-Omni thinker) ------------------------------------------------------------------

SECTIONS = {"D128-24-20-20": (128, (24, 20, 20)), "D16-4-2-2": (16, (4, 2, 2)), "D32-6-5-5": (32, (6, 5, 5))}


def text_and_image_positions(gen) -> torch.Tensor:
    """[3, T] (t, h, w) position ids as Qwen3-Omni lays them out: text, an image grid, text again.

    Text tokens carry their position in all three rows. The image's patches share one t (the position
    where the image starts) and take h = start + row, w = start + column; the text after it resumes at
    one past the largest position used."""
    before = int(torch.randint(1, 5, (), generator=gen))
    rows, cols = (int(torch.randint(2, 5, (), generator=gen)) for _ in range(2))
    after = int(torch.randint(1, 4, (), generator=gen))
    text = torch.arange(before).expand(3, -1)  # [3, before]
    grid_h, grid_w = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")  # [rows, cols]
    image = torch.stack((torch.zeros(rows * cols, dtype=torch.long), grid_h.flatten(), grid_w.flatten())) + before
    resume = int(image.max()) + 1
    tail = torch.arange(resume, resume + after).expand(3, -1)  # [3, after]
    return torch.cat((text, image, tail), dim=1)  # [3, T]


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("sections", SECTIONS)
def test_mrope_matches_hf(impl, gen, sections, dtype):
    """M-RoPE tables for text + an image grid match HF Qwen3OmniMoeThinkerTextRotaryEmbedding"""
    head_dim, section = SECTIONS[sections]
    position_ids = text_and_image_positions(gen)
    cos, sin = impl.mrope_cos_sin(position_ids.clone(), hf_inverse_frequencies(head_dim), list(section), dtype)
    expected_cos, expected_sin = hf_mrope_tables(head_dim, section, position_ids, dtype)
    tol = tolerance("rope", dtype)
    expect_close(cos, expected_cos, tol, f"cos ({position_ids.shape[1]} tokens, mrope_section {list(section)})")
    expect_close(sin, expected_sin, tol, f"sin ({position_ids.shape[1]} tokens, mrope_section {list(section)})")


# Unequal h and w sections, and positions far apart: a long text before an image (t = h = w = 900 on),
# then three video frames 40 apart in time, each a 2 x 3 grid.
UNEQUAL_SECTIONS = {"D32-6-6-4": (32, (6, 6, 4)), "D32-4-3-9": (32, (4, 3, 9))}
FAR_APART = torch.tensor([
    [0, 1, 2] + [900] * 6 + [940] * 6 + [980] * 6 + [990],
    [0, 1, 2] + [900, 900, 900, 901, 901, 901] * 3 + [990],
    [0, 1, 2] + [900, 901, 902, 900, 901, 902] * 3 + [990],
])  # [3, T]: rows t, h, w


@pytest.mark.parametrize("sections", UNEQUAL_SECTIONS)
def test_mrope_unequal_sections_and_far_positions(impl, sections):
    """M-RoPE with h and w sections of different sizes, video frames and an image after long text match HF"""
    head_dim, section = UNEQUAL_SECTIONS[sections]
    inv_freq = hf_inverse_frequencies(head_dim)
    cos, sin = impl.mrope_cos_sin(FAR_APART.clone(), inv_freq, list(section), torch.float32)
    expected_cos, expected_sin = hf_mrope_tables(head_dim, section, FAR_APART, torch.float32)
    tol = tolerance("rope", torch.float32)
    expect_close(cos, expected_cos, tol, f"cos (mrope_section {list(section)}, positions up to 990)")
    expect_close(sin, expected_sin, tol, f"sin (mrope_section {list(section)}, positions up to 990)")


@pytest.mark.parametrize("where", WHERE)
def test_mrope_of_text_is_plain_rope(impl, gen, where):
    """for text (t = h = w) M-RoPE's tables equal HF's plain RoPE tables"""
    positions = positions_for(where, gen)
    cos, sin = impl.mrope_cos_sin(positions.expand(3, -1).clone(), hf_inverse_frequencies(128), [24, 20, 20],
                                  torch.float32)
    expected_cos, expected_sin = rope_tables(128, positions, torch.float32)
    tol = tolerance("rope", torch.float32)
    expect_close(cos, expected_cos, tol, "cos")
    expect_close(sin, expected_sin, tol, "sin")

