"""One request as the engine tracks it: its tokens, its KV blocks and how far its KV is computed.

Plain Python, no tensors. Every count is derived from `token_ids` or set in one place, so a
preempted sequence can be recomputed from scratch with nothing stale left behind. A sequence
swapped out to host memory keeps its computed count, and its K/V sit in host blocks
(`host_block_table`) until it is swapped back in.

Under async scheduling a sequence's newest token may be a placeholder while the device is still
sampling it: a negative id, -(row + 1), naming its row among that step's sampled tokens (the
runner reads the real id there on the device; the scheduler replaces it once it reaches the
host). Only counts are read while it stands: lengths, blocks, positions.
"""
import weakref
from enum import Enum, auto

from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.math_utils import cdiv


class SequenceStatus(Enum):
    WAITING = auto()  # no KV blocks: its tokens are (re)computed when it is admitted
    RUNNING = auto()  # holds device KV blocks for all its tokens; computes in every step it is given tokens
    SWAPPED = auto()  # its computed K/V wait in host memory; no device blocks
    FINISHED = auto()

# A host_block_table entry for a block that was shared with other sequences (a prefix-cache hit)
# when this one was swapped out: not copied, but found in the prefix cache again at swap-in.
SHARED_BLOCK = -1


class Sequence:

    def __init__(self, seq_id: int, token_ids: list[int], sampling_params: SamplingParams, block_size: int,
                 request_id: str | None = None, priority: int = 0):
        self.seq_id = seq_id  # given in arrival order, so it breaks priority ties
        self.request_id = request_id  # the request it is a sample of, whose caller gets its output
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.block_size = block_size
        self.block_table: list[int] = []
        # While swapped: per block holding computed K/V, the host block it was copied to, or
        # SHARED_BLOCK. Empty otherwise.
        self.host_block_table: list[int] = []
        self.priority = priority  # lower runs first (as vLLM)
        # Scheduling order: priority, then arrival. Fixed for the sequence's life.
        self.sort_key = (priority, seq_id)
        # Chained hashes of this sequence's full blocks, computed once each, in order.
        self.block_hashes: list[int] = []
        # Tokens whose K/V are in the cache; the next forward starts here.
        self.num_computed_tokens = 0
        # Tokens the scheduler gave this sequence for the current step.
        self.num_scheduled_tokens = 0
        # Speculative decoding: tokens that may be proposed after its newest one in the current
        # step (slots, budget and blocks reserved for them); 0 when it decodes one token.
        self.num_lookahead_slots = 0
        # Prompt tokens served from the prefix cache at first scheduling (reported to the user).
        self.num_cached_tokens = 0
        self.scheduled_once = False
        self.finish_reason: str | None = None  # "stop" | "length" | "abort"
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        self.sampling_params = sampling_params
        self.seed = sampling_params.seed  # this sample's seed (the request's seed + sample index)
        self.generator = None  # its torch.Generator, made on the sampling device at first use
        self.logprobs: list = []  # per generated token, when sampling_params.logprobs is set
        # With sampling_params.prompt_logprobs: the logprobs of prompt tokens 1, 2, ... as the
        # runner computes them (entry j is token j + 1's), gathered across chunks. None: not wanted
        # (the engine also sets it for a request's other samples, which share sample 0's).
        self.prompt_logprobs: list | None = None if sampling_params.prompt_logprobs is None else []
        # Other samples of the same prompt (n > 1): queued once this one's prompt is computed,
        # so they find its prefix blocks in the cache.
        self.pending_siblings: list["Sequence"] = []
        # Every sample of its request, itself included (`samples`), held weakly: a list of them on
        # each would put every sequence in a reference cycle, which only the cyclic collector frees
        # (a batch job's memory grew ~3 MB over 25,000 requests, tests/test_batch_scale.py).
        self._samples: tuple[weakref.ref, ...] = (weakref.ref(self),)
        self.detokenizer = None  # an engine Detokenizer, for streaming or stop strings
        # Its structured_outputs matcher (a structured_outputs.GrammarState, which this module does
        # not import): the sampler masks its next token with it, the stop checker advances it.
        self.grammar = None
        # Set by the engine loop for its inter-token latency counters: when the newest token came
        # (perf_counter seconds) and how many steps with prefill work had run by then.
        self.last_token_time: float | None = None
        self.last_token_prefill_steps = 0

    @staticmethod
    def link_samples(seqs: list["Sequence"]) -> None:
        """Make `seqs` the samples of one request."""
        refs = tuple(weakref.ref(seq) for seq in seqs)
        for seq in seqs:
            seq._samples = refs

    @property
    def samples(self) -> list["Sequence"]:
        """Every sample of its request still alive, itself included: a fault in one fails them all."""
        return [seq for ref in self._samples if (seq := ref()) is not None]

    @property
    def temperature(self) -> float:
        return self.sampling_params.temperature

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens

    @property
    def ignore_eos(self) -> bool:
        return self.sampling_params.ignore_eos

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Some of its prompt tokens' logprobs are still to be computed (so no prefix-cache hit)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def is_decoding(self) -> bool:
        """Everything but the newest token is computed: the next step computes that one token."""
        return self.num_computed_tokens == len(self.token_ids) - 1

    @property
    def num_blocks(self) -> int:
        """Blocks needed to hold the K/V of every token, including the one not yet computed."""
        return cdiv(len(self.token_ids), self.block_size)

    def block(self, i: int) -> list[int]:
        assert 0 <= i < self.num_blocks
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids the host has: all but a trailing placeholder (async scheduling)."""
        token_ids = self.token_ids
        return len(token_ids) - (bool(token_ids) and token_ids[-1] < 0)  # no tokens: a request failed as it was built
