"""Settings for running on CPU, applied once when a model runner starts there: how many cores
this process may use and whether freed memory is kept for reuse.

It does not decide the settings' values (Config resolves cpu_threads and cpu_malloc_tuning, with
available_cores() from here), and it changes nothing on CUDA. The weights' layout on the CPU
(float32 holding, oneDNN packing) is the CPU platform's (platform/cpu/linear.py).
"""
import ctypes
import os
import platform
from pathlib import Path

CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"  # cgroup v2 CPU quota: "max PERIOD" or "QUOTA PERIOD"
SYSFS_CPU = "/sys/devices/system/cpu/cpu{}"  # its topology/ says which core and package a CPU is on
# glibc mallopt() parameters and the values set: activations up to 256 MiB come from the heap, and
# the heap is trimmed only past 1 GiB free, so a step's buffers reuse the previous step's pages.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_BYTES, TRIM_THRESHOLD_BYTES = 256 << 20, 1 << 30


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
