"""P02 · store_kvcache: scatter a step's new keys and values into the paged KV cache, in Triton.

Every attention layer of a paged engine first stores the keys and values it just computed: token t goes
to cache slot `slot_mapping[t]` (p01 computes the mapping), and a slot of -1 means "store nothing" (a
padding row of a batch captured in a CUDA graph). It is a scatter, one row per token, which a plain
copy cannot express. You will learn to write it twice: in PyTorch first (the version to read), then as
a Triton kernel and its launcher, the way nano-vllm's `store_kvcache` does it
(`nanovllm/layers/attention.py`): one program per token, pointers from strides, the layout assumptions
asserted in the launcher. The kernel runs compiled on a GPU and, with TRITON_INTERPRET=1, on a CPU.

Names: N new tokens, KVH key/value heads, D head dim, ROW = KVH*D values per token and per slot; the
cache of one layer is `[num_blocks, block_size, KVH, D]`, and slot s is row s of it seen as
`[num_blocks * block_size, ROW]`.

Run `./check.sh p02` to check this file.
"""

import torch
import triton
import triton.language as tl


def store_kvcache_torch(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Plain PyTorch: `k_cache[slot] = key[t]` and `v_cache[slot] = value[t]` for every token t whose
    `slot = slot_mapping[t]` is not -1. Same arguments and contract as `store_kvcache`.

    Memory traffic: the boolean mask and the gathers `key[keep]`, `value[keep]` read and write a
    compacted copy of the rows before the scatter writes them again, so K and V cross memory about
    twice (the kernel below reads each row once and writes it once) and there are several launches.
    """
    N, KVH, D = key.shape
    keep = slot_mapping != -1  # [N]: padding rows (slot -1) store nothing
    slots = slot_mapping[keep].long()  # [n]
    k_rows = k_cache.view(-1, KVH * D)  # [num_blocks * block_size, ROW]: row s is slot s (a view)
    v_rows = v_cache.view(-1, KVH * D)
    k_rows[slots] = key[keep].reshape(-1, KVH * D)  # [n, ROW]
    v_rows[slots] = value[keep].reshape(-1, KVH * D)


@triton.jit
def store_kvcache_kernel(
    key_ptr,  # [N, KVH, D] keys: a token's ROW values are contiguous, tokens key_token_stride apart
    key_token_stride,  # elements from one token's keys to the next (ROW, or more for a slice of qkv)
    value_ptr,  # [N, KVH, D] values, laid out like the keys
    value_token_stride,
    k_cache_ptr,  # [num_blocks * block_size, ROW] key cache: slot s starts at s * cache_slot_stride
    v_cache_ptr,  # the value cache, laid out like the key cache
    cache_slot_stride,  # elements from one slot to the next: ROW for a contiguous cache
    slot_mapping_ptr,  # [N] int32 or int64: the slot of each token, -1 for none
    ROW: tl.constexpr,  # KVH * D: the values one token stores in each cache
    BLOCK: tl.constexpr,  # the power of two >= ROW that tl.arange needs; lanes ROW.. are masked off
):
    """One program per token: load `slot_mapping[token]`; if it is -1, return; otherwise copy the
    token's ROW keys and ROW values to row `slot` of `k_cache` and `v_cache`."""
    token = tl.program_id(0).to(tl.int64)  # 64-bit: token * stride may pass 2**31 in a long batch
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot == -1:
        return
    lanes = tl.arange(0, BLOCK)  # [BLOCK]
    inside = lanes < ROW  # [BLOCK]: off for the padding lanes when ROW is not a power of two
    key = tl.load(key_ptr + token * key_token_stride + lanes, mask=inside)  # [BLOCK]
    value = tl.load(value_ptr + token * value_token_stride + lanes, mask=inside)
    tl.store(k_cache_ptr + slot * cache_slot_stride + lanes, key, mask=inside)
    tl.store(v_cache_ptr + slot * cache_slot_stride + lanes, value, mask=inside)


def store_kvcache(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store each token's keys and values in its cache slot, with one Triton program per token.

    Args:
        key, value: `[N, KVH, D]`, same shape and dtype. Each token's KVH*D values must be contiguous
            (`stride(2) == 1`, `stride(1) == D`); the token stride `stride(0)` may be anything, e.g.
            the row width of a fused qkv output that `key` and `value` are slices of.
        k_cache, v_cache: `[num_blocks, block_size, KVH, D]` in key's dtype and on its device,
            contiguous. Written in place: the rows of the mapped slots, and nothing else.
        slot_mapping: `[N]` int32 or int64, the slot `block_id * block_size + offset` of each token,
            or -1 for a token whose keys and values are not stored.

    Returns None. `key`, `value` and `slot_mapping` are not modified. A layout the kernel cannot address
    fails an assert that says which precondition broke.
    """
    N, KVH, D = key.shape
    assert value.shape == key.shape, f"value {list(value.shape)} must have key's shape {list(key.shape)}"
    assert key.stride(2) == 1 and value.stride(2) == 1, "the last dim (D) of key and value must be contiguous"
    assert key.stride(1) == D and value.stride(1) == D, "a token's KVH heads must lie back to back (stride(1) == D)"
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "k_cache and v_cache must be contiguous"
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (KVH, D), (
        f"caches {list(k_cache.shape)}, {list(v_cache.shape)} must both be [num_blocks, block_size, {KVH}, {D}]"
    )
    assert k_cache.dtype == v_cache.dtype == key.dtype == value.dtype, "keys, values and caches need one dtype"
    assert slot_mapping.shape == (N,), f"slot_mapping {list(slot_mapping.shape)} must have one slot per token ({N})"
    assert not slot_mapping.dtype.is_floating_point, "slot_mapping must hold integers"
    ROW = KVH * D
    store_kvcache_kernel[(N,)](
        key, key.stride(0), value, value.stride(0), k_cache, v_cache, k_cache.stride(1), slot_mapping,
        ROW=ROW, BLOCK=triton.next_power_of_2(ROW),
    )
