"""Settings for running on CPU, applied once when a model runner starts there: how many threads
torch uses, whether freed memory is kept for reuse, whether half-precision layers do their
matmuls in float32, and the linear layers' weights packed for oneDNN.

It does not decide the settings' values (Config resolves cpu_threads and cpu_malloc_tuning, with
available_cores() from here), choose the attention backend or the KV block size, and it changes
nothing on CUDA.
"""
import ctypes
import os
import platform
from pathlib import Path

import torch
from torch import nn

CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"  # cgroup v2 CPU quota: "max PERIOD" or "QUOTA PERIOD"
SYSFS_CPU = "/sys/devices/system/cpu/cpu{}"  # its topology/ says which core and package a CPU is on
# glibc mallopt() parameters and the values set: activations up to 256 MiB come from the heap, and
# the heap is trimmed only past 1 GiB free, so a step's buffers reuse the previous step's pages.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_BYTES, TRIM_THRESHOLD_BYTES = 256 << 20, 1 << 30
# torch reports whether oneDNN has a native kernel for these (AVX-512 BF16/FP16 or AMX); without
# one, a half-precision matmul is emulated, about 10x slower than float32 on an AVX2-only Zen 3.
NATIVE_HALF_MATMUL_CHECKS = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}
# The batch size oneDNN picks the packed layout for. Measured on a 2-core Zen 4 (3072x512 weight):
# packed for 64 rows ran as fast as packed for 1 at batch 1 and 1.6x faster at 16 rows in float32.
PACK_BATCH_HINT = 64


def _cpu_quota(cpus: int) -> int:
    """`cpus` capped by a cgroup v2 CPU quota (docker --cpus) when one is set."""
    try:
        with open(CGROUP_CPU_MAX) as f:
            quota, period = f.read().split()
        if quota != "max":
            cpus = min(cpus, max(1, int(quota) // int(period)))
    except (OSError, ValueError):  # no cgroup v2 here, or a file in another format: no quota to apply
        pass
    return cpus


def _affinity() -> set[int]:
    """The CPUs this process may run on (taskset, numactl, a container's cpuset)."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def available_cpus() -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup v2 CPU quota."""
    return _cpu_quota(len(_affinity()))


def physical_cores(cpus: set[int]) -> int:
    """Distinct physical cores among `cpus`: SMT siblings (hyper-threads) count once, as read from
    sysfs; a CPU whose topology cannot be read counts as a core of its own."""
    cores = set()
    for n in cpus:
        try:
            topology = Path(SYSFS_CPU.format(n)) / "topology"
            package = (topology / "physical_package_id").read_text().strip()
            cores.add((package, (topology / "core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(n)))
    return len(cores)


def available_cores() -> int:
    """Physical cores this process may use: one compute thread per core, as vLLM's and llama.cpp's
    CPU paths run (a second thread on a core's sibling shares its vector units and its cache)."""
    return _cpu_quota(physical_cores(_affinity()))


def keep_freed_memory() -> bool:
    """Stop glibc malloc from returning activation-sized buffers to the OS after every op.

    By default glibc maps each allocation above its (adaptive) threshold afresh and trims the heap
    when its top is free, so a tensor of a few hundred KiB or more is often fresh memory that
    page-faults in: measured on 2 cores, RMSNorm over 2,048 tokens took 1.7 ms that way and 0.15 ms
    with this (as with tcmalloc preloaded, which vLLM's CPU docs advise). The cost is that the
    process keeps its peak heap. Returns whether the settings were applied: only on Linux with
    glibc (Config's cpu_malloc_tuning=False does not call it).
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))


def native_half_matmul(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies `dtype` matrices natively (float32 always does)."""
    check = NATIVE_HALF_MATMUL_CHECKS.get(dtype)
    if check is None:
        return True
    try:
        return bool(getattr(torch.ops.mkldnn, check)())
    except (AttributeError, RuntimeError):  # a torch without the check: assume emulated, the safe side
        return False


def hold_matmul_weights_in_float32(model: nn.Module) -> int:
    """Convert the parameters of every layer that computes in its weight's dtype
    (`computes_in_weight_dtype`, see layers/linear.py linear()) to float32; returns how many.

    The values are unchanged (every half-precision value is exact in float32); activations stay
    in the model's dtype and each matmul's result is rounded back to it, as a native kernel's
    float32 accumulation would be. A weight shared with another module (a tied LM head and
    embedding) gets a float32 copy of its own, so the embedding keeps returning the model's dtype.
    Each converted layer's `held_dtype` says what it held (its enable_cpu may keep a copy in that
    dtype for the few-row product, which reads half the bytes: layers/linear.py HalfRows), and a
    shared weight's `held_weight` is the other module's tensor, which that copy can be.
    """
    uses = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    converted = 0
    for module in model.modules():
        if not getattr(module, "computes_in_weight_dtype", False):
            continue
        for name, param in list(module.named_parameters(recurse=False)):
            if param.dtype == torch.float32:
                continue
            module.held_dtype = param.dtype
            if uses[id(param)] > 1:
                if name == "weight":
                    module.held_weight = param.detach()
                setattr(module, name, nn.Parameter(param.detach().float(), requires_grad=False))
            else:
                param.data = param.data.float()
            converted += 1
    return converted


def pack_linear_weights(model: nn.Module) -> int:
    """Give every layer that computes in its weight's dtype (`computes_in_weight_dtype`: the
    linear layers and the LM head, layers/linear.py linear()) a `packed_weight`: its weight
    reordered once into oneDNN's blocked layout, which linear() then multiplies by instead of
    the plain weight. Returns how many were packed: none where torch has no oneDNN, and none for
    a dtype oneDNN does not multiply natively here (those stay on F.linear).

    Measured on a 2-core AMD EPYC (Zen 4, AVX-512 with bf16), this model's shapes, medians
    (docs/BENCHMARKS.md, "CPU kernels"): float32 at 16 rows 1.15-2.1x F.linear (MKL on the plain
    weight), bf16 at 1-16 rows 1.2-1.9x; 0.75-1.3x at 1 row in float32. The plain weight is kept
    (the embedding may share it, and the loader's checks read it): the weights' memory doubles.
    """
    if not torch.backends.mkldnn.is_available():
        return 0
    packed = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not getattr(module, "computes_in_weight_dtype", False) or weight is None or weight.dim() != 2:
            continue
        if weight.device.type != "cpu" or not native_half_matmul(weight.dtype) or weight.dtype == torch.float16:
            continue
        module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)
        packed += 1
    return packed
