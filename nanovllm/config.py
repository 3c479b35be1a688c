"""Engine configuration: nano-vllm's fields plus device, dtype, attention backend and prefix caching.

Owns validation of every user-facing knob and the facts read from the checkpoint: its
`config.json` (a quantized one refused by its method's name, models/quantization.py), its
tokenizer (loaded and checked here, so a checkpoint without a usable one is refused before any
weight loads) and the end-of-text id that comes from them. "auto" settings
are resolved here, once (device, dtype, compile mode, fused kernels, async scheduling), from the facts of
the device's platform (platform/device.py); the attention backend is resolved by the runner, which needs
the backends' imports. It does not know how the model runs.
"""
import copy
import json
import logging
import os
from dataclasses import dataclass, field, fields
from typing import Literal, get_type_hints

import torch
from transformers import AutoConfig, PretrainedConfig, PreTrainedTokenizerBase

try:  # transformers 5's configs validate their fields through huggingface_hub's strict dataclasses
    from huggingface_hub.errors import StrictDataclassError
except ImportError:  # an older huggingface_hub: its configs raise ValueError and TypeError alone
    StrictDataclassError = ValueError

from nanovllm.attention.kv_quant import FP8_DTYPES
from nanovllm.scheduling.scheduler import DEFAULT_SCHEDULING_POLICY, PREEMPTION_MODES, RECOMPUTE, SCHEDULING_POLICIES
from nanovllm.platform.device import MIN_BLOCK_SIZE, DevicePlatform, auto_device, device_platform, unavailable
from nanovllm.platform.device_host import available_cores
from nanovllm.speculative_config import DRAFT_MODEL, SpeculativeConfig
from nanovllm.utils.tokenizer import end_of_text_id, load_tokenizer
from nanovllm.utils.validation import ParamError, is_int, is_number, literal_values, require

from nanovllm.models.quantization import check_quantization_config
from nanovllm.models.registry import MODELS, architecture_of

logger = logging.getLogger("nanovllm")

# Each vocabulary is written once, here, and a field takes it as its Literal type: the checks
# (VOCABULARIES, at the end of this module) and the choices of the CLI's and bench.py's flags
# (entrypoints/cli/args.py) read it from there.
DEVICES = ("auto", "cuda", "cpu")
ATTENTION_BACKENDS = ("auto", "flash_attn", "triton", "torch", "cpu")
COMPILE_MODES = ("auto", "on", "off")
FUSED_KERNELS = ("auto", "triton", "cpu", "torch")
ASYNC_SCHEDULING_MODES = ("auto", "on", "off")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
KV_CACHE_DTYPES = ("auto", *FP8_DTYPES)
Device = Literal[DEVICES]
AttentionBackend = Literal[ATTENTION_BACKENDS]
CompileMode = Literal[COMPILE_MODES]
FusedKernels = Literal[FUSED_KERNELS]
AsyncScheduling = Literal[ASYNC_SCHEDULING_MODES]
DtypeName = Literal[("auto", *DTYPES)]
KvCacheDtype = Literal[KV_CACHE_DTYPES]
SchedulingPolicy = Literal[SCHEDULING_POLICIES]
PreemptionMode = Literal[PREEMPTION_MODES]
# The metadata of a field the command line takes but leaves out of --help (entrypoints/cli/args.py):
# knobs for tests and tuning, and settings a command that reads and prints text has no use for.
CLI_HIDDEN = {"cli_hidden": True}
# The environment variable that sets cpu_threads when the field is None (before OMP_NUM_THREADS).
CPU_THREADS_ENV = "NANOVLLM_CPU_THREADS"
# Tensor parallelism spans at most one 8-GPU node.
MAX_TENSOR_PARALLEL_SIZE = 8
# A worker beats several times per timeout from a thread that competes with its compute for the
# CPU; below a second, a busy but healthy worker could be taken for a silent one.
MIN_HEARTBEAT_TIMEOUT_S = 1.0


@dataclass
class Config:
    model: str
    max_num_batched_tokens: int = 16384  # most tokens computed in one step; a longer prompt is prefilled in chunks
    max_num_seqs: int = 512  # most sequences in one batch
    max_model_len: int = 4096  # capped by the model's max_position_embeddings (GPT-2: n_positions)
    gpu_memory_utilization: float = 0.9  # share of GPU memory the engine may fill (weights, activations, KV cache)
    tensor_parallel_size: int = 1  # ranks (processes; GPUs on CUDA) the model is sharded over
    enforce_eager: bool = False  # True: never capture CUDA graphs (CPU runs are always eager)
    # Tokens per KV-cache block, a power of two >= 16; None = the device's (default_block_size in
    # platform/device.py: 256 on CUDA, which flash-attn can page; 32 on CPU). Always an int once
    # the Config is made.
    kvcache_block_size: int | None = None
    num_kvcache_blocks: int = -1  # -1: size the KV cache from memory; > 0: exactly this many blocks
    device: Device = "auto"  # "auto" = cuda when available, else cpu
    # "auto" = the checkpoint's dtype on CUDA, float32 on CPU; or "float32", "float16", "bfloat16"
    # or a torch.dtype. Always the torch.dtype once the Config is made.
    dtype: torch.dtype | DtypeName = "auto"
    # The KV cache's element type: "auto" = the model's dtype; "fp8_e4m3" or "fp8_e5m2" store K and
    # V in one byte with a float32 scale per (layer, KV head): twice the tokens of a 16-bit cache
    # (4x on CPU's float32) at a small accuracy cost (docs/gpu.md, "FP8 KV cache"). Scales come from the checkpoint's
    # `self_attn.k_scale`/`v_scale` tensors when it has them, else from the start-up warm-up.
    kv_cache_dtype: KvCacheDtype = "auto"
    # "auto" = flash_attn on CUDA when installed, else triton on CUDA; on CPU "cpu" (the in-place
    # paged C++ kernel) when it builds, else torch
    attention_backend: AttentionBackend = "auto"
    enable_prefix_caching: bool = True  # reuse the KV blocks of a prompt prefix already computed
    # On CPU there is no device to measure, so the KV cache gets this fixed budget (as vLLM's
    # VLLM_CPU_KVCACHE_SPACE), per tensor-parallel rank; it is capped by what max_num_seqs sequences
    # of max_model_len need.
    cpu_kvcache_space_gib: float = 4.0
    # True: no tokenizer is loaded (as vLLM's option): prompts are token ids, outputs carry token ids
    # and empty text, and end-of-text is the checkpoint config's eos_token_id.
    skip_tokenizer_init: bool = field(default=False, metadata=CLI_HIDDEN)
    # A tensor-parallel worker that sends no heartbeat for this long (its process stopped or wedged)
    # is reported and killed, instead of blocking rank 0 until the process group's 30-minute timeout.
    tensor_parallel_heartbeat_timeout_s: float = field(default=30.0, metadata=CLI_HIDDEN)
    # torch.compile of the small hot layer functions (RMSNorm, rotary embedding, SiLU-and-mul, the
    # sampler's temperature and draw): "on", "off", or "auto" = on for CUDA, off for CPU, where the
    # float32 path is the HF oracle and a cold compile costs more than short runs gain
    # (benchmarks/compiled_layers.py). Resolved to "on" or "off" when the Config is made.
    compile_mode: CompileMode = "auto"
    # "mixed": each step gives every running sequence its next token, then fills the rest of
    # max_num_batched_tokens with prefill chunks, in one forward pass (no prefill stalls the
    # decodes). "prefill_first": nano-vllm's policy, a step is all prefill while any can be
    # scheduled, else all decode. The default measured better on bench.py (docs/BENCHMARKS.md).
    scheduling_policy: SchedulingPolicy = DEFAULT_SCHEDULING_POLICY
    # What preemption does with a sequence's K/V when blocks run out: "recompute" frees them (the
    # tokens are computed again later); "swap" copies them to host memory and back (a sequence
    # still in its prompt, or one that finds the swap space full, is recomputed instead).
    preemption_mode: PreemptionMode = RECOMPUTE
    # GiB of host memory per tensor-parallel rank for swapped-out K/V (pinned on CUDA); only with
    # preemption_mode="swap". Capped by what max_num_seqs sequences of max_model_len need.
    swap_space: float = 4.0
    # The small layer functions (residual add + RMSNorm, q/k norm + rotary + KV store, SiLU-and-mul)
    # and the sampler's race as Triton kernels (nanovllm/kernels/), or as the torch functions:
    # "auto" = "triton" on CUDA when triton is installed, "cpu" on CPU where a C++ compiler is
    # (kernels/cpu_fused.cpp: RMSNorm, SiLU-and-mul, q/k norm + rotary + KV store, the sampler's draw),
    # else "torch". "triton" without CUDA needs TRITON_INTERPRET=1 (tests). On Llama, Qwen2/3 and
    # Qwen3-MoE the Triton path calls no torch.compile'd function, whatever compile_mode says;
    # GPT-2's LayerNorm and GELU stay torch's. Resolved to "triton", "cpu" or "torch" when the
    # Config is made ("cpu" becomes "torch" at start-up if the library cannot be built).
    fused_kernels: FusedKernels = "auto"
    # Speculative decoding (docs/sampling.md, "Speculative decoding"): None (off), {"method": "ngram",
    # "num_speculative_tokens": k, "prompt_lookup_min": a, "prompt_lookup_max": b} or
    # {"method": "draft_model", "model": PATH, "num_speculative_tokens": k}. Output is exactly
    # the same as without it (greedy token for token; sampled, the same distribution).
    speculative_config: dict | None = None
    # CPU only. torch threads per tensor-parallel rank; None = $NANOVLLM_CPU_THREADS when set, else
    # $OMP_NUM_THREADS when set, else one per physical core this process may run on (affinity mask,
    # SMT siblings once, capped by a cgroup v2 CPU quota) shared among the ranks. Resolved to an
    # int on CPU when the Config is made.
    cpu_threads: int | None = None
    # CPU only. True: keep freed activation memory for reuse instead of glibc returning it to the
    # OS after each op and faulting it in again (platform/device_host.py keep_freed_memory); the process keeps
    # its peak heap. No effect with another allocator preloaded (tcmalloc) or off glibc.
    cpu_malloc_tuning: bool = field(default=True, metadata=CLI_HIDDEN)
    # Overlap the host's work with the device's (as vLLM's async scheduling and SGLang's overlap
    # scheduler): the next step is scheduled and launched while the device runs this one, so the
    # scheduling, input building, stop checks and detokenising of ~0.55 ms a step hide behind it.
    # "on", "off", or "auto" = on for CUDA on one rank without speculative decoding (on CPU the
    # forward pass blocks the host anyway, so it gains nothing there; "on" still runs it, for
    # tests). Outputs are the same token for token. Not with tensor parallelism or speculative
    # decoding. Resolved to "on" or "off" when the Config is made.
    async_scheduling: AsyncScheduling = "auto"
    # Read from the checkpoint, not settings:
    hf_config: PretrainedConfig = field(init=False, repr=False)
    tokenizer: PreTrainedTokenizerBase | None = field(init=False, repr=False, compare=False)  # None: skipped
    eos: int = field(init=False)  # the end-of-text token id (tokenizer's, else config.json's; -1 if none)
    speculative: SpeculativeConfig | None = field(init=False, default=None)  # speculative_config, checked
    # The draft model's own Config (draft_model method): the same engine settings, no tokenizer.
    draft_config: "Config | None" = field(init=False, default=None, repr=False, compare=False)

    @classmethod
    def from_kwargs(cls, model: str, kwargs: dict) -> "Config":
        """Build a Config, refusing keyword arguments it does not know (never drop them silently)."""
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ParamError(unknown[0], f"unknown config key(s) {unknown}; allowed keys: {sorted(known - {'model'})}")
        return cls(model, **kwargs)

    def __post_init__(self) -> None:
        self._check_fields()
        self.hf_config = self._load_hf_config()
        positions = self.hf_config.max_position_embeddings
        if self.max_model_len > positions:  # said, not silent: a longer prompt is refused for it
            name = self.hf_config.attribute_map.get("max_position_embeddings", "max_position_embeddings")
            logger.info("max_model_len=%d capped to %d: the checkpoint's %s", self.max_model_len, positions, name)
            self.max_model_len = positions
        self.device = self._resolve_device()
        platform = device_platform(self.device)
        if self.kvcache_block_size is None:
            self.kvcache_block_size = platform.default_block_size
        if platform.uses_cpu_threads and self.cpu_threads is None:
            self.cpu_threads = self._default_cpu_threads()
        elif not platform.uses_cpu_threads and self.cpu_threads is not None:  # said, not silent
            logger.warning("cpu_threads=%d has no effect: it sets the CPU engine's threads, and this one runs on %s",
                           self.cpu_threads, self.device)
        self.dtype = self._resolve_dtype(platform)
        if self.compile_mode == "auto":
            self.compile_mode = "on" if platform.compiles_by_default else "off"
        self.fused_kernels = self._resolve_fused_kernels(platform)
        self._check_tensor_parallel(platform)
        if self.async_scheduling == "auto":
            single = self.tensor_parallel_size == 1 and self.speculative is None
            self.async_scheduling = "on" if platform.overlaps_host_by_default and single else "off"
        self.tokenizer = None if self.skip_tokenizer_init else load_tokenizer(self.model)
        self.eos = end_of_text_id(self.tokenizer, self.hf_config)
        if self.speculative is not None and self.speculative.method == DRAFT_MODEL:
            self.draft_config = self._make_draft_config()

    def for_workers(self) -> "Config":
        """This config as tensor-parallel workers get it: the same settings and facts without the
        tokenizer (a worker never sees text; a large vocabulary's tokenizer is megabytes to send)."""
        config = copy.copy(self)
        config.tokenizer = None
        return config

    def _check_fields(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            value = getattr(self, name)
            require(is_int(value) and value >= 1, name, value, "an integer >= 1")
        u = self.gpu_memory_utilization
        require(is_number(u) and 0 < u <= 1, "gpu_memory_utilization", u, "in (0, 1]")
        tp = self.tensor_parallel_size
        require(is_int(tp) and 1 <= tp <= MAX_TENSOR_PARALLEL_SIZE, "tensor_parallel_size", tp,
                f"an integer in 1..{MAX_TENSOR_PARALLEL_SIZE}")
        bs = self.kvcache_block_size
        require(bs is None or (is_int(bs) and bs >= MIN_BLOCK_SIZE and bs & (bs - 1) == 0), "kvcache_block_size",
                bs, f"None (the device's default) or a power of two >= {MIN_BLOCK_SIZE}")
        threads = self.cpu_threads
        require(threads is None or (is_int(threads) and threads >= 1), "cpu_threads", threads,
                "None (from NANOVLLM_CPU_THREADS, OMP_NUM_THREADS or the cores) or an integer >= 1")
        n = self.num_kvcache_blocks
        require(is_int(n) and (n == -1 or n >= 1), "num_kvcache_blocks", n, "-1 (size from memory) or >= 1")
        for name in ("enforce_eager", "enable_prefix_caching", "skip_tokenizer_init", "cpu_malloc_tuning"):
            require(isinstance(getattr(self, name), bool), name, getattr(self, name), "True or False")
        for name, allowed in VOCABULARIES.items():  # every field typed with a Literal, but dtype (below)
            require(getattr(self, name) in allowed, name, getattr(self, name), f"one of {allowed}")
        require(isinstance(self.dtype, (str, torch.dtype)) and  # (a list is unhashable: no `in DTYPES` for it)
                (self.dtype == "auto" or self.dtype in DTYPES or self.dtype in DTYPES.values()), "dtype",
                self.dtype, f"'auto', one of {list(DTYPES)} or the matching torch.dtype")
        g = self.cpu_kvcache_space_gib
        require(is_number(g) and g > 0, "cpu_kvcache_space_gib", g, "a number > 0")
        require(is_number(self.swap_space) and self.swap_space >= 0, "swap_space", self.swap_space,
                "a finite number of GiB >= 0")
        if self.speculative_config is not None:
            self.speculative = SpeculativeConfig.from_dict(self.speculative_config)
            require(self.tensor_parallel_size == 1, "tensor_parallel_size", self.tensor_parallel_size,
                    "1 with speculative_config (speculative decoding runs on one rank only)")
        if self.async_scheduling == "on":  # the workers and the proposer need every token on the host
            require(self.tensor_parallel_size == 1, "tensor_parallel_size", self.tensor_parallel_size,
                    "1 with async_scheduling='on' (the overlapped loop runs on one rank only)")
            require(self.speculative is None, "speculative_config", self.speculative_config,
                    "None with async_scheduling='on' (speculative steps run the plain loop)")
        t = self.tensor_parallel_heartbeat_timeout_s
        require(is_number(t) and t >= MIN_HEARTBEAT_TIMEOUT_S, "tensor_parallel_heartbeat_timeout_s", t,
                f"a finite number of seconds >= {MIN_HEARTBEAT_TIMEOUT_S}")

    def _make_draft_config(self) -> "Config":
        """The draft model's Config: this one's engine settings, its own checkpoint, no tokenizer
        (it shares the target's), its KV cache sized with the target's (runner/speculative.py)."""
        settings = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        settings.update(model=self.speculative.model, speculative_config=None, skip_tokenizer_init=True)
        try:
            draft = Config(**settings)
        except ValueError as error:
            raise ParamError("speculative_config['model']", f"speculative_config['model']={self.speculative.model!r} is not a usable draft "
                             f"model: {error}") from error
        target_vocab, draft_vocab = self.hf_config.vocab_size, draft.hf_config.vocab_size
        if draft_vocab != target_vocab:
            raise ParamError("speculative_config['model']", f"speculative_config['model']={self.speculative.model!r} has vocab_size={draft_vocab}; "
                             f"a draft model must share the target's vocabulary (vocab_size={target_vocab})")
        if draft.max_model_len < self.max_model_len:
            raise ParamError("speculative_config['model']", f"speculative_config['model']={self.speculative.model!r} holds {draft.max_model_len} "
                             f"positions, fewer than max_model_len={self.max_model_len}; lower max_model_len")
        return draft

    def _check_tensor_parallel(self, platform: DevicePlatform) -> None:
        """Each rank holds 1/tensor_parallel_size of these, so each must divide; checked here,
        before any worker process is spawned."""
        tp = self.tensor_parallel_size
        sizes = MODELS[self.architecture].tensor_parallel_sizes(self.hf_config)
        allowed = [n for n in range(1, MAX_TENSOR_PARALLEL_SIZE + 1) if all(v % n == 0 for v in sizes.values())]
        for name, value in sizes.items():
            if value % tp:
                raise ParamError("tensor_parallel_size", f"tensor_parallel_size={tp} is not allowed for this model: its {name}={value} "
                                 f"does not divide by {tp}; tensor_parallel_size must divide "
                                 f"{', '.join(f'{n}={v}' for n, v in sizes.items())} (allowed: {allowed})")
        refused = platform.refuses_tensor_parallel(tp)
        if refused is not None:
            raise ParamError("tensor_parallel_size", refused)

    def _load_hf_config(self) -> PretrainedConfig:
        if not isinstance(self.model, (str, os.PathLike)) or not os.path.isdir(self.model):
            raise ParamError("model", f"model={self.model!r} is not a directory; model must be a local checkpoint "
                             "directory holding config.json and *.safetensors (nothing is downloaded)")
        path = os.path.join(self.model, "config.json")
        if not os.path.isfile(path):
            raise ParamError("model", f"model={self.model!r} has no config.json")
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ParamError("model", f"{path} is not valid JSON ({error}); config.json must be the checkpoint's "
                             "transformers config, a JSON object") from None
        if not isinstance(raw, dict):
            raise ParamError("model", f"{path} holds a JSON {type(raw).__name__}, not an object; config.json must be "
                             "the checkpoint's transformers config, a JSON object")
        try:  # any family: a quantized checkpoint is refused by its method's name, before the model is built
            check_quantization_config(raw)
        except ValueError as error:
            raise ParamError("model", f"{path}: {error}") from None
        architecture = architecture_of(raw.get("architectures"), self.model)
        model_class = MODELS[architecture]
        try:  # sizes, epsilons and head counts as written, before transformers builds anything of them
            model_class.check_raw_config(raw)
        except ValueError as error:
            raise ParamError("model", f"{path}: {error}") from None
        # A local directory and no trust_remote_code: nothing from the checkpoint is executed.
        try:
            hf_config = AutoConfig.from_pretrained(self.model, trust_remote_code=False)
        except (ValueError, KeyError, TypeError, StrictDataclassError) as error:  # fields it cannot make a config of
            raise ParamError("model", f"{path} is not a config transformers can read: {error}") from error
        try:  # refuses what the model cannot run, before any work
            model_class.adapt_config(hf_config)
        except ValueError as error:
            raise ParamError("model", f"{path}: {error}") from None
        return hf_config

    def _resolve_device(self) -> str:
        refused = unavailable(self.device)
        if refused is not None:
            raise ParamError("device", refused)
        return auto_device(self.device)

    def _resolve_fused_kernels(self, platform: DevicePlatform) -> str:
        if self.fused_kernels == "auto":
            return platform.default_fused_kernels()
        refused = platform.refuses_fused_kernels(self.fused_kernels)
        if refused is not None:
            raise ParamError("fused_kernels", refused)
        return self.fused_kernels

    def _default_cpu_threads(self) -> int:
        """cpu_threads=None: $NANOVLLM_CPU_THREADS when set, else OMP_NUM_THREADS when set (which
        torch follows anyway), else one thread per available physical core, the cores shared among
        the ranks (no oversubscription: every rank computes at once)."""
        for name in (CPU_THREADS_ENV, "OMP_NUM_THREADS"):
            value = os.environ.get(name)
            if value is not None:
                require(value.strip().isdigit() and int(value) >= 1, name, value, "an integer >= 1 when set")
                return int(value)
        return max(1, available_cores() // self.tensor_parallel_size)

    def _resolve_dtype(self, platform: DevicePlatform) -> torch.dtype:
        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        if platform.default_dtype is not None:
            return platform.default_dtype
        checkpoint_dtype = getattr(self.hf_config, "dtype", None) or getattr(self.hf_config, "torch_dtype", None)
        if isinstance(checkpoint_dtype, str):
            checkpoint_dtype = DTYPES.get(checkpoint_dtype)
        return checkpoint_dtype if checkpoint_dtype in DTYPES.values() else torch.bfloat16

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        """The KV cache's element type: the model's dtype, or the fp8 type kv_cache_dtype names."""
        return FP8_DTYPES.get(self.kv_cache_dtype, self.dtype)

    @property
    def architecture(self) -> str:
        return architecture_of(self.hf_config.architectures, self.model)


# Field name -> the values its Literal type allows, for the checks in _check_fields (dtype, which
# also takes a torch.dtype, is checked apart). The CLI reads the same Literal types for its choices.
VOCABULARIES = {name: values for name, hint in get_type_hints(Config).items()
                if name != "dtype" and (values := literal_values(hint)) is not None}
