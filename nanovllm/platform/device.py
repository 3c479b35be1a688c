"""The device a runner computes on, CPU or CUDA: its facts and the few device calls the code
above it needs, chosen once from the device's name (`device_platform`).

Owns what differs between the devices outside the model's own kernels: pinned host memory and
non-blocking copies and the events that mark them, CUDA-graph capture, waiting for queued work,
the memory the model and the KV cache may take and the warm-up that measures it, the process-wide
settings a CPU run applies (threads, malloc), the start-up log's device line, and the defaults
Config resolves per device ("auto" device, dtype, block size, compile mode, async scheduling,
fused kernels). Nothing outside nanovllm/platform/ tests a device's type; callers ask these
objects instead. Which kernels the layers run is chosen by the rest of platform/, not here.
"""
import importlib.util
import logging
import os
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, contextmanager
from typing import Callable, Iterator, NamedTuple

import torch

from nanovllm.kernels import MIN_DOT_SIZE, cpu_build
from nanovllm.platform import device_host

logger = logging.getLogger("nanovllm")

GIB = 1 << 30
# On CPU the warm-up only checks the forward pass runs; a full max_num_batched_tokens prefill
# (done on CUDA to measure peak memory) would take minutes on a few cores.
CPU_WARMUP_TOKENS = 64
# The smallest paged-KV block the backends accept: Triton's tl.dot needs tiles of at least this.
MIN_BLOCK_SIZE = MIN_DOT_SIZE
DeviceGraph = torch.cuda.CUDAGraph  # a captured decode step (runner/graph.py); CUDA alone has them


class Available(NamedTuple):
    """Bytes the model and KV cache may take, and how they were measured (for messages)."""
    bytes: int
    where: str


class WarmupShape(NamedTuple):
    """The start-up forward pass: num_seqs prompts of seq_len tokens."""
    seq_len: int
    num_seqs: int


def auto_device(device: str) -> str:
    """The device `device` names here: "auto" is cuda when torch sees a CUDA device, else cpu."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def unavailable(device: str) -> str | None:
    """Why `device` ("cpu" or "cuda") cannot run here, or None when it can."""
    if device == "cuda" and not torch.cuda.is_available():
        return "device='cuda' but torch sees no CUDA device; use device='cpu' or 'auto'"
    return None


class DevicePlatform(ABC):
    """What the engine asks of its device; CpuDevice and CudaDevice answer. The facts are class
    attributes, the same for every device of the type."""
    # Host tensors bound for the device are pinned, so their copies need not block.
    pin_memory: bool
    # Host tensors are the device's: nothing to copy, and nothing to wait for.
    shares_host_memory: bool
    supports_cuda_graphs: bool
    # kvcache_block_size when none is given.
    default_block_size: int
    # dtype="auto": this, or None for the checkpoint's own.
    default_dtype: torch.dtype | None
    compiles_by_default: bool  # compile_mode="auto"
    overlaps_host_by_default: bool  # async_scheduling="auto", on one rank without speculative decoding
    uses_cpu_threads: bool  # cpu_threads sets this device's compute threads
    # A prefill of max_num_batched_tokens takes seconds, not milliseconds: the warm-up runs a short
    # one (warmup_shape) and the server bounds a step's tokens (server_settings.py).
    slow_prefill: bool
    process_group_backend: str  # torch.distributed's, for the tensor-parallel ranks' collectives
    # A collective waiting on a dead rank never returns (NCCL's), so a dead rank's group is aborted.
    collectives_hang_on_dead_rank: bool

    def __init__(self, device: torch.device):
        self.device = device

    def upload(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        """A host list as a tensor on this device, copied without blocking where there is a copy."""
        return torch.tensor(data, dtype=dtype, pin_memory=self.pin_memory).to(self.device, non_blocking=True)

    @abstractmethod
    def synchronize(self) -> None:
        """Return once the work queued on the device is done."""

    @abstractmethod
    def copy_event(self) -> torch.cuda.Event | None:
        """An event to record after non-blocking copies and wait on before reusing their source;
        None where copies never wait."""

    @abstractmethod
    def copy_to_host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """`tensor` on the host, copied without blocking, and the event that marks the copy's end
        (None: it is there already)."""

    @abstractmethod
    def capture_graph(self, run: Callable[[], None], pool: tuple | None) -> DeviceGraph:
        """A graph of the work `run` launches, in the memory pool `pool` (None: a new one)."""

    @abstractmethod
    def prepare_process(self, threads: int | None, malloc_tuning: bool) -> None:
        """Apply the process-wide settings (Config's cpu_threads, cpu_malloc_tuning) before the model is built."""

    @abstractmethod
    def warmup_shape(self, max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int) -> WarmupShape:
        """The start-up forward pass's prompts."""

    @abstractmethod
    def measuring_peak(self) -> AbstractContextManager[None]:
        """Run the warm-up inside this, so that kv_cache_budget sees its activations' peak."""

    @abstractmethod
    def free_cached_memory(self) -> None:
        """Give back what the allocator keeps after the runner's tensors are gone."""

    @abstractmethod
    def available_memory(self, gpu_memory_utilization: float) -> Available | None:
        """Memory the model and KV cache may take, before any is allocated; None where it cannot be measured."""

    @abstractmethod
    def kv_cache_budget(self, gpu_memory_utilization: float, cpu_kvcache_space_gib: float,
                        reserved_bytes: int) -> Available:
        """Bytes the KV cache may take after the warm-up, `reserved_bytes` (a draft model's weights) aside."""

    @abstractmethod
    def log_startup(self, weights: str, backend, kv_layout: tuple[torch.dtype, int, int]) -> None:
        """Log this device's own start-up facts, if it has any. `weights`: what the kernel platform
        made of the linear layers' weights (Platform.prepare_model); `backend`: the attention
        backend; `kv_layout`: the cache's (dtype, head_dim, block_size)."""

    @abstractmethod
    def bind_rank(self, rank: int, threads: int | None) -> None:
        """Give tensor-parallel rank `rank`'s process its share of the device, before it joins the
        group: its own GPU, or `threads` compute threads (Config's cpu_threads)."""

    @abstractmethod
    def process_group_options(self, rank: int) -> dict:
        """init_process_group's device arguments for rank `rank`."""

    @abstractmethod
    def describe_ranks(self, threads: int | None) -> str:
        """What the tensor-parallel log line says of each rank's share ("" where bind_rank says it all)."""

    @abstractmethod
    def default_fused_kernels(self) -> str:
        """fused_kernels="auto"."""

    def refuses_fused_kernels(self, choice: str) -> str | None:
        """Why the fused_kernels `choice` cannot run here, or None."""
        if choice == "triton" and not triton_installed():
            return "fused_kernels='triton' but triton is not installed (pip install triton)"
        return self._refuses_fused_kernels(choice)

    @abstractmethod
    def _refuses_fused_kernels(self, choice: str) -> str | None:
        """refuses_fused_kernels for what this device's own kernels need."""

    @abstractmethod
    def refuses_tensor_parallel(self, ranks: int) -> str | None:
        """Why `ranks` tensor-parallel ranks cannot run here, or None."""

    @abstractmethod
    def worker_environments(self, engines: int, tensor_parallel_size: int) -> list[dict[str, str]]:
        """The environment of each of `engines` engine processes sharing this machine (a data-parallel
        batch job): each its own GPUs, or an equal share of the compute threads."""


class CpuDevice(DevicePlatform):
    pin_memory = False
    shares_host_memory = True
    supports_cuda_graphs = False
    # The torch backend's decode gathers whole blocks, so smaller ones waste less; 16..64 measured
    # alike and 256 slower (docs/BENCHMARKS.md); 32 keeps prefix caching fine-grained.
    default_block_size = 32
    # The HF oracle's dtype; half precision runs natively only on some CPUs (AVX-512 BF16, AMX).
    default_dtype = torch.float32
    # The float32 path is the HF oracle, and a cold compile costs more than short runs gain
    # (benchmarks/compiled_layers.py).
    compiles_by_default = False
    # The forward pass blocks the host anyway: overlapping gains nothing.
    overlaps_host_by_default = False
    uses_cpu_threads = True
    slow_prefill = True
    process_group_backend = "gloo"
    collectives_hang_on_dead_rank = False  # gloo's fail at once

    def __init__(self, device: torch.device):
        super().__init__(device)
        self.threads: int | None = None  # what prepare_process set, for the start-up log
        self.malloc_tuned = False

    def synchronize(self) -> None:
        """Nothing is queued: every op has run when it returns."""

    def copy_event(self) -> None:
        """No copies, so no event marks them."""
        return None

    def copy_to_host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, None]:
        """The tensor is on the host already."""
        return tensor, None

    def capture_graph(self, run: Callable[[], None], pool: tuple | None) -> DeviceGraph:
        """Never called: supports_cuda_graphs is False."""
        raise RuntimeError("CUDA graphs capture CUDA work; a CPU runner runs every step eagerly")

    def prepare_process(self, threads: int | None, malloc_tuning: bool) -> None:
        """torch's threads (as OMP_NUM_THREADS would set them; Config resolves them to an int here)
        and, with `malloc_tuning`, glibc's treatment of freed activations."""
        torch.set_num_threads(threads)
        self.threads = threads
        self.malloc_tuned = malloc_tuning and device_host.keep_freed_memory()

    def warmup_shape(self, max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int) -> WarmupShape:
        """One short prompt: the warm-up only checks that the forward pass runs."""
        return WarmupShape(min(CPU_WARMUP_TOKENS, max_model_len), 1)

    @contextmanager
    def measuring_peak(self) -> Iterator[None]:
        """Nothing to measure: the KV cache has a fixed budget here (kv_cache_budget)."""
        yield

    def free_cached_memory(self) -> None:
        """torch's CPU allocator keeps no cache of its own."""

    def available_memory(self, gpu_memory_utilization: float) -> Available | None:
        """The host's available memory (gpu_memory_utilization is the GPU's)."""
        have = device_host.available_host_memory()
        if have is None:
            return None
        return Available(have, "host memory: MemAvailable, capped by any cgroup memory limit")

    def kv_cache_budget(self, gpu_memory_utilization: float, cpu_kvcache_space_gib: float,
                        reserved_bytes: int) -> Available:
        """There is no device to measure, so the cache gets the fixed cpu_kvcache_space_gib (as
        vLLM's VLLM_CPU_KVCACHE_SPACE); a draft model's weights come on top of it."""
        return Available(int(cpu_kvcache_space_gib * GIB), f"cpu_kvcache_space_gib={cpu_kvcache_space_gib}")

    def log_startup(self, weights: str, backend, kv_layout: tuple[torch.dtype, int, int]) -> None:
        """The CPU's own facts: threads, malloc, the kernels' ISA, the linear layers' weights and
        the prefill attention's units. `kv_layout`: the cache's (dtype, head_dim, block_size)."""
        kernel = getattr(backend, "kernel", None)  # the C++ paged attention, when chosen
        amx_prefill = kernel is not None and kernel.amx_prefill(*kv_layout)
        logger.info("CPU: %d torch threads per rank, malloc tuned %s, kernels built for %s, %s, prefill "
                    "attention %s", self.threads, self.malloc_tuned, os.environ.get(cpu_build.CPU_ISA_ENV, "native"),
                    weights, "on AMX tiles" if amx_prefill else "in vector registers" if kernel is not None
                    else f"by the {backend.name} backend")

    def bind_rank(self, rank: int, threads: int | None) -> None:
        """Every rank computes at once, each on its share of the cores."""
        torch.set_num_threads(threads)

    def process_group_options(self, rank: int) -> dict:
        return {}

    def describe_ranks(self, threads: int | None) -> str:
        return f", {threads} CPU thread(s) per rank"

    def default_fused_kernels(self) -> str:
        """The CPU's C++ kernels where a compiler can build them, else the torch functions."""
        return "cpu" if cpu_build.compiler() is not None else "torch"

    def _refuses_fused_kernels(self, choice: str) -> str | None:
        """Triton's kernels need a GPU, or its interpreter (tests)."""
        if choice == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
            return ("fused_kernels='triton' needs a CUDA device (device is 'cpu'), or TRITON_INTERPRET=1 to run "
                    "the kernels on CPU (slowly, for tests)")
        return None

    def refuses_tensor_parallel(self, ranks: int) -> str | None:
        """Ranks share the host's cores (cpu_threads each): any number can run."""
        return None

    def worker_environments(self, engines: int, tensor_parallel_size: int) -> list[dict[str, str]]:
        threads = str(max(1, torch.get_num_threads() // engines))  # Config reads OMP_NUM_THREADS for cpu_threads
        return [{"OMP_NUM_THREADS": threads} for _ in range(engines)]



class CudaDevice(DevicePlatform):
    pin_memory = True
    shares_host_memory = False
    supports_cuda_graphs = True
    default_block_size = 256  # nano-vllm's, a page size flash-attn takes
    default_dtype = None
    compiles_by_default = True
    overlaps_host_by_default = True
    uses_cpu_threads = False
    slow_prefill = False
    process_group_backend = "nccl"
    collectives_hang_on_dead_rank = True

    def synchronize(self) -> None:
        """Wait for the work queued on this CUDA device."""
        torch.cuda.synchronize(self.device)

    def copy_event(self) -> torch.cuda.Event:
        return torch.cuda.Event()

    def copy_to_host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        """Into pinned memory, so the copy need not block."""
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return host, ready

    def capture_graph(self, run: Callable[[], None], pool: tuple | None) -> DeviceGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool):
            run()
        return graph

    def prepare_process(self, threads: int | None, malloc_tuning: bool) -> None:
        """Nothing process-wide: cpu_threads and cpu_malloc_tuning are the CPU's."""

    def warmup_shape(self, max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int) -> WarmupShape:
        """The largest step the engine takes, so the warm-up's peak is the activations' peak."""
        seq_len = min(max_num_batched_tokens, max_model_len)
        return WarmupShape(seq_len, max(1, min(max_num_batched_tokens // seq_len, max_num_seqs)))

    @contextmanager
    def measuring_peak(self) -> Iterator[None]:
        """Run the block with the allocator's peak reset, for kv_cache_budget; its cache freed after."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        yield
        torch.cuda.empty_cache()

    def free_cached_memory(self) -> None:
        """Once queued work is done, return the allocator's cached blocks to the device."""
        self.synchronize()
        torch.cuda.empty_cache()

    def available_memory(self, gpu_memory_utilization: float) -> Available:
        """gpu_memory_utilization of the device, less what is in use (as the KV cache is sized)."""
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free
        return Available(int(total * gpu_memory_utilization) - used, f"gpu_memory_utilization="
                         f"{gpu_memory_utilization} of {total / GIB:.1f} GiB, less {used / GIB:.1f} GiB in use")

    def kv_cache_budget(self, gpu_memory_utilization: float, cpu_kvcache_space_gib: float,
                        reserved_bytes: int) -> Available:
        """What gpu_memory_utilization leaves after the warm-up (measuring_peak) and `reserved_bytes`."""
        free, total = torch.cuda.mem_get_info()
        stats = torch.cuda.memory_stats()
        budget = gpu_kv_budget(total, free, stats["allocated_bytes.all.peak"], stats["allocated_bytes.all.current"],
                               gpu_memory_utilization)
        return Available(budget - reserved_bytes, f"gpu_memory_utilization={gpu_memory_utilization} of "
                         f"{total / GIB:.1f} GiB")

    def log_startup(self, weights: str, backend, kv_layout: tuple[torch.dtype, int, int]) -> None:
        """Nothing beyond the runner's own line."""

    def bind_rank(self, rank: int, threads: int | None) -> None:
        """One GPU per rank: rank r computes on GPU r."""
        torch.cuda.set_device(rank)

    def process_group_options(self, rank: int) -> dict:
        """NCCL binds the group to the rank's GPU at once, instead of at its first collective."""
        return {"device_id": torch.device("cuda", rank)}

    def describe_ranks(self, threads: int | None) -> str:
        return ""

    def default_fused_kernels(self) -> str:
        """The Triton kernels where triton is installed, else the torch functions."""
        return "triton" if triton_installed() else "torch"

    def _refuses_fused_kernels(self, choice: str) -> str | None:
        """The CPU's C++ kernels read host memory."""
        if choice == "cpu":
            return "fused_kernels='cpu' runs on the CPU only (device is 'cuda')"
        return None

    def refuses_tensor_parallel(self, ranks: int) -> str | None:
        """One GPU per rank."""
        count = torch.cuda.device_count()
        if ranks > count:
            return f"tensor_parallel_size={ranks} needs {ranks} GPUs, one per rank; torch sees {count}"
        return None

    def worker_environments(self, engines: int, tensor_parallel_size: int) -> list[dict[str, str]]:
        tp = tensor_parallel_size
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        if engines * tp > len(gpus):
            raise ValueError(f"data_parallel={engines} with tensor_parallel_size={tp} needs {engines * tp} GPUs; "
                             f"{len(gpus)} are visible")
        return [{"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * tp:(i + 1) * tp])} for i in range(engines)]


def gpu_kv_budget(total: int, free: int, peak: int, current: int, utilization: float) -> int:
    """Bytes the KV cache may take: `utilization` of the device, less what is in use now (this
    process's weights and anything else on the device) and less the warm-up's activation peak
    above what stays allocated."""
    used = total - free
    return int(total * utilization) - used - (peak - current)


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


PLATFORMS = {"cpu": CpuDevice, "cuda": CudaDevice}


def device_platform(device: torch.device | str) -> DevicePlatform:
    """The platform of `device` ("cpu", "cuda", "cuda:1" or a torch.device)."""
    device = torch.device(device)
    if device.type not in PLATFORMS:
        raise ValueError(f"device={str(device)!r} is not supported; allowed device types: {sorted(PLATFORMS)}")
    return PLATFORMS[device.type](device)
