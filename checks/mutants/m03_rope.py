"""Known mistakes in M03 (RoPE), each a patch of `solutions/m03_rope.py`.

Ids match the Pitfalls section of `exercises/m03_rope.md`.
"""

from checks.harness.mistakes import Broken, Mistake, Variant, append, chain, everyday_breakage, replace

_HALVES = "return torch.cat((-second, first), dim=-1)"
_ANGLES = "angles = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]  # [T, D/2] fp32"
_LOOKUP = "cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)"
_MROPE_AXIS = (
    "    for row in (1, 2):\n"
    "        axis[(slot % 3 == row) & (slot < 3 * mrope_section[row])] = row\n"
)

MISTAKES = [
    Mistake(
        "interleaved-pairs",
        "rotate_half pairs adjacent channels (2i, 2i+1) instead of i and i + D/2",
        "Qwen3 uses the half-split (NeoX) rule: split D into halves [x1, x2] and return [-x2, x1]; "
        "pairing x[0::2] with x[1::2] is GPT-J's interleaved convention.",
        replace(
            "    first, second = x.chunk(2, dim=-1)  # [..., D/2] each\n    " + _HALVES,
            "    even, odd = x[..., 0::2], x[..., 1::2]\n    return torch.stack((-odd, even), dim=-1).flatten(-2)",
        ),
    ),
    Mistake(
        "positions-restarted",
        "positions counted from 0 in every call instead of the given absolute positions",
        "Use the positions you are given: a chunk starting at 37 or a decode step at 1000 must not be "
        "rotated as if it started at 0.",
        chain(
            replace(_ANGLES, _ANGLES.replace("positions.to(torch.float32)", "torch.arange(positions.shape[0]).float()")),
            replace(_LOOKUP, "cos, sin = cos_sin_cache[: positions.shape[0]].chunk(2, dim=-1)"),
        ),
    ),
    Mistake(
        "theta-default",
        "the base 10,000 (HF's config default) used instead of theta",
        "Pass theta through: Qwen3's is 1,000,000. With 10,000 every pair but the first turns too fast.",
        replace("return 1.0 / (theta**exponents)", "return 1.0 / (10_000.0**exponents)"),
    ),
    Mistake(
        "angles-in-bf16",
        "angles computed in the model dtype instead of fp32",
        "Compute positions * inv_freq in fp32 and cast only cos/sin: a bf16 angle near position 1000 is off "
        "by up to 2 radians.",
        replace(_ANGLES, "angles = positions.to(dtype)[:, None] * inv_freq.to(dtype)[None, :]"),
    ),
    Mistake(
        "sin-sign-flipped",
        "rotate_half returns [x2, -x1]: every token turns the wrong way",
        "rotate_half([x1, x2]) is [-x2, x1]; with the minus on the other half the rotation runs backwards.",
        replace(_HALVES, "return torch.cat((second, -first), dim=-1)"),
    ),
    Mistake(
        "halves-not-duplicated",
        "the angle table is [a0, a0, a1, a1, ...] instead of the two halves [a0 ... a(D/2-1), a0 ... a(D/2-1)]",
        "Channel i pairs with channel i + D/2, so both need angle i: torch.cat((angles, angles), -1), "
        "not repeat_interleave(2).",
        chain(
            replace(
                "angles = torch.cat((angles, angles), dim=-1)  # [T, D]: channel i and i + D/2 turn together",
                "angles = angles.repeat_interleave(2, dim=-1)",
            ),
            replace(
                "cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)",
                "cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)",
            ),
            replace("chosen = torch.cat((chosen, chosen), dim=-1)", "chosen = chosen.repeat_interleave(2, dim=-1)"),
        ),
    ),
    Mistake(
        "w-limit-from-h",
        "the w slots limited by mrope_section[1] (h's count) instead of mrope_section[2]",
        "Each row has its own count: slots 1, 4, 7, ... read h while slot < 3 * mrope_section[1], and slots 2, 5, "
        "8, ... read w while slot < 3 * mrope_section[2]; [24, 20, 20] hides a mix-up, unequal counts do not.",
        replace("        axis[(slot % 3 == row) & (slot < 3 * mrope_section[row])] = row\n",
                "        axis[(slot % 3 == row) & (slot < 3 * mrope_section[1])] = row\n"),
    ),
    Mistake(
        "mrope-sections-misassigned",
        "M-RoPE slots given to t, h, w in contiguous blocks instead of interleaved with stride 3",
        "Qwen3-Omni interleaves: slots 1, 4, 7, ... read h and 2, 5, 8, ... read w (mrope_section[1], [2] "
        "of them); the rest read t. Contiguous blocks are Qwen2-VL's older layout.",
        replace(
            "    axis = torch.zeros_like(slot)  # 0 = t everywhere, then h and w take their interleaved slots\n"
            + _MROPE_AXIS,
            "    axis = torch.repeat_interleave(torch.arange(3), torch.tensor(mrope_section))\n",
        ),
    ),
    Mistake(
        "cache-shifted",
        "nano-vllm's table built for positions 1 .. max_position, one row off",
        "Row p of the cache is position p: the angles of arange(max_position), starting at 0 (cos 1, sin 0).",
        replace("    positions = torch.arange(max_position)  # [max_position]", "    positions = torch.arange(1, max_position + 1)  # [max_position]"),
    ),
    Mistake(
        "cache-halves-swapped",
        "nano-vllm's table stored as sin | cos",
        "Store cos first and sin second, `cat((cos, sin), -1)`, and split it in the same order in rotary.",
        replace("return torch.cat((angles.cos(), angles.sin()), dim=-1)  # [P, D]: cos | sin",
                "return torch.cat((angles.sin(), angles.cos()), dim=-1)  # [P, D]: cos | sin"),
    ),
]

VARIANTS = [
    Variant(
        "rotate-in-fp32",
        "apply_rope rotates in fp32 and rounds once (more accurate than HF's rotation in the model dtype)",
        replace(
            "    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin",
            "    q32, k32 = q.float(), k.float()\n"
            "    q_out = q32 * cos.float() + rotate_half(q32) * sin.float()\n"
            "    k_out = k32 * cos.float() + rotate_half(k32) * sin.float()\n"
            "    return q_out.to(q.dtype), k_out.to(k.dtype)",
        ),
    ),
    Variant(
        "rotary-in-model-dtype",
        "rotary casts the looked-up cos/sin to q's dtype and rotates there (HF's rounding)",
        replace(
            "    q_rotated, k_rotated = apply_rope(q.float(), k.float(), cos, sin)",
            "    q_rotated, k_rotated = apply_rope(q, k, cos.to(q.dtype), sin.to(q.dtype))",
        ),
    ),
    Variant(
        "negative-power",
        "inverse frequencies as theta ** (-2i/D): one rounding instead of two",
        replace("return 1.0 / (theta**exponents)", "return theta ** (-exponents)"),
    ),
    Variant(
        "outer-product",
        "angles by torch.outer and a split-free rotate_half with index arithmetic",
        chain(
            replace(_ANGLES, "angles = torch.outer(positions.to(torch.float32), inv_freq.to(torch.float32))"),
            replace(
                "    first, second = x.chunk(2, dim=-1)  # [..., D/2] each\n    " + _HALVES,
                "    half = x.shape[-1] // 2\n    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)",
            ),
        ),
    ),
]

BROKEN = [
    *everyday_breakage("    first, second = x.chunk(2, dim=-1)", "rotate_half"),
    Broken("half-width-tables", replace("angles = torch.cat((angles, angles), dim=-1)", "angles = angles"), "returned (item 0) shape"),
    Broken("wrong-dtype", replace("return angles.cos().to(dtype), angles.sin().to(dtype)", "return angles.cos(), angles.sin()"), "float32, expected bfloat16"),
    Broken("nan", replace("    return 1.0 / (theta**exponents)", "    return 0.0 / (0 * theta**exponents)"), "NaN"),
    Broken("returns-one-tensor", append("\n_both = apply_rope\n\n\ndef apply_rope(q, k, cos, sin):\n    return _both(q, k, cos, sin)[0]\n"), "expected a tuple of 2 tensors"),
]
