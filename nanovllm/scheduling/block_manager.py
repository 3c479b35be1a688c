"""The paged KV cache's bookkeeping: which physical block holds which part of which sequence.

Owns the block pool (ref counts, an LRU free queue with O(1) removal), the prefix cache
(chained xxhash of full blocks -> block id, with a token check on every hit) and the pool of
host blocks that swapped-out sequences occupy. A block is published to the prefix cache only
once its K/V are computed, so no request can read a block that a chunked prefill has not
written yet.

Swapping: `swap_out` copies a sequence's exclusively owned computed blocks to host blocks and
frees its device blocks; a block it shares with other sequences (ref_count > 1, always a
published prefix-cache block) is not duplicated: the sequence drops its reference and finds
that block in the prefix cache again at `swap_in` (if it was evicted meanwhile, the sequence
must be recomputed). So only running sequences ever hold device blocks. Both return the block
copies for the runner to make; this module knows nothing of tensors.
"""
from array import array
from collections import OrderedDict
from typing import NamedTuple

import xxhash

from nanovllm.scheduling.sequence import SHARED_BLOCK, Sequence


class BlockCopies(NamedTuple):
    """Block copies the runner makes before a step's forward pass: src[i] -> dst[i]. Swap-outs
    copy device -> host blocks, swap-ins host -> device blocks."""
    src: list[int]
    dst: list[int]


NO_COPIES = BlockCopies([], [])


class Block:

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None  # set while the block is published in the prefix cache
        self.token_ids: tuple[int, ...] = ()


class BlockManager:

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0):
        assert num_blocks > 0 and block_size > 0 and num_host_blocks >= 0
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        # Free blocks, least recently freed first; an OrderedDict gives O(1) removal of a
        # cached block that gets reused while free.
        self.free_block_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_host_blocks = num_host_blocks
        self.free_host_blocks: list[int] = list(range(num_host_blocks))

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    @staticmethod
    def compute_hash(token_ids: list[int], prefix_hash: int | None) -> int:
        h = xxhash.xxh64()
        if prefix_hash is not None:
            h.update(prefix_hash.to_bytes(8, "little"))
        h.update(array("q", token_ids).tobytes())
        return h.intdigest()

    def block_hash(self, seq: Sequence, i: int) -> int:
        """Hash of the sequence's full block i; each block is hashed once and remembered."""
        while len(seq.block_hashes) <= i:
            j = len(seq.block_hashes)
            prefix = seq.block_hashes[-1] if seq.block_hashes else None
            seq.block_hashes.append(self.compute_hash(seq.block(j), prefix))
        return seq.block_hashes[i]

    def _cached_block(self, seq: Sequence, i: int) -> int | None:
        """The published block holding exactly the sequence's full block i (and its prefix), if any."""
        block_id = self.hash_to_block_id.get(self.block_hash(seq, i))
        if block_id is None or self.blocks[block_id].token_ids != tuple(seq.block(i)):
            return None
        return block_id

    def _match_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix. The block holding the last token is never
        matched, so a fully cached prompt still computes one token (and yields logits). A sequence
        still owed prompt logprobs matches none: every prompt position's logits are computed (as
        vLLM v1 does); its blocks are still published for others."""
        if not self.enable_prefix_caching or seq.needs_prompt_logprobs:  # a hit would skip their logits
            return []
        hits = []
        for i in range((len(seq) - 1) // self.block_size):
            block_id = self._cached_block(seq, i)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _num_needed(self, num_blocks: int, hits: list[int]) -> int:
        """Free blocks taken by a table of num_blocks blocks of which `hits` are cached: a hit on
        a free block takes it off the free queue, so only in-use hits come for free."""
        return num_blocks - sum(self.blocks[b].ref_count > 0 for b in hits)

    def _take_block(self, block_id: int) -> None:
        """One more reference to a published block (taking it off the free queue if it was free)."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_block_queue[block_id]
        block.ref_count += 1

    def allocate(self, seq: Sequence) -> bool:
        """Give a waiting sequence blocks for all its tokens, reusing cached prefix blocks.
        Returns False, changing nothing, when too few blocks are free."""
        assert not seq.block_table and not seq.host_block_table
        hits = self._match_prefix(seq)
        if self._num_needed(seq.num_blocks, hits) > self.num_free_blocks:
            return False
        for block_id in hits:
            self._take_block(block_id)
            seq.block_table.append(block_id)
        while len(seq.block_table) < seq.num_blocks:
            seq.block_table.append(self._take_free_block())
        seq.num_computed_tokens = len(hits) * self.block_size
        if not seq.scheduled_once:
            seq.num_cached_tokens = seq.num_computed_tokens
            seq.scheduled_once = True
        return True

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_queue.popitem(last=False)
        block = self.blocks[block_id]
        assert block.ref_count == 0
        if block.hash is not None:  # evict it from the prefix cache
            if self.hash_to_block_id.get(block.hash) == block_id:
                del self.hash_to_block_id[block.hash]
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id

    def _release_blocks(self, seq: Sequence) -> None:
        # Tail blocks are freed first, so they are evicted before the shared prefix blocks.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                self.free_block_queue[block_id] = None
        seq.block_table.clear()

    def deallocate(self, seq: Sequence) -> None:
        """Free everything the sequence holds, device and host blocks: it will be recomputed (or
        is finished)."""
        self._release_blocks(seq)
        self.free_host(seq.host_block_table)
        seq.host_block_table = []
        seq.num_computed_tokens = 0

    # --- swapping ---

    @property
    def num_free_host_blocks(self) -> int:
        return len(self.free_host_blocks)

    def free_host(self, host_block_ids: list[int]) -> None:
        """Return host blocks to the pool (SHARED_BLOCK entries are not host blocks)."""
        self.free_host_blocks.extend(h for h in host_block_ids if h != SHARED_BLOCK)

    def swap_out(self, seq: Sequence) -> BlockCopies | None:
        """Move a running sequence's computed K/V to host blocks and free its device blocks; its
        num_computed_tokens stays. Blocks shared with other sequences are not copied (see the
        module's docstring). Returns the device -> host copies to make, or None, changing
        nothing, when too few host blocks are free."""
        num_computed_blocks = (seq.num_computed_tokens + self.block_size - 1) // self.block_size
        computed = seq.block_table[:num_computed_blocks]
        exclusive = [self.blocks[b].ref_count == 1 for b in computed]
        if sum(exclusive) > self.num_free_host_blocks:
            return None
        copies = BlockCopies([], [])
        for block_id, own in zip(computed, exclusive):
            if own:
                host_id = self.free_host_blocks.pop()
                copies.src.append(block_id)
                copies.dst.append(host_id)
                seq.host_block_table.append(host_id)
            else:  # a published prefix block that others hold: it stays on the device for them
                assert self.blocks[block_id].hash is not None, "a shared block must be a published one"
                seq.host_block_table.append(SHARED_BLOCK)
        self._release_blocks(seq)
        return copies

    def _swapped_hits(self, seq: Sequence) -> list[int] | None:
        """Device blocks holding a swapped sequence's shared blocks now, in order; None if one of
        them has left the prefix cache while the sequence was away."""
        hits = []
        for i, host_id in enumerate(seq.host_block_table):
            if host_id == SHARED_BLOCK:
                block_id = self._cached_block(seq, i)
                if block_id is None:
                    return None
                hits.append(block_id)
        return hits

    def swapped_prefix_lost(self, seq: Sequence) -> bool:
        """Whether a block the sequence shared when it was swapped out is no longer cached: then
        its K/V are incomplete and it must be recomputed (deallocate it)."""
        return self._swapped_hits(seq) is None

    def swap_in(self, seq: Sequence) -> BlockCopies | None:
        """Give a swapped sequence device blocks for all its tokens again: its shared blocks from
        the prefix cache, new blocks for the rest. Returns the host -> device copies to make;
        the caller frees their host blocks (`free_host(copies.src)`) once no copy of the step
        can write them. None, changing nothing, when too few device blocks are free. The
        sequence's shared prefix must still be cached (`swapped_prefix_lost` is False)."""
        hits = self._swapped_hits(seq)
        assert hits is not None and not seq.block_table
        if self._num_needed(seq.num_blocks, hits) > self.num_free_blocks:
            return None
        for block_id in hits:  # before any new block is taken, so taking one cannot evict a hit
            self._take_block(block_id)
        hits.reverse()
        copies = BlockCopies([], [])
        for host_id in seq.host_block_table:
            if host_id == SHARED_BLOCK:
                seq.block_table.append(hits.pop())
            else:
                seq.block_table.append(self._take_free_block())
                copies.src.append(host_id)
                copies.dst.append(seq.block_table[-1])
        while len(seq.block_table) < seq.num_blocks:
            seq.block_table.append(self._take_free_block())
        seq.host_block_table = []
        return copies

    def can_append(self, seq: Sequence) -> bool:
        return seq.num_blocks - len(seq.block_table) <= self.num_free_blocks

    def may_append(self, seq: Sequence) -> None:
        """Give a decoding sequence the block its newest token's K/V will be written to."""
        while len(seq.block_table) < seq.num_blocks:
            seq.block_table.append(self._take_free_block())

    def reserve_lookahead(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks for up to num_tokens more K/V slots past the sequence's tokens (speculative
        decoding's proposed tokens), from free blocks only: never at another sequence's expense.
        Returns the slots reserved; `trim` gives back what the step did not keep."""
        slots = (len(seq.block_table) + self.num_free_blocks) * self.block_size - len(seq)
        num_tokens = max(min(num_tokens, slots), 0)
        while len(seq.block_table) * self.block_size < len(seq) + num_tokens:
            seq.block_table.append(self._take_free_block())
        return num_tokens

    def trim(self, seq: Sequence) -> None:
        """Free the blocks past the ones the sequence's tokens need (lookahead blocks whose
        proposed tokens were rejected: never published, so nothing leaves the prefix cache)."""
        while len(seq.block_table) > seq.num_blocks:
            block = self.blocks[seq.block_table.pop()]
            assert block.ref_count == 1 and block.hash is None
            block.ref_count = 0
            self.free_block_queue[block.block_id] = None

    def unpublish(self, seqs: list[Sequence]) -> None:
        """Take out of the prefix cache the published blocks that only these sequences hold (a
        failed step's: their K/V may never have been written), so no later request hits them."""
        holders: dict[int, int] = {}
        for seq in seqs:
            for block_id in seq.block_table:
                holders[block_id] = holders.get(block_id, 0) + 1
        for block_id, num in holders.items():
            block = self.blocks[block_id]
            if block.hash is not None and num == block.ref_count:
                if self.hash_to_block_id.get(block.hash) == block_id:
                    del self.hash_to_block_id[block.hash]
                block.hash, block.token_ids = None, ()

    def cache_blocks(self, seq: Sequence, start: int, end: int) -> None:
        """Publish the sequence's full blocks start..end-1, whose K/V are now computed."""
        if not self.enable_prefix_caching:
            return
        for i in range(start, end):
            h = self.block_hash(seq, i)
            if h in self.hash_to_block_id:  # an identical block is already published
                continue
            block = self.blocks[seq.block_table[i]]
            block.hash, block.token_ids = h, tuple(seq.block(i))
            self.hash_to_block_id[h] = block.block_id
