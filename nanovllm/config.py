"""Engine configuration: nano-vllm's fields plus device, dtype, attention backend and prefix caching.

Owns validation of every user-facing knob and the facts read from the checkpoint's
`config.json`. It does not know how the model runs; the runner reads the resolved values.
"""
import json
import os
from dataclasses import dataclass, field, fields

import torch
from transformers import AutoConfig, PretrainedConfig

# Architectures `models/qwen3.py` can build, by the name in config.json's "architectures".
SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen2ForCausalLM")
DEVICES = ("auto", "cuda", "cpu")
ATTENTION_BACKENDS = ("auto", "flash_attn", "triton", "torch")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# The smallest paged-KV block the backends accept: Triton's tl.dot needs tiles of >= 16.
MIN_BLOCK_SIZE = 16
# kvcache_block_size when none is given, per device. CUDA: nano-vllm's 256, a page size flash-attn
# takes. CPU: the torch backend's decode gathers whole blocks, so smaller ones waste less, and
# 16..64 measured alike (256 ~10% slower, docs/BENCHMARKS.md); 32 keeps prefix caching fine-grained.
DEFAULT_BLOCK_SIZE = {"cuda": 256, "cpu": 32}
# Tensor parallelism spans at most one 8-GPU node.
MAX_TENSOR_PARALLEL_SIZE = 8
# Model sizes split across tensor-parallel ranks (heads, KV heads, vocabulary, MLP width).
TENSOR_PARALLEL_DIVIDES = ("num_attention_heads", "num_key_value_heads", "vocab_size", "intermediate_size")


def _require(ok: bool, name: str, value, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is not allowed; {name} must be {allowed}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class Config:
    model: str
    max_num_batched_tokens: int = 16384
    max_num_seqs: int = 512
    max_model_len: int = 4096  # capped by the model's max_position_embeddings
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1  # ranks (processes; GPUs on CUDA) the model is sharded over
    enforce_eager: bool = False
    kvcache_block_size: int | None = None  # None: per device (DEFAULT_BLOCK_SIZE); else a power of two >= 16
    num_kvcache_blocks: int = -1  # -1: size the KV cache from memory; > 0: exactly this many blocks
    device: str = "auto"  # "auto" = cuda when available, else cpu
    dtype: str | torch.dtype = "auto"  # "auto" = checkpoint dtype on CUDA, float32 on CPU
    attention_backend: str = "auto"
    enable_prefix_caching: bool = True
    # On CPU there is no device to measure, so the KV cache gets this fixed budget (as vLLM's
    # VLLM_CPU_KVCACHE_SPACE), per tensor-parallel rank; it is capped by what max_num_seqs sequences
    # of max_model_len need.
    cpu_kvcache_space_gib: float = 4.0
    hf_config: PretrainedConfig = field(init=False, repr=False)
    eos: int = field(init=False, default=-1)

    @classmethod
    def from_kwargs(cls, model: str, kwargs: dict) -> "Config":
        """Build a Config, refusing keyword arguments it does not know (never drop them silently)."""
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown config key(s) {unknown}; allowed keys: {sorted(known - {'model'})}")
        return cls(model, **kwargs)

    def __post_init__(self) -> None:
        self._check_fields()
        self.hf_config = self._load_hf_config()
        self.max_model_len = min(self.max_model_len, self.hf_config.max_position_embeddings)
        self.device = self._resolve_device()
        if self.kvcache_block_size is None:
            self.kvcache_block_size = DEFAULT_BLOCK_SIZE[self.device]
        self.dtype = self._resolve_dtype()
        self._check_tensor_parallel()

    def _check_fields(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            value = getattr(self, name)
            _require(_is_int(value) and value >= 1, name, value, "an integer >= 1")
        u = self.gpu_memory_utilization
        _require(isinstance(u, (int, float)) and 0 < u <= 1, "gpu_memory_utilization", u, "in (0, 1]")
        tp = self.tensor_parallel_size
        _require(_is_int(tp) and 1 <= tp <= MAX_TENSOR_PARALLEL_SIZE, "tensor_parallel_size", tp,
                 f"an integer in 1..{MAX_TENSOR_PARALLEL_SIZE}")
        bs = self.kvcache_block_size
        _require(bs is None or (_is_int(bs) and bs >= MIN_BLOCK_SIZE and bs & (bs - 1) == 0), "kvcache_block_size",
                 bs, f"None (the device's default) or a power of two >= {MIN_BLOCK_SIZE}")
        n = self.num_kvcache_blocks
        _require(_is_int(n) and (n == -1 or n >= 1), "num_kvcache_blocks", n, "-1 (size from memory) or >= 1")
        for name in ("enforce_eager", "enable_prefix_caching"):
            _require(isinstance(getattr(self, name), bool), name, getattr(self, name), "True or False")
        _require(self.device in DEVICES, "device", self.device, f"one of {DEVICES}")
        _require(self.attention_backend in ATTENTION_BACKENDS, "attention_backend", self.attention_backend,
                 f"one of {ATTENTION_BACKENDS}")
        _require(self.dtype == "auto" or self.dtype in DTYPES or self.dtype in DTYPES.values(), "dtype",
                 self.dtype, f"'auto', one of {list(DTYPES)} or the matching torch.dtype")
        g = self.cpu_kvcache_space_gib
        _require(isinstance(g, (int, float)) and g > 0, "cpu_kvcache_space_gib", g, "a number > 0")

    def _check_tensor_parallel(self) -> None:
        """Each rank holds 1/tensor_parallel_size of these, so each must divide; checked here,
        before any worker process is spawned."""
        tp = self.tensor_parallel_size
        sizes = {name: getattr(self.hf_config, name, None) for name in TENSOR_PARALLEL_DIVIDES}
        sizes = {name: value for name, value in sizes.items() if value is not None}
        allowed = [n for n in range(1, MAX_TENSOR_PARALLEL_SIZE + 1) if all(v % n == 0 for v in sizes.values())]
        for name, value in sizes.items():
            if value % tp:
                raise ValueError(f"tensor_parallel_size={tp} is not allowed for this model: its {name}={value} "
                                 f"does not divide by {tp}; tensor_parallel_size must divide "
                                 f"{', '.join(f'{n}={v}' for n, v in sizes.items())} (allowed: {allowed})")
        if self.device == "cuda" and tp > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={tp} needs {tp} GPUs, one per rank; torch sees "
                             f"{torch.cuda.device_count()}")

    def _load_hf_config(self) -> PretrainedConfig:
        if not isinstance(self.model, (str, os.PathLike)) or not os.path.isdir(self.model):
            raise ValueError(f"model={self.model!r} is not a directory; model must be a local checkpoint "
                             "directory holding config.json and *.safetensors (nothing is downloaded)")
        path = os.path.join(self.model, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"model={self.model!r} has no config.json")
        with open(path) as f:
            architectures = json.load(f).get("architectures") or []
        if not any(a in SUPPORTED_ARCHITECTURES for a in architectures):
            raise ValueError(f"model={self.model!r} has architectures {architectures}; "
                             f"supported: {list(SUPPORTED_ARCHITECTURES)}")
        # A local directory and no trust_remote_code: nothing from the checkpoint is executed.
        return AutoConfig.from_pretrained(self.model, trust_remote_code=False)

    def _resolve_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch sees no CUDA device; use device='cpu' or 'auto'")
        return self.device

    def _resolve_dtype(self) -> torch.dtype:
        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        if self.device == "cpu":
            return torch.float32
        checkpoint_dtype = getattr(self.hf_config, "dtype", None) or getattr(self.hf_config, "torch_dtype", None)
        if isinstance(checkpoint_dtype, str):
            checkpoint_dtype = DTYPES.get(checkpoint_dtype)
        return checkpoint_dtype if checkpoint_dtype in DTYPES.values() else torch.bfloat16

    @property
    def architecture(self) -> str:
        return next(a for a in self.hf_config.architectures if a in SUPPORTED_ARCHITECTURES)
