"""The host process's own resources, as the CPU device reads and tunes them: the cores it may
run on, how glibc malloc treats freed activations, and the memory it may still take.

Config reads available_cores() for cpu_threads' default; the CPU device (device.py) applies the
malloc tuning and measures the memory. It knows nothing of models or the engine, and nothing
here touches a GPU.
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
MEMINFO = "/proc/meminfo"
# cgroup v2: this process's group is named in /proc/self/cgroup as "0::/path".
PROC_CGROUP = "/proc/self/cgroup"
CGROUP_ROOT = "/sys/fs/cgroup"


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


def _meminfo_available() -> int | None:
    try:
        with open(MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file counts kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_available() -> int | None:
    """What the cgroup v2 memory limit leaves this process's group (docker --memory), or None."""
    try:
        with open(PROC_CGROUP) as f:
            group = next(line.strip()[3:] for line in f if line.startswith("0::"))
        base = f"{CGROUP_ROOT}{group.rstrip('/')}"
        with open(f"{base}/memory.max") as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open(f"{base}/memory.current") as f:
            return int(limit) - int(f.read().strip())
    except (OSError, ValueError, StopIteration):  # no cgroup v2 here: no limit to apply
        return None


def available_host_memory() -> int | None:
    """Bytes this process may still take: MemAvailable, capped by any cgroup v2 memory limit;
    None where neither can be read."""
    known = [v for v in (_meminfo_available(), _cgroup_available()) if v is not None]
    return min(known) if known else None
