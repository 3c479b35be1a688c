"""Random-weight checkpoints and a small tokenizer, built locally in seconds.

Tests, example.py and bench.py use these so that they run with no model download: a byte-level
BPE tokenizer trained in-process on a built-in English text, and Qwen3 / Qwen2 checkpoints
(config.json + model.safetensors) saved by HF transformers itself, so the tensor names and
config fields are exactly what a real checkpoint of that architecture has.
"""
import os

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import nn
from transformers import (PretrainedConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)

from nanovllm.utils.math_utils import round_up

EOS_TOKEN = "<|endoftext|>"  # Qwen's end of text; also its pad token
SPECIAL_TOKENS = [EOS_TOKEN, "<|im_start|>", "<|im_end|>"]
# The model's vocabulary is the tokenizer's rounded up to this, as real checkpoints pad it.
VOCAB_MULTIPLE = 64
# Tokens in all: one multiple of VOCAB_MULTIPLE, small enough for tiny models to run fast.
TOKENIZER_SIZE = 640
# Learned BPE tokens (the 256 byte tokens included); the special tokens come after them, at the
# end of the vocabulary as in Qwen, so small random token ids are ordinary text tokens.
BPE_VOCAB_SIZE = TOKENIZER_SIZE - len(SPECIAL_TOKENS)
ROPE_THETA = 1_000_000.0  # Qwen2.5 / Qwen3 value
INIT_STD = 0.02  # transformers' default initializer_range
# Random weights at INIT_STD give near-uniform logits, so greedy decoding falls into a loop of
# one or two tokens (tied embeddings worst). Drawing them with std INIT_STD * this lets attention
# and the MLP dominate: greedy output is diverse with clear top-1 margins (checked with HF generate).
WEIGHT_SCALE = 12.0
# Norm weights are all ones at init; jitter them so a swapped q_norm/k_norm load shows up.
NORM_JITTER = 0.1

# Qwen's ChatML: <|im_start|>role\ncontent<|im_end|>\n per message, then the assistant header.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A few paragraphs of plain English to learn merges from; any string still encodes, byte by byte.
CORPUS = """\
The quick brown fox jumps over the lazy dog. A large language model reads a prompt as a list
of tokens and writes one new token at a time. Each new token depends on every token before it,
so the model keeps the keys and values of past tokens in a cache instead of computing them again.

An inference engine serves many requests at once. It packs the prompts of new requests into one
batch for the prefill step, then runs decode steps in which every running request adds a single
token. When memory runs short, the scheduler pauses the newest request and gives its cache blocks
to the others; the paused request starts again later from its prompt and the tokens it has made.

The cache is split into fixed blocks of tokens. Two requests that begin with the same text can
share the blocks of that prefix, so a long system prompt is computed only once. A hash of the
tokens in each full block, chained with the hash of the block before it, finds such a match.

Hello world! How are you today? I am fine, thank you. What is the capital of France? The capital
of France is Paris. Write a short poem about the sea, the wind and the stars at night. Count from
one to ten: one, two, three, four, five, six, seven, eight, nine, ten. Numbers like 0 1 2 3 4 5 6
7 8 9 10 100 1000 and symbols like ( ) [ ] { } < > = + - * / % # @ & are text too.

Greedy decoding always picks the most likely next token; sampling draws it at random from the
distribution, sharpened or flattened by the temperature. Generation stops at the end of text
token, or when the request has made as many tokens as it asked for.
"""

ARCHITECTURES = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}

# Qwen3-0.6B's config.json values (HF hub Qwen/Qwen3-0.6B), for throughput runs.
QWEN3_0_6B_CONFIG: dict = {
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": ROPE_THETA,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "hidden_act": "silu",
    "attention_bias": False,
}


def _train_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB_SIZE, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS.split("\n\n"), trainer)
    tokenizer.add_special_tokens(SPECIAL_TOKENS)  # appended after the learned tokens
    return tokenizer


def build_tokenizer(path: str) -> None:
    """Save a small byte-level BPE tokenizer with Qwen's special tokens and chat template to `path`."""
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=_train_tokenizer(), eos_token=EOS_TOKEN,
                                        pad_token=EOS_TOKEN, chat_template=CHAT_TEMPLATE)
    tokenizer.save_pretrained(path)


def _token_ids(path: str) -> tuple[int, int]:
    """(number of tokens, eos id) of the tokenizer saved at `path`."""
    tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    return tokenizer.get_vocab_size(with_added_tokens=True), tokenizer.token_to_id(EOS_TOKEN)


@torch.no_grad()
def _randomize(model: nn.Module, std: float, seed: int) -> None:
    """Draw every parameter from a generator seeded with `seed` (torch's global RNG is left alone):
    weights and biases ~ N(0, std^2), norm gains ~ 1 + N(0, NORM_JITTER^2) (all ones would hide a
    swapped q_norm/k_norm load)."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():  # a tied lm_head is the embedding: drawn once
        if name.endswith("norm.weight"):
            param.normal_(1.0, NORM_JITTER, generator=generator)
        else:  # [out, in] linear weights, [vocab, hidden] embedding, Qwen2's q/k/v biases
            param.normal_(0.0, std, generator=generator)


def _save_random_model(path: str, model_class: type, config: PretrainedConfig, std: float, seed: int,
                       dtype: torch.dtype) -> None:
    """Save a `model_class` checkpoint of random weights, drawn directly in `dtype`.

    The model is built on the meta device (shapes only), so no default init runs and no float32
    copy is made: building Qwen3-0.6B stays fast and its memory is one bfloat16 copy.
    """
    with torch.device("meta"):
        model = model_class(config)
    model.to(dtype).to_empty(device="cpu")  # uninitialised storage; every parameter is drawn below
    model.tie_weights()  # to_empty gave a tied lm_head storage of its own: share the embedding again
    _randomize(model, std, seed)
    # Only the parameters are drawn (non-persistent buffers such as rotary inv_freq are garbage),
    # so the model is saved and dropped, never run; loading the checkpoint rebuilds the buffers.
    model.save_pretrained(path, safe_serialization=True)


def build_checkpoint(path: str, arch: str = "qwen3", *, hidden_size: int = 64, intermediate_size: int = 128,
                     num_hidden_layers: int = 2, num_attention_heads: int = 6, num_key_value_heads: int = 2,
                     head_dim: int = 16, vocab_size: int | None = None, tie_word_embeddings: bool = False,
                     max_position_embeddings: int = 1024, weight_scale: float = WEIGHT_SCALE, seed: int = 0,
                     dtype: torch.dtype = torch.float32) -> str:
    """Write a random-weight `arch` ("qwen3" or "qwen2") checkpoint plus the small tokenizer to `path`.

    The same arguments give the same weights. head_dim is written to config.json for both
    architectures (HF's Qwen2 and the engine read it when present).
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch={arch!r} is not one of {list(ARCHITECTURES)}")
    config_class, model_class = ARCHITECTURES[arch]
    build_tokenizer(path)
    num_tokens, eos_id = _token_ids(path)
    if vocab_size is None:
        vocab_size = round_up(num_tokens, VOCAB_MULTIPLE)
    if vocab_size < num_tokens:
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's {num_tokens} tokens")
    config = config_class(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads, head_dim=head_dim,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA}, initializer_range=INIT_STD,
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id,
    )
    _save_random_model(path, model_class, config, INIT_STD * weight_scale, seed, dtype)
    return path


def build_qwen3_0_6b(path: str, dtype: torch.dtype = torch.bfloat16) -> str:
    """Write a random-weight checkpoint with Qwen3-0.6B's shapes (for throughput, not output quality)."""
    build_tokenizer(path)
    _, eos_id = _token_ids(path)
    fields = dict(QWEN3_0_6B_CONFIG)
    rope_theta = fields.pop("rope_theta")  # transformers 5 takes it inside rope_parameters
    del fields["torch_dtype"]  # the checkpoint's dtype is the `dtype` argument
    config = Qwen3Config(**fields, rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
                         initializer_range=INIT_STD, bos_token_id=eos_id, eos_token_id=eos_id,
                         pad_token_id=eos_id)
    _save_random_model(path, Qwen3ForCausalLM, config, INIT_STD, seed=0, dtype=dtype)
    return path
