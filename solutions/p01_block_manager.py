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
        return len(self.free_block_ids) >= seq.num_blocks

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
        prefix_hash, hitting = -1, True
        for j in range(seq.num_blocks):
            tokens = seq.block(j)
            full = len(tokens) == self.block_size
            block_hash = self.hash_block(tokens, prefix_hash) if full else -1
            prefix_hash = block_hash  # the next block's hash chains on this one
            found = self.hash_to_block_id.get(block_hash, -1) if full and j < seq.num_blocks - 1 else -1
            hitting = hitting and found != -1 and self.blocks[found].token_ids == tokens  # ids guard collisions
            if hitting:
                self._share(found)
                seq.num_cached_tokens += self.block_size
                seq.block_table.append(found)
            else:
                block = self._take(self.free_block_ids[0])
                if full:
                    self._seal(block, tokens, block_hash)
                seq.block_table.append(block.block_id)

    def can_append(self, seq: Sequence) -> bool:
        """True when one more token fits: a free block exists, or the last block has room."""
        return len(self.free_block_ids) >= self._opens_block(seq)

    def append(self, seq: Sequence, token_id: int) -> None:
        """Append `token_id` to `seq`, taking a new block (from the left of the free list) exactly when
        the last block is full; when the token fills its block, hash it (chained to the previous
        block's hash) and enter it in the cache. Requires `can_append(seq)`."""
        if self._opens_block(seq):
            seq.block_table.append(self._take(self.free_block_ids[0]).block_id)
        seq.token_ids.append(token_id)
        if len(seq) % self.block_size == 0:
            j = seq.num_blocks - 1
            prefix_hash = self.blocks[seq.block_table[j - 1]].hash if j > 0 else -1
            tokens = seq.block(j)
            self._seal(self.blocks[seq.block_table[j]], tokens, self.hash_block(tokens, prefix_hash))

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq`, last block first: subtract 1 from its ref_count and, at 0, put
        it back on the right of the free list (hash and tokens kept). Freed in reverse, a sequence's
        tail is reused before its head, so a shared prefix stays cached longest. Empties
        `seq.block_table` and sets `seq.num_cached_tokens` to 0."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.used_block_ids.remove(block_id)
                self.free_block_ids.append(block_id)
        seq.block_table.clear()
        seq.num_cached_tokens = 0

    def _opens_block(self, seq: Sequence) -> bool:
        return len(seq) % self.block_size == 0  # the last block is full: the next token needs a new one

    def _take(self, block_id: int) -> Block:
        """A free block, taken for new tokens: its old cache entry goes, since its slots will be overwritten."""
        block = self.blocks[block_id]
        if self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]
        block.ref_count, block.hash, block.token_ids = 1, -1, []
        self.free_block_ids.remove(block_id)
        self.used_block_ids.add(block_id)
        return block

    def _share(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:  # freed but still cached: revived with its contents
            self.free_block_ids.remove(block_id)
            self.used_block_ids.add(block_id)
        block.ref_count += 1

    def _seal(self, block: Block, tokens: list[int], block_hash: int) -> None:
        block.hash, block.token_ids = block_hash, list(tokens)
        self.hash_to_block_id[block_hash] = block.block_id


def slot_of(seq: Sequence, position: int) -> int:
    """The cache slot of token `position` of `seq`: `block_table[position // block_size] * block_size
    + position % block_size`."""
    return seq.block_table[position // seq.block_size] * seq.block_size + position % seq.block_size


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
    ids, positions, slots, cu_q, cu_k = [], [], [], [0], [0]
    for seq in seqs:
        start = seq.num_cached_tokens  # the cached prefix's K/V is already in the cache
        ids += seq.token_ids[start:]
        positions += range(start, len(seq))
        slots += [slot_of(seq, p) for p in range(start, len(seq))]
        cu_q.append(cu_q[-1] + len(seq) - start)
        cu_k.append(cu_k[-1] + len(seq))
    return PrefillMetadata(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32),
        cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32),
        max_seqlen_q=max(len(seq) - seq.num_cached_tokens for seq in seqs),
        max_seqlen_k=max(len(seq) for seq in seqs),
        slot_mapping=torch.tensor(slots, dtype=torch.int32),
        block_tables=_padded_block_tables(seqs) if cu_k[-1] > cu_q[-1] else None,
    )


def decode_metadata(seqs: list[Sequence]) -> DecodeMetadata:
    """The metadata of one decode step: for each sequence, its last token (already appended, its slot
    reserved by `BlockManager.append`), at position `len - 1`, reading `len` tokens of context, and
    the block tables padded with -1. The sequences are not modified."""
    last = [len(seq) - 1 for seq in seqs]
    return DecodeMetadata(
        input_ids=torch.tensor([seq.token_ids[-1] for seq in seqs], dtype=torch.int64),
        positions=torch.tensor(last, dtype=torch.int64),
        context_lens=torch.tensor([len(seq) for seq in seqs], dtype=torch.int32),
        slot_mapping=torch.tensor([slot_of(seq, p) for seq, p in zip(seqs, last)], dtype=torch.int32),
        block_tables=_padded_block_tables(seqs),
    )


def _padded_block_tables(seqs: list[Sequence]) -> torch.Tensor:
    width = max(len(seq.block_table) for seq in seqs)
    rows = [seq.block_table + [-1] * (width - len(seq.block_table)) for seq in seqs]  # -1: no block
    return torch.tensor(rows, dtype=torch.int32)  # [B, width]
