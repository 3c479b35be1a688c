"""Decode steps through a Llama-family model's decoder layers in one C++ call on the CPU
(kernels/cpu_decode_layers.cpp), attached by the CPU platform to the model's `fused_decode`.

With one to a few sequences a decode step reads the weights once (~200 us a layer for a 512-wide
model); the Python between the layer's ten kernel calls (modules, views, ctypes) cost ~150 us
more. `CpuDecodeLayers` hands the whole stack of layers, and the final norm, to one call that runs
the same kernels with the same arguments, so its output is bit for bit the layers' own with
fused_kernels="cpu" (tests/test_cpu_decode.py). It takes a step only when every part would have
gone to those kernels: a decode step (no prefill rows) of at most the few-row product's rows (over
the layers' bf16 copies where they hold float32 for their matmuls: platform/cpu/linear.py HalfRows), or
of the AMX product's where every layer's products have it (bf16 or float32 on a CPU with AMX), on
an unquantised cache in the model's dtype, one tensor-parallel rank, a dense SwiGLU MLP in every
layer; any other step returns None and the Python layers run it. Like an attention layer it reads
the step's attention metadata from the forward context.
"""
import ctypes

import torch
from torch import nn

from nanovllm.kernels.cpu_build import DTYPE_CODES, FusedKernels
from nanovllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP
from nanovllm.platform.cpu.attention import CpuPagedBackend
from nanovllm.utils.context import get_context

_ptr, _f32, _i32, _i64 = ctypes.c_void_p, ctypes.c_float, ctypes.c_int, ctypes.c_int64


class LayerWeights(ctypes.Structure):
    """kernels/cpu_decode_layers.cpp's LayerWeights, field for field."""
    _fields_ = [(name, _ptr) for name in ("input_norm", "post_norm", "qkv", "qkv_bias", "o", "o_bias", "q_norm",
                                           "k_norm", "gate_up", "gate_up_bias", "down", "down_bias", "k_cache",
                                           "v_cache", "qkv_amx", "o_amx", "gate_up_amx", "down_amx")] + [
        ("input_eps", _f32), ("post_eps", _f32), ("qk_eps", _f32)]


class DecodeModel(ctypes.Structure):
    """kernels/cpu_decode_layers.cpp's DecodeModel, field for field."""
    _fields_ = [(name, _i32) for name in ("dtype", "element_size", "hidden", "num_heads", "num_kv_heads", "head_dim",
                                           "intermediate", "block_size", "num_layers", "few_rows_max")] + [
        ("scale", _f32), ("final_eps", _f32), ("final_norm", _ptr), ("cos_sin", _ptr), ("cos_sin_stride", _i64),
        ("layers", ctypes.POINTER(LayerWeights))]


def _address(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _weights(linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight and bias a linear layer's few-row product reads: its half-precision copy where it
    holds float32 for its matmuls (platform/cpu/linear.py HalfRows), else its own."""
    half = linear.linear_method.half_rows
    return (linear.weight, linear.bias) if half is None else (half.weight, half.bias)


def _amx_address(linear: nn.Module) -> int | None:
    """Where a linear layer's weight packed for the AMX product lies, or None."""
    amx = linear.linear_method.amx
    return None if amx is None else amx.packed.data_ptr()


class CpuDecodeLayers:
    """The decoder layers' decode step in one call, for a model whose every layer it can run."""

    def __init__(self, model: nn.Module, kernels: FusedKernels, few_rows_max: int, max_rows: int):
        self.model = model  # models/llama.py's LlamaModel: embed_tokens, layers, norm
        self.few_rows_max = few_rows_max  # rows up to this go to the few-row product, above to the AMX one
        self.max_rows = max_rows
        self.dtype = model.embed_tokens.weight.dtype
        self._fn = kernels.decode_layers
        self._built_for: int | None = None  # the first layer's K cache address last built for
        self._layers = self._args = None  # the structures for that cache; None: the Python layers run

    @classmethod
    def for_model(cls, model: nn.Module, kernels: FusedKernels) -> "CpuDecodeLayers | None":
        """The fused decode for `model`, or None where some layer has a part it does not run."""
        dtype = model.embed_tokens.weight.dtype
        few_rows = kernels.few_rows_linear(dtype)
        if few_rows is None or getattr(model.embed_tokens, "tp_size", 1) != 1:
            return None
        amx_rows = []  # each product's AMX rows; none where a product has no AMX weight
        for layer in model.layers:
            if not (type(layer) is LlamaDecoderLayer and type(layer.self_attn) is LlamaAttention
                    and type(layer.mlp) is LlamaMLP and isinstance(layer.self_attn.attn.backend, CpuPagedBackend)):
                return None
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if any(_weights(lin)[0].dtype != dtype or lin.tp_size != 1 for lin in linears):
                return None
            if attn.rotary_emb is None:
                return None
            amx_rows += [0 if lin.linear_method.amx is None else lin.linear_method.amx.max_rows for lin in linears]
        return cls(model, kernels, few_rows.max_rows, max(few_rows.max_rows, min(amx_rows, default=0)))

    def _build(self) -> DecodeModel | None:
        """The structures for the cache the layers hold now (kept on self); None where the cache is
        not the model's dtype unquantised (or not there yet: the warm-up runs before it exists)."""
        attentions = [layer.self_attn for layer in self.model.layers]
        for a in attentions:
            if (a.attn.k_cache.numel() == 0 or a.attn.k_cache.dtype != self.dtype or a.attn.kv_scales is not None
                    or a.attn.kv_observer is not None):
                return None
        layers = (LayerWeights * len(attentions))()
        for slot, layer in zip(layers, self.model.layers):
            a, mlp = layer.self_attn, layer.mlp
            slot.input_norm, slot.post_norm = _address(layer.input_layernorm.weight), _address(
                layer.post_attention_layernorm.weight)
            slot.qkv, slot.qkv_bias = map(_address, _weights(a.qkv_proj))
            slot.o, slot.o_bias = map(_address, _weights(a.o_proj))
            slot.q_norm = _address(a.q_norm.weight) if a.qk_norm else None
            slot.k_norm = _address(a.k_norm.weight) if a.qk_norm else None
            slot.gate_up, slot.gate_up_bias = map(_address, _weights(mlp.gate_up_proj))
            slot.down, slot.down_bias = map(_address, _weights(mlp.down_proj))
            slot.k_cache, slot.v_cache = _address(a.attn.k_cache), _address(a.attn.v_cache)
            slot.qkv_amx, slot.o_amx = _amx_address(a.qkv_proj), _amx_address(a.o_proj)
            slot.gate_up_amx, slot.down_amx = _amx_address(mlp.gate_up_proj), _amx_address(mlp.down_proj)
            slot.input_eps, slot.post_eps = layer.input_layernorm.eps, layer.post_attention_layernorm.eps
            slot.qk_eps = a.q_norm.eps if a.qk_norm else 0.0
        first = attentions[0]
        rotary = first.rotary_emb.cos_sin_cache  # [max_position, 1, head_dim] float32, shared by the layers
        self._layers = layers  # the structure below points into this array: keep it alive
        return DecodeModel(
            dtype=DTYPE_CODES[self.dtype], element_size=self.dtype.itemsize,
            hidden=self.model.norm.weight.numel(), num_heads=first.num_heads, num_kv_heads=first.num_kv_heads,
            head_dim=first.head_dim, intermediate=self.model.layers[0].mlp.down_proj.weight.size(1),
            block_size=first.attn.k_cache.size(1), num_layers=len(attentions), few_rows_max=self.few_rows_max,
            scale=first.attn.scale,
            final_eps=self.model.norm.eps, final_norm=_address(self.model.norm.weight), cos_sin=_address(rotary),
            cos_sin_stride=rotary.stride(0), layers=layers)

    def __call__(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """The final norm's output [rows, hidden] for embeddings hidden_states [rows, hidden], or
        None when this step is not one it takes (the Python layers then run it)."""
        rows = hidden_states.size(0)
        meta = get_context()
        if meta.is_prefill or rows > self.max_rows or hidden_states.dtype != self.dtype:
            return None
        cache = self.model.layers[0].self_attn.attn.k_cache.data_ptr()
        if cache != self._built_for:
            self._args, self._built_for = self._build(), cache
        if self._args is None:
            return None
        steps = self.model.layers[0].self_attn.attn.backend.steps(hidden_states, meta)
        if positions.dtype != torch.int64:
            positions = positions.long()
        out = torch.empty_like(hidden_states)
        rc = self._fn(ctypes.addressof(self._args), rows, hidden_states.data_ptr(), out.data_ptr(),
                      positions.data_ptr(), meta.slot_mapping.data_ptr(), steps.block_tables.data_ptr(),
                      steps.block_tables.stride(0), steps.q_start.data_ptr(), steps.q_len.data_ptr(),
                      steps.k_len.data_ptr(), torch.get_num_threads())
        assert rc == 0, f"nanovllm_decode_layers returned {rc}"
        return out
