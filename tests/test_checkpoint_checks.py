"""A checkpoint's config.json is checked before anything is built from it, for every model family
(Qwen3, Qwen2, Llama, Mistral, GPT-2's field names, Qwen3-MoE's expert fields): each bad size,
epsilon or head count is a ValueError naming the field and config.json, raised before the model
runner starts (it is patched to fail the test if reached). The up-front memory estimate equals
what a real tiny model holds, and a model whose weights and smallest KV cache cannot fit is
refused, needed against available, before any weight is loaded. A quantized checkpoint (config.json's
quantization_config: GPTQ, AWQ, compressed-tensors, FP8, any other) is refused by its
quant_method's name, through LLM and the command line alike."""
import json
import shutil

import pytest
import torch

import nanovllm.runner.model_runner as model_runner
from nanovllm import LLM
from nanovllm.config import Config
from nanovllm.entrypoints.cli.main import main as cli_main
from nanovllm.platform.device import GIB, Available, CpuDevice, device_platform
from nanovllm.runner.memory_check import estimate, model_bytes
from nanovllm.runner.model_runner import ModelRunner
from nanovllm.utils.validation import ParamError
from nanovllm.testing.synthetic import build_checkpoint
from serving import ENGINE_FLAGS, ENGINE_KWARGS

DELETE = object()  # with_config: remove the field


@pytest.fixture(scope="module")
def mistral_tiny(tmp_path_factory) -> str:
    return build_checkpoint(str(tmp_path_factory.mktemp("mistral_tiny")), "mistral")


def with_config(src: str, dst, **changes) -> str:
    """A copy of checkpoint `src` whose config.json has `changes` applied (DELETE removes a field)."""
    path = shutil.copytree(src, dst)
    with open(path / "config.json") as f:
        config = json.load(f)
    for name, value in changes.items():
        if value is DELETE:
            config.pop(name, None)
        else:
            config[name] = value
    with open(path / "config.json", "w") as f:
        json.dump(config, f)  # NaN and Infinity are written as JSON's extensions, which json.load reads
    return str(path)


@pytest.fixture
def no_model_runner(monkeypatch):
    """Fail the test if the engine gets as far as building a model runner."""
    def reached(*args, **kwargs):
        raise AssertionError("the model runner was built: the config should have been refused before")
    monkeypatch.setattr(ModelRunner, "__init__", reached)


BAD_FIELDS = [
    # (checkpoint fixture, field changes, the field the error names)
    ("qwen3_tiny", {"rms_norm_eps": -1e-6}, "rms_norm_eps"),
    ("qwen3_tiny", {"rms_norm_eps": 0.0}, "rms_norm_eps"),
    ("qwen3_tiny", {"rms_norm_eps": float("nan")}, "rms_norm_eps"),
    ("qwen3_tiny", {"rms_norm_eps": float("inf")}, "rms_norm_eps"),
    ("qwen3_tiny", {"max_position_embeddings": 0}, "max_position_embeddings"),
    ("qwen3_tiny", {"max_position_embeddings": -4096}, "max_position_embeddings"),
    ("qwen3_tiny", {"intermediate_size": 2e8}, "intermediate_size"),  # a float
    ("qwen3_tiny", {"intermediate_size": 200_000_000}, "intermediate_size"),  # an integer, absurd
    ("qwen3_tiny", {"hidden_size": 1 << 20}, "hidden_size"),
    ("qwen3_tiny", {"num_hidden_layers": 10 ** 8}, "num_hidden_layers"),  # transformers would build 1e8 entries
    ("qwen3_tiny", {"vocab_size": 1 << 30}, "vocab_size"),
    ("qwen3_tiny", {"hidden_size": 64.5}, "hidden_size"),
    ("qwen3_tiny", {"num_attention_heads": "6"}, "num_attention_heads"),
    ("qwen3_tiny", {"num_attention_heads": True}, "num_attention_heads"),
    ("qwen3_tiny", {"num_attention_heads": 0}, "num_attention_heads"),
    ("qwen3_tiny", {"num_key_value_heads": 4}, "num_key_value_heads"),  # 6 heads in groups of 4
    ("qwen3_tiny", {"head_dim": 0}, "head_dim"),
    ("qwen3_tiny", {"head_dim": 15}, "head_dim"),  # rotary needs pairs
    ("qwen3_tiny", {"head_dim": DELETE, "hidden_size": 68}, "hidden_size"),  # 6 heads do not split 68
    ("qwen2_tiny", {"rms_norm_eps": 0}, "rms_norm_eps"),
    ("qwen2_tiny", {"num_key_value_heads": 5}, "num_key_value_heads"),
    ("qwen2_tiny", {"intermediate_size": -128}, "intermediate_size"),
    ("llama_tiny", {"max_position_embeddings": 0}, "max_position_embeddings"),
    ("llama_tiny", {"intermediate_size": 2e8}, "intermediate_size"),
    ("llama_tiny", {"head_dim": None, "hidden_size": 100}, "hidden_size"),
    ("mistral_tiny", {"rms_norm_eps": -1.0}, "rms_norm_eps"),
    ("mistral_tiny", {"num_hidden_layers": 0}, "num_hidden_layers"),
    ("gpt2_tiny", {"layer_norm_epsilon": 0.0}, "layer_norm_epsilon"),
    ("gpt2_tiny", {"n_positions": 0}, "n_positions"),
    ("gpt2_tiny", {"n_head": 3}, "n_head"),  # 80 wide
    ("gpt2_tiny", {"n_embd": 10 ** 9}, "n_embd"),
    ("gpt2_tiny", {"n_inner": 2.5}, "n_inner"),
    ("gpt2_tiny", {"n_layer": 1e3}, "n_layer"),
    ("qwen3_moe_tiny", {"num_experts": -1}, "num_experts"),
    ("qwen3_moe_tiny", {"num_experts_per_tok": 0}, "num_experts_per_tok"),
    ("qwen3_moe_tiny", {"num_experts_per_tok": 9}, "num_experts_per_tok"),  # of 8 experts
    ("qwen3_moe_tiny", {"moe_intermediate_size": 2e8}, "moe_intermediate_size"),
    ("qwen3_moe_tiny", {"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ("qwen3_moe_tiny", {"num_experts": 1 << 20}, "num_experts"),
]


@pytest.mark.parametrize("ckpt, changes, field", BAD_FIELDS,
                         ids=[f"{c}-{'-'.join(map(str, ch))}-{i}" for i, (c, ch, _) in enumerate(BAD_FIELDS)])
def test_bad_config_field_refused_before_the_model_is_built(ckpt, changes, field, request, tmp_path,
                                                            no_model_runner):
    path = with_config(request.getfixturevalue(ckpt), tmp_path / "bad", **changes)
    with pytest.raises(ValueError, match=rf"config\.json.*\b{field}\b") as error:
        LLM(path, **ENGINE_KWARGS)
    assert "Traceback" not in str(error.value)


def test_good_configs_of_every_family_still_load(qwen3_tiny, qwen2_tiny, llama_tiny, gpt2_tiny, qwen3_moe_tiny,
                                                 mistral_tiny):
    """The checks pass what the tiny checkpoints hold (so each refusal above is the bad field's)."""
    for path in (qwen3_tiny, qwen2_tiny, llama_tiny, gpt2_tiny, qwen3_moe_tiny, mistral_tiny):
        assert Config(path).hf_config.head_dim > 0


@pytest.mark.parametrize("ckpt", ["qwen3_tiny", "qwen3_tiny_tied", "llama_tiny", "gpt2_tiny", "qwen3_moe_mixed"])
def test_estimate_equals_the_real_models_bytes(ckpt, request):
    """The weights estimate (a build on the meta device) is what the built model holds, byte for
    byte; and the checkpoint's own tensors are within 15% of it (the rest is the rotary tables)."""
    path = request.getfixturevalue(ckpt)
    llm = LLM(path, **ENGINE_KWARGS)
    try:
        need = estimate(llm.config)
        model = llm.model_runner.model
        assert need.weight_bytes == model_bytes(model)
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        assert params <= need.weight_bytes <= 1.15 * params
        assert need.kv_blocks == ENGINE_KWARGS["num_kvcache_blocks"]
        assert need.kv_bytes == need.kv_blocks * llm.model_runner._kv_block_bytes()
    finally:
        llm.exit()


def test_smallest_kv_cache_is_one_sequence_of_max_model_len(qwen3_tiny):
    config = Config(qwen3_tiny, max_model_len=1000, kvcache_block_size=16)
    need = estimate(config)
    assert need.kv_blocks == 63  # ceil(1000 / 16): what the runner refuses to run below


def test_model_that_cannot_fit_is_refused_before_loading(qwen3_tiny, monkeypatch):
    monkeypatch.setattr(CpuDevice, "available_memory", lambda self, utilization: Available(100_000, "a test"))

    def load_model(*args):
        raise AssertionError("weights loaded: the memory check should have refused first")
    monkeypatch.setattr(model_runner, "load_model", load_model)
    with pytest.raises(ValueError, match=r"cannot fit: it needs at least .* GiB .* but 0\.00 GiB is available "
                                         r"\(a test\)"):
        LLM(qwen3_tiny, **ENGINE_KWARGS)


def test_huge_config_refused_on_this_machine(qwen3_tiny, tmp_path, monkeypatch):
    """Sizes within the per-field caps but ~800 TB of float32 weights: refused by the real
    available memory, at start-up, naming both numbers."""
    path = with_config(qwen3_tiny, tmp_path / "huge", hidden_size=1 << 16, intermediate_size=1 << 20,
                       num_hidden_layers=1 << 10, num_attention_heads=512, num_key_value_heads=8, head_dim=128,
                       layer_types=DELETE)  # transformers derives one per layer
    monkeypatch.setattr(model_runner, "load_model", lambda *args: pytest.fail("weights loaded"))
    with pytest.raises(ValueError, match=r"needs at least \d+\.\d\d GiB \(weights in float32 .* GiB is available"):
        LLM(path, **ENGINE_KWARGS)


def test_cuda_available_memory_is_the_kv_cache_budget(monkeypatch):
    """On CUDA: gpu_memory_utilization of the device, less what is in use (as the KV cache is sized)."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (30 * GIB, 80 * GIB))
    have = device_platform("cuda").available_memory(0.9)
    assert have.bytes == int(72 * GIB) - 50 * GIB
    assert "gpu_memory_utilization=0.9" in have.where


def test_cpu_available_memory_is_measured():
    have = device_platform("cpu").available_memory(0.9)
    assert have is not None and have.bytes > 0


# quantization_config objects as each tool writes them into config.json (trimmed to the fields
# that say what they are), and what the refusal must quote of each.
QUANTIZATION_CONFIGS = {
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
             ["quantization_config.quant_method='gptq'"]),
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True},
            ["quantization_config.quant_method='awq'"]),
    # llm-compressor's W4A16: group-quantized int4 weights packed into int32
    "compressed-tensors": ({"quant_method": "compressed-tensors", "format": "pack-quantized",
                            "quantization_status": "compressed",
                            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
                                "symmetric": True}}}},
                           ["quantization_config.quant_method='compressed-tensors'",
                            "quantization_config.format='pack-quantized'"]),
    # Qwen3-*-FP8's: e4m3 weights in 128x128 blocks, each with a scale
    "fp8": ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
            ["quantization_config.quant_method='fp8'"]),
    "unknown": ({"quant_method": "no-such-method", "bits": 3}, ["quantization_config.quant_method='no-such-method'"]),
    "no-quant-method": ({"bits": 4, "group_size": 128}, ["quantization_config has no quant_method",
                                                         "['bits', 'group_size']"]),
    "not-an-object": ("gptq", ["quantization_config='gptq'"]),
}


@pytest.mark.parametrize("case", QUANTIZATION_CONFIGS)
def test_quantized_checkpoint_refused_by_name(case, qwen3_tiny, tmp_path, no_model_runner):
    quantization, named = QUANTIZATION_CONFIGS[case]
    path = with_config(qwen3_tiny, tmp_path / case, quantization_config=quantization)
    with pytest.raises(ParamError) as error:
        LLM(path, **ENGINE_KWARGS)
    message = str(error.value)
    assert error.value.param == "model" and "config.json" in message
    for text in named:
        assert text in message, message
    assert "quantized checkpoints are not supported yet" in message and "unquantized checkpoint" in message
    assert "Traceback" not in message and "\n" not in message


def test_null_quantization_config_is_an_unquantized_checkpoint(qwen3_tiny, tmp_path):
    """The refusals above are quantization_config's: null, as some tools write it, loads."""
    path = with_config(qwen3_tiny, tmp_path / "null", quantization_config=None)
    assert Config(path).hf_config.num_hidden_layers == 2


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_cli_says_the_quantization_refusal_in_one_line(command, qwen3_tiny, tmp_path, capsys, no_model_runner):
    quantization, named = QUANTIZATION_CONFIGS["compressed-tensors"]
    path = with_config(qwen3_tiny, tmp_path / "ct", quantization_config=quantization)
    args = [command, path, "hello"] if command == "generate" else [command, path, "--port", "0"]
    assert cli_main([*args, *ENGINE_FLAGS]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert all(text in err for text in named) and "not supported yet" in err, err
