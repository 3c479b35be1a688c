"""The Triton kernels compiled for an H100 (sm_90) on a machine without a GPU.

The interpreter that runs the kernel tests on CPU never compiles, so it cannot catch what only
compilation checks (a global that is not a constexpr, a type the compiler refuses, a shape rule).
This test runs Triton's own compiler, in a subprocess without TRITON_INTERPRET, on the launches
the wrappers make for Qwen3-0.6B in bfloat16 (captured, not run), down to the cubin the wheel's
ptxas makes: what an H100 compiles at their first launch, less the driver's loading.
"""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="triton is not installed")

COMPILE_SCRIPT = r"""
import json, torch
from nanovllm.testing.kernel_launches import capturing, compile_for_cuda, triton_kernels
from nanovllm.kernels.decode_attention import decode_attention
from nanovllm.kernels.prefill_attention import prefill_attention
from nanovllm.kernels.qk_norm_rope import qk_norm_rope_store
from nanovllm.kernels.rms_norm import rms_norm
from nanovllm.kernels.sampling import sample_tokens
from nanovllm.kernels.silu_mul import silu_and_mul
from nanovllm.kernels.store_kv import store_kv
bf = torch.bfloat16
T, H, I, Hq, Hkv, D, V = 3, 1024, 3072, 16, 8, 128, 151936  # Qwen3-0.6B
with capturing(triton_kernels()) as launches:
    x = torch.zeros(T, H, dtype=bf)
    rms_norm(x, torch.zeros(H, dtype=bf), 1e-6, x)
    silu_and_mul(torch.zeros(T, 2 * I, dtype=bf))
    qkv = torch.zeros(T, (Hq + 2 * Hkv) * D, dtype=bf)
    q, k, v = (t.view(T, -1, D) for t in qkv.split([Hq * D, Hkv * D, Hkv * D], -1))
    cache = torch.zeros(4, 256, Hkv, D, dtype=bf)
    w = torch.zeros(D, dtype=bf)
    index = torch.zeros(T, dtype=torch.int64)
    qk_norm_rope_store(q, k, v, index, torch.zeros(64, 1, D), w, w, 1e-6, k_cache=cache, v_cache=cache.clone(),
                       slot_mapping=index)
    sample_tokens(torch.zeros(T, V, dtype=bf), torch.zeros(T), index, index)
    cu_q, cu_k = torch.tensor([0, T], dtype=torch.int32), torch.tensor([0, 256 + T], dtype=torch.int32)
    tables = torch.tensor([[0, 1]], dtype=torch.int32)
    prefill_attention(q, cache, cache.clone(), cu_q, cu_k, D ** -0.5, block_tables=tables)
    # The fp8 cache's variants (kv_cache_dtype="fp8_e4m3"): quantised store, dequantised reads.
    fp8 = torch.zeros(4, 256, Hkv, D, dtype=torch.float8_e4m3fn)
    scales = dict(k_scale=torch.ones(Hkv), v_scale=torch.ones(Hkv))
    qk_norm_rope_store(q, k, v, index, torch.zeros(64, 1, D), w, w, 1e-6, k_cache=fp8, v_cache=fp8.clone(),
                       slot_mapping=index, **scales)
    store_kv(k, v, fp8, fp8.clone(), index, **scales)
    prefill_attention(q, fp8, fp8.clone(), cu_q, cu_k, D ** -0.5, block_tables=tables, **scales)
    decode_attention(q[:1], fp8, fp8.clone(), tables, torch.tensor([256 + T], dtype=torch.int32), D ** -0.5,
                     **scales)
compiled = [(launch.kernel, len(compile_for_cuda(launch, arch=90).asm["cubin"])) for launch in launches]
print(json.dumps(compiled))
"""


def test_kernels_compile_for_sm90_without_a_gpu():
    """Triton's real compiler (the wheel's ptxas) on the bf16 Qwen3-0.6B launches of the fused
    kernels and the paged prefill, and of the fp8 cache's variants (store, fused store, paged
    prefill, decode), down to an sm_90 cubin each, as an H100 compiles them at their first launch."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                      env.get("PYTHONPATH")]))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9 warns when it is unset
    result = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    launches = json.loads(result.stdout.strip().splitlines()[-1])
    compiled = dict(launches)
    assert set(compiled) == {"rms_norm._rms_norm_kernel", "silu_mul._silu_and_mul_kernel",
                             "qk_norm_rope._qk_norm_rope_store_kernel", "sampling._race_chunk_kernel",
                             "sampling._pick_kernel", "prefill_attention._prefill_kernel", "store_kv._store_kv_kernel",
                             "decode_attention._decode_kernel"}
    assert all(size > 0 for _, size in launches)
    # The fp8 variants compiled too (the second launches of kernels with a 16-bit one).
    names = [name for name, _ in launches]
    assert names.count("qk_norm_rope._qk_norm_rope_store_kernel") == 2
    assert names.count("prefill_attention._prefill_kernel") == 2
