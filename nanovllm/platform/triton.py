"""The Triton platform: the fused layer functions and the sampler's race as the Triton kernels of
nanovllm/kernels (rms_norm.py, silu_mul.py, qk_norm_rope.py, sampling.py; fused_moe.py for the MoE
experts), on CUDA, or on the CPU under TRITON_INTERPRET=1 (tests). On Llama, Qwen2/3 and
Qwen3-MoE it calls no torch.compile'd function (GPT-2's LayerNorm and GELU stay torch's), and its
kernels compile at their first launch, so the runner launches each at start-up.
The kernel modules are imported here, when the platform is made: `import nanovllm` never imports
triton.
"""
import torch
from torch import nn

from nanovllm.platform.cpu import CpuTorchPlatform
from nanovllm.platform.sampling import RaceSampler
from nanovllm.platform.torch import TorchPlatform, qk_norm_args


class CudaPlatform(TorchPlatform):
    """fused_kernels="torch" on CUDA: the reference functions, but the MoE experts on the Triton
    kernel (the torch loop over experts is the oracle, too slow to serve with)."""

    def fused_experts(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                      expert_ids: torch.Tensor) -> torch.Tensor:
        from nanovllm.kernels.fused_moe import fused_moe  # lazy: triton only where a MoE model runs
        return fused_moe(x, w13, w2, weights, expert_ids)


class TritonPlatform(CudaPlatform):
    name = "triton"
    compiles_kernels = True

    def __init__(self, device: str):
        TorchPlatform.__init__(self, device)  # by name: InterpretedTritonPlatform's next class is not its
        from nanovllm.kernels import qk_norm_rope, rms_norm, sampling, silu_mul
        self._rms_norm, self._silu_and_mul = rms_norm.rms_norm, silu_mul.silu_and_mul
        self._qk_norm_rope_store = qk_norm_rope.qk_norm_rope_store
        self._race = sampling.sample_tokens

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.dim() != 2:  # the kernel takes rows
            return super().rms_norm(x, weight, eps, residual)
        out = self._rms_norm(x, weight, eps, residual)
        return out.out if residual is None else (out.out, out.residual)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self._silu_and_mul(x) if x.dim() == 2 else super().silu_and_mul(x)

    def prepare_qk(self, attn: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   positions: torch.Tensor, rotary: nn.Module, q_norm: nn.Module | None,
                   k_norm: nn.Module | None, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """One kernel: the norm, the rotation (in place, in q and k) and the cache store, quantised
        for an fp8 cache."""
        cached = attn.k_cache.numel() > 0  # warm-up runs before the cache exists
        cache = dict(k_cache=attn.k_cache, v_cache=attn.v_cache, slot_mapping=slot_mapping) if cached else {}
        if cached and attn.kv_scales is not None:
            cache.update(k_scale=attn.kv_scales.k, v_scale=attn.kv_scales.v)
        self._qk_norm_rope_store(q, k, v, positions, rotary.cos_sin_cache, **qk_norm_args(q_norm, k_norm), **cache)
        return q, k, cached

    def sampler(self, model: nn.Module) -> RaceSampler:
        return RaceSampler(self._race)


class InterpretedTritonPlatform(TritonPlatform, CpuTorchPlatform):
    """The Triton kernels run by the interpreter on the CPU (TRITON_INTERPRET=1, tests): Triton's
    fused functions and race, the CPU's linear layers and draw, the MoE experts in torch (as on
    any CPU)."""

    def __init__(self, dtype: torch.dtype):
        CpuTorchPlatform.__init__(self, dtype)
        TritonPlatform.__init__(self, "cpu")

    def fused_experts(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                      expert_ids: torch.Tensor) -> torch.Tensor:
        return TorchPlatform.fused_experts(self, x, w13, w2, weights, expert_ids)
