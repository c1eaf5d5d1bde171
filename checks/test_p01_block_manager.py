"""Checks for P01 · paged KV block manager (mine/p01_block_manager.py).

Oracles: the hand-worked scenarios in toy_cases/p01_block_manager.json; a dense model of the same
bookkeeping in this file (prefixes compared as whole token tuples, no hashing), run side by side with
the learner's manager on random allocate/append/free sequences drawn by hypothesis, together with
invariants that hold for any correct manager (every slot a live sequence reads holds the K/V of exactly
that sequence's prefix, ref counts equal owners, free + used = all); and, for the metadata, the slot
and position of every token computed from its position alone.
"""

from dataclasses import dataclass

import pytest
import torch
from hypothesis import strategies as st

from checks.harness.compare import Mismatch
from checks.harness.guard import LearnerError
from checks.harness.properties import explore
from checks.harness.toys import load_toy

pytestmark = pytest.mark.p01

TOLERANCE_KIND = "exact"  # bookkeeping: integers, compared exactly
# What `./check.sh grade` awards: a check's points, shared out over its cases (a module is worth the sum,
# 46). An optional oracle's check (absent on most machines) is worth nothing.
POINTS = {
    "test_toy_scenario": 4,
    "test_toy_prefill_metadata": 2,
    "test_toy_decode_metadata": 2,
    "test_slot_of": 1,
    "test_blocks_at_every_length": 3,
    "test_can_append_when_no_block_is_free": 2,
    "test_shared_prefix_and_last_block": 3,
    "test_hash_is_chained": 3,
    "test_freed_blocks_are_revived_and_reused_in_order": 3,
    "test_taking_a_block_keeps_an_entry_that_points_at_another": 2,
    "test_token_ids_guard_against_collisions": 2,
    "test_a_miss_ends_the_hits_even_when_a_later_block_matches": 2,
    "test_can_allocate_at_a_block_boundary": 2,
    "test_free_empties_the_sequence_and_it_can_be_allocated_again": 2,
    "test_a_partial_block_has_no_hash_and_no_tokens": 2,
    "test_random_operations_match_the_model": 6,
    "test_prefill_metadata": 3,
    "test_prefill_metadata_without_a_cached_prefix": 1,
    "test_decode_metadata": 3,
}
CONTRACTS = {}  # results are checked field by field below
TOY = load_toy("p01_block_manager")


# ---- reading the learner's state --------------------------------------------------------------------


@dataclass
class State:
    free: list[int]  # free_block_ids, in order
    used: list[int]  # used_block_ids, sorted
    refs: list[int]  # ref_count of each block
    hashes: list[int]
    full: list[bool]  # token_ids of the block has block_size ids
    entries: dict[int, int]  # hash_to_block_id


def read_state(manager, block_size: int) -> State:
    try:
        blocks = list(manager.blocks)
        return State(list(manager.free_block_ids), sorted(manager.used_block_ids), [b.ref_count for b in blocks],
                     [b.hash for b in blocks], [len(b.token_ids) == block_size for b in blocks],
                     dict(manager.hash_to_block_id))
    except LearnerError:
        raise
    except Exception as error:  # noqa: BLE001 - the state is the learner's to keep
        raise LearnerError(f"reading the manager's state (blocks, free_block_ids, used_block_ids, "
                           f"hash_to_block_id) raised {type(error).__name__}: {error}") from None


def cached_blocks(state: State) -> list[int]:
    return sorted(state.entries.values())


def shown(tokens) -> str:
    tokens = list(tokens)
    if len(tokens) > 16:  # blocks of 256: a prompt of hundreds of tokens would fill the one-line reason
        return f"[{', '.join(map(str, tokens[:3]))}, …, {tokens[-1]}] ({len(tokens)} tokens)"
    return "[" + ", ".join(map(str, tokens)) + "]"


def expect_bool(answer, expected: bool, what: str) -> None:
    if not isinstance(answer, bool):
        raise Mismatch(f"{what} returned {answer!r} ({type(answer).__name__}), expected a bool")
    if answer != expected:
        raise Mismatch(f"{what} is {answer}, expected {expected}")


# ---- the dense model ---------------------------------------------------------------------------------


class Model:
    """The bookkeeping the contract describes, written the plainest way: a cached block is known by the
    whole tuple of tokens from the sequence's start through its end (what a chained hash stands for)."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.free = list(range(num_blocks))
        self.refs = [0] * num_blocks
        self.prefix: list[tuple | None] = [None] * num_blocks  # the prefix a full block ends, once sealed
        self.cache: dict[tuple, int] = {}  # that prefix -> block
        self.tables: dict[str, list[int]] = {}
        self.cached: dict[str, int] = {}
        self.tokens: dict[str, list[int]] = {}

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def can_allocate(self, tokens) -> bool:
        return len(self.free) >= self.blocks_for(len(tokens))

    def allocate(self, name: str, tokens) -> None:
        bs, n = self.block_size, self.blocks_for(len(tokens))
        table, cached, hitting = [], 0, True
        for j in range(n):
            key = tuple(tokens[: (j + 1) * bs]) if (j + 1) * bs <= len(tokens) else None
            found = self.cache.get(key) if key is not None and j < n - 1 else None
            hitting = hitting and found is not None
            if hitting:
                if self.refs[found] == 0:
                    self.free.remove(found)
                self.refs[found] += 1
                cached += bs
                table.append(found)
            else:
                table.append(self.take())
                if key is not None:
                    self.seal(table[-1], key)
        self.tables[name], self.cached[name], self.tokens[name] = table, cached, list(tokens)

    def can_append(self, name: str) -> bool:
        return len(self.free) >= (len(self.tokens[name]) % self.block_size == 0)

    def append(self, name: str, token: int) -> None:
        tokens = self.tokens[name]
        if len(tokens) % self.block_size == 0:
            self.tables[name].append(self.take())
        tokens.append(token)
        if len(tokens) % self.block_size == 0:
            self.seal(self.tables[name][-1], tuple(tokens))

    def release(self, name: str) -> None:
        for block in reversed(self.tables.pop(name)):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free.append(block)
        del self.cached[name], self.tokens[name]

    def take(self) -> int:
        block = self.free.pop(0)
        if self.prefix[block] is not None and self.cache.get(self.prefix[block]) == block:
            del self.cache[self.prefix[block]]
        self.prefix[block], self.refs[block] = None, 1
        return block

    def seal(self, block: int, prefix: tuple) -> None:
        self.prefix[block] = prefix
        self.cache[prefix] = block


# ---- invariants ---------------------------------------------------------------------------------------


def count(n: int, unit: str) -> str:
    """"1 block", "3 blocks": a number with what it counts."""
    return f"{n} {unit}" if n == 1 else f"{n} {unit}s"


def slot(table: list[int], position: int, block_size: int) -> int:
    return table[position // block_size] * block_size + position % block_size


def invariant_problem(state: State, live: dict, holds: dict, block_size: int) -> str | None:
    """What any correct manager keeps true, whatever its choices; None when all hold."""
    n = len(state.refs)
    if len(set(state.free)) != len(state.free) or set(state.free) & set(state.used) or \
            set(state.free) | set(state.used) != set(range(n)):
        return f"free {state.free} and used {state.used} are not a partition of the {n} blocks"
    owners = [0] * n
    for seq in live.values():
        for block in seq.block_table:
            owners[block] += 1
    for b in range(n):
        if state.refs[b] != owners[b]:
            return f"blocks[{b}].ref_count is {state.refs[b]}, but the block tables of " \
                   f"{count(owners[b], 'live sequence')} hold it"
        if (state.refs[b] == 0) != (b in state.free):
            return f"blocks[{b}].ref_count is {state.refs[b]} and the block is " \
                   f"{'' if b in state.free else 'not '}in free_block_ids"
    for key, b in state.entries.items():
        if not 0 <= b < n or state.hashes[b] != key or not state.full[b]:
            if not 0 <= b < n:
                return f"hash_to_block_id maps hash {key} to block {b}, which does not exist"
            held = "its token_ids fill it" if state.full[b] else "its token_ids do not fill it"
            return (f"hash_to_block_id maps hash {key} to block {b}, whose hash is {state.hashes[b]} and {held}: "
                    f"an entry must point at a full block with that hash")
    for name, seq in live.items():
        length, table, cached = len(seq), list(seq.block_table), seq.num_cached_tokens
        if len(table) != -(-length // block_size):
            return f"{name} has {count(length, 'token')} in {count(len(table), 'block')} {table}, expected " \
                   f"{count(-(-length // block_size), 'block')} of {block_size} tokens"
        if cached % block_size or not 0 <= cached < length:
            return f"{name} has num_cached_tokens {cached} of {length} tokens (a multiple of {block_size}, < len)"
        if length % block_size and state.refs[table[-1]] != 1:
            return f"{name}'s partial last block {table[-1]} is shared, so its free slots have two writers"
        if length % block_size and (state.hashes[table[-1]] != -1 or state.full[table[-1]]):
            held = " and a full token_ids" if state.full[table[-1]] else ""
            return f"{name}'s partial last block {table[-1]} has hash {state.hashes[table[-1]]}{held}, expected -1 " \
                   f"and no tokens until it is full"
        for p in range(length):
            prefix = tuple(seq.token_ids[: p + 1])
            if holds.get(slot(table, p, block_size)) != prefix:
                found = holds.get(slot(table, p, block_size))
                got = "nothing" if found is None else f"the K/V of prefix {shown(found)}"
                return f"position {p} of {name} reads slot {slot(table, p, block_size)}, which holds {got}, " \
                       f"not that of {shown(prefix)}"
    return None


def model_problem(state: State, model: Model, live: dict) -> str | None:
    """Where the learner's choices differ from the contract's (block ids, reuse order, cache entries)."""
    for name, seq in live.items():
        if list(seq.token_ids) != model.tokens[name]:
            return f"{name} has tokens {shown(seq.token_ids)}, expected {shown(model.tokens[name])}"
        if list(seq.block_table) != model.tables[name]:
            return f"{name} has block table {list(seq.block_table)}, expected {model.tables[name]}"
        if seq.num_cached_tokens != model.cached[name]:
            return f"{name} has num_cached_tokens {seq.num_cached_tokens}, expected {model.cached[name]}"
    if state.free != model.free:
        return f"free_block_ids is {state.free}, expected {model.free} (taken from the left, freed to the right)"
    if cached_blocks(state) != sorted(model.cache.values()):
        return f"hash_to_block_id points at blocks {cached_blocks(state)}, expected {sorted(model.cache.values())}"
    return None


# ---- playing operations against the model ----------------------------------------------------------------


def with_steps(method):
    """A failure inside a player's operation carries the operations so far, in words, on its one line."""

    def run(self, *args):
        try:
            return method(self, *args)
        except (Mismatch, LearnerError) as error:
            text = str(error)
            hung = "did not return within" in text or "hung in an earlier" in text
            if not self.steps or " · steps: " in text or hung:
                raise
            text += f" · steps: {'; '.join(self.steps)}"
            raise (Mismatch(text) if isinstance(error, Mismatch) else LearnerError(text, error.identifiable)) from None

    return run


class Player:
    """Runs operations on the learner's manager and the model side by side; records them in words.
    With `follow_model=False` (a custom hash) only the invariants are checked."""

    def __init__(self, impl, num_blocks: int, block_size: int, hash_block=None, follow_model: bool = True):
        self.impl, self.block_size, self.follow_model = impl, block_size, follow_model
        extra = () if hash_block is None else (hash_block,)
        self.manager = impl.BlockManager(num_blocks, block_size, *extra)
        self.model = Model(num_blocks, block_size)
        self.live: dict = {}
        self.holds: dict[int, tuple] = {}  # slot -> the prefix whose last token's K/V was written there
        self.steps: list[str] = []
        self.made = 0

    @with_steps
    def allocate(self, tokens) -> str | None:
        name = f"s{self.made}"
        seq = self.impl.Sequence(tokens, self.block_size)
        if self.follow_model:
            possible = self.model.can_allocate(tokens)
        else:  # the model's hits are not the custom hash's: count the learner's free blocks instead
            possible = len(read_state(self.manager, self.block_size).free) >= self.model.blocks_for(len(tokens))
        expect_bool(self.manager.can_allocate(seq), possible, f"can_allocate({shown(tokens)})")
        if not possible:
            self.note(f"can_allocate({shown(tokens)}) is False")
            return None
        self.made += 1
        self.note(f"{name} = allocate {shown(tokens)}")
        self.manager.allocate(seq)
        self.model.allocate(name, tokens)
        self.live[name] = seq
        self.written(seq, range(self.read_cached(seq), len(tokens)))
        return name

    @with_steps
    def append(self, name: str, token: int) -> bool:
        seq = self.live[name]
        possible = self.model.can_append(name)
        length = len(self.model.tokens[name])
        expect_bool(self.manager.can_append(seq), possible, f"can_append({name}) at {length} tokens")
        if not possible:
            self.note(f"can_append({name}) is False")
            return False
        self.note(f"append {token} to {name}")
        self.manager.append(seq, token)
        self.model.append(name, token)
        self.written(seq, [len(seq) - 1])
        return True

    @with_steps
    def free(self, name: str) -> None:
        self.note(f"free {name}")
        self.manager.free(self.live.pop(name))
        self.model.release(name)

    def note(self, step: str) -> str:
        self.steps.append(step)
        return step

    def read_cached(self, seq) -> int:
        cached = seq.num_cached_tokens
        if not isinstance(cached, int) or not 0 <= cached <= len(seq):
            raise Mismatch(f"{self.steps[-1]}: num_cached_tokens is {cached!r}, expected a number of tokens from 0 to "
                           f"{len(seq)}")
        return cached

    def written(self, seq, positions) -> None:
        """Computing tokens stores their K/V in their slots: remember which prefix each slot now holds."""
        table = list(seq.block_table)
        for p in positions:
            if p // self.block_size >= len(table):
                raise Mismatch(f"after {self.steps[-1]}: {count(len(seq), 'token')} in {count(len(table), 'block')} "
                               f"{table}, expected {count(-(-len(seq) // self.block_size), 'block')} of "
                               f"{self.block_size} tokens")
            self.holds[slot(table, p, self.block_size)] = tuple(seq.token_ids[: p + 1])

    @with_steps
    def check(self) -> None:
        state = read_state(self.manager, self.block_size)
        problem = invariant_problem(state, self.live, self.holds, self.block_size)
        if problem is None and self.follow_model:
            problem = model_problem(state, self.model, self.live)
        if problem:
            raise Mismatch(f"after {self.steps[-1]}: {problem}")

    def expect_cached(self, name: str, expected: int) -> None:
        got = self.live[name].num_cached_tokens
        if got != expected:
            raise Mismatch(f"after {self.steps[-1]}: {name} has num_cached_tokens {got}, expected "
                           f"{count(expected, 'cached token')} · steps: {'; '.join(self.steps)}")


def play_toy(impl, scenario: dict) -> None:
    bs = TOY["block_size"]
    player = Player(impl, scenario["num_blocks"], bs)
    names: dict[str, str] = {}  # the toy's names (A, B, ...) -> the player's (s0, s1, ...)
    for step in scenario["steps"]:
        if step["do"] == "can_allocate":
            seq = impl.Sequence(step["tokens"], bs)
            expect_bool(player.manager.can_allocate(seq), step["answer"], f"can_allocate({shown(step['tokens'])})")
            continue
        if step["do"] == "can_append":
            seq = player.live[names[step["seq"]]]
            expect_bool(player.manager.can_append(seq), step["answer"], f"can_append({step['seq']})")
            continue
        if step["do"] == "allocate":
            names[step["seq"]] = player.allocate(step["tokens"])
        elif step["do"] == "append":
            player.append(names[step["seq"]], step["token"])
        else:
            player.free(names[step["seq"]])
        state = read_state(player.manager, bs)
        what = f"after step {step['step']} ({step['do']} {step['seq']})"
        for toy_name, table in step["block_tables"].items():
            seq = player.live[names[toy_name]]
            if list(seq.block_table) != table:
                raise Mismatch(f"{what}: {toy_name}'s block table is {list(seq.block_table)}, expected {table}")
            if seq.num_cached_tokens != step["num_cached_tokens"][toy_name]:
                raise Mismatch(f"{what}: {toy_name}'s num_cached_tokens is {seq.num_cached_tokens}, "
                               f"expected {count(step['num_cached_tokens'][toy_name], 'cached token')}")
        if state.free != step["free"]:
            raise Mismatch(f"{what}: free_block_ids is {state.free}, expected {step['free']}")
        if state.refs != step["ref_counts"]:
            differ = [b for b, (got, want) in enumerate(zip(state.refs, step["ref_counts"])) if got != want]
            first = f": blocks[{differ[0]}].ref_count is {state.refs[differ[0]]}, expected " \
                    f"{step['ref_counts'][differ[0]]}" if differ else ""
            raise Mismatch(f"{what}: the blocks' ref counts are {state.refs}, expected {step['ref_counts']}{first}")
        if cached_blocks(state) != step["cached_blocks"]:
            raise Mismatch(f"{what}: hash_to_block_id points at blocks {cached_blocks(state)}, expected "
                           f"{step['cached_blocks']}")


# ---- the toy --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", TOY["scenarios"], ids=lambda s: s["name"])
def test_toy_scenario(impl, scenario):
    """the page's toy scenarios: block tables, cached tokens, free list, ref counts and cache after each step"""
    play_toy(impl, scenario)


def toy_sequences(impl, rows: list[dict]):
    return [impl.Sequence(r["tokens"], TOY["block_size"], r["block_table"], r["num_cached_tokens"]) for r in rows]


def test_toy_prefill_metadata(impl):
    """the page's toy prefill batch: ids, positions, cu_seqlens, slots and padded block tables"""
    batch = TOY["prefill"]
    expect_metadata(impl.prefill_metadata(toy_sequences(impl, batch["sequences"])), batch["expected"], "prefill")


def test_toy_decode_metadata(impl):
    """the page's toy decode batch: last tokens, positions, context lengths, slots and block tables"""
    batch = TOY["decode"]
    expect_metadata(impl.decode_metadata(toy_sequences(impl, batch["sequences"])), batch["expected"], "decode")


# ---- targeted behaviours ---------------------------------------------------------------------------------


def test_slot_of(impl, gen):
    """slot_of gives block_table[i // block_size] * block_size + i % block_size for every token"""
    for block_size in (1, 3, 4, 16):
        length = int(torch.randint(1, 5 * block_size + 1, (), generator=gen))
        table = torch.randperm(40, generator=gen)[: -(-length // block_size)].tolist()
        seq = impl.Sequence(torch.randint(0, 100, (length,), generator=gen).tolist(), block_size, table)
        for p in range(length):
            got, expected = impl.slot_of(seq, p), slot(table, p, block_size)
            if got != expected:
                raise Mismatch(f"block_size {block_size}, table {table}: slot_of(seq, {p}) is {got}, "
                               f"expected {expected}")


EVERY_LENGTH_BLOCK_SIZES = [1, 3, 4]  # one token a block, a size no length divides evenly, and the toy's


@pytest.mark.parametrize("block_size", EVERY_LENGTH_BLOCK_SIZES, ids=lambda b: f"blocks of {b}")
def test_blocks_at_every_length(impl, block_size):
    """prompts of every length get ceil(len / block_size) blocks; a token opens a block exactly when the last is full"""
    player = Player(impl, 3 * block_size + 8, block_size)
    for length in range(1, 2 * block_size + 2):  # lengths around every multiple of block_size
        name = player.allocate(list(range(100 * length, 100 * length + length)))
        player.check()
        player.free(name)
        player.check()
    name = player.allocate([7])
    for token in range(3 * block_size):
        player.append(name, token)
        player.check()


def test_can_append_when_no_block_is_free(impl):
    """with no free block left, can_append is True while the last block has room and False once it is full"""
    player = Player(impl, 2, 4)
    name = player.allocate([1, 2, 3, 4, 5])  # both blocks taken, the second holds 1 token
    for token in (6, 7, 8):
        player.append(name, token)
        player.check()
    player.append(name, 9)  # the last block is full and none is free: the player checks can_append is False
    player.check()


SHARED_PREFIX_BLOCK_SIZES = [4, 256]  # the toy's, and nano-vllm's


@pytest.mark.parametrize("block_size", SHARED_PREFIX_BLOCK_SIZES, ids=lambda b: f"blocks of {b}")
def test_shared_prefix_and_last_block(impl, block_size):
    """a prompt that repeats another's full blocks shares them (ref counts 2), except its last block"""
    player = Player(impl, 8, block_size)  # blocks of 256: nano-vllm's (a prompt of 512 tokens, then 513)
    first = list(range(1, 2 * block_size + 1))  # two full blocks
    player.allocate(first)
    player.allocate(first)  # all blocks cached, but the last must be computed: one block cached, not two
    player.check()
    player.allocate(first + [9])  # three blocks: the first two are hits
    player.check()


def test_hash_is_chained(impl):
    """the same tokens at another depth, or after another block, are not a cache hit"""
    player = Player(impl, 10, 2)
    player.allocate([1, 2, 3, 4, 5])  # blocks [1, 2] and [3, 4] cached
    player.allocate([3, 4, 1, 2, 6])  # [3, 4] at depth 0 is not the [3, 4] that followed [1, 2]
    player.check()
    player.allocate([9, 9, 3, 4, 6])  # [3, 4] at depth 1, after another block
    player.check()


def test_freed_blocks_are_revived_and_reused_in_order(impl):
    """a freed full block is a cache hit until taken; blocks are reused left to right, a sequence's tail first"""
    player = Player(impl, 6, 2)
    a = player.allocate([1, 2, 3, 4, 5, 6, 7])  # 4 blocks, 3 full
    player.free(a)
    player.check()
    b = player.allocate([1, 2, 3, 4, 8])  # revives the first two
    player.check()
    player.allocate([5, 5, 5])  # takes the oldest free blocks, dropping their cache entries
    player.check()
    player.free(b)
    player.allocate([1, 2, 3, 4, 5, 6, 9])
    player.check()


def test_taking_a_block_keeps_an_entry_that_points_at_another(impl):
    """two blocks can hold the same content (a last block is computed even when it is cached); taking the
    older one for new tokens leaves the cache entry, which points at the newer one"""
    player = Player(impl, 4, 2)
    a = player.allocate([1, 2, 3, 4])  # blocks 0 [1, 2] and 1 [3, 4]; the entry of [1, 2, 3, 4] is block 1
    b = player.allocate([1, 2, 3, 4])  # 0 is a hit; the last block is computed in block 2, the entry's block now
    player.free(a)  # block 1 is free, still holding [3, 4], but the cache points at block 2: free list [3, 1]
    c = player.allocate([9, 9, 9])  # takes blocks 3 and 1: the entry of [1, 2, 3, 4] is block 2's, so it stays
    player.check()
    player.free(c)
    player.free(b)  # free list [1, 3, 2, 0]
    d = player.allocate([1, 2, 3, 4, 5])  # both full blocks are hits (0 and 2), then block 1
    player.check()
    player.expect_cached(d, 4)


def weak_hash(token_ids, prefix_hash=-1) -> int:
    """A deliberately weak block hash: every full block collides with every other one."""
    return 7


def test_token_ids_guard_against_collisions(impl):
    """with a hash under which every block collides, a hit still needs equal token ids"""
    # Under one hash the cache holds one entry, the block sealed last. (Equal tokens after another prefix
    # would be a false hit no token check can see, so every block here has tokens of its own.)
    player = Player(impl, 9, 2, hash_block=weak_hash, follow_model=False)
    player.allocate([1, 2, 3, 4, 5])  # the entry: the block [3, 4]
    b = player.allocate([5, 6, 7])  # [5, 6] collides with [3, 4]: a miss, and [5, 6] is the entry now
    player.check()
    player.expect_cached(b, 0)
    c = player.allocate([3, 4, 8])  # [3, 4] collides with [5, 6]: a miss; [3, 4] (first block) is the entry
    player.check()
    player.expect_cached(c, 0)
    d = player.allocate([3, 4, 9])  # equal tokens, same (empty) prefix: a true hit
    player.check()
    player.expect_cached(d, 2)


def test_a_miss_ends_the_hits_even_when_a_later_block_matches(impl):
    """after a miss every block is new, even when a later block would match (under the weak hash); every full
    block's hash is the manager's hash_block of it"""
    player = Player(impl, 9, 2, hash_block=weak_hash, follow_model=False)
    player.allocate([1, 2, 3, 4, 5])  # the cache's one entry: the block [3, 4]
    b = player.allocate([9, 9, 9, 9, 7])  # [9, 9] misses, becomes the entry; the second [9, 9] must not hit it
    player.check()
    player.expect_cached(b, 0)
    table = list(player.live[b].block_table)
    if len(set(table)) != len(table):
        raise Mismatch(f"after {player.steps[-1]}: {b}'s block table {table} holds a block twice · steps: "
                       f"{'; '.join(player.steps)}")
    state = read_state(player.manager, 2)
    wrong = [(i, h) for i, (h, full) in enumerate(zip(state.hashes, state.full)) if full and h != weak_hash(())]
    if wrong:
        raise Mismatch(f"blocks {[i for i, _ in wrong]} are full but have hashes {[h for _, h in wrong]}; the "
                       f"manager's hash_block gives {weak_hash(())} for every block (use self.hash_block everywhere)")


def test_can_allocate_at_a_block_boundary(impl):
    """can_allocate is True with exactly the blocks a prompt needs (a partial last block counts), False with fewer"""
    player = Player(impl, 3, 4)
    a = player.allocate(list(range(100, 109)))  # 9 tokens: 3 blocks, exactly the 3 free ones
    player.check()
    player.allocate([1, 2, 3, 4])  # none free: False
    player.free(a)
    player.allocate(list(range(200, 213)))  # 13 tokens need 4 blocks, 3 are free: False
    b = player.allocate(list(range(300, 305)))  # 5 tokens: 2 blocks, 1 left
    player.allocate([7, 8, 9, 10])  # exactly the 1 block left: True
    player.check()
    if b is None:
        raise Mismatch(f"a 5-token prompt did not fit 3 free blocks · steps: {'; '.join(player.steps)}")


def test_free_empties_the_sequence_and_it_can_be_allocated_again(impl):
    """after free a sequence holds no block and no cached token; allocated again (a preempted sequence comes
    back) it finds its prefix in the cache"""
    manager = impl.BlockManager(6, 4)
    other = impl.Sequence([1, 2, 3, 4, 5, 6, 7, 8, 50], 4)
    manager.allocate(other)  # blocks 0, 1 (full, cached) and 2
    seq = impl.Sequence([1, 2, 3, 4, 5, 6, 7, 8, 60, 61], 4)
    manager.allocate(seq)  # hits 0 and 1 (8 cached tokens), then block 3
    manager.free(seq)  # block 3 goes back on the right: free list [4, 5, 3]
    table, cached = list(seq.block_table), seq.num_cached_tokens
    if table or cached != 0:
        raise Mismatch(f"after free the sequence has block_table {table} and num_cached_tokens {cached}, "
                       f"expected block_table [] and 0 cached tokens")
    manager.allocate(seq)  # the same object again, as a scheduler re-admits a preempted sequence
    table, cached = list(seq.block_table), seq.num_cached_tokens
    if (table, cached) != ([0, 1, 4], 8):
        raise Mismatch(f"allocated again after free, the sequence has block_table {table} and num_cached_tokens "
                       f"{cached}, expected block_table [0, 1, 4] and 8 cached tokens (two hits, then the leftmost "
                       f"free block)")


def test_a_partial_block_has_no_hash_and_no_tokens(impl):
    """a block that is not full has hash -1, token_ids [] and no cache entry, also one taken from the free list
    that held another prompt's full block; it gets all three once an append fills it"""
    manager = impl.BlockManager(3, 4)
    used = impl.Sequence(list(range(11, 23)), 4)
    manager.allocate(used)  # blocks 0, 1, 2: full, each with its hash and tokens
    manager.free(used)  # free list [2, 1, 0]: each block keeps its hash and tokens
    seq = impl.Sequence([1, 2, 3, 4, 5, 6], 4)
    manager.allocate(seq)  # block 2 takes [1, 2, 3, 4]; block 1, which held [15 .. 18], now holds [5, 6]
    # (tokens appended, the sequence's block to read, whether it is full then): 9 opens block 0, which held [11 .. 14]
    for tokens, j, expect_full in (([], 1, False), ([7], 1, False), ([8], 1, True), ([9], 2, False)):
        for token in tokens:
            manager.append(seq, token)
        block_id = seq.block_table[j]
        block = manager.blocks[block_id]
        entries = dict(manager.hash_to_block_id)
        what = f"with {len(seq)} tokens, block {block_id} (the sequence's block {j}) holding {len(seq) - 4 * j}"
        if not expect_full and (block.hash != -1 or list(block.token_ids) or -1 in entries
                                or block_id in entries.values()):
            raise Mismatch(f"{what}: the partial block has hash {block.hash} and token_ids {list(block.token_ids)}"
                           f"{' and a cache entry' if block_id in entries.values() else ''}; expected "
                           f"hash -1, token_ids [] and no cache entry")
        if expect_full and (block.hash == -1 or list(block.token_ids) != [5, 6, 7, 8]
                            or entries.get(block.hash) != block_id):
            raise Mismatch(f"{what}: the block just filled has hash {block.hash} and token_ids "
                           f"{list(block.token_ids)}; expected its chained hash, token_ids [5, 6, 7, 8] and a cache "
                           f"entry")


# ---- random operations (hypothesis) ----------------------------------------------------------------------

OPS_CONFIGS = {"bs2-8blocks": (2, 8), "bs3-7blocks": (3, 7)}
MAX_EXAMPLES = 25


def operations(block_size: int):
    """Allocate / append / free with tokens from {0, 1}: shared prefixes and repeated blocks are common."""
    prompt = st.lists(st.integers(0, 1), min_size=1, max_size=3 * block_size + 1)
    return st.lists(st.one_of(
        st.tuples(st.just("allocate"), prompt),
        st.tuples(st.just("append"), st.integers(0, 3), st.integers(0, 1)),
        st.tuples(st.just("free"), st.integers(0, 3)),
    ), min_size=1, max_size=20)


def play_operations(impl, ops, num_blocks: int, block_size: int) -> None:
    player = Player(impl, num_blocks, block_size)
    for op in ops:
        live = sorted(player.live, key=lambda name: int(name[1:]))
        if op[0] == "allocate":
            player.allocate(op[1])
        elif not live:
            continue
        elif op[0] == "append":
            player.append(live[op[1] % len(live)], op[2])
        else:
            player.free(live[op[1] % len(live)])
        player.check()


@pytest.mark.parametrize("config", OPS_CONFIGS)
def test_random_operations_match_the_model(impl, seed, config):
    """random allocate / append / free sequences keep every invariant and match the dense model"""
    block_size, num_blocks = OPS_CONFIGS[config]
    explore(impl, seed, operations(block_size), lambda ops: play_operations(impl, ops, num_blocks, block_size),
            MAX_EXAMPLES, "operations", "manager")


# ---- metadata --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """A sequence as the check keeps it: its own copy, read before and after the learner's call."""

    token_ids: tuple
    block_size: int
    block_table: tuple
    num_cached_tokens: int

    def __len__(self) -> int:
        return len(self.token_ids)


def random_batch(gen, block_size: int, prefill: bool) -> list[Spec]:
    """2-4 sequences with random tokens, distinct random blocks, and (prefill) random cached prefixes."""
    free = torch.randperm(60, generator=gen).tolist()
    specs = []
    for _ in range(int(torch.randint(2, 5, (), generator=gen))):
        length = int(torch.randint(1, 4 * block_size + 2, (), generator=gen))
        table = [free.pop() for _ in range(-(-length // block_size))]
        cached = block_size * int(torch.randint(0, (length - 1) // block_size + 1, (), generator=gen)) if prefill else 0
        tokens = torch.randint(0, 1000, (length,), generator=gen).tolist()
        specs.append(Spec(tuple(tokens), block_size, tuple(table), cached))
    return specs


def metadata_of(impl, function: str, specs: list[Spec], expected: dict, what: str) -> None:
    """Expected values first, from the check's own copy; then the call; then: were the inputs left alone?"""
    seqs = [impl.Sequence(list(s.token_ids), s.block_size, list(s.block_table), s.num_cached_tokens) for s in specs]
    result = getattr(impl, function)(seqs)
    for i, (seq, spec) in enumerate(zip(seqs, specs)):
        for field in ("token_ids", "block_table", "num_cached_tokens"):
            got, was = getattr(seq, field), getattr(spec, field)
            if not isinstance(was, int):
                got, was = list(got), list(was)
            if got != was:
                raise LearnerError(f"`{function}` changed its input in place: seqs[{i}].{field} is {got}, was {was}",
                                   identifiable=True)
    expect_metadata(result, expected, what)


def prefill_expected(seqs) -> dict:
    """Straight from each token's position: new tokens are positions num_cached_tokens .. len - 1."""
    ids, positions, slots, cu_q, cu_k = [], [], [], [0], [0]
    for seq in seqs:
        for p in range(seq.num_cached_tokens, len(seq)):
            ids.append(seq.token_ids[p])
            positions.append(p)
            slots.append(slot(seq.block_table, p, seq.block_size))
        cu_q.append(cu_q[-1] + len(seq) - seq.num_cached_tokens)
        cu_k.append(cu_k[-1] + len(seq))
    any_cached = any(seq.num_cached_tokens for seq in seqs)
    return {"input_ids": ids, "positions": positions, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k,
            "max_seqlen_q": max(len(s) - s.num_cached_tokens for s in seqs), "max_seqlen_k": max(map(len, seqs)),
            "slot_mapping": slots, "block_tables": padded(seqs) if any_cached else None}


def decode_expected(seqs) -> dict:
    return {"input_ids": [s.token_ids[-1] for s in seqs], "positions": [len(s) - 1 for s in seqs],
            "context_lens": [len(s) for s in seqs],
            "slot_mapping": [slot(s.block_table, len(s) - 1, s.block_size) for s in seqs], "block_tables": padded(seqs)}


def padded(seqs) -> list[list[int]]:
    width = max(len(s.block_table) for s in seqs)
    return [list(s.block_table) + [-1] * (width - len(s.block_table)) for s in seqs]


FIELD_DTYPES = {"input_ids": torch.int64, "positions": torch.int64, "cu_seqlens_q": torch.int32,
                "cu_seqlens_k": torch.int32, "slot_mapping": torch.int32, "context_lens": torch.int32,
                "block_tables": torch.int32}


def expect_metadata(result, expected: dict, what: str) -> None:
    for name, value in expected.items():
        try:
            got = getattr(result, name)
        except AttributeError:
            raise Mismatch(f"{what}: the result has no field `{name}`") from None
        if value is None or isinstance(value, int):
            if got is not None and not isinstance(got, int) or got != value:
                raise Mismatch(f"{what} {name}: {got!r}, expected {value!r}")
            continue
        if not isinstance(got, torch.Tensor):
            raise Mismatch(f"{what} {name}: a {type(got).__name__}, expected a tensor")
        if got.dtype != FIELD_DTYPES[name]:
            raise Mismatch(f"{what} {name}: dtype {str(got.dtype).removeprefix('torch.')}, expected "
                           f"{str(FIELD_DTYPES[name]).removeprefix('torch.')}")
        if got.tolist() != value:
            raise Mismatch(f"{what} {name}: {got.tolist()}, expected {value}")


def batches(block_size: int) -> int:
    """Random batches a metadata check tries: 4 of small blocks; 2 of nano-vllm's blocks of 256, where a batch of
    2-4 sequences of up to 1025 tokens holds a few thousand tokens."""
    return 2 if block_size >= 256 else 4


@pytest.mark.parametrize("block_size", [1, 4, 5, 256], ids=lambda b: f"blocks of {b}")
def test_prefill_metadata(impl, gen, block_size):
    """prefill metadata equals the one computed token by token (positions from the cached prefix on)"""
    for _ in range(batches(block_size)):
        specs = random_batch(gen, block_size, prefill=True)
        metadata_of(impl, "prefill_metadata", specs, prefill_expected(specs), "prefill")


def test_prefill_metadata_without_a_cached_prefix(impl, gen):
    """a prefill with nothing cached has no block tables, and cu_seqlens_q equals cu_seqlens_k"""
    specs = random_batch(gen, 4, prefill=False)
    metadata_of(impl, "prefill_metadata", specs, prefill_expected(specs), "prefill")


@pytest.mark.parametrize("block_size", [1, 4, 5, 256], ids=lambda b: f"blocks of {b}")
def test_decode_metadata(impl, gen, block_size):
    """decode metadata equals the one computed from each sequence's last position"""
    for _ in range(batches(block_size)):
        specs = random_batch(gen, block_size, prefill=False)
        metadata_of(impl, "decode_metadata", specs, decode_expected(specs), "decode")
