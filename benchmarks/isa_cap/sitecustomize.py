"""Imported at start-up by every Python process of a peer's venv that benchmarks/vs_vllm_cpu.py
runs with --isa-cap (this folder first on PYTHONPATH): torch.cpu's ISA checks answer as a CPU of
the capped class would (False for what it lacks), so vLLM picks the kernel library and paths
(_C_AVX2 or _C_AVX512, its AMX or vector attention and GEMMs) that such a CPU gets. The cap is
$NANOVLLM_BENCH_ISA_CAP; unset, nothing is imported or changed."""
import os

# What each class lacks among torch.cpu's checks (x86-64-v3 / v4 machines, Zen 4).
HIDDEN = {
    "avx2": ("_is_avx512_supported", "_is_avx512_vnni_supported", "_is_avx512_bf16_supported", "_is_vnni_supported",
             "_is_amx_tile_supported", "_is_amx_fp16_supported"),
    "avx512": ("_is_avx512_vnni_supported", "_is_avx512_bf16_supported", "_is_vnni_supported",
               "_is_amx_tile_supported", "_is_amx_fp16_supported"),
    "avx512_bf16": ("_is_amx_tile_supported", "_is_amx_fp16_supported"),
}

_cap = os.environ.get("NANOVLLM_BENCH_ISA_CAP")
if _cap:
    import torch

    def _absent() -> bool:
        return False

    for _name in HIDDEN[_cap]:
        for _module in (torch.cpu, torch._C._cpu):  # torch.cpu's functions call torch._C._cpu's
            if hasattr(_module, _name):
                setattr(_module, _name, _absent)
