"""The stand-ins for the reference's kernels (checks/harness/standins.py) write what the interpreted kernels
write, launch for launch, and a replay uses them only for kernels that are not the module it is about."""

import sys

import pytest
import torch

from checks.harness.interpreter import DEVICE
from checks.harness.loader import named
from checks.harness.mistakes import catalogue
from checks.harness.standins import Launch, use_standins

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="the stand-ins stand in for the CPU interpreter")
KERNELS = ("p02_store_kvcache", "p03_flash_attention", "p04_paged_decode")


def references():
    """The reference's kernel modules twice: as written (interpreted) and with every launch stood in."""
    written, stood_in = named("solutions"), named("solutions")  # two packages, each its own modules
    written, stood_in = [written.load(stem) for stem in KERNELS], [stood_in.load(stem) for stem in KERNELS]
    use_standins(stood_in[0], own="")
    return written, stood_in


WRITTEN, STOOD_IN = references()
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def agree(got: torch.Tensor, expected: torch.Tensor, dtype=torch.float16):
    assert torch.equal(got.isinf(), expected.isinf()) and torch.equal(got == 0, expected == 0)
    finite = expected.isfinite()
    torch.testing.assert_close(got[finite].float(), expected[finite].float(), atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])


def test_every_launch_of_the_stood_in_modules_goes_through_a_stand_in():
    p02, p03, p04 = STOOD_IN
    assert isinstance(p02.store_kvcache_kernel, Launch) and isinstance(p03._flash_attn_varlen_kernel, Launch)
    assert isinstance(p04._paged_attention_kernel, Launch) and isinstance(p04._merge_splits_kernel, Launch)
    assert not isinstance(WRITTEN[1]._flash_attn_varlen_kernel, Launch)


def test_a_replay_stands_in_for_the_other_modules_kernels_only():
    engine = catalogue("p06_engine").implementation(catalogue("p06_engine").mistakes[0]).load("p06_engine")
    kernel = catalogue("p04_paged_decode").implementation(catalogue("p04_paged_decode").mistakes[0]).load(
        "p04_paged_decode")
    use_standins(engine, "p06_engine")
    use_standins(kernel, "p04_paged_decode")
    package = engine.__name__.rsplit(".", 1)[0]
    assert isinstance(sys.modules[f"{package}.p03_flash_attention"]._flash_attn_varlen_kernel, Launch)
    assert not isinstance(kernel._paged_attention_kernel, Launch)  # the mutant's own kernel runs as written


def test_store_kvcache_writes_the_same_slots():
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(7, 3 * 2 * 16, generator=gen).half()
    key, value = qkv[:, 32:64].view(7, 2, 16), qkv[:, 64:].view(7, 2, 16)  # token stride 96: slices of qkv
    slots = torch.tensor([5, -1, 0, 11, 3, -1, 8])
    caches = []
    for module in (WRITTEN[0], STOOD_IN[0]):
        k_cache, v_cache = torch.zeros(3, 4, 2, 16).half(), torch.zeros(3, 4, 2, 16).half()
        module.store_kvcache(key, value, k_cache, v_cache, slots)
        caches.append((k_cache, v_cache))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_flash_attn_varlen_gives_the_same_rows_and_lse(dtype, causal):
    gen = torch.Generator().manual_seed(1)
    lengths_q, lengths_k = [3, 1, 5, 4], [3, 6, 2, 70]  # a prefix (6 keys, 1 query), a query seeing none, 2 tiles
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(lengths_q), 4, 32, generator=gen).to(dtype)
    k, v = (torch.randn(sum(lengths_k), 2, 32, generator=gen).to(dtype) for _ in range(2))
    got = [m.flash_attn_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal, return_lse=True)
           for m in (STOOD_IN[1], WRITTEN[1])]
    agree(got[0][0], got[1][0], dtype)
    agree(got[0][1], got[1][1], dtype)


@pytest.mark.parametrize("splits", [1, 3])
def test_paged_decode_and_prefill_give_the_same_rows(splits):
    gen = torch.Generator().manual_seed(2)
    k_cache, v_cache = (torch.randn(6, 4, 2, 32, generator=gen).half() for _ in range(2))
    table = torch.tensor([[2, 0, -1], [5, 1, 3], [4, -1, -1]], dtype=torch.int32)
    seqlens = torch.tensor([6, 11, 0], dtype=torch.int32)  # the last row pads: no keys, output 0
    q = torch.randn(3, 4, 32, generator=gen).half()
    got = [m.paged_decode(q, k_cache, v_cache, table, seqlens, num_splits=splits) for m in (STOOD_IN[2], WRITTEN[2])]
    agree(got[0], got[1])
    cu_q = torch.tensor([0, 2, 5, 5], dtype=torch.int32)
    q = torch.randn(5, 4, 32, generator=gen).half()
    got = [m.paged_prefill(q, k_cache, v_cache, table, cu_q, seqlens, 3, num_splits=splits)
           for m in (STOOD_IN[2], WRITTEN[2])]
    agree(got[0], got[1])
