"""Loads a checkpoint's tokenizer, refuses one that cannot be used, and picks the end-of-text id.

transformers builds *something* from a directory with no tokenizer files (an empty tokenizer of
the model type's class whose only token is a special one), so loading without an error proves
little: a usable tokenizer loads and has ordinary tokens, ones that are not special or added.
Without one the engine does not start, unless the user asked for token-id-only use
(`Config.skip_tokenizer_init`); then the end-of-text id comes from the checkpoint's config.
This module knows nothing of prompts or decoding; the engine and its Detokenizer use the result.
"""
import os

from transformers import AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

# transformers builds a tokenizer from tokenizer.json alone (the fast tokenizer's whole
# serialization), or from tokenizer_config.json and the vocabulary files of its class.
TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
# The vocabulary files of the usual kinds: byte-level BPE (Qwen, GPT-2), SentencePiece, WordPiece.
VOCABULARY_FILES = (("vocab.json", "merges.txt"), ("tokenizer.model",), ("vocab.txt",))
# What AutoTokenizer raises for missing, unreadable or inconsistent files (JSONDecodeError is a
# ValueError; ImportError when a slow tokenizer needs a package that is not installed).
LOAD_ERRORS = (ValueError, OSError, KeyError, TypeError, ImportError)
NO_EOS = -1  # the scheduler's "no end-of-text token": only max_tokens and stop rules end a sequence


def _files_report(path: str) -> str:
    """Which of the files transformers builds a tokenizer from this checkpoint has, and lacks."""
    present = set(os.listdir(path))
    known = [TOKENIZER_JSON, TOKENIZER_CONFIG, *(name for group in VOCABULARY_FILES for name in group)]
    found = [name for name in known if name in present] or "none"
    if TOKENIZER_JSON in present:  # enough on its own: what is wrong is inside the files
        return f"tokenizer files present: {found}"
    instead = [] if TOKENIZER_CONFIG in present else [TOKENIZER_CONFIG]
    if not any(all(name in present for name in group) for group in VOCABULARY_FILES):
        instead.append(f"vocabulary files ({' or '.join(' + '.join(group) for group in VOCABULARY_FILES)})")
    return (f"tokenizer files present: {found}; missing: {TOKENIZER_JSON}"
            + (f" (or else {' and '.join(instead)})" if instead else ""))


def _refuse(path: str, why: str) -> ValueError:
    return ValueError(
        f"model={path!r} has no usable tokenizer: {why}. transformers builds one from {TOKENIZER_JSON}, or from "
        f"{TOKENIZER_CONFIG} with its vocabulary files; {_files_report(path)}. Add or repair the checkpoint's "
        "tokenizer files, or pass skip_tokenizer_init=True to give prompts as token ids (outputs then have empty text)")


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer; a ValueError naming the missing files when it has no usable one."""
    try:
        # A local directory and no trust_remote_code: no code from the checkpoint runs.
        tokenizer = AutoTokenizer.from_pretrained(path, use_fast=True, trust_remote_code=False)
    except LOAD_ERRORS as error:
        raise _refuse(path, f"loading it failed with {type(error).__name__}: {' '.join(str(error).split())}") from error
    ordinary = set(tokenizer.get_vocab().values()) - set(tokenizer.added_tokens_decoder)
    if not ordinary:
        raise _refuse(path, f"transformers built a tokenizer with no ordinary tokens (only "
                            f"{sorted(tokenizer.get_vocab())[:5]})")
    return tokenizer


def end_of_text_id(tokenizer: PreTrainedTokenizerBase | None, hf_config: PretrainedConfig) -> int:
    """The tokenizer's eos token id, else the checkpoint config's eos_token_id (the first, when it
    lists several: the scheduler stops on one id), else NO_EOS."""
    eos = tokenizer.eos_token_id if tokenizer is not None else None
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return NO_EOS if eos is None else eos
