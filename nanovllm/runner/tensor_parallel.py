"""Tensor parallelism's entry point: rank 0 runs in the caller's process, ranks 1..N-1 in spawned
worker processes (`worker.py`, managed by `worker_group.py`), each an ordinary ModelRunner over
its shard of the weights.

`create_model_runner` gives the engine one runner whatever the tensor-parallel size; with
several ranks, rank 0's runner hands each step to the workers before running it itself. A
step is pickled once per step: `Sequence.__getstate__` sends only the step's tokens, the length,
the block table and two counts, never whole sequences or their sampling fields.
"""
from nanovllm.config import Config
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.sampler import SamplerOutput
from nanovllm.runner.model_runner import ModelRunner
from nanovllm.runner.worker_group import WorkerGroup
from nanovllm.utils.parallel import tensor_parallel_rank


class TensorParallelRunner(ModelRunner):
    """Rank 0's ModelRunner, which also hands every step to the workers. The engine uses it as
    a ModelRunner; only run() and exit() differ."""

    def __init__(self, config: Config):
        self._forwarding = False  # the warm-up in ModelRunner.__init__ runs on every rank by itself
        self.workers = WorkerGroup(config)
        self._exited = False  # the engine's exit hook calls exit(); this runner registers none of its own
        try:
            with tensor_parallel_rank(0, config.tensor_parallel_size):
                super().__init__(config)
        except BaseException as error:
            failure = self.workers.failed_with(error)
            self.exit()
            if failure is None or isinstance(error, ValueError):  # bad input fails every rank alike
                raise
            raise failure from error
        self._forwarding = True

    @property
    def worker_pids(self) -> list[int]:
        return self.workers.pids

    def run(self, seqs: list[Sequence], is_prefill: bool) -> SamplerOutput:
        if not self._forwarding:
            return super().run(seqs, is_prefill)
        self.workers.send_step(seqs, is_prefill)
        try:
            return super().run(seqs, is_prefill)
        except BaseException as error:
            failure = self.workers.failed_with(error)
            if failure is None:
                raise
            raise failure from error

    def exit(self) -> None:
        if self._exited:
            return
        self._exited = True
        # Workers first: under NCCL, freeing this rank's cache synchronises the GPU, which must not
        # wait on a collective a dead worker will never join.
        self.workers.close()
        if hasattr(self, "kv_cache"):  # absent when start-up failed before the cache was made
            super().exit()


def create_model_runner(config: Config) -> ModelRunner:
    """One process for tensor_parallel_size=1; otherwise rank 0 here and a worker per other rank."""
    return ModelRunner(config) if config.tensor_parallel_size == 1 else TensorParallelRunner(config)
