"""The paged KV cache's bookkeeping: which physical block holds which part of which sequence.

Owns the block pool (ref counts, an LRU free queue with O(1) removal) and the prefix cache
(chained xxhash of full blocks -> block id, with a token check on every hit). A block is
published to the prefix cache only once its K/V are computed, so no request can read a block
that a chunked prefill has not written yet. It knows nothing of tensors.
"""
from array import array
from collections import OrderedDict

import xxhash

from nanovllm.engine.sequence import Sequence


class Block:

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None  # set while the block is published in the prefix cache
        self.token_ids: tuple[int, ...] = ()


class BlockManager:

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        # Free blocks, least recently freed first; an OrderedDict gives O(1) removal of a
        # cached block that gets reused while free.
        self.free_block_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

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

    def _match_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix. The block holding the last token is never
        matched, so a fully cached prompt still computes one token (and yields logits)."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for i in range((len(seq) - 1) // self.block_size):
            block_id = self.hash_to_block_id.get(self.block_hash(seq, i))
            if block_id is None or self.blocks[block_id].token_ids != tuple(seq.block(i)):
                break
            hits.append(block_id)
        return hits

    def allocate(self, seq: Sequence) -> bool:
        """Give a waiting sequence blocks for all its tokens, reusing cached prefix blocks.
        Returns False, changing nothing, when too few blocks are free."""
        assert not seq.block_table
        hits = self._match_prefix(seq)
        # A hit on a free block takes it off the free queue, so only in-use hits come for free.
        num_needed = seq.num_blocks - sum(self.blocks[b].ref_count > 0 for b in hits)
        if num_needed > self.num_free_blocks:
            return False
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_queue[block_id]
            block.ref_count += 1
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

    def deallocate(self, seq: Sequence) -> None:
        # Tail blocks are freed first, so they are evicted before the shared prefix blocks.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                self.free_block_queue[block_id] = None
        seq.block_table.clear()
        seq.num_computed_tokens = 0

    def can_append(self, seq: Sequence) -> bool:
        return seq.num_blocks - len(seq.block_table) <= self.num_free_blocks

    def may_append(self, seq: Sequence) -> None:
        """Give a decoding sequence the block its newest token's K/V will be written to."""
        while len(seq.block_table) < seq.num_blocks:
            seq.block_table.append(self._take_free_block())

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
