"""Speculative decoding's verification: which proposed tokens the target keeps, and the token after.

A sequence with d proposed tokens has d + 1 rows of target logits: row j (j < d) is the target's
next-token distribution p_j before proposed token j, and row d the one after the last. The
standard rule (Leviathan et al., Chen et al.; vLLM's rejection sampler) keeps the output exactly
distributed as the target's: proposed token x_j, drawn from the draft's q_j, is accepted with
probability min(1, p_j(x_j) / q_j(x_j)); at the first rejection the token is drawn from the
residual max(p_j - q_j, 0) (renormalised) and the rest is dropped; when all d are accepted, a
bonus token is drawn from p_d. A prompt-lookup proposal is a deterministic draft: q_j is 1 on x_j.
Greedy rows (temperature 0) reduce to: accept while x_j is the argmax, then take the argmax.

p is the sampler's own distribution: the same pipeline of logits processors
(layers/logits_processors.py) the Sampler applies, and greedy rows take the argmax of its
adjusted logits. Rows whose processors depend on the tokens before each proposed one (penalties,
min_tokens bans) or that want logprobs are never speculated on (the runner samples those with the
Sampler: scheduling/scheduler.py, may_speculate). A structured-outputs row's grammar mask is built
for each row after the proposals before it (RowsView.drafts), so a proposal the grammar forbids
has p = 0 and is rejected, and the token drawn in its place is one the grammar allows. This module never sees a sequence: it gets
tensors and returns, per row, whether its proposed token is accepted and the token to emit if
the sequence's run stops at that row.
"""
from typing import Callable, NamedTuple

import torch
from torch import nn

from nanovllm.layers.logits_processors import SamplingTensors
from nanovllm.layers.sampler import uniforms


class Verdicts(NamedTuple):
    accepted: list[bool]  # per row: its proposed token is accepted (False on each sequence's last row)
    tokens: list[int]  # per row: the token emitted if the run of accepted tokens ends at this row


class RejectionSampler(nn.Module):

    def __init__(self, draw: Callable[[torch.Tensor, SamplingTensors], torch.Tensor]) -> None:
        super().__init__()
        self.draw = draw  # the platform's (platform/ Platform.draw): tokens in proportion to weights

    def forward(self, logits: torch.Tensor, proposed: torch.Tensor, draft_probs: torch.Tensor | None,
                t: SamplingTensors) -> Verdicts:
        """logits: [rows, vocab] target logits; proposed: [rows] int64, the proposed token each row
        judges, -1 on each sequence's last row; draft_probs: [rows, vocab] the draft's q per row
        (rows without a proposal: anything), or None for deterministic drafts; t: one entry per row."""
        logits = t.adjust(logits)
        has_proposal = proposed >= 0
        index = proposed.clamp_min(0).unsqueeze(1)  # [rows, 1]
        best = logits.argmax(dim=-1)
        accepted, tokens = best == proposed, best
        if not t.all_greedy:
            p = torch.softmax(t.filter(logits), dim=-1)
            p_x = p.gather(1, index).squeeze(1)
            if draft_probs is None:  # q is 1 on the proposed token: accept with p(x), else draw from p without x
                q_x = torch.ones_like(p_x)
                residual = p.scatter(1, index, 0.0)
            else:
                q_x = draft_probs.gather(1, index).squeeze(1)
                residual = (p - draft_probs).clamp_min(0.0)
            residual = torch.where(has_proposal.unsqueeze(1), residual, p)  # a last row draws its bonus from p
            # p == q leaves no residual; such a row's proposal is always accepted, so this is never drawn.
            residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)
            sampled = t.temperatures > 0
            accepted = torch.where(sampled, uniforms(p.size(0), t, p.device) * q_x < p_x, accepted)
            tokens = torch.where(sampled, self.draw(residual, t), tokens)
        accepted = accepted & has_proposal
        both = torch.stack([accepted.long(), tokens]).tolist()  # the step's one host sync
        return Verdicts([bool(a) for a in both[0]], both[1])
