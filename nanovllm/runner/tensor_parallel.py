"""Tensor parallelism's entry point: rank 0 runs in the caller's process, ranks 1..N-1 in spawned
worker processes (`worker.py`, managed by `worker_group.py`), each an ordinary ModelRunner over
its shard of the weights.

`create_model_runner` gives the engine one Runner (runner/protocol.py) whatever the
tensor-parallel size and the speculative setting. With several ranks it is a
TensorParallelRunner: rank 0's own ModelRunner and the worker group, side by side. Each step it builds the step's StepMessage once, hands it to the workers (pickled
once for all of them), then runs the same message itself; the parallel layers' collectives keep
the ranks in step, and only rank 0 samples. It registers no exit hook: the engine's is the one.
"""
from nanovllm.config import Config
from nanovllm.scheduling.block_manager import NO_COPIES, BlockCopies
from nanovllm.scheduling.sequence import Sequence
from nanovllm.runner.model_runner import ModelRunner
from nanovllm.runner.protocol import Runner, RunnerOutput
from nanovllm.runner.speculative import SpeculativeRunner
from nanovllm.runner.step_inputs import StepMessage
from nanovllm.runner.worker_group import WorkerGroup
from nanovllm.utils.parallel import tensor_parallel_rank


class TensorParallelRunner:
    """Rank 0 of a tensor-parallel group: a Runner, and the start-up times (`startup`) as a
    ModelRunner's."""

    def __init__(self, config: Config):
        self.workers = WorkerGroup(config)  # spawns ranks 1..N-1 and joins the process group with them
        try:
            # Each rank builds, warms up and sizes its KV cache by itself, in step through the collectives.
            with self.workers.reporting_failures(own_errors=(ValueError,)), \
                    tensor_parallel_rank(0, config.tensor_parallel_size):
                self.runner = ModelRunner(config)
        except BaseException:
            self.workers.close()
            raise
        self.num_kvcache_blocks = self.runner.num_kvcache_blocks
        self.num_swap_blocks = self.runner.num_swap_blocks  # the same on every rank: same shard sizes
        self.attention_backend = self.runner.attention_backend
        self.startup = self.runner.startup  # rank 0's start-up times, the ones the others wait on

    @property
    def worker_pids(self) -> list[int]:
        return self.workers.pids

    def run(self, seqs: list[Sequence], is_prefill: bool, swap_out: BlockCopies = NO_COPIES,
            swap_in: BlockCopies = NO_COPIES) -> RunnerOutput:
        step = StepMessage.of(seqs, is_prefill, swap_out, swap_in)  # each rank swaps its own shard
        self.workers.send_step(step)
        with self.workers.reporting_failures():
            return self.runner.sample(seqs, self.runner.forward(step))

    def exit(self) -> None:
        # Workers first: under NCCL, freeing this rank's cache synchronises the GPU, which must not
        # wait on a collective a dead worker will never join.
        self.workers.close()
        self.runner.exit()


def create_model_runner(config: Config) -> Runner:
    """One process for tensor_parallel_size=1; otherwise rank 0 here and a worker per other rank.
    With speculative_config (one rank only, as Config checks), the SpeculativeRunner."""
    if config.speculative is not None:
        return SpeculativeRunner(config)
    return ModelRunner(config) if config.tensor_parallel_size == 1 else TensorParallelRunner(config)
