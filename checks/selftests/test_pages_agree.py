"""Every number a page's Statement states about its checks is the number the checks use.

A page says what its checks do ("the first tokens of 48 seeded requests must follow the top-3 distribution (a
chi-square test whose false-alarm rate is 1e-4)"); the check file holds the same numbers as named module-level
constants (`DRAWS`, `TOP_K`, `FALSE_ALARM`). Each claim below ties one sentence of a page, in English and in
Chinese, to the value the check module computes its cases from. A claim's patterns match only inside the page's
Statement section, within one sentence, and their groups (`n`, and `m` where the sentence parts the numbers) hold
the numbers as the page writes them: digits (`1e-4`, `-300`), a few number words (`two`, `两`, `half`, `一半`) or
dtype names (`fp32`, `bfloat16`). They are read in the page's order and must equal the value exactly.

When a check changes a number, this test names the sentence to update in both pages; when a page's sentence is
reworded so that its pattern no longer finds it, the test says so, and the pattern moves with the sentence. The
check is the truth: a page that disagrees is the one to fix.
"""

import importlib
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from checks.harness.loader import ROOT
from checks.harness.modules import modules

STEMS = [m.stem for m in modules()]
WORDS = {"one": 1, "two": 2, "three": 3, "four": 4, "half": 0.5, "一半": 0.5, "一": 1, "两": 2, "二": 2, "三": 3,
         "四": 4}
DTYPE_NAMES = {"fp16": "fp16", "float16": "fp16", "bf16": "bf16", "bfloat16": "bf16", "fp32": "fp32",
               "float32": "fp32", "fp64": "fp64", "float64": "fp64"}
# a signed decimal or scientific number, a word (letters, then digits: "fp32"), or a Chinese numeral
TOKEN = re.compile(r"[+-]?\d+(?:\.\d+)?(?:e[+-]?\d+)?|[A-Za-z]+\d*|一半|[一两二三四]")
SENTENCE_END = re.compile(r"[.;:!?]\s|[。；：！？]")


@dataclass(frozen=True)
class Claim:
    stem: str
    claim: str  # what the sentence says, in words
    constant: str  # where the check keeps the number
    value: Callable  # the check module -> the value(s), in the order the pages write them
    en: str  # pattern in the English page's Statement; groups `n` (and `m`) hold the number(s)
    zh: str  # the same in the Chinese page's


def dtypes(names) -> list[str]:
    return [DTYPE_NAMES[str(n).removeprefix("torch.")] for n in names]


def block_size_range(m) -> list[int]:
    """p04: the smallest and largest block size of the checks' paged caches."""
    sizes = [case[-1] for case in [*m.DECODE_CASES.values(), *m.PREFILL_CASES.values()]]
    sizes += [block_size for block_size, _ in m.BLOCK_ORDERS]
    return [min(sizes), max(sizes)]


def layouts_and_world_sizes(m) -> list[int]:
    """p07's layouts as the pages list them: H and KVH of each layout, then the world sizes it is split over."""
    found = []
    for layout in dict.fromkeys(layout for _, layout in m.SPLITS.values()):
        H, KVH = m.LAYOUTS[layout][4:6]
        found += [H, KVH, *[tp for tp, name in m.SPLITS.values() if name == layout]]
    return found


CLAIMS = [
    # m01: the Statement says nothing numeric about the checks beyond the dtypes they run
    Claim("m01_rmsnorm", "rms_norm takes (and the checks run) fp32, bf16 and fp16", "DTYPES",
          lambda m: dtypes(m.DTYPES), r"any float dtype \((?P<n>fp32, bf16 or fp16)\)",
          r"任意浮点 dtype（(?P<n>fp32、bf16 或 fp16)）"),
    Claim("m02_thinker_attention", "a chunked prefill, for example 4 + 7 tokens", "SPLITS (the first split)",
          lambda m: list(m.SPLITS.values())[0], r"a chunked prefill \(for example (?P<n>\d+ \+ \d+) tokens\)",
          r"分块 prefill（比如 (?P<n>\d+ \+ \d+) 个 token）"),
    Claim("m02_thinker_attention", "a prefill of 5 followed by 7 single-token decode steps", "PREFILL_THEN_DECODE",
          lambda m: list(m.PREFILL_THEN_DECODE), r"a prefill of (?P<n>\d+ followed by \d+) single-token decode steps",
          r"先 prefill (?P<n>\d+ 个再逐个 decode \d+) 次"),
    Claim("m03_rope", "HF's rotary embedding with theta 1e6", "THETA", lambda m: m.THETA,
          r"\(theta (?P<n>\S+), passed explicitly\)", r"（theta 为 (?P<n>[^，]+)，显式传入）"),
    Claim("m03_rope", "in fp32 and bf16", "DTYPES", lambda m: dtypes(m.DTYPES),
          r"in (?P<n>\w+ and \w+), at positions", r"覆盖 (?P<n>\w+ 和 \w+)，位置"),
    Claim("m03_rope", "positions that start at 0, at 37 and near 1000", "CHUNK_START, DECODE_NEAR",
          lambda m: [0, m.CHUNK_START, m.DECODE_NEAR], r"positions that start at (?P<n>\d+, at \d+ and near \d+)",
          r"位置分别(?P<n>从 \d+ 开始、从 \d+ 开始和接近 \d+)"),
    Claim("m04_qwen3_model", "tiny random configs of 2 to 4 layers", "LAYOUTS (L)",
          lambda m: [min(x[3] for x in m.LAYOUTS.values()), max(x[3] for x in m.LAYOUTS.values())],
          r"tiny random configs \((?P<n>\d+ to \d+) layers", r"小型随机配置构建（(?P<n>\d+ 到 \d+) 层"),
    Claim("m04_qwen3_model", "logits in fp32 tightly, in bf16 within a tolerance", "DTYPES",
          lambda m: dtypes(m.DTYPES), r"in (?P<n>fp32) tightly, in (?P<m>bf16) within",
          r"(?P<n>fp32) 下严格比对，(?P<m>bf16) 下"),
    Claim("m04_qwen3_model", "greedy tokens for 20 new tokens", "NEW_TOKENS", lambda m: m.NEW_TOKENS,
          r"for (?P<n>\d+) new tokens", r"生成的 (?P<n>\d+) 个新 token"),
    Claim("m04_qwen3_model", "the prompt prefilled in chunks of 1, 2 and 4", "CHUNKED",
          lambda m: sorted(chunk for _, chunk in m.CHUNKED.values()), r"in chunks of (?P<n>\d+, \d+ and \d+), and",
          r"以及按 (?P<n>\d+、\d+、\d+) 个 token 分块 prefill"),
    Claim("p01_block_manager", "prompts of every length in blocks of 1, 3 and 4", "EVERY_LENGTH_BLOCK_SIZES",
          lambda m: m.EVERY_LENGTH_BLOCK_SIZES, r"prompts of every length in blocks of (?P<n>\d+, \d+ and \d+)",
          r"block size 为 (?P<n>\d+、\d+、\d+) 时各种长度的 prompt"),
    Claim("p01_block_manager", "prefixes shared in blocks of 4 and 256", "SHARED_PREFIX_BLOCK_SIZES",
          lambda m: m.SHARED_PREFIX_BLOCK_SIZES, r"prefixes shared in blocks of (?P<n>\d+ and \d+)",
          r"block size 为 (?P<n>\d+ 和 \d+) 时的共享前缀"),
    Claim("p02_store_kvcache", "the checks use fp32 and bf16", "DTYPES", lambda m: dtypes(m.DTYPES),
          r"They use (?P<n>\w+ and \w+), `KVH \* D`", r"检查覆盖 (?P<n>\w+ 和 \w+)，`KVH \* D`"),
    Claim("p02_store_kvcache", "`KVH * D` of 16, 24, 6 and 1024", "LAYOUTS",
          lambda m: [kvh * d for kvh, d in m.LAYOUTS.values()], r"`KVH \* D` of (?P<n>\d+, \d+, \d+ and \d+) \(",
          r"`KVH \* D` 取 (?P<n>\d+、\d+、\d+ 和 \d+)（"),
    Claim("p02_store_kvcache", "three layouts the launcher must refuse", "BAD_LAYOUTS",
          lambda m: len(m.BAD_LAYOUTS), r"and (?P<n>\w+) layouts the launcher must refuse",
          r"以及(?P<n>[一两二三四])种 launcher 必须拒绝的布局"),
    Claim("p03_flash_attention", "online_softmax stays finite for scores all near -300 or all near +300",
          "FAR_FROM_ZERO", lambda m: [-m.FAR_FROM_ZERO, m.FAR_FROM_ZERO],
          r"all near (?P<n>-\d+) or all near (?P<m>\+\d+) in fp32",
          r"分数全在 (?P<n>-\d+) 附近或全在 (?P<m>\+\d+) 附近"),
    Claim("p03_flash_attention", "no tensor half the size of the score matrix", "SCORE_MATRIX_SHARE",
          lambda m: m.SCORE_MATRIX_SHARE, r"No tensor (?P<n>half) the size of the `\[H, Tq, Tk\]` score matrix",
          r"`\[H, Tq, Tk\]` 分数矩阵(?P<n>一半)的张量"),
    Claim("p04_paged_decode", "block sizes from 16 to 256 in the checks", "DECODE_CASES, BLOCK_ORDERS, PREFILL_CASES",
          block_size_range,
          r"\((?P<n>\d+ to \d+) in the checks", r"（检查里为 (?P<n>\d+ 到 \d+)"),
    Claim("p04_paged_decode", "block size 2 in the toy", "TOY['block_size']", lambda m: m.TOY["block_size"],
          r"in the checks, (?P<n>\d+) in the toy\)", r"toy 里为 (?P<n>\d+)）"),
    Claim("p04_paged_decode", "the same keys in blocks of 16, 64 and 256", "BLOCK_ORDERS",
          lambda m: [b for b, _ in m.BLOCK_ORDERS], r"the same keys in blocks of (?P<n>\d+, \d+ and \d+), in order",
          r"放进大小为 (?P<n>\d+、\d+ 和 \d+) 的 block"),
    Claim("p05_scheduler", "the two toy scenarios are replayed", "TOY['scenarios']",
          lambda m: len(m.TOY["scenarios"]), r"replay the (?P<n>\w+) toy scenarios",
          r"下面的(?P<n>[一两二三四])个 toy 场景"),
    Claim("p06_engine", "probabilities on rows of 40 tokens", "SAMPLER_VOCAB", lambda m: m.SAMPLER_VOCAB,
          r"on rows of (?P<n>\d+) tokens", r"在 (?P<n>\d+) 个 token 宽的行上"),
    Claim("p06_engine", "the engine runs in float16", "ENGINE_DTYPE", lambda m: dtypes([m.ENGINE_DTYPE]),
          r"small random Qwen3 models in (?P<n>\w+) against", r"在 (?P<n>\w+) 的小型随机 Qwen3 上运行"),
    Claim("p06_engine", "prompts sharing two full blocks", "SHARED_BLOCKS", lambda m: m.SHARED_BLOCKS,
          r"prompts sharing (?P<n>\w+) full blocks", r"共享(?P<n>[一两二三四])个完整 block 的"),
    Claim("p06_engine", "three prompts sharing them in one step", "PREFIX_PROMPTS", lambda m: m.PREFIX_PROMPTS,
          r"with (?P<n>\w+) prompts sharing", r"完整 block 的(?P<n>[一两二三四])个 prompt"),
    Claim("p06_engine", "a later prompt whose rest is computed in two chunks", "LATER_TAIL, PREFIX_BUDGET",
          lambda m: -(-m.LATER_TAIL // m.PREFIX_BUDGET), r"whose rest is computed in (?P<n>\w+) chunks",
          r"剩下的部分分(?P<n>[一两二三四])块来算"),
    Claim("p06_engine", "three requests under max_num_seqs 2", "SEATS", lambda m: m.SEATS,
          r"three requests under `max_num_seqs` (?P<n>\d+), where", r"预算，`max_num_seqs` 为 (?P<n>\d+) 时的 3 个请求"),
    Claim("p06_engine", "a budget of 5 tokens that chunks the prompts", "CHUNK_BUDGET", lambda m: m.CHUNK_BUDGET,
          r"a budget of (?P<n>\d+) tokens that chunks the prompts", r"把 prompt 分块的 (?P<n>\d+) token 预算"),
    Claim("p06_engine", "the first tokens of 48 seeded requests", "DRAWS", lambda m: m.DRAWS,
          r"the first tokens of (?P<n>\d+) seeded requests", r"(?P<n>\d+) 个带 seed 请求的第一个 token"),
    Claim("p06_engine", "follow the top-3 distribution", "TOP_K", lambda m: m.TOP_K,
          r"must follow the top-(?P<n>\d+) distribution", r"必须服从 top-(?P<n>\d+) 分布"),
    Claim("p06_engine", "the first tokens drawn at temperature 0.75", "DRAW_TEMPERATURE", lambda m: m.DRAW_TEMPERATURE,
          r"false-alarm rate is 1e-4\) at temperature (?P<n>[\d.]+) with top_p",
          r"其中 temperature 为 (?P<n>[\d.]+)、top_p"),
    Claim("p06_engine", "... with top_p 0.95", "DRAW_TOP_P", lambda m: m.DRAW_TOP_P,
          r"at temperature [\d.]+ with top_p (?P<n>[\d.]*\d)", r"、top_p 为 (?P<n>[\d.]*\d)"),
    Claim("p06_engine", "16 more seeded requests in the nucleus", "NUCLEUS_DRAWS", lambda m: m.NUCLEUS_DRAWS,
          r"Then (?P<n>\d+) more seeded requests", r"另外 (?P<n>\d+) 个带 seed 的请求"),
    Claim("p06_engine", "... at temperature 1.5", "NUCLEUS_TEMPERATURE", lambda m: m.NUCLEUS_TEMPERATURE,
          r"more seeded requests at temperature (?P<n>[\d.]+) and", r"个带 seed 的请求在 temperature (?P<n>[\d.]+)、"),
    Claim("p06_engine", "... with top_p 0.2", "NUCLEUS_TOP_P", lambda m: m.NUCLEUS_TOP_P,
          r"at temperature [\d.]+ and top_p (?P<n>[\d.]*\d) must draw only", r"、top_p (?P<n>[\d.]*\d) 下只能抽到"),
    Claim("p06_engine", "a chi-square test whose false-alarm rate is 1e-4", "FALSE_ALARM", lambda m: m.FALSE_ALARM,
          r"a chi-square test whose false-alarm rate is (?P<n>[\d.e+-]+)\)", r"卡方检验，误报率 (?P<n>[\d.e+-]+)）"),
    Claim("p06_engine", "a row at temperature 1e-6 whose two largest logits tie", "TINY_TEMPERATURE",
          lambda m: m.TINY_TEMPERATURE, r"a row at temperature (?P<n>[\d.e+-]+) whose two largest logits tie",
          r"temperature 为 (?P<n>[\d.e+-]+)、最大的两个 logit 相等"),
    Claim("p06_engine", "... 0.01 above the next", "RUNNER_UP_GAP", lambda m: m.RUNNER_UP_GAP,
          r"logits tie, (?P<n>[\d.]+) above the next", r"比第三大的高 (?P<n>[\d.]+) 的一行"),
    Claim("p06_engine", "... a runner-up only 1e-5 below such a tie", "NEAR_GAP", lambda m: m.NEAR_GAP,
          r"a runner-up only (?P<n>[\d.e+-]+) below such a tie", r"只比这两个相等的 logit 低 (?P<n>[\d.e+-]+) 的第三个"),
    Claim("p06_engine", "a seeded request at temperature 1000", "HOT", lambda m: m.HOT,
          r"At temperature (?P<n>\d+), where every token", r"在 temperature (?P<n>\d+) 下，每个 token"),
    Claim("p06_engine", "its 5 tokens must not all be the same", "HOT_TOKENS", lambda m: m.HOT_TOKENS,
          r"a seeded request's (?P<n>\d+) tokens must not all be the same",
          r"带 seed 的请求生成的 (?P<n>\d+) 个 token 不能全都一样"),
    Claim("p06_engine", "the engine with tensor_parallel_size=2", "RANKS", lambda m: m.RANKS,
          r"The engine with `tensor_parallel_size=(?P<n>\d+)`", r"`tensor_parallel_size=(?P<n>\d+)` 的引擎"),
    Claim("p06_engine", "two forked ranks", "RANKS", lambda m: m.RANKS,
          r"\((?P<n>\w+) forked ranks, gloo\)", r"（fork 出(?P<n>[一两二三四])个 rank，用 gloo）"),
    Claim("p06_engine", "two ranks on prompts that share two blocks", "SHARED_BLOCKS", lambda m: m.SHARED_BLOCKS,
          r"on prompts that share (?P<n>\w+) blocks under a budget",
          r"在共享(?P<n>[一两二三四])个 block、又被预算分块"),
    Claim("p06_engine", "a row of Qwen3's 151936 tokens with top_p 1", "QWEN3_VOCAB", lambda m: m.QWEN3_VOCAB,
          r"a row of Qwen3's (?P<n>\d+) tokens with top_p 1", r"Qwen3 词表大小的一行（(?P<n>\d+) 个 token）"),
    Claim("p07_tensor_parallel", "a chunk after caches of 5000 zero keys, at positions 5000 and 5001", "FAR_START",
          lambda m: [m.FAR_START, m.FAR_START, m.FAR_START + 1],
          r"after caches holding (?P<n>\d+) zero keys and values per layer, at positions (?P<m>\d+ and \d+)",
          r"cache 里每层先放 (?P<n>\d+) 个全零的 key 和 value，再算 2 个 token 时，它们位于位置 (?P<m>\d+ 和 \d+)"),
    Claim("p07_tensor_parallel", "models of another eps and RoPE base on the same ranks", "OTHER_MODELS",
          lambda m: [value for _, value in m.OTHER_MODELS],
          r"a model whose norm eps is (?P<n>[\d.]+) and one whose RoPE base is (?P<m>\d+)",
          r"norm 的 eps 为 (?P<n>[\d.]+) 的模型和一个 RoPE 基数为 (?P<m>\d+) 的模型"),
    Claim("p07_tensor_parallel", "a second greedy call for a prompt of 4 tokens", "SECOND_PROMPT",
          lambda m: m.SECOND_PROMPT, r"the second time for a prompt of (?P<n>\d+) tokens",
          r"第二次换成 (?P<n>\d+) 个 token 的 prompt"),
    Claim("p07_tensor_parallel", "the sharding functions for world sizes 1, 2 and 4", "SHARD_WORLD_SIZES",
          lambda m: m.SHARD_WORLD_SIZES, r"for world sizes (?P<n>\d+, \d+ and \d+)",
          r"在 world size (?P<n>\d+、\d+、\d+) 上"),
    Claim("p07_tensor_parallel", "shard_layer for 2 and 4", "LAYER_WORLD_SIZES", lambda m: m.LAYER_WORLD_SIZES,
          r"`shard_layer` for (?P<n>\d+ and \d+)", r"`shard_layer` 在 (?P<n>\d+ 和 \d+) 上"),
    Claim("p07_tensor_parallel", "8 query heads and 2 kv heads over 4 ranks raise ValueError",
          "LAYOUTS['H8-KVH4'] (H), REFUSED_KV_HEADS, REFUSED_WORLD_SIZE",
          lambda m: [m.LAYOUTS["H8-KVH4"][4], m.REFUSED_KV_HEADS, m.REFUSED_WORLD_SIZE],
          r"(?P<n>\d+ query heads and \d+ kv heads over \d+) ranks must raise `ValueError`",
          r"(?P<n>\d+ 个 query head、\d+ 个 kv head 切给 \d+) 个 rank 必须抛出 `ValueError`"),
    Claim("p07_tensor_parallel", "6 query heads and 6 kv heads over 4 ranks raise ValueError",
          "REFUSED_EVEN_HEADS, REFUSED_WORLD_SIZE",
          lambda m: [m.REFUSED_EVEN_HEADS, m.REFUSED_EVEN_HEADS, m.REFUSED_WORLD_SIZE],
          r"as must (?P<n>\d+ query heads and \d+ kv heads over \d+) ranks \(more heads than ranks",
          r"(?P<n>\d+ 个 query head、\d+ 个 kv head 切给 \d+) 个 rank（head 比 rank 多"),
    Claim("p07_tensor_parallel", "process groups of 2 and 4 ranks", "GROUP_SIZES, SPLITS, GREEDY_RANKS",
          lambda m: sorted({*m.GROUP_SIZES, *(tp for tp, _ in m.SPLITS.values()), m.GREEDY_RANKS}),
          r"process groups of (?P<n>\d+ and \d+) worker processes",
          r"检查 fork 出 (?P<n>\d+ 个或 \d+) 个 worker 进程"),
    Claim("p07_tensor_parallel", "the layer and the model in float32 and bfloat16", "DTYPES",
          lambda m: dtypes(m.DTYPES),
          r"at the usual tolerances, in (?P<n>\w+ and \w+), for", r"容差和前面的模块相同，(?P<n>\w+ 和 \w+) 都要跑"),
    Claim("p07_tensor_parallel", "H 4, KVH 2 over 2 ranks; H 8, KVH 4 over 2 and 4 ranks", "LAYOUTS, SPLITS",
          layouts_and_world_sizes,
          r"(?P<n>\d+ heads and \d+ kv heads over \d+ ranks and for \d+ heads and \d+ kv heads over \d+ and \d+) ranks",
          r"布局有 (?P<n>H \d+、KVH \d+ 切成 \d+ 份，以及 H \d+、KVH \d+ 切成 \d+ 份和 \d+) 份"),
    Claim("p07_tensor_parallel", "a prompt prefilled in two chunks of 4 at positions 0 and 4, then a decode step",
          "CHUNKED_CALLS",  # the last call is the decode step
          lambda m: [len(m.CHUNKED_CALLS) - 1, m.CHUNKED_CALLS[0][1], *(start for start, _, _ in m.CHUNKED_CALLS[:-1])],
          r"a prompt prefilled in (?P<n>\w+) chunks of the same length \((?P<len>\d+) tokens at positions "
          r"(?P<at>\d+ and \d+):",
          r"prompt 分成(?P<n>[一两二三四])个等长的分块 prefill（各 (?P<len>\d+) 个 token，"
          r"分别从位置 (?P<at>\d+ 和 \d+) 开始"),
    Claim("p07_tensor_parallel", "the 8 greedy tokens", "GREEDY_TOKENS", lambda m: m.GREEDY_TOKENS,
          r"the (?P<n>\d+) greedy tokens of", r"贪心生成的 (?P<n>\d+) 个 token"),
    Claim("p07_tensor_parallel", "greedy generation on 2 ranks", "GREEDY_RANKS", lambda m: m.GREEDY_RANKS,
          r"greedy tokens of (?P<n>\d+) ranks", r"(?P<n>\d+) 个 rank 上贪心生成"),
    Claim("p07_tensor_parallel", "a layer makes exactly two all_reduce calls", "LAYER_ALL_REDUCES",
          lambda m: m.LAYER_ALL_REDUCES, r"a layer must make exactly (?P<n>\w+) `all_reduce` calls",
          r"一层必须恰好调用(?P<n>[一两二三四])次 `all_reduce`"),
    Claim("p07_tensor_parallel", "a whole forward makes 2L+1 all_reduce calls", "LAYER_ALL_REDUCES",
          lambda m: m.LAYER_ALL_REDUCES, r"a whole forward (?P<n>\d+)L ?\+ ?1 `all_reduce` calls",
          r"整个模型是 (?P<n>\d+)L ?\+ ?1 次 `all_reduce`"),
    Claim("p08_moe", "route and the block in float32 and bfloat16", "DTYPES", lambda m: dtypes(m.DTYPES.values()),
          r"in (?P<n>float32 and bfloat16), for", r"(?P<n>float32 和 bfloat16) 都要跑"),
    Claim("p08_moe", "permute in blocks of 4 and 16", "EDGE_CASES (block_size)",
          lambda m: sorted({case[-1] for case in m.EDGE_CASES.values()}),
          r"in blocks of (?P<n>\d+ and \d+)", r"块大小取 (?P<n>\d+ 和 \d+)"),
    Claim("p08_moe", "fused_moe in blocks of 16", "BLOCK_SIZE", lambda m: m.BLOCK_SIZE,
          r"with each expert's MLP, in blocks of (?P<n>\d+)", r"以 (?P<n>\d+) 行为一块"),
    Claim("p08_moe", "12 tokens in three chunks", "CHUNKS", lambda m: [m.CHUNKS[-1][1], len(m.CHUNKS)],
          r"on (?P<n>\d+ tokens in \w+) chunks", r"把 (?P<n>\d+ 个 token 分成[一两二三四])段"),
    Claim("p08_moe", "a case at hidden 1024", "REAL (hidden)", lambda m: m.REAL[1],
          r"at hidden (?P<n>\d+)", r"再在 hidden (?P<n>\d+) 上"),
    Claim("p08_moe", "2 ranks holding 5 and 3 tokens, 4 ranks holding 3, 0, 4 and 2", "EP_CASES",
          lambda m: [n for world, counts, _ in m.EP_CASES.values() for n in (world, *counts)],
          r"(?P<n>\d+ ranks holding \d+ and \d+ tokens and \d+ ranks holding \d+, \d+, \d+ and \d+), and every",
          r"(?P<n>\d+ 个 rank 各有 \d+ 个和 \d+ 个 token，\d+ 个 rank 各有 \d+、\d+、\d+、\d+) 个 token"),
    Claim("p08_moe", "at most 4 all_to_all calls", "MAX_EXCHANGES", lambda m: m.MAX_EXCHANGES,
          r"at most (?P<n>\d+) `all_to_all` calls", r"最多调用 (?P<n>\d+) 次 `all_to_all`"),
    Claim("p08_moe", "6 experts over 4 ranks raise ValueError", "REFUSED_EXPERTS, REFUSED_WORLD_SIZE",
          lambda m: [m.REFUSED_EXPERTS, m.REFUSED_WORLD_SIZE],
          r"`shard_experts` of (?P<n>\d+ experts over \d+) ranks must raise",
          r"(?P<n>\d+ 个专家分给 \d+) 个 rank 时 `shard_experts` 必须抛出"),
    Claim("p09_overlap", "the fused kernels in fp32 and bf16", "DTYPES", lambda m: dtypes(m.DTYPES.values()),
          r"both in (?P<n>fp32 and bf16) on rows", r"两者都在 (?P<n>fp32 和 bf16) 下"),
    Claim("p09_overlap", "norm rows of widths 40 and 1024, MLP rows of 24 and 3072", "NORM_SHAPES, MLP_SHAPES",
          lambda m: [n for _, n in m.NORM_SHAPES.values()] + [i for _, i in m.MLP_SHAPES.values()],
          r"rows of widths (?P<n>\d+ and \d+) for the norm and (?P<m>\d+ and \d+) for the MLP",
          r"norm 的行宽取 (?P<n>\d+ 和 \d+)，MLP 的取 (?P<m>\d+ 和 \d+)"),
    Claim("p09_overlap", "a greedy batch of prompts of 5, 13 and 8 tokens, 4 new tokens each", "GREEDY_RUNS",
          lambda m: [*m.GREEDY_RUNS[m.GREEDY_LAYOUT][0], m.GREEDY_RUNS[m.GREEDY_LAYOUT][1]],
          r"a batch of prompts of (?P<n>\d+, \d+ and \d+ tokens with \d+) new tokens each",
          r"长度为 (?P<n>\d+、\d+、\d+ 个 token 的 prompt，各生成 \d+) 个新 token"),
    Claim("p09_overlap", "at Qwen3-0.6B's widths one prompt of 6 tokens, 3 new tokens, blocks of 256", "GREEDY_RUNS",
          lambda m: [m.GREEDY_RUNS[m.QWEN3][0][0], m.GREEDY_RUNS[m.QWEN3][1], m.GREEDY_RUNS[m.QWEN3][2].block_size],
          r"one prompt of (?P<n>\d+ tokens and \d+) new tokens on blocks of (?P<m>\d+)",
          r"一个 (?P<n>\d+ 个 token 的 prompt 生成 \d+) 个新 token，块大小 (?P<m>\d+)"),
]


def statement(stem: str, language: str) -> tuple[str, str]:
    """(the page's name, its Statement section)."""
    folder = ROOT / "exercises" / ("zh" if language == "zh" else "")
    page = folder / f"{stem}.md"
    text = page.read_text(encoding="utf-8")
    return str(page.relative_to(ROOT)), text.split("\n## Statement\n", 1)[1].split("\n## ", 1)[0]


def numbers(text: str) -> list:
    """What a page writes, in its order: numbers, number words and dtype names; other words are skipped."""
    found = []
    for token in TOKEN.findall(text):
        if token in WORDS or token.lower() in WORDS:
            found.append(WORDS.get(token, WORDS.get(token.lower())))
        elif token.lower() in DTYPE_NAMES:
            found.append(DTYPE_NAMES[token.lower()])
        elif token[-1].isdigit() and (token[0].isdigit() or token[0] in "+-"):
            found.append(float(token))
    return found


def same(page: list, check: list) -> bool:
    if len(page) != len(check):
        return False
    for a, b in zip(page, check):
        if isinstance(a, str) or isinstance(b, str):
            if a != b:
                return False
        elif not math.isclose(float(a), float(b), rel_tol=1e-12):
            return False
    return True


def expected_values(claim: Claim) -> list:
    value = claim.value(importlib.import_module(f"checks.test_{claim.stem}"))
    values = list(value) if isinstance(value, list | tuple) else [value]
    return [dtypes([v])[0] if isinstance(v, torch.dtype) else v for v in values]


def claim_id(claim: Claim) -> str:
    return f"{claim.stem.split('_')[0]}-{re.sub(r'[^a-z0-9]+', '-', claim.claim.lower()).strip('-')}"


@pytest.mark.parametrize("language", ["en", "zh"])
@pytest.mark.parametrize("claim", CLAIMS, ids=claim_id)
def test_page_states_the_checks_number(claim, language):
    page, text = statement(claim.stem, language)
    pattern = claim.en if language == "en" else claim.zh
    found = list(re.finditer(pattern, text))
    assert found, (f"{page}: no sentence of the Statement matches {pattern!r} ({claim.claim}): reword the pattern "
                   f"with the sentence, or restore the sentence")
    assert len(found) == 1, f"{page}: {len(found)} sentences match {pattern!r} ({claim.claim}): make it specific"
    match = found[0]
    assert not SENTENCE_END.search(text[match.start() : match.end()]), \
        f"{page}: {pattern!r} spans two sentences: {match.group(0)!r}"
    written = numbers(" ".join(group for group in match.groups() if group))
    expected = expected_values(claim)
    assert same(written, expected), (
        f"{page} says {match.group(0)!r} ({claim.claim}), but the check's {claim.constant} gives "
        f"{expected}: fix the page (English and Chinese) to the check's numbers")


@pytest.mark.parametrize("stem", STEMS)
def test_every_module_has_its_claims_covered(stem):
    """Every module's page has a claim held to its checks (m01's Statement states only the dtypes)."""
    assert any(claim.stem == stem for claim in CLAIMS), f"no claim of {stem}'s page is held to its checks"
