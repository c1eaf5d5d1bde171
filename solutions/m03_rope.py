"""M03 · RoPE: the cos/sin tables m02 receives, the rotation, and Qwen3-Omni's 3-D M-RoPE.

Rotary position embedding turns each pair of channels (i, i + D/2) of a query or key into a point in
a plane and rotates it by `position * inv_freq[i]`, so that the dot product of a rotated query and key
depends only on the distance between their positions. The conventions follow Hugging Face's
`Qwen3RotaryEmbedding` and `apply_rotary_pos_emb` (angles in fp32, the two halves of the table
duplicated, the half-split `rotate_half`); `build_rotary_cache` and `rotary` follow nano-vllm's
rotary module (a fp32 cos|sin table built once, rows looked up by position, rotation in fp32). The
M-RoPE tables follow `Qwen3OmniMoeThinkerTextRotaryEmbedding`.

nano-vllm packs its two steps in a module whose `forward(positions, q, k)` does the lookup and the
rotation. Here they are two functions, so that each can be checked on its own:
`functools.partial(rotary, build_rotary_cache(D, max_position, theta))` is that module, called as
`rotary(positions, q, k)`.

Names: T tokens, H query heads, KVH key/value heads, D head dim (even).

Run `./check.sh m03` to check this file.
"""

import torch


def inverse_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    """The rotation speed of each channel pair: `inv_freq[i] = theta ** (-2i / D)`.

    Args:
        head_dim: D, even.
        theta: the base. Qwen3 uses 1,000,000; Hugging Face's config default is 10,000, so always pass
            the model's value.

    Returns:
        `[D/2]` fp32, computed as `1 / theta ** (arange(0, D, 2) / D)` in fp32 (Hugging Face's rounding).
        `inv_freq[0] == 1`, and the values fall towards `1 / theta`.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim  # [D/2]: 0, 2/D, 4/D, ...
    return 1.0 / (theta**exponents)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos and sin tables for a vector of absolute positions (Hugging Face's convention).

    Args:
        positions: `[T]` integer absolute positions, in any order (a chunk starting at 37 is
            `arange(37, 37 + T)`; a decode step is one position). Not modified.
        inv_freq: `[D/2]` fp32, from `inverse_frequencies`. Not modified.
        dtype: the dtype of the returned tables (the model's dtype).

    Returns:
        `(cos, sin)`, each `[T, D]` in `dtype`. Row t holds the angles `positions[t] * inv_freq`,
        computed in fp32 and written twice, `[angles, angles]` (the two halves duplicated), then
        `cos`/`sin` in fp32 and one cast to `dtype`.
    """
    angles = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]  # [T, D/2] fp32
    angles = torch.cat((angles, angles), dim=-1)  # [T, D]: channel i and i + D/2 turn together
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The half-split (NeoX) quarter turn: `[x1, x2] -> [-x2, x1]` on the last dim.

    Args:
        x: `[..., D]`, any float dtype. Not modified.

    Returns:
        `[..., D]` like `x`: the first half is minus the second half of `x`, the second half is the
        first half of `x`. (Not interleaved pairs: channel i is paired with channel i + D/2.)
    """
    first, second = x.chunk(2, dim=-1)  # [..., D/2] each
    return torch.cat((-second, first), dim=-1)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate queries and keys by their tokens' angles: `x * cos + rotate_half(x) * sin`.

    Args:
        q: `[T, H, D]`. Not modified.
        k: `[T, KVH, D]`, same dtype. Not modified.
        cos, sin: `[T, D]` in the same dtype, from `rope_cos_sin` (row t belongs to token t). Not modified.

    Returns:
        `(q_rotated, k_rotated)`, shapes and dtype of `q` and `k`. The products and the sum run in the
        inputs' dtype, as in Hugging Face's `apply_rotary_pos_emb`; rotating in fp32 and rounding once
        is also accepted.
    """
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, D] -> [T, 1, D], broadcast over the heads
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def build_rotary_cache(head_dim: int, max_position: int, theta: float) -> torch.Tensor:
    """nano-vllm's table, built once: the half-width cos and sin of every position below `max_position`.

    Args:
        head_dim: D, even.
        max_position: the number of positions the table covers (0 .. max_position - 1).
        theta: the base, as in `inverse_frequencies`.

    Returns:
        `[max_position, D]` fp32: row p is `[cos(p * inv_freq), sin(p * inv_freq)]`, each half `[D/2]`
        (no duplication: `rotary` duplicates what it looks up). Angles in fp32, as in `rope_cos_sin`.
    """
    positions = torch.arange(max_position)  # [max_position]
    angles = positions.to(torch.float32)[:, None] * inverse_frequencies(head_dim, theta)[None, :]  # [P, D/2]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)  # [P, D]: cos | sin


def rotary(
    cos_sin_cache: torch.Tensor, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """nano-vllm's rotary step: look up each token's row of the fp32 table and rotate q and k.

    Args:
        cos_sin_cache: `[max_position, D]` fp32 from `build_rotary_cache`. Not modified.
        positions: `[T]` integer absolute positions, each below `max_position`. Not modified.
        q: `[T, H, D]`, any float dtype. Not modified.
        k: `[T, KVH, D]`, same dtype. Not modified.

    Returns:
        `(q_rotated, k_rotated)`, shapes and dtype of `q` and `k`. Rounding rule: q and k are upcast to
        fp32, rotated with the fp32 cos/sin, and rounded to their dtype once at the end (nano-vllm's
        rule; it is at least as accurate as Hugging Face's rotation in the model dtype). Casting the
        looked-up cos/sin to q's dtype and rotating there (Hugging Face's rounding) is also accepted.
    """
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [T, D] -> [T, D/2] each
    cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)  # [T, D], halves duplicated
    q_rotated, k_rotated = apply_rope(q.float(), k.float(), cos, sin)
    return q_rotated.to(q.dtype), k_rotated.to(k.dtype)


def mrope_cos_sin(
    position_ids: torch.Tensor, inv_freq: torch.Tensor, mrope_section: list[int], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-Omni thinker's M-RoPE tables from 3-D (t, h, w) positions, frequency slots interleaved.

    Each frequency slot i (0 .. D/2 - 1) takes its angle from one of the three position rows: slots
    `1, 4, 7, ...` (the first `mrope_section[1]` of them) from h, slots `2, 5, 8, ...` (the first
    `mrope_section[2]`) from w, and every other slot from t (`mrope_section[0]` slots in all). For text
    every row is the token's ordinary position, and the tables equal `rope_cos_sin`'s.

    Args:
        position_ids: `[3, T]` integer positions, rows t, h, w. Not modified.
        inv_freq: `[D/2]` fp32 from `inverse_frequencies`. Not modified.
        mrope_section: three slot counts summing to D/2, `[24, 20, 20]` for D = 128.
        dtype: the dtype of the returned tables.

    Returns:
        `(cos, sin)`, each `[T, D]` in `dtype`: the chosen angles (fp32) for the first half, the same
        angles again for the second half, then cos/sin in fp32 and one cast to `dtype`.
    """
    angles = position_ids.to(torch.float32)[:, :, None] * inv_freq.to(torch.float32)  # [3, T, D/2]
    slot = torch.arange(inv_freq.shape[0])  # [D/2]
    axis = torch.zeros_like(slot)  # 0 = t everywhere, then h and w take their interleaved slots
    for row in (1, 2):
        axis[(slot % 3 == row) & (slot < 3 * mrope_section[row])] = row
    chosen = angles.gather(0, axis.expand(1, angles.shape[1], -1))[0]  # [T, D/2]: slot i from row axis[i]
    chosen = torch.cat((chosen, chosen), dim=-1)  # [T, D]
    return chosen.cos().to(dtype), chosen.sin().to(dtype)
