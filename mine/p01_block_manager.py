"""P01 · Paged KV block manager: block tables, slots, prefix caching and one step's batch metadata.

A paged KV cache keeps each layer's keys and values in `num_blocks` blocks of `block_size` token slots
(`[num_blocks, block_size, KVH, D]`). A sequence owns a list of blocks, its block table, and token i of
it lives in slot `block_table[i // block_size] * block_size + i % block_size`. This file is the
bookkeeping only, with no K/V tensors: which blocks are free, which sequence holds which block, and
which full blocks sequences that start with the same tokens can share (prefix caching). It follows
nano-vllm's block manager (`nanovllm/engine/block_manager.py`) and the metadata its model runner
builds for a prefill or a decode step (`nanovllm/engine/model_runner.py`).

Names: block_size slots per block; a block is full when it holds block_size tokens; B sequences in a
batch; a sequence's cached prefix is the leading full blocks `allocate` found in the cache.

Run `./check.sh p01` to check this file.
"""

import hashlib
import struct
from collections import deque
from typing import NamedTuple

import torch


class Sequence:
    """One request's tokens and the blocks that hold their keys and values (given complete).

    `token_ids`: the prompt, then every token appended since. `block_table[j]`: the block holding
    tokens `j*block_size .. j*block_size + block_size - 1`. `num_cached_tokens`: how many leading
    tokens `allocate` found in the cache (a multiple of block_size); their K/V is not computed again.
    The block manager fills the last two; pass them here only for a sequence that already has blocks.
    """

    def __init__(self, token_ids, block_size: int, block_table=(), num_cached_tokens: int = 0) -> None:
        self.token_ids: list[int] = list(token_ids)
        self.block_size = block_size
        self.block_table: list[int] = list(block_table)
        self.num_cached_tokens = num_cached_tokens

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_blocks(self) -> int:
        """Blocks the tokens need: ceil(len / block_size)."""
        return (len(self) + self.block_size - 1) // self.block_size

    def block(self, j: int) -> list[int]:
        """The token ids of block j: block_size of them, fewer in a partial last block."""
        return self.token_ids[j * self.block_size : (j + 1) * self.block_size]


class Block:
    """One block as the manager tracks it (given complete).

    `ref_count`: how many live sequences have it in their block table (0: free). `hash`: the chained
    hash of its tokens once it is full, -1 while it is partial. `token_ids`: its tokens once it is full
    (`[]` before), kept to tell a true cache hit from a hash collision.
    """

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.token_ids: list[int] = []

    @staticmethod
    def chained_hash(token_ids: list[int], prefix_hash: int = -1) -> int:
        """The hash of a full block chained to the previous block's: 64 bits of BLAKE2b over
        `prefix_hash` (left out when -1, for a first block) and the token ids, in [0, 2**64), never -1.

        Chaining makes one hash stand for the whole prefix up to and including this block, so the same
        tokens after other tokens, or at another depth, hash differently. Why BLAKE2b from hashlib
        rather than nano-vllm's xxh64: it is in the standard library (no extra dependency) and gives
        the same value on every machine and in every process (Python's own `hash` of bytes is salted
        per process); 64 bits make an accidental collision between two blocks a 2**-64 event, and the
        manager compares token ids anyway. It is slower than xxh64, but hashing a few hundred ids takes
        microseconds, nothing next to computing a block's keys and values.
        """
        digest = hashlib.blake2b(digest_size=8)
        if prefix_hash != -1:
            digest.update(struct.pack("<Q", prefix_hash))
        digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
        return int.from_bytes(digest.digest(), "little")


class BlockManager:
    """Which blocks are free, which sequences hold which blocks, and which full blocks can be shared.

    The state (laid out by `__init__`; the checks read it):
    - `blocks[b]`: block b's `Block`.
    - `free_block_ids`: the blocks with ref_count 0, in the order they are reused: a new block is taken
      from the left, a freed one goes back on the right. A freed full block keeps its hash and tokens,
      still a valid cache entry, until it is taken for other tokens.
    - `used_block_ids`: the blocks with ref_count >= 1. Every block is in exactly one of the two.
    - `hash_to_block_id`: the prefix cache, chained hash -> the block holding that full block's tokens.
      An entry always points at a block whose `hash` is its key.
    - `hash_block`: the hash function, `Block.chained_hash` unless the caller passes another (the
      checks pass a weak one to see that token ids guard against collisions).
    """

    def __init__(self, num_blocks: int, block_size: int, hash_block=Block.chained_hash) -> None:
        self.block_size = block_size
        self.hash_block = hash_block
        self.blocks = [Block(b) for b in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.used_block_ids: set[int] = set()
        self.hash_to_block_id: dict[int, int] = {}

    def can_allocate(self, seq: Sequence) -> bool:
        """True when there are `seq.num_blocks` free blocks (cache hits are not counted: conservative)."""
        raise NotImplementedError("BlockManager.can_allocate (mine/p01_block_manager.py) is not written yet")

    def allocate(self, seq: Sequence) -> None:
        """Give a new sequence its blocks, reusing cached ones for the longest cached prefix.

        Walk the blocks of `seq` in order. A full block that is not the last one is looked up by its
        chained hash; it is a hit when the hash is in the cache and that block's token ids are equal.
        From the first miss on, every block is a new one from the left of `free_block_ids`. A hit on a
        used block adds 1 to its ref_count; a hit on a freed block revives it (out of the free list,
        ref_count 1). The last block never comes from the cache, so at least one token is computed.
        Every full block that was not a hit is hashed and entered in the cache (replacing an older
        entry of the same hash). Sets `seq.block_table` and `seq.num_cached_tokens` (block_size per
        hit). Requires `can_allocate(seq)` and an empty `seq.block_table`.
        """
        raise NotImplementedError("BlockManager.allocate (mine/p01_block_manager.py) is not written yet")

    def can_append(self, seq: Sequence) -> bool:
        """True when one more token fits: a free block exists, or the last block has room."""
        raise NotImplementedError("BlockManager.can_append (mine/p01_block_manager.py) is not written yet")

    def append(self, seq: Sequence, token_id: int) -> None:
        """Append `token_id` to `seq`, taking a new block (from the left of the free list) exactly when
        the last block is full; when the token fills its block, hash it (chained to the previous
        block's hash) and enter it in the cache. Requires `can_append(seq)`."""
        raise NotImplementedError("BlockManager.append (mine/p01_block_manager.py) is not written yet")

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq`, last block first: subtract 1 from its ref_count and, at 0, put
        it back on the right of the free list (hash and tokens kept). Freed in reverse, a sequence's
        tail is reused before its head, so a shared prefix stays cached longest. Empties
        `seq.block_table` and sets `seq.num_cached_tokens` to 0."""
        raise NotImplementedError("BlockManager.free (mine/p01_block_manager.py) is not written yet")


def slot_of(seq: Sequence, position: int) -> int:
    """The cache slot of token `position` of `seq`: `block_table[position // block_size] * block_size
    + position % block_size`."""
    raise NotImplementedError("slot_of (mine/p01_block_manager.py) is not written yet")


class PrefillMetadata(NamedTuple):
    """What a prefill step hands the model (given). total_q = new tokens of all B sequences."""

    input_ids: torch.Tensor  # [total_q] int64: the tokens whose K/V is computed now, sequence after sequence
    positions: torch.Tensor  # [total_q] int64: each one's position in its sequence (from its cached prefix on)
    cu_seqlens_q: torch.Tensor  # [B + 1] int32: 0, then running totals of new tokens
    cu_seqlens_k: torch.Tensor  # [B + 1] int32: 0, then running totals of whole lengths (cached + new)
    max_seqlen_q: int  # the most new tokens of one sequence
    max_seqlen_k: int  # the longest sequence
    slot_mapping: torch.Tensor  # [total_q] int32: the slot each new token's K/V is stored in
    block_tables: torch.Tensor | None  # [B, most blocks] int32 padded with -1; None when nothing is cached


class DecodeMetadata(NamedTuple):
    """What a decode step hands the model (given): one new token, the last, per sequence."""

    input_ids: torch.Tensor  # [B] int64: each sequence's last token
    positions: torch.Tensor  # [B] int64: its position, len(seq) - 1
    context_lens: torch.Tensor  # [B] int32: tokens the attention reads, len(seq)
    slot_mapping: torch.Tensor  # [B] int32: the slot its K/V is stored in
    block_tables: torch.Tensor  # [B, most blocks] int32 padded with -1


def prefill_metadata(seqs: list[Sequence]) -> PrefillMetadata:
    """The metadata of one prefill step over `seqs`, each with its blocks allocated.

    Only tokens after a sequence's cached prefix are computed: their ids, their positions
    `num_cached_tokens .. len - 1`, and their slots, sequence after sequence. `cu_seqlens_q` counts
    them, `cu_seqlens_k` counts whole lengths, both int32 and starting at 0. `block_tables` (rows padded
    with -1 to the longest table) is there only when some prefix is cached, i.e. when the attention
    must read keys it does not compute now; otherwise None. The sequences are not modified.
    """
    raise NotImplementedError("prefill_metadata (mine/p01_block_manager.py) is not written yet")


def decode_metadata(seqs: list[Sequence]) -> DecodeMetadata:
    """The metadata of one decode step: for each sequence, its last token (already appended, its slot
    reserved by `BlockManager.append`), at position `len - 1`, reading `len` tokens of context, and
    the block tables padded with -1. The sequences are not modified."""
    raise NotImplementedError("decode_metadata (mine/p01_block_manager.py) is not written yet")
