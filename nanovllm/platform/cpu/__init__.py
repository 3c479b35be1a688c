"""The CPU platforms. `CpuTorchPlatform` (fused_kernels="torch" on the CPU): torch's functions,
with the linear layers' weights held in float32 where this CPU emulates half-precision matmul and
packed once for oneDNN (linear.py), and draws by inverse transform (layers/sampler.py). `CpuPlatform`
(fused_kernels="cpu") adds the C++ kernels of kernels/cpu_build.py: RMSNorm, SiLU-and-mul and q/k
norm + rotary + K/V store (cpu_fused.cpp), the few-row, AMX and HalfRows products (linear.py), the
decode step of a Llama-family model in one call (decode.py), the race and the greedy heads
(sampling.py). The paged attention kernel (attention.py) is the attention backend's choice
(platform/attention.py), made on the CPU whatever the fused kernels.
"""
import torch
from torch import nn

from nanovllm.kernels.cpu_build import AMX_GREEDY_HEAD_MIN_ROWS, FusedKernels
from nanovllm.layers.logits_processors import LOGIT_LIMIT
from nanovllm.layers.sampler import Sampler, inverse_transform_draw, inverse_transform_from_logits
from nanovllm.models.llama import LlamaModel
from nanovllm.platform.base import LinearMethod
from nanovllm.platform.cpu.decode import CpuDecodeLayers
from nanovllm.platform.cpu.linear import (CpuLinearMethod, CpuLmHeadMethod, hold_matmul_weights_in_float32,
                                          native_half_matmul)
from nanovllm.platform.cpu.sampling import CpuSampler
from nanovllm.platform.torch import TorchPlatform, qk_norm_args


class CpuTorchPlatform(TorchPlatform):
    kernels: FusedKernels | None = None  # CpuPlatform's

    def __init__(self, dtype: torch.dtype):
        TorchPlatform.__init__(self, "cpu")
        self.dtype = dtype
        # Half-precision layers do their matmuls in float32 where this CPU has no native kernel for them.
        self.half_in_float32 = not native_half_matmul(dtype)

    def linear_method(self) -> LinearMethod:
        return CpuLinearMethod(self.kernels)

    def lm_head_method(self) -> LinearMethod:
        return CpuLmHeadMethod(self.kernels)

    def prepare_model(self, model: nn.Module) -> str:
        if self.half_in_float32:
            hold_matmul_weights_in_float32(model)
        methods = []
        for module in model.modules():
            method = getattr(module, "linear_method", None)
            if isinstance(method, CpuLinearMethod):
                method.process_weights_after_loading(module)
                methods.append(method)
        return "linear layers in %s, %d packed for oneDNN, %d for AMX" % (
            "float32 (no native half-precision matmul here)" if self.half_in_float32
            else str(self.dtype).removeprefix("torch."),
            sum(m.packed is not None for m in methods), sum(m.amx is not None for m in methods))

    def sampler(self, model: nn.Module) -> Sampler:
        return Sampler(inverse_transform_from_logits)

    def draw(self, weights: torch.Tensor, t) -> torch.Tensor:
        return inverse_transform_draw(weights, t)


class CpuPlatform(CpuTorchPlatform):
    name = "cpu"

    def __init__(self, kernels: FusedKernels, dtype: torch.dtype):
        super().__init__(dtype)
        self.kernels = kernels

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.dim() != 2:  # the kernel takes rows
            return super().rms_norm(x, weight, eps, residual)
        out = self.kernels.rms_norm(x, weight, eps, residual)
        return out.out if residual is None else (out.out, out.residual)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_and_mul(x) if x.dim() == 2 else super().silu_and_mul(x)

    def prepare_qk(self, attn: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   positions: torch.Tensor, rotary: nn.Module, q_norm: nn.Module | None,
                   k_norm: nn.Module | None, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """One kernel: the norm and the rotation in place, and the K/V store, unless the cache is
        quantised (the backend's store does that)."""
        stored = attn.k_cache.numel() > 0 and attn.kv_scales is None
        cache = dict(v=v, k_cache=attn.k_cache, v_cache=attn.v_cache, slot_mapping=slot_mapping) if stored else {}
        self.kernels.qk_norm_rope(q, k, positions, rotary.cos_sin_cache, **qk_norm_args(q_norm, k_norm), **cache)
        return q, k, stored

    def prepare_model(self, model: nn.Module) -> str:
        line = super().prepare_model(model)
        for module in model.modules():  # after the products: the fused decode reads them
            if isinstance(module, LlamaModel):
                module.fused_decode = CpuDecodeLayers.for_model(module, self.kernels)
        return line

    def sampler(self, model: nn.Module) -> CpuSampler:
        return CpuSampler(self.kernels, self._greedy_head(model))

    def _greedy_head(self, model: nn.Module):
        """The LM head's tokens without every logit (kernels/cpu_build.py GreedyHead; a bf16 head's
        greedy steps of many rows on AMX tiles where the CPU has AMX: AmxGreedyHead), for a float32
        or bf16 head (held in float32 or not) on one rank; None where there is none."""
        head = getattr(model, "lm_head", None)
        method = getattr(head, "linear_method", None)
        if not isinstance(method, CpuLmHeadMethod) or head.tp_size != 1 or \
                method.held_dtype not in (None, torch.bfloat16):
            return None
        greedy = self.kernels.greedy_head(head.weight, LOGIT_LIMIT)
        return self.kernels.amx_greedy_head(head.weight, LOGIT_LIMIT, AMX_GREEDY_HEAD_MIN_ROWS, greedy) or greedy
