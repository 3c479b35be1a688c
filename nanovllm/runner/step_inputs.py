"""The step's inputs as the runner builds them from scheduled sequences: cache slots of tokens.

`token_slots` and `decode_slot` turn a sequence's block table into the flat cache slots
(block_id * block_size + offset) its new tokens' K/V are written to: the slot mapping of a
prefill and of a decode step. Plain Python; the tensors are made by their callers.
"""


def token_slots(block_table: list[int], block_size: int, start: int, end: int) -> list[int]:
    """Flat cache slots (block_id * block_size + offset) of token positions start..end-1."""
    slots = []
    for i in range(start // block_size, (end + block_size - 1) // block_size):
        base = block_table[i] * block_size
        slots.extend(range(base + max(start - i * block_size, 0), base + min(end - i * block_size, block_size)))
    return slots


def decode_slot(block_table: list[int], block_size: int, num_tokens: int) -> int:
    """Slot of a decoding sequence's newest token, the one at position num_tokens - 1."""
    position = num_tokens - 1
    return block_table[position // block_size] * block_size + position % block_size
