"""Test helpers shared by the test modules: HF transformers as the greedy reference, seeded
random prompts, stop strings that span a token boundary, and what each test needs to say which
device it is about. (A module of its own,
since conftest.py is not meant to be imported.)"""
import importlib.util
import os
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from nanovllm import SamplingParams
from nanovllm.kernels import cpu_build

HAS_CUDA = torch.cuda.is_available()
# What device="auto" must resolve to on the machine the tests run on.
AUTO_DEVICE = "cuda" if HAS_CUDA else "cpu"
# What attention_backend="auto" picks on CPU: the in-place paged kernel where a C++ compiler can build it.
AUTO_CPU_BACKEND = "cpu" if cpu_build.compiler() is not None else "torch"
# What attention_backend="auto" must pick here for KV blocks smaller than flash-attn's pages of
# 256 (the tests use 16 or 32): our Triton kernels on CUDA when triton is installed, else torch;
# on CPU, AUTO_CPU_BACKEND.
if HAS_CUDA:
    AUTO_BACKEND_SMALL_BLOCKS = "triton" if importlib.util.find_spec("triton") else "torch"
else:
    AUTO_BACKEND_SMALL_BLOCKS = AUTO_CPU_BACKEND
# A test about the CUDA path: marked `gpu`, and skipped where torch sees no GPU.
GPU_ONLY = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU; torch sees none here")]
# Parametrize a test with this to run it on CPU everywhere and on CUDA where there is a GPU.
EVERY_DEVICE = ["cpu", pytest.param("cuda", marks=GPU_ONLY)]

# A test of the Triton kernels on CPU tensors: they run there only under TRITON_INTERPRET=1, which
# conftest.py sets only where there is no GPU (then the kernels are compiled for the GPU instead).
TRITON_ON_CPU = [pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                    reason="Triton kernels run on CPU tensors only under TRITON_INTERPRET=1, which is "
                                           "not set where there is a GPU (the cuda variant runs them there)")]
# EVERY_DEVICE for a test of the Triton kernels: on CPU under the interpreter, on CUDA where there is a GPU.
TRITON_DEVICES = [pytest.param("cpu", marks=TRITON_ON_CPU), pytest.param("cuda", marks=GPU_ONLY)]

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


def spanning_stop_string(tokenizer, token_ids: list[int]) -> tuple[str, int]:
    """A 2-character stop string made of the last character of one token's text and the first
    of the next one's, so it spans a token boundary. Returns it and the index of that boundary
    (token_ids[boundary] is the token that completes it)."""
    for i in range(2, len(token_ids) - 1):
        left = tokenizer.decode(token_ids[:i])
        right = tokenizer.decode(token_ids[:i + 1])[len(left):]
        if left and right and "\ufffd" not in left + right and left == tokenizer.decode(token_ids[:i]):
            return left[-1] + right[0], i
    pytest.skip("no clean token boundary in this continuation")


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    """Greedy sampling of exactly `max_tokens` tokens (end of text ignored, as in the HF reference,
    unless ignore_eos=False is given), with any other SamplingParams field as given."""
    return SamplingParams(**{"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True, **kwargs})


def kernel_test_device(kernel) -> torch.device:
    """Where a Triton kernel test module runs, from one of its kernels: CPU tensors when the
    kernels run under TRITON_INTERPRET=1 (CI), else the GPU. Skips the module when the kernels
    were compiled for a GPU (triton imported before TRITON_INTERPRET=1 was set, or it is 0) and
    there is none."""
    from triton.runtime.interpreter import InterpretedFunction
    if isinstance(kernel, InterpretedFunction):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        pytest.skip("the kernels were compiled for a GPU (triton was imported before TRITON_INTERPRET=1 was set, "
                    "or it is set to 0) and there is no GPU", allow_module_level=True)
    return torch.device("cuda")


def integer_head(vocab: int, width: int, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 rows and a head of small integers: every float32 logit is exact (|sum| < 2^24), and
    their values, in the hundreds to thousands, round to bfloat16's 8 bits in ties."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randint(-8, 9, (vocab, width), generator=gen).float()
    x = torch.randint(-8, 9, (rows, width), generator=gen).float()
    return x.bfloat16(), w


def rounded_logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().T).bfloat16()  # exact, then rounded once
