"""Session-wide random-weight checkpoints (built in well under a second each, never downloaded).

Each fixture returns the checkpoint directory as a str. All use GQA with 3 query heads per KV head.
The greedy reference and prompt helpers live in tests/helpers.py.
"""
import os

import torch

if not torch.cuda.is_available():
    # Before anything imports triton (transformers does): without a GPU, Triton kernels run on
    # CPU tensors in the interpreter, which is how CI tests them.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from nanovllm.testing.synthetic import build_checkpoint  # noqa: E402


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
