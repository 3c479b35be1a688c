"""Test helpers shared by the test modules: HF transformers as the greedy reference, and
seeded random prompts. (A module of its own, since conftest.py is not meant to be imported.)"""
import random

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

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
