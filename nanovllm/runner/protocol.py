"""The one shape of a runner, as the engine loop sees it, and what a step gives back.

Every runner (`ModelRunner` on one rank, `TensorParallelRunner` over several, `SpeculativeRunner`
proposing and verifying) is a `Runner`: the engine holds one, built by
`tensor_parallel.create_model_runner`, and calls the same methods whatever the mode. A step's
`RunnerOutput` tells, per sequence, its newest token and the proposals it accepted before it
(none for a plain runner: one token per step), so the scheduler has one post-processing path.

The overlapped loop (async scheduling) also launches steps whose tokens are still on the
device; only a runner that is an `OverlappedRunner` can (Config allows async scheduling only
with the single-rank ModelRunner).
"""
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

from nanovllm.scheduling.block_manager import BlockCopies
from nanovllm.scheduling.sequence import Sequence
from nanovllm.layers.sampler import TokenLogprobs

if TYPE_CHECKING:  # pending_tokens builds RunnerOutputs, so it imports this module
    from nanovllm.runner.pending_tokens import PendingTokens


class RunnerOutput(NamedTuple):
    """A step's tokens, one entry per sequence of the step."""
    token_ids: list[int]  # its newest token; -1 if it sampled nothing (a prefill chunk short of its prompt's end)
    logprobs: list[TokenLogprobs | None]  # for a sequence that sampled without proposals and asked for them
    # Sequences (index into the step's) whose sampling inputs raised: no real token; the engine
    # fails their requests alone. None: every row sampled.
    failed: dict[int, Exception] | None = None
    # Speculative decoding: per sequence, the proposals it accepted, which come before its token
    # in token_ids, and how many were proposed. None from a runner that proposes nothing.
    accepted: list[list[int]] | None = None
    num_proposed: list[int] | None = None
    # Per sequence of the step, its prompt logprobs from this step (runner/prompt_logprobs.py's
    # PromptLogprobs) or None; None when no sequence asked (SamplingParams.prompt_logprobs).
    prompt_logprobs: list | None = None


@runtime_checkable
class Runner(Protocol):
    """Builds and runs the model's steps; the engine's only handle on tensors."""
    num_kvcache_blocks: int  # device KV blocks, the BlockManager's pool
    num_swap_blocks: int  # host blocks for swap-mode preemption
    attention_backend: str  # the backend "auto" chose

    def run(self, seqs: list[Sequence], is_prefill: bool, swap_out: BlockCopies = ...,
            swap_in: BlockCopies = ...) -> RunnerOutput:
        """One step: the block copies (swap-outs, then swap-ins), then the forward pass over
        `seqs` (none: copies alone) and its sampling, waiting for the tokens."""
        ...

    def exit(self) -> None:
        """Free the model and the KV cache (and stop any worker processes)."""
        ...


@runtime_checkable
class OverlappedRunner(Runner, Protocol):
    """A runner that can return before a step's tokens reach the host (async scheduling)."""

    def launch(self, seqs: list[Sequence], is_prefill: bool, swap_out: BlockCopies = ...,
               swap_in: BlockCopies = ...) -> "PendingTokens":
        ...
