"""Prompt-lookup drafting: propose the tokens that followed an earlier occurrence of the sequence's end.

For n from prompt_lookup_max down to prompt_lookup_min, the sequence's last n tokens are looked
for earlier in its tokens (prompt and output), most recent occurrence first; the first match
proposes the (up to k) tokens that followed it. Nothing matches: nothing is proposed, and the
sequence decodes one token as usual. The proposal is a deterministic draft (probability 1 on
each proposed token), which the rejection sampler accounts for. Plain Python, no tensors.
"""
from nanovllm.scheduling.sequence import Sequence


def ngram_proposal(token_ids: list[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Up to num_tokens tokens that followed the most recent earlier occurrence of the longest
    suffix of length in [min_n, max_n] that occurred before; [] when none did."""
    length = len(token_ids)
    if num_tokens <= 0:
        return []
    last = token_ids[-1]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = token_ids[length - n:]
        # An occurrence ending at `end` (exclusive) < length, so some token follows it; the
        # cheap check on its last token first, then the whole n-gram.
        for end in range(length - 1, n - 1, -1):
            if token_ids[end - 1] == last and token_ids[end - n:end] == suffix:
                return token_ids[end:end + num_tokens]
    return []


class NgramProposer:

    def __init__(self, min_n: int, max_n: int):
        assert 1 <= min_n <= max_n
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list[Sequence]) -> list[list[int]]:
        """Each sequence's proposal, at most its num_lookahead_slots tokens."""
        return [ngram_proposal(seq.token_ids, seq.num_lookahead_slots, self.min_n, self.max_n) for seq in seqs]
