"""A step's sampled tokens while they travel to the host, and the placeholders that stand for them.

Async scheduling (the engine's overlapped loop) launches step N+1 before step N's tokens reach
the host. `PendingTokens` holds step N's tokens as the sampler left them on the device, copied
to pinned host memory without blocking and marked by an event; `result()` waits for that event
alone, so the host works on while the device runs. The scheduler meanwhile gives each sequence
that goes on a placeholder token id, -(row + 1) (scheduling/sequence.py), and
`fill_placeholders` reads the real ids of a step's placeholder rows on the device, from the
previous step's sampled tokens, before the forward pass. On CPU the same code runs; there the
copy is the tensor itself and nothing waits (platform/device.py copy_to_host).
"""
import torch

from nanovllm.layers.sampler import TokenLogprobs
from nanovllm.platform.device import device_platform
from nanovllm.runner.protocol import RunnerOutput


class PendingTokens:
    """The tokens of the rows that sampled in a step (`sample_indices`, into the step's sequences)."""

    def __init__(self, num_seqs: int, sample_indices: list[int], tokens: torch.Tensor | None,
                 logprobs: list[TokenLogprobs | None], failed: dict[int, Exception] | None = None,
                 prompt_logprobs: list | None = None):
        self.num_seqs = num_seqs
        self.prompt_logprobs = prompt_logprobs  # per sequence, computed on the host already (or None)
        self.sample_indices = sample_indices
        self.logprobs = logprobs
        # Sequences (index into the step's) whose sampling inputs raised: their rows hold no real token.
        self.failed = failed or {}
        self.device_tokens = tokens  # [len(sample_indices)] int64 on the device; None when nothing sampled
        self.host_tokens, self.ready = tokens, None  # ready: the event that marks the copy's end, if any
        if tokens is not None:
            self.host_tokens, self.ready = device_platform(tokens.device).copy_to_host(tokens)

    def result(self) -> RunnerOutput:
        """Each sequence's token (-1 for a row that sampled nothing) and logprobs, once the copy
        has landed."""
        n = self.num_seqs
        if self.host_tokens is None:
            return RunnerOutput([-1] * n, [None] * n, prompt_logprobs=self.prompt_logprobs)
        if self.ready is not None:
            self.ready.synchronize()
        sampled = self.host_tokens.tolist()
        if len(sampled) == n:
            return RunnerOutput(sampled, self.logprobs, self.failed, prompt_logprobs=self.prompt_logprobs)
        token_ids, logprobs = [-1] * n, [None] * n
        for j, i in enumerate(self.sample_indices):
            token_ids[i], logprobs[i] = sampled[j], self.logprobs[j]
        return RunnerOutput(token_ids, logprobs, self.failed, prompt_logprobs=self.prompt_logprobs)


def fill_placeholders(input_ids: torch.Tensor, token_ids: list[int], previous: PendingTokens | None) -> None:
    """Write, on the device, the real id of each placeholder among a step's input tokens
    (`token_ids`, as the host built `input_ids` from them) from the previous step's sampled
    tokens. A step without placeholders is left as it is, with no device work."""
    if not token_ids or min(token_ids) >= 0:
        return
    assert previous is not None and previous.device_tokens is not None, "a placeholder with no step before it"
    ids = input_ids[:len(token_ids)]  # [num_tokens]; a graph's padding rows are never placeholders
    rows = (-ids - 1).clamp_(min=0)
    ids.copy_(torch.where(ids < 0, previous.device_tokens[rows], ids))
