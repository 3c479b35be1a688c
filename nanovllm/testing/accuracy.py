"""How close two greedy runs of the same prompts are: per-token logprob differences and greedy
agreement, as vLLM's check_logprobs_close compares a quantised run with a reference.

Along each sequence, while both runs chose the same tokens, the chosen token's logprob is
compared (once the tokens differ, the runs see different contexts and stop being comparable).
At the first differing token, both choices should be near-ties: each run's token among the
other's top logprobs. Used by tests/test_kv_cache_fp8.py and benchmarks/kv_cache_accuracy.py.
"""
from typing import NamedTuple


class Agreement(NamedTuple):
    mean_abs_logprob_diff: float  # over every compared token of the batch
    max_abs_logprob_diff: float
    compared_tokens: int  # tokens before each sequence's first difference, summed
    total_tokens: int
    identical_sequences: int  # sequences whose every token agrees
    num_sequences: int
    near_tie_divergences: bool  # at every first difference, each token is in the other's top logprobs

    @property
    def greedy_agreement(self) -> float:
        """The share of tokens generated before the first difference (1.0: identical runs)."""
        return self.compared_tokens / self.total_tokens if self.total_tokens else 1.0


def compare_runs(reference: list[dict], candidate: list[dict]) -> Agreement:
    """reference, candidate: generate() outputs of the same prompts, greedy, with logprobs >= 0
    (top logprobs >= 1 for the near-tie check)."""
    diffs: list[float] = []
    total = identical = 0
    near_ties = True
    for ref, cand in zip(reference, candidate, strict=True):
        total += len(ref["token_ids"])
        same = True
        for ref_lp, cand_lp in zip(ref["logprobs"], cand["logprobs"]):
            if ref_lp["token_id"] != cand_lp["token_id"]:
                near_ties &= (cand_lp["token_id"] in ref_lp["top_logprobs"]
                              and ref_lp["token_id"] in cand_lp["top_logprobs"])
                same = False
                break
            diffs.append(abs(ref_lp["logprob"] - cand_lp["logprob"]))
        identical += same and len(ref["token_ids"]) == len(cand["token_ids"])
    return Agreement(sum(diffs) / len(diffs) if diffs else 0.0, max(diffs, default=0.0), len(diffs), total,
                     identical, len(reference), near_ties)
