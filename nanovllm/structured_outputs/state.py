"""One sample's grammar matcher: what it may generate next, and the tokens it has kept.

The matcher advances only on tokens the sequence keeps (`accept`, called by the stop checker
after each token is appended). Speculative decoding asks for the mask after proposed tokens that
are not kept yet (`fill_bitmask`'s `draft`): they are accepted, the mask read, and rolled back at
once, so the matcher's state is always the sequence's own tokens.
"""
import torch
import xgrammar

from nanovllm.utils.validation import ParamError


class GrammarViolation(RuntimeError):
    """A kept token the grammar does not allow: the mask was not applied (an internal fault)."""


class GrammarState:

    def __init__(self, compiled: xgrammar.CompiledGrammar):
        self._matcher = xgrammar.GrammarMatcher(compiled)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its end-of-text token accepted: the output is finished."""
        return self._matcher.is_terminated()

    def accept(self, token_id: int) -> None:
        """Advance by one kept token; a token the grammar refuses raises GrammarViolation."""
        if not self._matcher.accept_token(token_id):
            raise GrammarViolation(f"token {token_id} does not follow the request's structured_outputs constraint "
                                   "(its token mask was not applied)")

    def fill_bitmask(self, bitmask: torch.Tensor, row: int, draft: list[int] | tuple[int, ...] = ()) -> None:
        """Write into bitmask[row] ([rows, ceil(vocab / 32)] int32 on the CPU, one bit per token,
        set = allowed) the tokens allowed after this sequence's tokens plus `draft`. When the draft
        leaves the grammar (a proposal it forbids, or one past its end) the row is left as it is:
        verification rejects that proposal at its own row, so this one is never used. A row that
        allows no token at all (a vocabulary that cannot spell what the grammar asks for next)
        raises, failing the sample alone, even where it follows a draft that might be rejected."""
        matcher = self._matcher
        accepted = 0
        for token_id in draft:
            if matcher.is_terminated() or not matcher.accept_token(token_id):
                break
            accepted += 1
        dead_end = False
        if accepted == len(draft) and not matcher.is_terminated():
            matcher.fill_next_token_bitmask(bitmask, row)
            dead_end = not bool(bitmask[row].any())
        if accepted:
            matcher.rollback(accepted)
        if dead_end:
            raise ParamError("structured_outputs", "structured_outputs: no token of this tokenizer continues the output "
                             "as the constraint requires (the vocabulary cannot spell what it asks for next)")
