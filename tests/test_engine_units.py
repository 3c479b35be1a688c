"""Model-free unit tests of the engine's bookkeeping: BlockManager, Scheduler and slot mapping.

Plain Python with fixed seeds. Expected values are derived independently of the code under
test: chained hashes recomputed from the tokens, brute-force slot lists, a shadow KV cache that
records what each slot was written with, and a reference generation loop per request.
"""
import random
from collections import Counter

import pytest

from nanovllm.scheduling.block_manager import BlockManager
from nanovllm.scheduling.scheduler import MIXED, PREFILL_FIRST, RECOMPUTE, SWAP, ScheduledBatch, Scheduler
from nanovllm.scheduling.sequence import Sequence, SequenceStatus
from nanovllm.scheduling.stop_checker import StopChecker
from nanovllm.runner.step_inputs import decode_slot, token_slots
from nanovllm.sampling_params import SamplingParams

VOCAB = 1000  # token ids drawn for prompts; large enough that accidental block matches are rare
EOS = 0


def make_seq(seq_id: int, tokens: list[int], block_size: int, max_tokens: int = 16,
             ignore_eos: bool = False, priority: int = 0) -> Sequence:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    return Sequence(seq_id, tokens, params, block_size, priority=priority)


def chained_hashes(tokens: list[int], block_size: int) -> list[int]:
    """Expected prefix-cache keys of the full blocks of `tokens`, computed from scratch."""
    hashes, prefix = [], None
    for i in range(len(tokens) // block_size):
        prefix = BlockManager.compute_hash(tokens[i * block_size:(i + 1) * block_size], prefix)
        hashes.append(prefix)
    return hashes


def flat_slots(block_table: list[int], block_size: int) -> list[int]:
    """Brute force: the slot of every position the block table can hold, in order."""
    return [b * block_size + o for b in block_table for o in range(block_size)]


def prefill(bm: BlockManager, seq: Sequence, sampled: int | None = None) -> None:
    """Compute the whole prompt the way Scheduler.postprocess records it, then sample."""
    first = seq.num_computed_tokens // bm.block_size
    seq.num_computed_tokens = len(seq)
    bm.cache_blocks(seq, first, seq.num_computed_tokens // bm.block_size)
    if sampled is not None:
        seq.token_ids.append(sampled)


def decode(bm: BlockManager, seq: Sequence, sampled: int) -> None:
    """One decode step: a block for the newest token, compute it, publish, append the sample."""
    assert seq.num_computed_tokens == len(seq) - 1
    assert bm.can_append(seq)
    bm.may_append(seq)
    first = seq.num_computed_tokens // bm.block_size
    seq.num_computed_tokens += 1
    bm.cache_blocks(seq, first, seq.num_computed_tokens // bm.block_size)
    seq.token_ids.append(sampled)


def manager_state(bm: BlockManager) -> tuple:
    return ([(b.ref_count, b.hash, b.token_ids) for b in bm.blocks], list(bm.free_block_queue),
            dict(bm.hash_to_block_id))


# ---------------------------------------------------------------------------------------------
# 1. BlockManager invariants under random allocate / append / preempt / free rounds
# ---------------------------------------------------------------------------------------------

class ShadowCache:
    """What the KV cache would hold: slot -> (position, token, chained hash of the blocks before).
    Together these identify a token and its whole prefix, so a wrong reuse is caught."""

    def __init__(self, bm: BlockManager):
        self.bm = bm
        self.kv: dict[int, tuple[int, int, int | None]] = {}
        self.hashes: dict[int, list[int]] = {}  # seq_id -> expected chained hashes, extended lazily
        self.tokens_of_hash: dict[int, tuple[int, ...]] = {}

    def expected_hashes(self, seq: Sequence) -> list[int]:
        bs = self.bm.block_size
        hashes = self.hashes.setdefault(seq.seq_id, [])
        while len(hashes) < len(seq) // bs:
            i = len(hashes)
            block = seq.token_ids[i * bs:(i + 1) * bs]
            hashes.append(BlockManager.compute_hash(block, hashes[-1] if hashes else None))
            self.tokens_of_hash[hashes[-1]] = tuple(block)
        return hashes

    def identity(self, seq: Sequence, p: int) -> tuple[int, int, int | None]:
        i = p // self.bm.block_size
        return p, seq.token_ids[p], self.expected_hashes(seq)[i - 1] if i else None

    def write(self, seq: Sequence, start: int, end: int) -> None:
        bs = self.bm.block_size
        for p in range(start, end):
            block = self.bm.blocks[seq.block_table[p // bs]]
            # Writing a shared or published block would corrupt another request's cache.
            assert block.ref_count == 1, f"write into shared block {block.block_id}"
            assert block.hash is None, f"write into published block {block.block_id}"
            self.kv[block.block_id * bs + p % bs] = self.identity(seq, p)

    def check_read(self, seq: Sequence, end: int) -> None:
        bs = self.bm.block_size
        for p in range(end):
            assert self.kv.get(seq.block_table[p // bs] * bs + p % bs) == self.identity(seq, p), \
                f"seq {seq.seq_id} position {p} reads a slot written for something else"


def check_invariants(bm: BlockManager, live: list[Sequence], shadow: ShadowCache) -> None:
    refs: Counter[int] = Counter()
    for seq in live:
        assert len(seq.block_table) == seq.num_blocks
        assert len(set(seq.block_table)) == len(seq.block_table), "block id twice in one table"
        refs.update(seq.block_table)
    for block in bm.blocks:
        assert block.ref_count == refs[block.block_id], f"block {block.block_id} ref_count"
    assert set(bm.free_block_queue) == {b.block_id for b in bm.blocks if b.ref_count == 0}
    assert bm.num_free_blocks + sum(b.ref_count > 0 for b in bm.blocks) == bm.num_blocks
    for h, block_id in bm.hash_to_block_id.items():
        block = bm.blocks[block_id]
        assert block.hash == h
        assert block.token_ids == shadow.tokens_of_hash[h], "published tokens do not match the key"
    for block in bm.blocks:
        if block.hash is None:
            assert block.token_ids == ()
        else:
            assert bm.hash_to_block_id.get(block.hash) == block.block_id, "stale block hash"
    for seq in live:
        expected = shadow.expected_hashes(seq)
        for i, block_id in enumerate(seq.block_table):
            block = bm.blocks[block_id]
            if block.hash is not None:
                assert i < len(expected) and block.hash == expected[i]
                assert block.token_ids == tuple(seq.block(i))


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_block_manager_invariants_random_rounds(prefix_caching: bool, block_size: int):
    rng = random.Random(1234 + block_size + prefix_caching)
    bm = BlockManager(num_blocks=16, block_size=block_size, enable_prefix_caching=prefix_caching)
    shadow = ShadowCache(bm)
    pool = [[rng.randrange(1, VOCAB) for _ in range(n)]
            for n in (block_size, 2 * block_size, 3 * block_size, block_size + 5)]
    max_len = 6 * block_size
    live: list[Sequence] = []
    preempted: list[Sequence] = []
    next_id = 0
    counts = Counter()

    def try_allocate(seq: Sequence) -> bool:
        before = manager_state(bm)
        if not bm.allocate(seq):
            assert manager_state(bm) == before, "a failed allocate changed the manager"
            assert seq.block_table == [] and seq.num_computed_tokens == 0
            counts["alloc_fail"] += 1
            return False
        nc = seq.num_computed_tokens
        assert nc % block_size == 0 and nc <= (len(seq) - 1) // block_size * block_size
        if not prefix_caching:
            assert nc == 0
        counts["cached_blocks"] += nc // block_size
        shadow.check_read(seq, nc)  # every reused block holds exactly this prefix
        live.append(seq)
        return True

    for _ in range(1000):
        r = rng.random()
        if r < 0.3:  # a new request, often behind a shared prefix
            prompt = list(rng.choice(pool)) if rng.random() < 0.6 else []
            prompt += [rng.randrange(1, VOCAB) for _ in range(rng.randrange(0, 2 * block_size))]
            prompt = prompt or [rng.randrange(1, VOCAB)]
            try_allocate(make_seq(next_id, prompt, block_size))
            next_id += 1
        elif r < 0.75 and live:  # one forward step for a running sequence
            seq = rng.choice(live)
            nc = seq.num_computed_tokens
            chunk = rng.randrange(1, len(seq) - nc + 1)  # a prefill chunk, or the one decode token
            shadow.write(seq, nc, nc + chunk)
            seq.num_computed_tokens += chunk
            bm.cache_blocks(seq, nc // block_size, seq.num_computed_tokens // block_size)
            if seq.num_computed_tokens == len(seq):  # a non-final chunk samples nothing
                seq.token_ids.append(rng.randrange(1, VOCAB))
                if len(seq) > max_len:
                    bm.deallocate(seq)
                    live.remove(seq)
                elif bm.can_append(seq):
                    had = len(seq.block_table)
                    bm.may_append(seq)
                    # A new block exactly when the newest token starts one.
                    assert len(seq.block_table) == had + ((len(seq) - 1) % block_size == 0)
                else:  # preempt: free everything, recompute later
                    assert (len(seq) - 1) % block_size == 0 and bm.num_free_blocks == 0
                    bm.deallocate(seq)
                    assert seq.block_table == [] and seq.num_computed_tokens == 0
                    live.remove(seq)
                    preempted.append(seq)
                    counts["preempt"] += 1
        elif r < 0.9 and live:  # a request finishes
            seq = live.pop(rng.randrange(len(live)))
            bm.deallocate(seq)
            assert seq.block_table == []
        elif preempted:  # a preempted request comes back with all its tokens
            seq = preempted[0]
            if try_allocate(seq):
                preempted.pop(0)
        check_invariants(bm, live, shadow)

    # The workload must have exercised what it claims to.
    assert counts["alloc_fail"] > 0 and counts["preempt"] > 0
    assert (counts["cached_blocks"] > 0) == prefix_caching
    for seq in live:
        bm.deallocate(seq)
    live.clear()
    check_invariants(bm, live, shadow)
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_allocate_fails_without_changing_anything(prefix_caching: bool):
    bs = 16
    bm = BlockManager(num_blocks=4, block_size=bs, enable_prefix_caching=prefix_caching)
    a = make_seq(0, list(range(1, 2 * bs + 1)), bs)  # 2 full blocks, both published
    assert bm.allocate(a)
    prefill(bm, a)
    bm.deallocate(a)  # both blocks free (and, with caching, still published)
    b = make_seq(1, list(range(100, 100 + 2 * bs)), bs)
    assert bm.allocate(b)  # takes 2 blocks: 2 left
    # 3 blocks needed (one of them possibly a free cached hit): only 2 are free.
    c = make_seq(2, list(range(1, 2 * bs + 1)) + [7] * (bs // 2), bs)
    assert c.num_blocks == 3
    before = manager_state(bm)
    assert not bm.allocate(c)
    assert manager_state(bm) == before
    assert c.block_table == [] and c.num_computed_tokens == 0 and c.num_cached_tokens == 0
    assert not c.scheduled_once
    # Freeing one sequence makes room, and the same request now goes through.
    bm.deallocate(b)
    assert bm.allocate(c)
    assert len(c.block_table) == 3 and bm.num_free_blocks == 1


def test_allocate_counts_a_free_cached_hit_as_needing_a_free_block():
    bs = 16
    bm = BlockManager(num_blocks=3, block_size=bs)
    prompt = list(range(1, 2 * bs + 2))  # 33 tokens: 3 blocks, blocks 0 and 1 full
    a = make_seq(0, prompt, bs)
    assert bm.allocate(a)
    prefill(bm, a)
    bm.deallocate(a)
    # The same prompt again, with exactly 3 blocks free: two hits on free blocks + one new.
    b = make_seq(1, prompt, bs)
    assert bm.allocate(b)
    assert b.num_cached_tokens == 2 * bs
    assert b.block_table[:2] == published_blocks_of(bm, prompt, bs)
    assert bm.num_free_blocks == 0


def published_blocks_of(bm: BlockManager, tokens: list[int], bs: int) -> list[int]:
    """Block ids published for the full blocks of `tokens`, looked up by recomputed hash."""
    return [bm.hash_to_block_id[h] for h in chained_hashes(tokens, bs)]


# ---------------------------------------------------------------------------------------------
# 2. Prefix cache behaviour
# ---------------------------------------------------------------------------------------------

def test_prefix_hits_count_full_blocks_but_never_the_last_tokens_block():
    bs = 16
    bm = BlockManager(num_blocks=64, block_size=bs)
    rng = random.Random(7)
    prompt = [rng.randrange(1, VOCAB) for _ in range(2 * bs)]  # exactly 2 blocks
    a = make_seq(0, prompt, bs)
    assert bm.allocate(a)
    assert a.num_cached_tokens == 0 and a.num_computed_tokens == 0
    prefill(bm, a)
    assert set(bm.hash_to_block_id) == set(chained_hashes(prompt, bs))

    # Same prompt: block 1 holds the last token, so only block 0 comes from the cache.
    b = make_seq(1, prompt, bs)
    assert bm.allocate(b)
    assert b.num_cached_tokens == bs and b.num_computed_tokens == bs
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    assert bm.blocks[a.block_table[0]].ref_count == 2 and bm.blocks[a.block_table[1]].ref_count == 1

    # One more token: both full blocks hit.
    c = make_seq(2, prompt + [5], bs)
    assert bm.allocate(c)
    assert c.num_cached_tokens == 2 * bs and c.block_table[:2] == a.block_table
    # Second block differs: only the first hits.
    d = make_seq(3, prompt[:bs] + [x + 1 for x in prompt[bs:]] + [5], bs)
    assert bm.allocate(d)
    assert d.num_cached_tokens == bs and d.block_table[0] == a.block_table[0]
    # First block differs (second identical): the chained hash misses everything.
    e = make_seq(4, [prompt[0] + 1] + prompt[1:] + [5], bs)
    assert bm.allocate(e)
    assert e.num_cached_tokens == 0 and not set(e.block_table) & set(a.block_table)
    # Shorter than a block: nothing to match.
    f = make_seq(5, prompt[:bs - 3], bs)
    assert bm.allocate(f)
    assert f.num_cached_tokens == 0


def test_prefix_hit_on_freed_block_takes_it_out_of_the_free_queue():
    bs = 16
    bm = BlockManager(num_blocks=8, block_size=bs)
    prompt = list(range(1, 2 * bs + 4))  # 35 tokens: blocks 0, 1 full
    a = make_seq(0, prompt, bs)
    assert bm.allocate(a)
    prefill(bm, a)
    a_table = list(a.block_table)
    bm.deallocate(a)
    assert bm.num_free_blocks == 8 and all(b in bm.free_block_queue for b in a_table)

    b = make_seq(1, prompt, bs)
    assert bm.allocate(b)
    assert b.block_table[:2] == a_table[:2] and b.num_cached_tokens == 2 * bs
    for block_id in b.block_table:
        assert block_id not in bm.free_block_queue and bm.blocks[block_id].ref_count == 1
    assert bm.num_free_blocks == 8 - 3


def test_freed_cached_blocks_are_evicted_when_reused():
    bs = 16
    bm = BlockManager(num_blocks=4, block_size=bs)
    prompt = list(range(1, 2 * bs + 2))
    a = make_seq(0, prompt, bs)
    assert bm.allocate(a)
    prefill(bm, a)
    bm.deallocate(a)
    # Fill the whole pool with an unrelated request: every cached block is taken and evicted.
    other = make_seq(1, [VOCAB + i for i in range(4 * bs)], bs)
    assert bm.allocate(other)
    assert bm.hash_to_block_id == {}
    assert all(b.hash is None and b.token_ids == () for b in bm.blocks)
    bm.deallocate(other)
    b = make_seq(2, prompt, bs)
    assert bm.allocate(b)
    assert b.num_cached_tokens == 0


def test_eviction_takes_tail_blocks_and_least_recently_freed_first():
    bs = 4
    bm = BlockManager(num_blocks=6, block_size=bs)
    prompt = list(range(1, 3 * bs + 2))  # 13 tokens: 4 blocks, blocks 0..2 published
    a = make_seq(0, prompt, bs)
    assert bm.allocate(a)
    prefill(bm, a)
    other = make_seq(1, list(range(50, 50 + 2 * bs)), bs)  # 2 blocks, freed after a
    assert bm.allocate(other)
    prefill(bm, other)
    a_table, other_table = list(a.block_table), list(other.block_table)
    bm.deallocate(a)
    bm.deallocate(other)
    # Two single-block requests take a's two tail blocks (freed first, a's tail before its head).
    x = make_seq(2, [200], bs)
    y = make_seq(3, [201], bs)
    assert bm.allocate(x) and bm.allocate(y)
    assert x.block_table + y.block_table == [a_table[3], a_table[2]]
    # a's first two blocks and all of `other` survive in the prefix cache.
    assert set(bm.hash_to_block_id) == set(chained_hashes(prompt, bs)[:2]) | set(chained_hashes(other.token_ids, bs))
    z = make_seq(4, [202], bs)  # next in line: a's block 1, still before anything of `other`
    assert bm.allocate(z)
    assert z.block_table == [a_table[1]]
    again = make_seq(5, prompt[:bs + 1], bs)
    assert bm.allocate(again)
    # A hit on a's block 0; its new block is the next in line: other's tail.
    assert again.num_cached_tokens == bs and again.block_table == [a_table[0], other_table[1]]
    assert set(bm.hash_to_block_id) == {chained_hashes(prompt, bs)[0], chained_hashes(other.token_ids, bs)[0]}


def test_hash_collision_is_caught_by_the_token_check(monkeypatch):
    monkeypatch.setattr(BlockManager, "compute_hash", staticmethod(lambda token_ids, prefix_hash: 42))
    bs = 16
    bm = BlockManager(num_blocks=16, block_size=bs)
    a = make_seq(0, list(range(1, bs + 2)), bs)
    assert bm.allocate(a)
    prefill(bm, a)
    assert bm.hash_to_block_id == {42: a.block_table[0]}

    b = make_seq(1, list(range(101, 101 + bs + 1)), bs)  # same hash, different tokens
    assert bm.allocate(b)
    assert b.num_cached_tokens == 0 and b.block_table[0] != a.block_table[0]
    assert bm.blocks[a.block_table[0]].ref_count == 1
    prefill(bm, b)  # publishing b's block must not overwrite a's entry
    assert bm.hash_to_block_id == {42: a.block_table[0]}
    assert bm.blocks[b.block_table[0]].hash is None

    c = make_seq(2, list(range(1, bs + 2)), bs)  # same tokens as a: a genuine hit
    assert bm.allocate(c)
    assert c.num_cached_tokens == bs and c.block_table[0] == a.block_table[0]


def test_each_block_is_hashed_once(monkeypatch):
    calls: list[tuple[int, ...]] = []
    real = BlockManager.compute_hash

    def counting(token_ids, prefix_hash):
        calls.append(tuple(token_ids))
        return real(token_ids, prefix_hash)

    monkeypatch.setattr(BlockManager, "compute_hash", staticmethod(counting))
    bs = 16
    bm = BlockManager(num_blocks=32, block_size=bs)
    prompt = list(range(1, 3 * bs + 6))  # 53 tokens: 3 full blocks
    a = make_seq(0, prompt, bs)
    assert bm.allocate(a)
    assert len(calls) <= 3
    prefill(bm, a, sampled=500)
    assert len(calls) == 3  # each full block of a exactly once

    bm.deallocate(a)  # a preempted: re-allocating reuses its remembered hashes
    assert bm.allocate(a)
    assert a.num_computed_tokens == 3 * bs
    assert len(calls) == 3

    b = make_seq(1, prompt, bs)  # another request hashes its own blocks, once each
    assert bm.allocate(b)
    assert b.num_cached_tokens == 3 * bs
    prefill(bm, b, sampled=501)
    assert len(calls) == 6

    # Re-prefill a, then decode it past the end of block 3 and block 4.
    prefill(bm, a, sampled=502)
    while len(a) < 5 * bs + 1:
        decode(bm, a, sampled=600 + len(a))
    assert a.num_computed_tokens == 5 * bs
    assert len(calls) == 6 + 2
    assert Counter(calls[6:]) == Counter([tuple(a.block(3)), tuple(a.block(4))])


def test_no_prefix_caching_caches_nothing(monkeypatch):
    calls = []
    monkeypatch.setattr(BlockManager, "compute_hash",
                        staticmethod(lambda token_ids, prefix_hash: calls.append(1) or 1))
    bs = 16
    bm = BlockManager(num_blocks=16, block_size=bs, enable_prefix_caching=False)
    prompt = list(range(1, 3 * bs + 2))
    a = make_seq(0, prompt, bs)
    assert bm.allocate(a)
    prefill(bm, a, sampled=9)
    b = make_seq(1, prompt, bs)
    assert bm.allocate(b)
    assert b.num_cached_tokens == 0 and b.num_computed_tokens == 0
    assert not set(a.block_table) & set(b.block_table)
    assert bm.hash_to_block_id == {} and all(blk.hash is None for blk in bm.blocks)
    assert calls == []


# ---------------------------------------------------------------------------------------------
# 3. Slot mapping at block boundaries
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [15, 16, 17, 31, 32, 33])
def test_decode_gets_a_new_block_exactly_at_boundaries(n: int):
    bs = 16
    bm = BlockManager(num_blocks=8, block_size=bs, enable_prefix_caching=False)
    # Scramble the free queue so block ids are not contiguous.
    junk = [make_seq(100 + i, [1] * bs, bs) for i in range(5)]
    for s in junk:
        assert bm.allocate(s)
    for s in (junk[3], junk[0], junk[4], junk[1], junk[2]):
        bm.deallocate(s)

    seq = make_seq(0, list(range(1, n)), bs)  # the prompt: n - 1 tokens
    assert bm.allocate(seq)
    prefill(bm, seq, sampled=777)  # now n tokens, the newest not yet computed
    assert len(seq) == n
    needs_block = n % bs == 1  # n == k * 16 + 1
    had = len(seq.block_table)
    assert had == -(-(n - 1) // bs)

    # With no free block, can_append says yes only when no block is needed.
    hog = make_seq(1, [2] * (bm.num_free_blocks * bs), bs)
    assert bm.allocate(hog) and bm.num_free_blocks == 0
    assert bm.can_append(seq) == (not needs_block)
    bm.deallocate(hog)
    assert bm.can_append(seq)
    bm.may_append(seq)
    assert len(seq.block_table) == had + needs_block
    assert len(set(seq.block_table)) == len(seq.block_table)
    assert decode_slot(seq.block_table, bs, n) == flat_slots(seq.block_table, bs)[n - 1]
    # The newest token's slot lies in the last block of the table.
    assert decode_slot(seq.block_table, bs, n) // bs == seq.block_table[-1]


def test_decode_slot_matches_bruteforce_on_random_tables():
    rng = random.Random(3)
    for _ in range(300):
        bs = rng.choice([1, 4, 16, 32])
        table = rng.sample(range(200), rng.randrange(1, 7))
        flat = flat_slots(table, bs)
        n = rng.randrange(1, len(flat) + 1)
        assert decode_slot(table, bs, n) == flat[n - 1]


def test_token_slots_matches_bruteforce():
    rng = random.Random(11)
    fixed = [(15, 17), (0, 32), (16, 16), (16, 17), (15, 16), (0, 1), (31, 33), (1, 47), (0, 48)]
    table16 = [9, 2, 30]
    for start, end in fixed:
        assert token_slots(table16, 16, start, end) == flat_slots(table16, 16)[start:end]
    for _ in range(1500):
        bs = rng.choice([1, 3, 16, 32])
        table = rng.sample(range(100), rng.randrange(1, 7))
        flat = flat_slots(table, bs)
        start = rng.randrange(0, len(flat) + 1)
        end = rng.randrange(start, len(flat) + 1)
        assert token_slots(table, bs, start, end) == flat[start:end], (bs, table, start, end)


# ---------------------------------------------------------------------------------------------
# 4. Scheduler with a fake model
# ---------------------------------------------------------------------------------------------

def next_token(seq_id: int, n: int) -> int:
    """The fake model's choice for the token after n tokens of request seq_id (path independent,
    so a recomputed request must produce the same output). EOS about one time in 13."""
    return (seq_id * 7919 + n * 104729 + (n * n) % 97) % 13


def reference_output(seq_id: int, prompt: list[int], max_tokens: int, ignore_eos: bool,
                     max_model_len: int) -> tuple[list[int], str]:
    tokens = list(prompt)
    while True:
        t = next_token(seq_id, len(tokens))
        tokens.append(t)
        if not ignore_eos and t == EOS:
            return tokens[len(prompt):], "stop"
        if len(tokens) - len(prompt) >= max_tokens or len(tokens) >= max_model_len:
            return tokens[len(prompt):], "length"


class FakeModel:
    """Stands in for the model runner: makes the batch's block copies in a shadow cache (swap-outs
    to a shadow host memory first, then swap-ins), checks every sequence reads exactly its own
    tokens' K/V, writes the new ones, then returns next_token for each sequence, and EOS (a
    poison) for a prefill chunk that samples nothing."""

    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.bm = sched.block_manager
        self.shadow = ShadowCache(self.bm)
        self.host: dict[int, list] = {}  # host block -> the shadow entries of its slots
        self.chunks: list[tuple[int, int]] = []  # (seq_id, tokens) of every piece of a prompt computed

    def copy_blocks(self, batch: ScheduledBatch) -> None:
        bs, kv = self.bm.block_size, self.shadow.kv
        for dev, host in zip(*batch.swap_out):
            self.host[host] = [kv.get(dev * bs + o) for o in range(bs)]
        for host, dev in zip(*batch.swap_in):
            block = self.bm.blocks[dev]
            assert block.ref_count == 1 and block.hash is None, f"swap-in into shared or published block {dev}"
            for o, entry in enumerate(self.host.pop(host)):
                kv[dev * bs + o] = entry

    def __call__(self, batch: ScheduledBatch) -> list[int]:
        s = self.sched
        self.copy_blocks(batch)
        assert len(batch.seqs) <= s.max_num_seqs and len(s.running) <= min(s.max_num_seqs, s.max_num_batched_tokens)
        assert len({seq.seq_id for seq in batch.seqs}) == len(batch.seqs)
        assert batch.num_tokens <= s.max_num_batched_tokens, "token budget exceeded"
        assert batch.is_prefill == any(not seq.is_decoding for seq in batch.seqs)
        if s.policy == MIXED:  # every running sequence past its prompt gets its token
            scheduled = {id(seq) for seq in batch.seqs}
            assert all(id(seq) in scheduled for seq in s.running if seq.is_decoding)
        if s.policy == PREFILL_FIRST and batch.num_prefill_seqs:
            assert batch.num_prefill_seqs == len(batch.seqs), "a prefill-first step decodes nothing"
        assert not any(seq.host_block_table for seq in s.running)
        out = []
        for seq in batch.seqs:
            nc, k = seq.num_computed_tokens, seq.num_scheduled_tokens
            assert len(seq.block_table) == seq.num_blocks
            assert seq.status == SequenceStatus.RUNNING and seq in s.running
            assert 1 <= k and nc + k <= len(seq)
            self.shadow.check_read(seq, nc)
            if not seq.is_decoding or nc < seq.num_prompt_tokens:
                self.chunks.append((seq.seq_id, k))
            self.shadow.write(seq, nc, nc + k)
            out.append(next_token(seq.seq_id, len(seq)) if nc + k == len(seq) else EOS)
        return out


def drive(sched: Scheduler, model: FakeModel, max_steps: int) -> list[Sequence]:
    finished: list[Sequence] = []
    for _ in range(max_steps):
        if sched.is_finished():
            return finished
        batch = sched.schedule()
        finished += [seq for seq in sched.postprocess(batch, model(batch)) if seq.is_finished]
    raise AssertionError(f"not finished after {max_steps} steps: possible livelock")


def make_scheduler(num_blocks: int, bs: int, max_num_seqs: int = 8, max_batched: int = 256,
                   max_model_len: int = 4096, prefix_caching: bool = True, policy: str = PREFILL_FIRST,
                   mode: str = RECOMPUTE, num_host_blocks: int = 0) -> Scheduler:
    bm = BlockManager(num_blocks, bs, enable_prefix_caching=prefix_caching, num_host_blocks=num_host_blocks)
    return Scheduler(max_num_seqs, max_batched, bm, StopChecker(EOS, max_model_len), policy, mode)


def test_prefill_first_then_decode_in_order():
    bs = 4
    sched = make_scheduler(64, bs)
    model = FakeModel(sched)
    a = make_seq(0, [1, 2, 3, 4, 5], bs, max_tokens=10, ignore_eos=True)
    b = make_seq(1, [6, 7, 8], bs, max_tokens=10, ignore_eos=True)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert batch.is_prefill and batch.seqs == [a, b]
    assert [s.num_scheduled_tokens for s in batch.seqs] == [5, 3]
    assert all(not seq.is_finished for seq in sched.postprocess(batch, model(batch)))
    assert len(a) == 6 and len(b) == 4
    batch = sched.schedule()
    assert not batch.is_prefill and batch.seqs == [a, b]
    sched.postprocess(batch, model(batch))

    c = make_seq(2, [9, 10], bs, max_tokens=10, ignore_eos=True)
    sched.add(c)
    batch = sched.schedule()  # a waiting request goes before the decodes
    assert batch.is_prefill and batch.seqs == [c]
    sched.postprocess(batch, model(batch))
    batch = sched.schedule()
    assert not batch.is_prefill and batch.seqs == [a, b, c]
    sched.postprocess(batch, model(batch))
    assert a.completion_token_ids == [next_token(0, n) for n in range(5, 8)]
    assert c.completion_token_ids == [next_token(2, 2), next_token(2, 3)]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_chunked_prefill(prefix_caching: bool):
    bs, budget = 4, 8
    sched = make_scheduler(64, bs, max_batched=budget, prefix_caching=prefix_caching)
    model = FakeModel(sched)
    a = make_seq(0, list(range(1, 21)), bs, max_tokens=3, ignore_eos=True)  # 20 tokens
    b = make_seq(1, list(range(30, 36)), bs, max_tokens=3, ignore_eos=True)  # 6 tokens
    sched.add(a)
    sched.add(b)

    # Step 1 and 2: a alone, 8 tokens each; it is running (it holds its blocks), samples nothing.
    for step in range(2):
        batch = sched.schedule()
        assert batch.is_prefill and batch.seqs == [a] and a.num_scheduled_tokens == budget
        assert sched.running == [a] and a.status == SequenceStatus.RUNNING and list(sched.waiting) == [b]
        sched.postprocess(batch, model(batch))  # the model returns EOS for a non-final chunk
        assert len(a) == 20 and a.num_computed_tokens == budget * (step + 1)
        # Only blocks whose K/V are computed are published.
        published = set(sched.block_manager.hash_to_block_id)
        expected = set(chained_hashes(a.token_ids, bs)[:a.num_computed_tokens // bs])
        assert published == (expected if prefix_caching else set())

    # Step 3: a's last 4 tokens, then b takes the other 4 of the budget and is chunked itself.
    batch = sched.schedule()
    assert batch.is_prefill and batch.seqs == [a, b]
    assert (a.num_scheduled_tokens, b.num_scheduled_tokens) == (4, 4)
    assert sched.running == [a, b] and not sched.waiting
    sched.postprocess(batch, model(batch))
    assert a.completion_token_ids == [next_token(0, 20)] and len(b) == 6
    # Step 4: the rest of b, alone (prefill first), then decodes.
    batch = sched.schedule()
    assert batch.is_prefill and batch.seqs == [b] and b.num_scheduled_tokens == 2
    sched.postprocess(batch, model(batch))
    assert not sched.waiting and list(sched.running) == [a, b]

    drive(sched, model, 20)
    assert [k for sid, k in model.chunks if sid == 0] == [8, 8, 4]
    assert sum(k for sid, k in model.chunks if sid == 1) == 6
    for seq, prompt_len in ((a, 20), (b, 6)):
        assert seq.completion_token_ids == [next_token(seq.seq_id, n) for n in range(prompt_len, prompt_len + 3)]
        assert seq.finish_reason == "length"
    assert sched.block_manager.num_free_blocks == 64


@pytest.mark.parametrize("policy", [PREFILL_FIRST, MIXED])
def test_chunk_that_leaves_one_token_computes_it_as_a_decode_row(policy: str):
    bs, budget = 4, 8
    sched = make_scheduler(16, bs, max_batched=budget, policy=policy)
    model = FakeModel(sched)
    a = make_seq(0, list(range(1, budget + 2)), bs, max_tokens=2, ignore_eos=True)  # budget + 1
    sched.add(a)
    batch = sched.schedule()
    assert batch.is_prefill and a.num_scheduled_tokens == budget
    assert sched.running == [a] and not sched.waiting
    sched.postprocess(batch, model(batch))
    assert len(a) == budget + 1 and a.num_computed_tokens == budget
    # One token over the cached rest: the same computation as a decode, so the decode path
    # (CUDA graphs) runs it, and it samples the first completion token.
    batch = sched.schedule()
    assert not batch.is_prefill and batch.seqs == [a] and a.num_scheduled_tokens == 1
    drive(sched, model, 10)
    assert a.completion_token_ids == [next_token(0, budget + 1), next_token(0, budget + 2)]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_takes_the_newest_and_recomputes(prefix_caching: bool):
    bs = 4
    sched = make_scheduler(5, bs, max_num_seqs=4, prefix_caching=prefix_caching)
    model = FakeModel(sched)
    # a, b, d: one full block each, so their first decode needs a new block; c has room left.
    a, b, c, d = (make_seq(i, [10 * i + j for j in range(1, 5 if i != 2 else 3)], bs, max_tokens=3,
                           ignore_eos=True) for i in range(4))
    e = make_seq(4, [99], bs, max_tokens=2, ignore_eos=True)  # kept waiting by max_num_seqs
    for s in (a, b, c, d, e):
        sched.add(s)
    batch = sched.schedule()
    assert batch.is_prefill and batch.seqs == [a, b, c, d] and list(sched.waiting) == [e]
    sched.postprocess(batch, model(batch))
    assert sched.block_manager.num_free_blocks == 1

    # a takes the last free block; b needs one too: the newest running request (d) is
    # preempted, not c, and goes back to the head of the queue, before e.
    batch = sched.schedule()
    assert not batch.is_prefill and batch.seqs == [a, b, c]
    assert sched.num_preemptions == 1
    assert list(sched.waiting) == [d, e] and list(sched.running) == [a, b, c]
    assert d.status == SequenceStatus.WAITING
    assert d.block_table == [] and d.num_computed_tokens == 0 and len(d) == 5
    sched.postprocess(batch, model(batch))

    batch = sched.schedule()  # d needs 2 blocks, none free: a, b and c decode and finish
    assert not batch.is_prefill and batch.seqs == [a, b, c]
    finished = [seq for seq in sched.postprocess(batch, model(batch)) if seq.is_finished]
    assert finished == [a, b, c] and sched.block_manager.num_free_blocks == 5

    batch = sched.schedule()  # d is recomputed from scratch: prompt and its sampled token
    assert batch.is_prefill and batch.seqs == [d, e]
    assert d.num_computed_tokens == 0 and d.num_scheduled_tokens == 5 and len(d.block_table) == 2
    sched.postprocess(batch, model(batch))
    assert d.num_computed_tokens == 5 and len(d) == 6
    drive(sched, model, 10)
    for s in (a, b, c, d, e):
        assert (s.completion_token_ids, s.finish_reason) == \
            reference_output(s.seq_id, s.prompt_token_ids, s.max_tokens, True, 4096)
    assert sched.num_preemptions == 1
    assert sched.block_manager.num_free_blocks == 5


def drive_arrivals(sched: Scheduler, model: FakeModel, arrivals: list[tuple[int, Sequence]],
                   max_steps: int) -> list[Sequence]:
    """drive(), adding each (step, sequence) of `arrivals` (sorted by step) at its step."""
    finished: list[Sequence] = []
    pending = list(arrivals)
    for step in range(max_steps):
        while pending and pending[0][0] <= step:
            sched.add(pending.pop(0)[1])
        if sched.is_finished() and not pending:
            return finished
        batch = sched.schedule()
        finished += [seq for seq in sched.postprocess(batch, model(batch)) if seq.is_finished]
    raise AssertionError(f"not finished after {max_steps} steps: possible livelock")


@pytest.mark.parametrize("mode", [RECOMPUTE, SWAP])
@pytest.mark.parametrize("policy", [PREFILL_FIRST, MIXED])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_random_workloads_finish_with_reference_outputs(prefix_caching: bool, policy: str, mode: str):
    """Random caches, budgets, prompts (often behind a shared prefix), priorities and arrival
    steps: every request ends with its reference output within a bounded number of steps (no
    livelock), the fake model's shadow cache sees exact K/V through every chunk, preemption,
    swap out and swap in, and everything is freed at the end."""
    rng = random.Random(99 + prefix_caching + 2 * (policy == MIXED) + 4 * (mode == SWAP))
    totals = Counter()
    for trial in range(40):
        bs = rng.choice([2, 4, 8])
        max_num_seqs = rng.randrange(1, 7)
        max_batched = rng.randrange(4, 48)
        max_model_len = rng.choice([4096, rng.randrange(20, 60)])
        shared = [rng.randrange(1, 13) for _ in range(rng.randrange(1, 24))]
        specs = []
        arrival_steps = sorted(rng.choice([0, 0, rng.randrange(0, 30)]) for _ in range(rng.randrange(1, 10)))
        for i, arrival in enumerate(arrival_steps):  # seq ids in arrival order, as the engine gives them
            prompt = (list(shared) if rng.random() < 0.5 else []) + \
                [rng.randrange(1, 13) for _ in range(rng.randrange(0, 20))]
            prompt = (prompt or [5])[:max_model_len - 1]
            specs.append((i, prompt, rng.randrange(1, 25), rng.random() < 0.5, rng.randrange(3), arrival))
        # Every request fits in the cache on its own (the KV of all but its last token).
        need = max(-(-min(len(p) + m, max_model_len) // bs) for _, p, m, *_ in specs)
        sched = make_scheduler(need + rng.randrange(0, 4), bs, max_num_seqs, max_batched, max_model_len,
                               prefix_caching, policy, mode, num_host_blocks=rng.choice([0, 2, 8, 64]))
        model = FakeModel(sched)
        seqs = [make_seq(i, p, bs, max_tokens=m, ignore_eos=ig, priority=pr) for i, p, m, ig, pr, _ in specs]
        bound = 10 * sum(len(p) + m for _, p, m, *_ in specs) + 50 + max(arrival_steps)
        finished = drive_arrivals(sched, model, [(spec[-1], seq) for spec, seq in zip(specs, seqs)], bound)
        assert sorted(s.seq_id for s in finished) == [s.seq_id for s in seqs]
        for s, (i, p, m, ig, *_) in zip(seqs, specs):
            assert s.is_finished and s.prompt_token_ids == p
            assert (s.completion_token_ids, s.finish_reason) == reference_output(i, p, m, ig, max_model_len), \
                f"trial {trial} seq {i}"
            assert s.block_table == [] and s.host_block_table == []
            assert 0 <= s.num_cached_tokens <= (len(p) - 1) // bs * bs
            totals["cached"] += s.num_cached_tokens
        bm = sched.block_manager
        assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
        assert sorted(bm.free_host_blocks) == list(range(bm.num_host_blocks)) and not model.host
        assert not sched.running and not sched.waiting and not sched.swapped
        stats = sched.stats
        totals.update(preemptions=sched.num_preemptions, swaps=stats.preemptions_swap, swap_ins=stats.swap_ins,
                      swap_full=stats.swap_space_full, mixed=stats.mixed_steps,
                      chunked=sum(1 for sid, k in model.chunks if k < len(seqs[sid].prompt_token_ids)))
        assert stats.swap_ins + stats.swapped_prefix_lost == stats.preemptions_swap  # every swapped one came back
    # The workloads exercised what they claim to.
    assert totals["preemptions"] > 0 and totals["chunked"] > 0
    assert (totals["cached"] > 0) == prefix_caching
    assert (totals["swaps"] > 0) == (totals["swap_ins"] > 0) == (totals["swap_full"] > 0) == (mode == SWAP)
    assert (totals["mixed"] > 0) == (policy == MIXED)


def test_eos_stops_with_stop():
    bs = 4
    sched = make_scheduler(16, bs)
    model = FakeModel(sched)
    # Find a prompt length after which the fake model says EOS on the third sampled token.
    seq_id = 0
    n0 = next(n for n in range(1, 200) if next_token(seq_id, n + 2) == EOS
              and EOS not in (next_token(seq_id, n), next_token(seq_id, n + 1)))
    s = make_seq(seq_id, [3] * n0, bs, max_tokens=50)
    sched.add(s)
    finished = drive(sched, model, 20)
    assert finished == [s] and s.finish_reason == "stop"
    assert s.num_completion_tokens == 3 and s.completion_token_ids[-1] == EOS


def test_ignore_eos_keeps_going_and_max_tokens_is_exact():
    bs = 4
    sched = make_scheduler(16, bs)
    s = make_seq(0, [3, 4, 5], bs, max_tokens=7, ignore_eos=True)
    sched.add(s)
    for _ in range(20):
        if sched.is_finished():
            break
        batch = sched.schedule()
        sched.postprocess(batch, [EOS] * len(batch.seqs))  # the model says EOS every time
    assert sched.is_finished()
    assert s.completion_token_ids == [EOS] * 7 and s.finish_reason == "length"


@pytest.mark.parametrize("max_tokens", [1, 2, 9])
def test_max_tokens_is_exact(max_tokens: int):
    bs = 4
    sched = make_scheduler(16, bs)
    s = make_seq(0, [3, 4, 5, 6], bs, max_tokens=max_tokens)
    sched.add(s)
    steps = 0
    while not sched.is_finished():
        batch = sched.schedule()
        sched.postprocess(batch, [7] * len(batch.seqs))
        steps += 1
        assert steps <= max_tokens
    assert steps == max_tokens  # one prefill, then one decode per further token
    assert s.completion_token_ids == [7] * max_tokens and s.finish_reason == "length"
    assert sched.block_manager.num_free_blocks == 16


def test_max_model_len_stops_with_length():
    bs = 4
    sched = make_scheduler(16, bs, max_model_len=13)
    s = make_seq(0, list(range(1, 11)), bs, max_tokens=100, ignore_eos=True)
    sched.add(s)
    drive(sched, FakeModel(sched), 20)
    assert len(s) == 13 and s.num_completion_tokens == 3 and s.finish_reason == "length"


def test_max_num_seqs_is_never_exceeded():
    bs = 4
    sched = make_scheduler(64, bs, max_num_seqs=2)
    model = FakeModel(sched)
    seqs = [make_seq(i, [i + 1] * 3, bs, max_tokens=2 + i, ignore_eos=True) for i in range(5)]
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()
    assert batch.is_prefill and batch.seqs == seqs[:2]
    sched.postprocess(batch, model(batch))
    batch = sched.schedule()  # two running: no admission, decode only
    assert not batch.is_prefill and batch.seqs == seqs[:2]
    sched.postprocess(batch, model(batch))  # seq 0 finishes (max_tokens 2): one slot opens
    assert seqs[0].is_finished
    batch = sched.schedule()
    assert batch.is_prefill and batch.seqs == [seqs[2]]
    sched.postprocess(batch, model(batch))
    drive(sched, model, 50)  # FakeModel asserts the limit on every step
    assert all(s.is_finished for s in seqs)
    assert sched.block_manager.num_free_blocks == 64
