"""Known mistakes in M02 (thinker attention), each a patch of `solutions/m02_thinker_attention.py`.

Ids match the Pitfalls section of `exercises/m02_thinker_attention.md`.
"""

from checks.harness.mistakes import Broken, Mistake, Variant, append, chain, everyday_breakage, replace

_ROPE_BOTH = "q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)"
_SCORES = 'scores = torch.einsum("thd,shd->hts", q.float(), keys.float()) * D**-0.5'

MISTAKES = [
    Mistake(
        "past-after-append",
        "len(cache) read after appending the new keys",
        "Read past = len(cache) before cache.append(...): afterwards it already counts the T new tokens.",
        chain(
            replace("    past = 0 if cache is None else len(cache)  # read before the append, or the mask shifts by T\n", ""),
            replace("        keys, values = k, v\n", "        keys, values = k, v\n        past = 0\n"),
            replace("        cache.append(k, v)\n", "        cache.append(k, v)\n        past = len(cache)\n"),
            replace("    S = past + T", "    S = keys.shape[0]"),
            replace("torch.arange(past, S, device=x.device)[:, None]", "(past + torch.arange(T, device=x.device))[:, None]"),
        ),
    ),
    Mistake(
        "chunk-local-mask",
        "causal mask built from positions inside the chunk",
        "Query i of this call sits at absolute position past + i; a mask from arange(T) lets a decode token see only key 0.",
        replace("torch.arange(past, S, device=x.device)[:, None]", "torch.arange(T, device=x.device)[:, None]"),
    ),
    Mistake(
        "repeat-not-interleave",
        "GQA heads expanded with repeat (h % KVH) instead of repeat_interleave (h // (H/KVH))",
        "Query head h must read kv head h // (H // KVH): expand with repeat_interleave along the head dim.",
        chain(
            replace("keys = keys.repeat_interleave(group, dim=1)", "keys = keys.repeat(1, group, 1)"),
            replace("values = values.repeat_interleave(group, dim=1)", "values = values.repeat(1, group, 1)"),
        ),
    ),
    Mistake(
        "qk-norm-after-rope",
        "RoPE applied before the per-head RMSNorm",
        "Order is projections -> q_norm/k_norm -> RoPE: the norm's per-dim weights do not commute with the rotation.",
        chain(
            replace("    q = _head_rms_norm(q, w.q_norm, w.eps)", "    " + _ROPE_BOTH + "\n    q = _head_rms_norm(q, w.q_norm, w.eps)"),
            replace("    " + _ROPE_BOTH + "\n\n", "\n"),
        ),
    ),
    Mistake(
        "norm-over-all-heads",
        "one RMS over all H*D values of a token instead of one per head",
        "QK-norm normalises each head over its own D values: reduce over the last dim of [T, heads, D].",
        replace(
            "normed = t32 * torch.rsqrt(t32.pow(2).mean(dim=-1, keepdim=True) + eps)",
            "normed = t32 * torch.rsqrt(t32.pow(2).mean(dim=(-2, -1), keepdim=True) + eps)",
        ),
    ),
    Mistake(
        "softmax-wrong-dim",
        "softmax over the queries instead of the keys",
        "Each query's weights over the keys must sum to 1: softmax over the last (key) dim of [H, T, S].",
        replace("probs = scores.softmax(dim=-1)", "probs = scores.softmax(dim=-2)"),
    ),
    Mistake(
        "rerotate-cached-keys",
        "RoPE applied to the whole key history with the new tokens' cos/sin",
        "Cached keys were rotated at their own positions when stored; rotate only the T new keys, before appending.",
        chain(
            replace(_ROPE_BOTH, "q = _apply_rope(q, cos, sin)"),
            replace(
                "keys = keys.repeat_interleave(group, dim=1)",
                "keys = _apply_rope(keys, cos, sin).repeat_interleave(group, dim=1)",
            ),
        ),
    ),
    Mistake(
        "no-causal-mask",
        "no causal mask",
        "Mask keys after each query's absolute position (key_pos > past + i) with -inf before the softmax.",
        replace("    scores = scores.masked_fill(key_pos > query_pos, float(\"-inf\"))", "    del key_pos, query_pos"),
    ),
    Mistake(
        "wrong-scale",
        "scores divided by D instead of sqrt(D)",
        "Scale scores by D ** -0.5 (1 / sqrt(head_dim)), not 1 / D or 1 / sqrt(hidden).",
        replace(_SCORES, _SCORES.replace("D**-0.5", "D**-1.0")),
    ),
    Mistake(
        "v-normalised",
        "an RMSNorm applied to v",
        "Only q and k get the per-head RMSNorm; values go into the cache and the weighted sum untouched.",
        replace("    k = _head_rms_norm(k, w.k_norm, w.eps)", "    k = _head_rms_norm(k, w.k_norm, w.eps)\n    v = _head_rms_norm(v, torch.ones_like(w.k_norm), w.eps)"),
    ),
    Mistake(
        "cache-ignored",
        "attention over the new tokens only",
        "After appending, attend over torch.cat(cache.k) / torch.cat(cache.v): all S = past + T keys, not just the new T.",
        chain(
            replace("keys, values = torch.cat(cache.k), torch.cat(cache.v)  # [S, KVH, D]", "keys, values = k, v"),
            replace("    S = past + T", "    S, past = T, 0"),
        ),
    ),
    Mistake(
        "cache-holds-expanded-heads",
        "the cache stores K/V after the GQA expansion ([t, H, D])",
        "Append k and v with KVH heads and expand copies only for the computation: the cache must stay [t, KVH, D].",
        chain(
            replace("        cache.append(k, v)\n", "        cache.append(k.repeat_interleave(H // KVH, dim=1), v.repeat_interleave(H // KVH, dim=1))\n"),
            replace("    group = H // KVH", "    group = H // KVH if cache is None else 1"),
        ),
    ),
    Mistake(
        "input-modified",
        "an input tensor changed in place (rotate_half's sign folded into the caller's sin)",
        "Never write into x, cos, sin, the weights or old cache chunks: build new tensors (no `_`-suffixed ops on them).",
        append(
            '''
def _rotate_half(t):
    first, second = t.chunk(2, dim=-1)
    return torch.cat((second, first), dim=-1)  # the sign now lives in sin


_computed = attention_forward


def attention_forward(w, x, cos, sin, cache=None):
    sin[:, : sin.shape[-1] // 2].neg_()  # fold rotate_half's sign into the caller's sin
    return _computed(w, x, cos, sin, cache)
'''
        ),
    ),
    Mistake(
        "hard-coded-toy",
        "the toy's answers returned instead of computed ones",
        "Compute the output from the inputs: the checks draw random weights and shapes every run.",
        append(
            '''
_computed = attention_forward


def attention_forward(w, x, cos, sin, cache=None):
    past = 0 if cache is None else len(cache)
    out = _computed(w, x, cos, sin, cache)  # keeps the cache right
    toy = torch.tensor([[1.0, 0.0], [0.1956, 0.8044], [1.5768, 1.5768]])
    rows = toy[torch.arange(past, past + x.shape[0]) % 3]
    return rows.repeat(1, out.shape[1])[:, : out.shape[1]].to(out.dtype)
'''
        ),
    ),
    Mistake(
        "no-scale",
        "scores never scaled by 1 / sqrt(D)",
        "Multiply q . k by D ** -0.5 before the softmax: unscaled scores grow with D and the softmax saturates.",
        replace(_SCORES, _SCORES.replace(" * D**-0.5", "")),
    ),
    Mistake(
        "o-proj-skipped",
        "the heads returned as they are, without o_proj",
        "The attention output is `[T, H*D]` only before o_proj; the layer returns `out @ o_proj.T`, `[T, hidden]`.",
        replace("    return out.reshape(T, H * D) @ w.o_proj.T  # [T, H*D] -> [T, hidden]",
                "    return out.reshape(T, H * D)[:, : w.o_proj.shape[0]]  # [T, H*D] -> [T, hidden]"),
    ),
]

VARIANTS = [
    Variant(
        "hf-eager-rounding",
        "Hugging Face eager's rounding: QK^T and P@V in the model dtype, only the softmax in fp32",
        chain(
            replace(_SCORES, 'scores = torch.einsum("thd,shd->hts", q, keys) * D**-0.5'),
            replace("probs = scores.softmax(dim=-1)", "probs = scores.softmax(dim=-1, dtype=torch.float32).to(x.dtype)"),
            replace('torch.einsum("hts,shd->thd", probs, values.float()).to(x.dtype)', 'torch.einsum("hts,shd->thd", probs, values)'),
        ),
    ),
    Variant(
        "expand-reshape-gqa",
        "GQA by a zero-copy expand + reshape instead of repeat_interleave",
        chain(
            replace(
                "keys = keys.repeat_interleave(group, dim=1)",
                "keys = keys[:, :, None, :].expand(S, KVH, group, D).reshape(S, H, D)",
            ),
            replace(
                "values = values.repeat_interleave(group, dim=1)",
                "values = values[:, :, None, :].expand(S, KVH, group, D).reshape(S, H, D)",
            ),
        ),
    ),
]

VARIANTS.append(
    Variant(
        "sdpa",
        "torch's scaled_dot_product_attention in the model dtype, with a boolean mask from absolute positions",
        chain(
            replace("    " + _SCORES + "  # [H, T, S]\n", ""),
            replace(
                '    scores = scores.masked_fill(key_pos > query_pos, float("-inf"))  # [T, S] mask broadcasts over H\n'
                "    probs = scores.softmax(dim=-1)  # over keys; every row sees at least key 0\n"
                '    out = torch.einsum("hts,shd->thd", probs, values.float()).to(x.dtype)  # [T, H, D]\n',
                "    out = torch.nn.functional.scaled_dot_product_attention(\n"
                "        q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=key_pos <= query_pos\n"
                "    ).transpose(0, 1)\n",
            ),
        ),
    )
)

BROKEN = [
    *everyday_breakage("    group = H // KVH", "attention_forward"),
    Broken("wrong-shape", replace("return out.reshape(T, H * D) @ w.o_proj.T", "return out.reshape(T, H * D)"), "returned shape"),
    Broken("wrong-dtype", replace("return out.reshape(T, H * D) @ w.o_proj.T", "return (out.reshape(T, H * D) @ w.o_proj.T).double()"), "returned float64"),
    Broken("nan", replace("    probs = scores.softmax(dim=-1)", "    probs = scores.softmax(dim=-1) * float('nan')"), "NaN"),
    Broken("import-error", replace("import torch", "import torch\nimport kvlab_no_such_module"), "ModuleNotFoundError"),
]
