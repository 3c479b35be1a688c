"""One request as the engine tracks it: its tokens, its KV blocks and how far its KV is computed.

Plain Python, no tensors. Every count is derived from `token_ids` or set in one place, so a
preempted sequence can be recomputed from scratch with nothing stale left behind.
"""
from enum import Enum, auto

from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.math_utils import cdiv


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:

    def __init__(self, seq_id: int, token_ids: list[int], sampling_params: SamplingParams, block_size: int,
                 request_id: str | None = None):
        self.seq_id = seq_id
        self.request_id = request_id  # the request it is a sample of, whose caller gets its output
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.block_size = block_size
        self.block_table: list[int] = []
        # Chained hashes of this sequence's full blocks, computed once each, in order.
        self.block_hashes: list[int] = []
        # Tokens whose K/V are in the cache; the next forward starts here.
        self.num_computed_tokens = 0
        # Tokens the scheduler gave this sequence for the current step.
        self.num_scheduled_tokens = 0
        # Prompt tokens served from the prefix cache at first scheduling (reported to the user).
        self.num_cached_tokens = 0
        self.scheduled_once = False
        self.finish_reason: str | None = None  # "stop" | "length" | "abort"
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        self.sampling_params = sampling_params
        self.seed = sampling_params.seed  # this sample's seed (the request's seed + sample index)
        self.generator = None  # its torch.Generator, made on the sampling device at first use
        self.logprobs: list = []  # per generated token, when sampling_params.logprobs is set
        # Other samples of the same prompt (n > 1): queued once this one's prompt is computed,
        # so they find its prefix blocks in the cache.
        self.pending_siblings: list["Sequence"] = []
        self.detokenizer = None  # an engine Detokenizer, for streaming or stop strings

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
    def num_blocks(self) -> int:
        """Blocks needed to hold the K/V of every token, including the one not yet computed."""
        return cdiv(len(self.token_ids), self.block_size)

    def block(self, i: int) -> list[int]:
        assert 0 <= i < self.num_blocks
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
