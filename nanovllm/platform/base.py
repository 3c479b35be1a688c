"""The platform interface: what the model side asks of the hardware, and nothing else.

A `Platform` gives the layers their few device-specific functions (the norm, the activation,
q/k norm + rotary + K/V store, the MoE experts), each linear layer and LM head its `LinearMethod`
(as vLLM's `quant_method`: the weights' layout and the product over them), the model runner its
attention backend, its sampler (which also takes tokens from the LM head without the logits where
the platform can) and the model-wide work after loading (weight conversion, packing, the fused
decode step). platform/torch.py is the reference, triton.py and cpu/ the kernels; choose.py picks
one at start-up. This module imports nothing of nanovllm, so layers can name the interface; it
also answers the one device question asked where no platform is at hand (`bitmask_backend`).
"""
from abc import ABC, abstractmethod
import torch
from torch import nn


class LinearMethod(ABC):
    """How one linear layer (or LM head) holds its weight and multiplies by it; one object per layer,
    which keeps whatever per-layer state its product needs (a packed copy, a kernel)."""

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool) -> None:
        """Register `layer.weight` [output_size, input_size] (and `layer.bias` or None) as loaded."""
        layer.weight = nn.Parameter(torch.empty(output_size, input_size))
        layer.register_parameter("bias", nn.Parameter(torch.empty(output_size)) if bias else None)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Put the loaded weight into the layout `apply` reads (nothing for the reference)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ layer.weight.T (+ bias), returned in x's dtype."""


class Platform(ABC):
    name: str  # what Config.fused_kernels names: "torch", "triton" or "cpu"
    # Whether its kernels compile at their first launch (Triton): the runner launches each at start-up.
    compiles_kernels: bool = False

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """weight * rms_normalise(x), or with `residual` (out, x + residual) of x + residual."""

    @abstractmethod
    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for x = [..., gate | up]."""

    @abstractmethod
    def linear_method(self) -> LinearMethod:
        """A new linear method for one linear layer."""

    @abstractmethod
    def lm_head_method(self) -> LinearMethod:
        """A new linear method for one LM head (logits)."""

    @abstractmethod
    def prepare_qk(self, attn: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   positions: torch.Tensor, rotary: nn.Module, q_norm: nn.Module | None,
                   k_norm: nn.Module | None, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """q and k normalised per head (with q_norm/k_norm) and rotated, and whether this step's K/V
        were also stored in attn's cache (layers/attention.py stores them otherwise)."""

    @abstractmethod
    def fused_experts(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                      expert_ids: torch.Tensor) -> torch.Tensor:
        """A sparse MLP's experts over their routed tokens (layers/fused_moe.py)."""

    @abstractmethod
    def attention_backend(self, requested: str, block_size: int, kv_cache_dtype: str):
        """The attention backend (attention/base.py) to use, chosen and logged, or a ValueError."""

    @abstractmethod
    def prepare_model(self, model: nn.Module) -> str | None:
        """After loading, with the attention backend set: every layer's weights in the layout its
        kernels read, and any model-wide step attached; a line for the start-up log, or None."""

    @abstractmethod
    def sampler(self, model: nn.Module) -> nn.Module:
        """The sampler (layers/sampler.py) for `model`'s steps, prepared."""

    @abstractmethod
    def draw(self, weights: torch.Tensor, t) -> torch.Tensor:
        """One token per row with probability proportional to `weights` [rows, vocab] (>= 0), seeded
        rows (t: layers/logits_processors.py SamplingTensors) from their own generator."""


def bitmask_backend(device: torch.device) -> str:
    """xgrammar's backend for applying a token bitmask to logits on `device`: its C++ kernel on the
    CPU (unpacking the bits in torch there costs ~100x more); on a GPU its plain-torch version,
    cheap there, where its default (a Triton kernel) would compile at the first constrained
    request, after start-up."""
    return "cpu" if device.type == "cpu" else "torch_native"
