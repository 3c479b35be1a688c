"""Test helpers shared by the test modules: HF transformers as the greedy reference, seeded
random prompts, and what each test needs to say which device it is about. (A module of its own,
since conftest.py is not meant to be imported.)"""
import importlib.util
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

HAS_CUDA = torch.cuda.is_available()
# What device="auto" must resolve to on the machine the tests run on.
AUTO_DEVICE = "cuda" if HAS_CUDA else "cpu"
# What attention_backend="auto" must pick here for KV blocks smaller than flash-attn's pages of
# 256 (the tests use 16 or 32): our Triton kernels on CUDA when triton is installed, else torch.
AUTO_BACKEND_SMALL_BLOCKS = "triton" if HAS_CUDA and importlib.util.find_spec("triton") else "torch"
# A test about the CUDA path: marked `gpu`, and skipped where torch sees no GPU.
GPU_ONLY = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU; torch sees none here")]
# Parametrize a test with this to run it on CPU everywhere and on CUDA where there is a GPU.
EVERY_DEVICE = ["cpu", pytest.param("cuda", marks=GPU_ONLY)]

_hf_models: dict[str, PreTrainedModel] = {}


def _hf_model(path: str) -> PreTrainedModel:
    if path not in _hf_models:
        _hf_models[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _hf_models[path]


@torch.inference_mode()
def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """HF transformers' greedy float32 continuation of each prompt: exactly max_new_tokens new ids.

    One prompt at a time (no padding), and eos_token_id=None so EOS does not stop it, as the
    engine's ignore_eos=True.
    """
    model = _hf_model(path)
    outputs = []
    for prompt in prompts:
        input_ids = torch.tensor([prompt])
        generated = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                   max_new_tokens=max_new_tokens, min_new_tokens=0, eos_token_id=None,
                                   pad_token_id=model.config.pad_token_id)
        new = generated[0, len(prompt):].tolist()
        assert len(new) == max_new_tokens, f"HF stopped after {len(new)} of {max_new_tokens} tokens"
        outputs.append(new)
    return outputs


def random_prompts(vocab_limit: int, lengths: list[int], seed: int) -> list[list[int]]:
    """One prompt per length, of token ids drawn uniformly from [0, vocab_limit), reproducibly."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_limit) for _ in range(length)] for length in lengths]
