"""Model-free tests of the scheduling policies, priorities and swap preemption.

The fake model of tests/test_engine_units.py stands in for the runner: it makes each batch's
block copies in a shadow cache and checks that every sequence reads exactly its own tokens'
K/V, so a swapped sequence that resumes with wrong block contents fails. Expected schedules are
worked out by hand in each test's comments.
"""
import pytest

from nanovllm.scheduling.block_manager import BlockManager
from nanovllm.scheduling.scheduler import MIXED, PREFILL_FIRST, RECOMPUTE, SWAP, Scheduler
from nanovllm.scheduling.sequence import SHARED_BLOCK, Sequence, SequenceStatus
from test_engine_units import (FakeModel, ShadowCache, drive, drive_arrivals, make_scheduler, make_seq, prefill,
                               reference_output)


def step(sched: Scheduler, model: FakeModel):
    batch = sched.schedule()
    sched.postprocess(batch, model(batch))
    return batch


def check_reference(seqs, max_model_len: int = 4096) -> None:
    for s in seqs:
        assert (s.completion_token_ids, s.finish_reason) == reference_output(
            s.seq_id, s.prompt_token_ids, s.max_tokens, s.ignore_eos, max_model_len), f"seq {s.seq_id}"


# ---------------------------------------------------------------------------------------------
# Mixed batches
# ---------------------------------------------------------------------------------------------

def test_mixed_step_decodes_every_running_sequence_then_fills_the_budget():
    bs, budget = 4, 10
    sched = make_scheduler(64, bs, max_batched=budget, policy=MIXED)
    model = FakeModel(sched)
    a = make_seq(0, [1, 2, 3], bs, max_tokens=20, ignore_eos=True)
    b = make_seq(1, [4, 5], bs, max_tokens=20, ignore_eos=True)
    sched.add(a)
    sched.add(b)
    batch = step(sched, model)  # nothing runs yet: both prompts, 5 tokens
    assert batch.is_prefill and batch.seqs == [a, b] and batch.num_prefill_seqs == 2 and not batch.is_mixed
    c = make_seq(2, list(range(100, 120)), bs, max_tokens=2, ignore_eos=True)  # 20 tokens
    d = make_seq(3, list(range(200, 206)), bs, max_tokens=2, ignore_eos=True)  # 6 tokens
    sched.add(c)
    sched.add(d)
    # a and b decode first (1 token each), then c takes the 8 tokens left; nothing is left for d.
    batch = step(sched, model)
    assert batch.seqs == [a, b, c] and [s.num_computed_tokens for s in (a, b, c)] == [4, 3, 8]
    assert batch.is_prefill and batch.is_mixed and batch.num_prefill_seqs == 1 and list(sched.waiting) == [d]
    batch = step(sched, model)  # the same again: c's second chunk
    assert batch.seqs == [a, b, c] and c.num_computed_tokens == 16 and list(sched.waiting) == [d]
    # c's last 4 tokens, then d gets the 4 that remain: two prompts beside two decodes.
    batch = step(sched, model)
    assert batch.seqs == [a, b, c, d] and (c.num_computed_tokens, d.num_computed_tokens) == (20, 4)
    assert batch.num_prefill_seqs == 2 and sched.running == [a, b, c, d]
    assert sched.stats.mixed_steps == 3 and sched.stats.decode_steps == 0
    drive(sched, model, 100)
    check_reference([a, b, c, d])
    assert sched.stats.decode_steps > 0  # once no prompt is left, steps are pure decodes again


def test_prefill_first_stalls_the_decodes_that_mixed_keeps_going():
    """The same arrivals under both policies: count the steps in which a running sequence got no
    token while a prompt was computed."""
    stalls = {}
    for policy in (PREFILL_FIRST, MIXED):
        bs = 4
        sched = make_scheduler(64, bs, max_batched=8, policy=policy)
        model = FakeModel(sched)
        a = make_seq(0, [1, 2, 3], bs, max_tokens=12, ignore_eos=True)
        late = make_seq(1, list(range(50, 90)), bs, max_tokens=2, ignore_eos=True)  # 40 tokens: 5+ chunks
        sched.add(a)
        step(sched, model)
        sched.add(late)
        stalls[policy] = 0
        while not sched.is_finished():
            before = len(a)
            batch = step(sched, model)
            stalls[policy] += batch.num_prefill_seqs > 0 and len(a) == before and not a.is_finished
        check_reference([a, late])
    assert stalls[MIXED] == 0 and stalls[PREFILL_FIRST] >= 5


@pytest.mark.parametrize("policy", [PREFILL_FIRST, MIXED])
def test_running_sequences_are_bounded_by_the_token_budget(policy: str):
    """With max_num_batched_tokens below max_num_seqs, at most that many sequences run, so each
    can get its token in every step; the fake model checks the budget and (mixed) that every
    decoding sequence is in the batch."""
    bs = 4
    sched = make_scheduler(64, bs, max_num_seqs=8, max_batched=3, policy=policy)
    model = FakeModel(sched)
    seqs = [make_seq(i, [i + 1, i + 2], bs, max_tokens=4, ignore_eos=True) for i in range(6)]
    for s in seqs:
        sched.add(s)
    peak = 0
    for _ in range(60):
        if sched.is_finished():
            break
        step(sched, model)
        peak = max(peak, len(sched.running))
    assert sched.is_finished() and peak == 3
    check_reference(seqs)


# ---------------------------------------------------------------------------------------------
# Priorities
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", [PREFILL_FIRST, MIXED])
def test_waiting_requests_are_admitted_by_priority_then_arrival(policy: str):
    bs = 4
    sched = make_scheduler(64, bs, max_num_seqs=1, policy=policy)
    model = FakeModel(sched)
    priorities = [2, 0, 1, 0, -1]
    seqs = [make_seq(i, [i + 1] * 3, bs, max_tokens=2, ignore_eos=True, priority=p) for i, p in enumerate(priorities)]
    for s in seqs:
        sched.add(s)
    assert [s.seq_id for s in sched.waiting] == [4, 1, 3, 2, 0]
    admitted = []
    while not sched.is_finished():
        batch = step(sched, model)
        admitted += [s.seq_id for s in batch.seqs if s.seq_id not in admitted]
    assert admitted == [4, 1, 3, 2, 0]
    check_reference(seqs)


@pytest.mark.parametrize("policy", [PREFILL_FIRST, MIXED])
def test_preemption_takes_the_lowest_priority_latest_arrival_first(policy: str):
    bs = 4
    sched = make_scheduler(5, bs, policy=policy)
    model = FakeModel(sched)
    # One full block each, so each needs a second block for its first decode; 1 block stays free.
    a, b, c, d = (make_seq(i, [10 * i + j for j in range(1, 5)], bs, max_tokens=3, ignore_eos=True, priority=p)
                  for i, p in enumerate([0, 1, 1, 0]))
    for s in (a, b, c, d):
        sched.add(s)
    step(sched, model)  # one block each for the 4-token prompts; the sampled token needs a second
    assert sched.running == [a, d, b, c] and sched.block_manager.num_free_blocks == 1
    # In order a, d, b, c: a takes the free block; d needs one: c goes (priority 1, latest);
    # b needs one and is itself the last: it goes, and never takes a block from a or d.
    batch = step(sched, model)
    assert batch.seqs == [a, d] and sched.running == [a, d]
    assert list(sched.waiting) == [b, c] and sched.stats.preemptions_recompute == 2
    drive(sched, model, 50)
    check_reference([a, b, c, d])


@pytest.mark.parametrize("policy", [PREFILL_FIRST, MIXED])
def test_a_lower_priority_sequence_never_preempts_a_higher_one(policy: str):
    """The lowest-priority running sequence needs a block and none is free: it preempts itself,
    though the higher-priority one arrived later."""
    bs = 4
    sched = make_scheduler(3, bs, policy=policy)
    model = FakeModel(sched)
    low = make_seq(0, [1, 2, 3, 4], bs, max_tokens=4, ignore_eos=True, priority=5)
    high = make_seq(1, list(range(5, 12)), bs, max_tokens=3, ignore_eos=True, priority=0)
    sched.add(low)
    sched.add(high)
    batch = step(sched, model)  # high first; 2 + 1 blocks: the whole cache
    assert batch.seqs == [high, low] and sched.block_manager.num_free_blocks == 0
    batch = step(sched, model)  # high fits its 8th token; low needs a 2nd block: it goes itself
    assert batch.seqs == [high] and list(sched.waiting) == [low] and sched.num_preemptions == 1
    drive(sched, model, 50)
    check_reference([low, high])
    assert sched.num_preemptions == 1


def test_no_livelock_under_priorities_and_a_tiny_cache():
    """Many arrivals of mixed priorities over a cache that holds about two requests: everything
    finishes in a bounded number of steps, with reference outputs, under both modes."""
    for mode in (RECOMPUTE, SWAP):
        bs = 4
        sched = make_scheduler(8, bs, max_num_seqs=4, max_batched=12, policy=MIXED, mode=mode, num_host_blocks=6)
        model = FakeModel(sched)
        seqs = [make_seq(i, [(7 * i + j) % 13 + 1 for j in range(3 + i % 9)], bs, max_tokens=12 + i % 5,
                         ignore_eos=True, priority=(i * 5) % 3) for i in range(16)]
        arrivals = [(2 * i, s) for i, s in enumerate(seqs)]
        drive_arrivals(sched, model, arrivals, 2000)
        check_reference(seqs)
        assert sched.num_preemptions > 0
        assert (sched.stats.preemptions_swap > 0) == (mode == SWAP)


# ---------------------------------------------------------------------------------------------
# Swap preemption
# ---------------------------------------------------------------------------------------------

def test_swap_out_copies_only_exclusive_blocks_and_swap_in_restores_them_exactly():
    bs = 4
    bm = BlockManager(16, bs, enable_prefix_caching=True, num_host_blocks=8)
    shadow = ShadowCache(bm)
    shared = list(range(1, 9))  # two full blocks
    x = make_seq(0, shared + [50], bs)
    assert bm.allocate(x)
    shadow.write(x, 0, len(x))
    prefill(bm, x, sampled=51)
    y = make_seq(1, shared + [60, 61, 62], bs)
    assert bm.allocate(y) and y.num_computed_tokens == 2 * bs  # the shared blocks are hits
    shadow.write(y, 2 * bs, len(y))
    prefill(bm, y, sampled=63)  # 12 tokens, 11 computed: blocks 0, 1 shared, block 2 its own
    table = list(y.block_table)
    assert [bm.blocks[b].ref_count for b in table] == [2, 2, 1]

    copies = bm.swap_out(y)
    assert copies.src == [table[2]] and len(copies.dst) == 1  # the shared blocks are not duplicated
    assert y.host_block_table == [SHARED_BLOCK, SHARED_BLOCK, copies.dst[0]]
    assert y.block_table == [] and y.num_computed_tokens == 11 and bm.num_free_host_blocks == 7
    assert [bm.blocks[b].ref_count for b in table] == [1, 1, 0]  # x alone holds the prefix now
    host = [shadow.kv.get(table[2] * bs + o) for o in range(bs)]
    # Another request takes (and overwrites) every free block, y's old one among them.
    z = make_seq(2, [900 + i for i in range(bm.num_free_blocks * bs)], bs)
    assert bm.allocate(z)
    shadow.write(z, 0, len(z))
    bm.deallocate(z)

    assert not bm.swapped_prefix_lost(y)
    host_id = y.host_block_table[2]
    copies = bm.swap_in(y)
    assert copies.src == [host_id]
    assert y.block_table[:2] == table[:2] and y.host_block_table == [] and len(y.block_table) == 3
    assert copies.dst == [y.block_table[2]]
    for o, entry in enumerate(host):
        shadow.kv[copies.dst[0] * bs + o] = entry
    bm.free_host(copies.src)
    assert bm.num_free_host_blocks == 8
    shadow.check_read(y, y.num_computed_tokens)  # exactly its own K/V again
    assert [bm.blocks[b].ref_count for b in y.block_table] == [2, 2, 1]


def test_swap_out_refuses_without_enough_host_blocks_and_changes_nothing():
    bs = 4
    bm = BlockManager(8, bs, num_host_blocks=1)
    y = make_seq(0, list(range(1, 10)), bs)  # 9 tokens: 3 blocks
    assert bm.allocate(y)
    prefill(bm, y, sampled=5)
    table = list(y.block_table)
    assert bm.swap_out(y) is None
    assert y.block_table == table and y.host_block_table == [] and bm.num_free_host_blocks == 1


@pytest.mark.parametrize("evict_prefix", [False, True])
@pytest.mark.parametrize("policy", [PREFILL_FIRST, MIXED])
def test_swapped_sequence_resumes_or_is_recomputed_when_its_prefix_is_gone(policy: str, evict_prefix: bool):
    """x and y share a two-block prefix; both grow into a 4th block with 5 blocks in all, so y
    (the later arrival) is swapped out, copying only its own block. Without z, y is swapped back
    in once x is done and reads exactly its K/V (the fake model checks). With z (priority -1,
    the whole cache), z goes first, evicts the shared prefix, and y must be recomputed."""
    bs = 4
    sched = make_scheduler(5, bs, policy=policy, mode=SWAP, num_host_blocks=4)
    model = FakeModel(sched)
    shared = list(range(1, 9))
    x = make_seq(0, shared + [50], bs, max_tokens=8, ignore_eos=True)
    y = make_seq(1, shared + [60], bs, max_tokens=8, ignore_eos=True)
    arrivals = [(0, x), (1, y)]
    if evict_prefix:
        z = make_seq(2, [700 + i for i in range(5 * bs - 1)], bs, max_tokens=1, ignore_eos=True, priority=-1)
        arrivals.append((2, z))
    drive_arrivals(sched, model, arrivals, 100)
    stats = sched.stats
    check_reference([s for _, s in arrivals])
    assert y.num_cached_tokens == 2 * bs
    assert stats.preemptions_swap == 1 and stats.blocks_swapped_out == 1 and stats.preemptions_recompute == 0
    if evict_prefix:
        assert (stats.swap_ins, stats.swapped_prefix_lost) == (0, 1)
    else:
        assert (stats.swap_ins, stats.swapped_prefix_lost, stats.blocks_swapped_in) == (1, 0, 1)
    bm = sched.block_manager
    assert bm.num_free_host_blocks == 4 and bm.num_free_blocks == 5


@pytest.mark.parametrize("policy", [PREFILL_FIRST, MIXED])
def test_full_swap_space_falls_back_to_recompute(policy: str):
    """The setting of the priority test above with one host block: c (the first victim) is
    swapped out, b (the second) finds the swap space full and is recomputed."""
    bs = 4
    sched = make_scheduler(5, bs, policy=policy, mode=SWAP, num_host_blocks=1)
    model = FakeModel(sched)
    a, b, c, d = (make_seq(i, [10 * i + j for j in range(1, 5)], bs, max_tokens=3, ignore_eos=True, priority=p)
                  for i, p in enumerate([0, 1, 1, 0]))
    for s in (a, b, c, d):
        sched.add(s)
    step(sched, model)
    batch = step(sched, model)
    assert batch.seqs == [a, d] and batch.swap_out.src and len(batch.swap_out.dst) == 1
    assert list(sched.swapped) == [c] and list(sched.waiting) == [b]
    assert c.status == SequenceStatus.SWAPPED and b.status == SequenceStatus.WAITING
    stats = sched.stats
    assert (stats.preemptions_swap, stats.swap_space_full, stats.preemptions_recompute) == (1, 1, 1)
    drive(sched, model, 50)
    check_reference([a, b, c, d])
    assert stats.swap_ins == 1 and sched.block_manager.num_free_host_blocks == 1


def test_abort_frees_a_swapped_sequences_host_blocks():
    bs = 4
    sched = make_scheduler(5, bs, policy=MIXED, mode=SWAP, num_host_blocks=4)
    model = FakeModel(sched)
    a, b, c, d = (make_seq(i, [10 * i + j for j in range(1, 5)], bs, max_tokens=3, ignore_eos=True)
                  for i in range(4))
    for s in (a, b, c, d):
        sched.add(s)
    step(sched, model)
    step(sched, model)
    assert list(sched.swapped) == [c, d] and sched.block_manager.num_free_host_blocks == 2
    sched.abort([d])
    assert list(sched.swapped) == [c] and d.finish_reason == "abort" and d.host_block_table == []
    assert sched.block_manager.num_free_host_blocks == 3
    drive(sched, model, 50)
    check_reference([a, b, c])
    assert sched.block_manager.num_free_host_blocks == 4


# ---------------------------------------------------------------------------------------------
# Failing a request
# ---------------------------------------------------------------------------------------------

def test_a_failed_sample_fails_its_requests_other_samples_and_no_one_else():
    """The scheduler fails a request as a whole: `fail` finishes the sequence at fault,
    `take_failed` aborts the other samples of its request and hands the fault over."""
    bs = 4
    sched = make_scheduler(16, bs, policy=MIXED)
    a, b = make_seq(0, [1, 2, 3], bs), make_seq(1, [1, 2, 3], bs)
    Sequence.link_samples([a, b])  # two samples of one request, as engine/request.py links them
    other = make_seq(2, [4, 5], bs)
    for seq in (a, b, other):
        sched.add(seq)
    sched.schedule()
    error = RuntimeError("injected")
    sched.fail(a, error, "checking its stop conditions")
    assert a.finish_reason == "abort" and not b.is_finished  # its sibling goes when the faults are taken
    (fault,) = sched.take_failed()
    assert (fault.seq, fault.error, fault.phase) == (a, error, "checking its stop conditions")
    assert b.finish_reason == "abort" and b.block_table == [] and not other.is_finished
    assert sched.running == [other] and sched.take_failed() == []
    assert sched.block_manager.num_free_blocks == 16 - len(other.block_table)


def test_linked_samples_are_freed_without_the_cyclic_collector():
    """A request's samples know each other weakly: dropping them frees them by reference counting
    alone, so a long batch job's memory does not wait for (or grow between) cyclic collections."""
    import gc
    import weakref
    bs = 4
    seqs = [make_seq(i, [1, 2, 3], bs) for i in range(3)]
    Sequence.link_samples(seqs)
    assert seqs[1].samples == seqs
    gone = [weakref.ref(seq) for seq in seqs]
    gc.disable()
    try:
        del seqs
        assert all(ref() is None for ref in gone)
    finally:
        gc.enable()
