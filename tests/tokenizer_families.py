"""Small tokenizers of the three families detokenization must handle, trained in-process on
the synthetic corpus (plus a few non-ASCII words) in well under a second, never downloaded:

- byte-level BPE (GPT-2, Qwen, Llama 3): nanovllm.testing.synthetic's tokenizer;
- SentencePiece BPE with byte fallback (Llama 2, Mistral): "▁" marks a word's leading space, the
  decoder strips the text's first space, and a character outside the vocabulary is spelled as
  <0xNN> byte tokens, so a multi-byte character is split across tokens;
- WordPiece (BERT): words joined by spaces, "##" continues a word.

Each is saved with save_pretrained, so AutoTokenizer (and so the engine) loads it as any
checkpoint's tokenizer. The SentencePiece one fits the synthetic checkpoints' vocabulary, so a
checkpoint can be given it in place of its own (`with_tokenizer`).
"""
import json
import os
import shutil

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from nanovllm.testing.synthetic import CORPUS, build_tokenizer

# Words with 2-, 3- and 4-byte UTF-8 characters: some become tokens of their own, the rest are
# spelled in bytes (SentencePiece's byte fallback, byte-level BPE's bytes).
NON_ASCII = "café naïve déjà vu — 東京 ½ € 😀 Ünïcödé straße"
SP_MARKER = "\u2581"  # SentencePiece's "▁": a space, as part of the token that follows it
SP_LEARNED_TOKENS = 300  # learned tokens before the 256 byte tokens: the whole fits 640 ids
WORDPIECE_TOKENS = 400
FAMILIES = ("byte_level_bpe", "sentencepiece", "wordpiece")


def _texts() -> list[str]:
    return CORPUS.split("\n\n") + [NON_ASCII]


def _sentencepiece() -> PreTrainedTokenizerFast:
    """Llama 2's layout: normalizer Prepend("▁") + Replace(" ", "▁"), no pre-tokenizer, BPE with
    byte fallback; decoder Replace("▁", " "), ByteFallback, Fuse, Strip one leading space."""
    trainer = trainers.BpeTrainer(vocab_size=SP_LEARNED_TOKENS, special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False)
    learner = Tokenizer(models.BPE(unk_token="<unk>"))
    learner.normalizer = normalizers.Sequence([normalizers.Prepend(SP_MARKER), normalizers.Replace(" ", SP_MARKER)])
    learner.train_from_iterator([t.replace("\n", " ") for t in _texts()], trainer)
    vocab = learner.get_vocab()
    for byte in range(256):  # <0xNN> for every byte not already learned, after the learned tokens
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(m) for m in _merges(learner)]
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tokenizer.normalizer = learner.normalizer
    tokenizer.decoder = decoders.Sequence([decoders.Replace(SP_MARKER, " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def _merges(tokenizer: Tokenizer) -> list[list[str]]:
    """A trained BPE's merges, as pairs (tokenizers saves them as pairs or "a b" strings)."""
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    return [m.split(" ") if isinstance(m, str) else m for m in merges]


def _wordpiece() -> PreTrainedTokenizerFast:
    """BERT's layout (lower-cased, split on spaces and punctuation, "##" continuations), with the
    decoder's cleanup off: it rewrites text already decoded (" do not" -> " don't"), which no
    stream can follow (engine/detokenizer.py)."""
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    trainer = trainers.WordPieceTrainer(vocab_size=WORDPIECE_TOKENS, special_tokens=["[UNK]", "[SEP]"],
                                        show_progress=False)
    tokenizer.train_from_iterator(_texts(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", sep_token="[SEP]",
                                   eos_token="[SEP]")


def build_family_tokenizer(family: str, path: str) -> str:
    """Save the `family` tokenizer (one of FAMILIES) to `path`; returns `path`."""
    if family == "byte_level_bpe":
        build_tokenizer(path)
    elif family == "sentencepiece":
        _sentencepiece().save_pretrained(path)
    elif family == "wordpiece":
        _wordpiece().save_pretrained(path)
    else:
        raise ValueError(f"family={family!r} is not one of {FAMILIES}")
    return path


def with_tokenizer(checkpoint: str, family: str, path: str) -> str:
    """A copy of `checkpoint` (its config and weights) at `path` with the `family` tokenizer."""
    os.makedirs(path, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(checkpoint, name), path)
    return build_family_tokenizer(family, path)
