"""Session-wide random-weight checkpoints (built in well under a second each, never downloaded).

Each fixture returns the checkpoint directory as a str. All use GQA with 3 query heads per KV head.
The greedy reference and prompt helpers live in tests/helpers.py.
"""
import ctypes
import os

import pytest
from hypothesis import settings

# The property tests (hypothesis) draw the same examples on every run and keep no example database,
# so a run's verdict depends on the code alone, not on luck or on what an earlier run left behind.
# To explore fresh examples: pytest --hypothesis-profile=explore tests/test_fuzz_sampling.py
settings.register_profile("deterministic", derandomize=True, database=None)
settings.register_profile("explore", database=None)
settings.load_profile("deterministic")


def _cuda_device_count() -> int:
    """CUDA devices as the driver counts them, asked without importing torch (which a test of
    plain-Python engine logic never needs): 0 when there is no driver or no device."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1") or _cuda_device_count() == 0:
    # Before anything imports triton (transformers does): without a GPU, Triton kernels run on
    # CPU tensors in the interpreter, which is how CI tests them.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def build_checkpoint(path: str, arch: str = "qwen3", **overrides) -> str:
    """nanovllm.testing.synthetic's builder, imported when a test first asks for a checkpoint, so
    collecting or running torch-free tests loads no torch."""
    from nanovllm.testing.synthetic import build_checkpoint as build
    return build(path, arch, **overrides)


@pytest.fixture(scope="session")
def qwen3_tiny(tmp_path_factory) -> str:
    """Qwen3, untied lm_head, 6 heads / 2 KV heads of head_dim 16 (q/k/v wider than hidden 64)."""
    return build_checkpoint(str(tmp_path_factory.mktemp("qwen3_tiny")), "qwen3")


@pytest.fixture(scope="session")
def qwen3_tiny_tied(tmp_path_factory) -> str:
    """Qwen3, lm_head tied to the embedding (no lm_head.weight in the file), 9 heads / 3 KV heads."""
    return build_checkpoint(str(tmp_path_factory.mktemp("qwen3_tiny_tied")), "qwen3", tie_word_embeddings=True,
                            num_attention_heads=9, num_key_value_heads=3)


@pytest.fixture(scope="session")
def qwen2_tiny(tmp_path_factory) -> str:
    """Qwen2 (q/k/v bias, no q/k norm), untied, 6 heads / 2 KV heads, hidden 96 = 6 heads x head_dim 16."""
    return build_checkpoint(str(tmp_path_factory.mktemp("qwen2_tiny")), "qwen2", hidden_size=96)


# Llama 3.1's rope scaling, with original_max_position_embeddings shrunk so that head_dim 16's
# eight frequencies fall in all three bands (kept, interpolated, divided by factor).
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256}


@pytest.fixture(scope="session")
def llama_tiny(tmp_path_factory) -> str:
    """Llama with llama3 rope scaling, untied lm_head, 6 heads / 2 KV heads of head_dim 16."""
    return build_checkpoint(str(tmp_path_factory.mktemp("llama_tiny")), "llama", rope_parameters=LLAMA3_ROPE)


@pytest.fixture(scope="session")
def llama_tiny_tied(tmp_path_factory) -> str:
    """Llama with a tied lm_head, biases on attention and MLP, linear rope scaling, 9 heads / 3 KV heads."""
    return build_checkpoint(str(tmp_path_factory.mktemp("llama_tiny_tied")), "llama", hidden_size=144,
                            num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
                            attention_bias=True, mlp_bias=True,
                            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})


@pytest.fixture(scope="session")
def gpt2_tiny(tmp_path_factory) -> str:
    """GPT-2: 5 heads of 16 (odd), tied LM head, 128 positions (so n_positions caps max_model_len)."""
    return build_checkpoint(str(tmp_path_factory.mktemp("gpt2_tiny")), "gpt2", n_embd=80, n_head=5,
                            n_positions=128)


@pytest.fixture(scope="session")
def qwen3_moe_tiny(tmp_path_factory) -> str:
    """Qwen3-MoE: 8 experts, top-2 renormalised (norm_topk_prob), every layer sparse; untied."""
    return build_checkpoint(str(tmp_path_factory.mktemp("qwen3_moe_tiny")), "qwen3_moe")


@pytest.fixture(scope="session")
def qwen3_moe_mixed(tmp_path_factory) -> str:
    """Qwen3-MoE: 10 experts, top-2 not renormalised, layer 0 dense (mlp_only_layers), tied."""
    return build_checkpoint(str(tmp_path_factory.mktemp("qwen3_moe_mixed")), "qwen3_moe", num_experts=10,
                            norm_topk_prob=False, mlp_only_layers=[0], tie_word_embeddings=True)


# The demo model's recipe cut down to seconds: a tenth of its text, a smaller tokenizer and model,
# a few steps. It still trains (the loss falls), saves and reloads as the full recipe does.
DEMO_TEST_RECIPE = dict(steps=12, corpus_bytes=300_000, tokenizer_bytes=150_000, vocab_size=512, hidden_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        intermediate_size=128, seq_len=64, batch_size=8, warmup_steps=3)


@pytest.fixture(scope="session")
def demo_cache(tmp_path_factory) -> str:
    """A cache dir (for XDG_CACHE_HOME) holding the demo model built with DEMO_TEST_RECIPE, where
    nanovllm.demo_model.default_model() finds it: README's snippets and the CLI's default use it."""
    from nanovllm.demo_model import DEMO_DIR_NAME, DemoRecipe, build_demo_model

    cache = tmp_path_factory.mktemp("xdg_cache")
    build_demo_model(cache / "nanovllm" / DEMO_DIR_NAME, DemoRecipe(**DEMO_TEST_RECIPE), log=lambda message: None)
    return str(cache)


@pytest.fixture(scope="session")
def cpu_kernels():
    """The CPU kernels' library (nanovllm/kernels/cpu_build.py), or a skip saying why it cannot be had here."""
    from nanovllm.kernels import cpu_build
    loaded = cpu_build.load_fused()
    if isinstance(loaded, str):
        pytest.skip(loaded)
    return loaded
