"""One request as the engine tracks it: its tokens, its KV blocks and how far its KV is computed.

Plain Python, no tensors. Every count is derived from `token_ids` or set in one place, so a
preempted sequence can be recomputed from scratch with nothing stale left behind.
"""
from enum import Enum, auto

from nanovllm.sampling_params import SamplingParams


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
        return (len(self.token_ids) + self.block_size - 1) // self.block_size

    def block(self, i: int) -> list[int]:
        assert 0 <= i < self.num_blocks
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __getstate__(self) -> tuple:
        """What a tensor-parallel worker's runner reads for this step, and nothing more: the token ids
        of positions [num_computed_tokens, num_computed_tokens + num_scheduled_tokens) (a prefill
        chunk, or the last token of a decode), the length, the block table and the two counts. No
        sampling fields and no other tokens: a decode step costs the same at any sequence length."""
        start, end = self.num_computed_tokens, self.num_computed_tokens + self.num_scheduled_tokens
        return self.seq_id, len(self.token_ids), self.block_table, start, self.num_scheduled_tokens, self.token_ids[start:end]

    def __setstate__(self, state: tuple) -> None:
        self.seq_id, length, self.block_table, self.num_computed_tokens, self.num_scheduled_tokens, ids = state
        self.token_ids = StepTokens(self.num_computed_tokens, ids, length)


class StepTokens:
    """A worker's stand-in for `Sequence.token_ids`: the sequence's length, and the ids of this step's
    positions [start, start + len(ids)) only. Reading any other position raises IndexError, so a
    runner that needs tokens a worker was never sent fails loudly instead of reading wrong ones."""
    __slots__ = ("start", "ids", "length")

    def __init__(self, start: int, ids: list[int], length: int):
        self.start, self.ids, self.length = start, ids, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, key: int | slice) -> int | list[int]:
        end = self.start + len(self.ids)
        if isinstance(key, slice):
            first, stop, step = key.indices(self.length)
            if step == 1 and first >= stop:
                return []
            if step != 1 or first < self.start or stop > end:
                raise IndexError(f"token slice {key} is outside this step's positions [{self.start}, {end})")
            return self.ids[first - self.start:stop - self.start]
        position = key + self.length if key < 0 else key
        if not self.start <= position < end:
            raise IndexError(f"token position {key} is outside this step's positions [{self.start}, {end})")
        return self.ids[position - self.start]
