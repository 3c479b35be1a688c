"""The device platform's decisions (platform/device.py), checked on any machine: the CPU's facts
on the CPU, and the CUDA ones on a CudaDevice whose torch.cuda calls are faked (building one
touches no GPU)."""
import pytest
import torch

from nanovllm.platform import device_host
from nanovllm.platform.device import (CPU_WARMUP_TOKENS, GIB, CpuDevice, CudaDevice, auto_device, device_platform,
                                      unavailable)


def test_each_device_type_gets_its_platform():
    assert type(device_platform("cpu")) is CpuDevice and type(device_platform(torch.device("cuda:1"))) is CudaDevice
    assert device_platform("cuda:1").device == torch.device("cuda:1")
    with pytest.raises(ValueError, match=r"device='meta' is not supported; allowed device types: \['cpu', 'cuda'\]"):
        device_platform("meta")


@pytest.mark.parametrize("cuda_available", [False, True])
def test_auto_is_cuda_where_torch_sees_one(monkeypatch, cuda_available):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_available)
    assert auto_device("auto") == ("cuda" if cuda_available else "cpu")
    assert auto_device("cpu") == "cpu" and unavailable("cpu") is None
    assert (unavailable("cuda") is None) is cuda_available


def test_cpu_pins_nothing_copies_nothing_and_captures_no_graphs():
    cpu = device_platform("cpu")
    assert (cpu.pin_memory, cpu.shares_host_memory, cpu.supports_cuda_graphs) == (False, True, False)
    assert (cpu.default_block_size, cpu.default_dtype, cpu.compiles_by_default, cpu.overlaps_host_by_default) == \
        (32, torch.float32, False, False)
    assert cpu.copy_event() is None
    tokens = torch.tensor([3, 4])
    host, ready = cpu.copy_to_host(tokens)
    assert host is tokens and ready is None
    uploaded = cpu.upload([1, 2], torch.int32)
    assert uploaded.dtype == torch.int32 and uploaded.tolist() == [1, 2] and not uploaded.is_pinned()
    with pytest.raises(RuntimeError, match="runs every step eagerly"):
        cpu.capture_graph(lambda: None, None)


def test_cpu_warms_up_on_one_short_prompt_and_sizes_the_cache_from_its_setting():
    cpu = device_platform("cpu")
    assert cpu.warmup_shape(16384, 4096, 512) == (CPU_WARMUP_TOKENS, 1)
    assert cpu.warmup_shape(16384, 40, 512) == (40, 1)  # never past max_model_len
    budget = cpu.kv_cache_budget(0.9, 2.5, reserved_bytes=GIB)  # a draft's weights are not taken from it
    assert budget == (int(2.5 * GIB), "cpu_kvcache_space_gib=2.5")


def test_cpu_process_settings_are_applied_and_kept_for_the_log(monkeypatch):
    before = torch.get_num_threads()
    calls = []
    monkeypatch.setattr(device_host, "keep_freed_memory", lambda: calls.append(True) or True)
    cpu = device_platform("cpu")
    try:
        cpu.prepare_process(1, malloc_tuning=False)
        assert torch.get_num_threads() == 1 and not cpu.malloc_tuned and not calls
        cpu.prepare_process(2, malloc_tuning=True)
        assert torch.get_num_threads() == 2 and cpu.malloc_tuned and calls == [True] and cpu.threads == 2
    finally:
        torch.set_num_threads(before)


def test_cuda_facts_without_a_gpu():
    cuda = device_platform("cuda")
    assert (cuda.pin_memory, cuda.shares_host_memory, cuda.supports_cuda_graphs) == (True, False, True)
    assert (cuda.default_block_size, cuda.default_dtype, cuda.compiles_by_default, cuda.overlaps_host_by_default) == \
        (256, None, True, True)
    assert cuda.slow_prefill is False and device_platform("cpu").slow_prefill is True
    assert not cuda.uses_cpu_threads and device_platform("cpu").uses_cpu_threads


def test_tensor_parallel_ranks_get_their_backend_and_share():
    cpu, cuda = device_platform("cpu"), device_platform("cuda")
    assert (cpu.process_group_backend, cpu.collectives_hang_on_dead_rank, cpu.process_group_options(1)) == \
        ("gloo", False, {})
    assert (cuda.process_group_backend, cuda.collectives_hang_on_dead_rank, cuda.process_group_options(1)) == \
        ("nccl", True, {"device_id": torch.device("cuda", 1)})
    assert cpu.describe_ranks(3) == ", 3 CPU thread(s) per rank" and cuda.describe_ranks(None) == ""
    before = torch.get_num_threads()
    try:
        cpu.bind_rank(1, 1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_cuda_warms_up_on_the_largest_step():
    cuda = device_platform("cuda")
    assert cuda.warmup_shape(16384, 4096, 512) == (4096, 4)  # four full-length prompts fill one step
    assert cuda.warmup_shape(16384, 4096, 2) == (4096, 2)  # no more than max_num_seqs
    assert cuda.warmup_shape(2048, 4096, 512) == (2048, 1)  # a step holds part of one prompt


def test_cuda_budget_is_what_utilization_leaves_after_use_peak_and_reserve(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *device: (70 * GIB, 80 * GIB))  # 10 GiB in use
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: {"allocated_bytes.all.peak": 6 * GIB,
                                                              "allocated_bytes.all.current": 2 * GIB})
    cuda = device_platform("cuda")
    budget = cuda.kv_cache_budget(0.9, 4.0, reserved_bytes=GIB)
    assert budget.bytes == int(72 * GIB) - 10 * GIB - 4 * GIB - GIB
    assert budget.where == "gpu_memory_utilization=0.9 of 80.0 GiB"
    have = cuda.available_memory(0.5)
    assert have.bytes == 40 * GIB - 10 * GIB and "less 10.0 GiB in use" in have.where


def test_each_device_refuses_the_others_kernels_and_cuda_counts_its_gpus(monkeypatch):
    cpu, cuda = device_platform("cpu"), device_platform("cuda")
    assert cuda.refuses_fused_kernels("cpu") == "fused_kernels='cpu' runs on the CPU only (device is 'cuda')"
    assert cuda.refuses_fused_kernels("triton") is None and cpu.refuses_fused_kernels("cpu") is None
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "needs a CUDA device (device is 'cpu')" in cpu.refuses_fused_kernels("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert cpu.refuses_fused_kernels("triton") is None
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert cuda.refuses_tensor_parallel(2) is None and cpu.refuses_tensor_parallel(8) is None
    assert cuda.refuses_tensor_parallel(4) == "tensor_parallel_size=4 needs 4 GPUs, one per rank; torch sees 2"


def test_data_parallel_engines_share_the_cpu_threads(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    assert device_platform("cpu").worker_environments(3, 1) == [{"OMP_NUM_THREADS": "2"}] * 3
    assert device_platform("cpu").worker_environments(16, 1) == [{"OMP_NUM_THREADS": "1"}] * 16


def test_data_parallel_engines_each_get_their_own_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    cuda = device_platform("cuda")
    assert cuda.worker_environments(2, 2) == [{"CUDA_VISIBLE_DEVICES": "4,5"}, {"CUDA_VISIBLE_DEVICES": "6,7"}]
    with pytest.raises(ValueError, match="data_parallel=3 with tensor_parallel_size=2 needs 6 GPUs; 4 are visible"):
        cuda.worker_environments(3, 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert cuda.worker_environments(2, 1) == [{"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"}]
