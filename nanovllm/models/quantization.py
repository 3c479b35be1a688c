"""Which quantized checkpoint formats the engine runs, as config.json's `quantization_config` names them.

A quantized checkpoint (compressed-tensors from llm-compressor, GPTQ, AWQ, FP8, bitsandbytes, ...)
says so in config.json: a `quantization_config` object whose `quant_method` names the method, and
for compressed-tensors a `format` ("pack-quantized", "int-quantized", "float-quantized", ...).
Owns the check of that object, run on the raw JSON before anything is built or read from the
checkpoint: a method the engine does not run is refused by name. Without it such a checkpoint
gets as far as building the model and then fails on a tensor it has no parameter for
(GPTQ's `qweight`, FP8's `weight_scale_inv`), which says nothing of the cause.

No method is run yet (SUPPORTED_QUANT_METHODS is empty): the way out is the model's unquantized
release. It knows nothing of how any format's weights are laid out or multiplied.
"""
from nanovllm.utils.validation import shown

# The quant_method values whose checkpoints load, each with the formats it takes (None: any).
# Empty until a format's linear method and loader entry exist (issue 55).
SUPPORTED_QUANT_METHODS: dict[str, tuple[str, ...] | None] = {}
# The float dtypes a checkpoint the engine runs holds its weights in, for the refusal's advice.
FLOAT_CHECKPOINT_DTYPES = "float32, float16 or bfloat16"


def _what_is_allowed() -> str:
    """The end of every refusal: what would load instead."""
    if not SUPPORTED_QUANT_METHODS:
        return (f"quantized checkpoints are not supported yet; load the model's unquantized checkpoint "
                f"({FLOAT_CHECKPOINT_DTYPES} weights, no quantization_config in config.json)")
    methods = ", ".join(method if formats is None else f"{method} (format {', '.join(formats)})"
                        for method, formats in SUPPORTED_QUANT_METHODS.items())
    return f"quantization_config.quant_method must be one of: {methods}; or load an unquantized checkpoint"


def check_quantization_config(raw: dict) -> None:
    """Refuse (ValueError naming quantization_config.quant_method, its value and its format) a
    config.json whose `quantization_config` is a method the engine does not run. An absent or
    null quantization_config is an unquantized checkpoint and passes."""
    quantization = raw.get("quantization_config")
    if quantization is None:
        return
    if not isinstance(quantization, dict):
        raise ValueError(f"quantization_config={shown(quantization)} is not allowed; quantization_config must be "
                         f"absent or a JSON object with a quant_method, and {_what_is_allowed()}")
    if "quant_method" not in quantization:
        raise ValueError(f"quantization_config has no quant_method (its keys: {sorted(quantization)}), so the "
                         f"checkpoint's quantization cannot be named; {_what_is_allowed()}")
    method, fmt = quantization["quant_method"], quantization.get("format")
    formats = SUPPORTED_QUANT_METHODS.get(method) if isinstance(method, str) else None
    if isinstance(method, str) and method in SUPPORTED_QUANT_METHODS and (formats is None or fmt in formats):
        return
    named = f"quantization_config.quant_method={shown(method)}"
    if fmt is not None:  # compressed-tensors says which of its layouts in "format"
        named += f" (quantization_config.format={shown(fmt)})"
    raise ValueError(f"{named} is not allowed: {_what_is_allowed()}")
