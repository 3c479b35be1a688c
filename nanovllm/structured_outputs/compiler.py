"""Compiles a request's StructuredOutputsParams into an xgrammar grammar for one tokenizer.

The tokenizer's vocabulary is read once (xgrammar.TokenizerInfo: byte-level BPE and
SentencePiece vocabularies, byte fallback included), at the first constrained request, so an
engine that never sees one pays nothing but the import. A WordPiece tokenizer (BERT's) is
refused: its decoder puts spaces between words that no token holds, so no grammar over the
tokens' text can say what the decoded output will be. Compiling is thread-safe and cached by xgrammar per constraint text
(the schema is kept as canonical JSON, so equal schemas hit the cache): the server compiles in
its prompt thread, and the engine's own call as it builds the request finds the result there.
A constraint xgrammar cannot compile is a ValueError naming the field and xgrammar's reason.
"""
import json
import re
import threading

import xgrammar
from transformers import PreTrainedTokenizerBase

from nanovllm.sampling_params import StructuredOutputsParams
from nanovllm.structured_outputs.state import GrammarState
from nanovllm.utils.validation import ParamError

# A compiled grammar per constraint: a few hundred KB each for a large vocabulary; this bounds
# the cache to what a server serving many distinct schemas can afford.
CACHE_LIMIT_BYTES = 512 * 1024 * 1024
# Whitespace characters allowed in a row between JSON tokens: pretty-printed JSON ten levels deep
# fits, but a model cannot loop on blanks forever (a small model's favourite failure under JSON).
MAX_JSON_WHITESPACE_RUN = 32
# xgrammar's errors open with "[hh:mm:ss] /path/file.cc:123: "; the client needs only the rest.
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class GrammarCompiler:

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's (the logits' width), which may exceed the tokenizer's
        self.eos = eos  # what ends a completed grammar: the engine's end-of-text token
        self._compiler = None
        self._lock = threading.Lock()

    def _unsupported_reason(self) -> str | None:
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None and type(backend.model).__name__ == "WordPiece":
            return ("structured_outputs is not supported for this model: its tokenizer is WordPiece, whose decoding "
                    "adds spaces between tokens that the tokens do not hold, so a grammar cannot constrain the text")
        return None

    def load(self) -> None:
        """Read the vocabulary now, if the tokenizer can be constrained at all: the server does this
        in the engine's thread, so no other thread reads the engine's tokenizer later."""
        if self.tokenizer is not None and self._unsupported_reason() is None:
            self._xgrammar_compiler()

    def _xgrammar_compiler(self) -> xgrammar.GrammarCompiler:
        with self._lock:  # the first two constrained requests may come from two threads
            if self._compiler is None:
                reason = self._unsupported_reason()
                if reason is not None:
                    raise ParamError("structured_outputs", reason)
                info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                               stop_token_ids=[self.eos])
                self._compiler = xgrammar.GrammarCompiler(info, cache_limit_bytes=CACHE_LIMIT_BYTES)
            return self._compiler

    def compile(self, params: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        """The compiled grammar; a ValueError naming the field if it does not compile."""
        compiler = self._xgrammar_compiler()
        kind = params.kind
        try:
            if kind in ("json", "json_object"):
                # json_object: any JSON object, as OpenAI's mode (not an array or a scalar)
                schema, strict = (params.json, True) if kind == "json" else ('{"type": "object"}', False)
                whitespace = not params.disable_any_whitespace
                return compiler.compile_json_schema(schema, strict_mode=strict, any_whitespace=whitespace,
                                                    max_whitespace_cnt=MAX_JSON_WHITESPACE_RUN if whitespace else None)
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(params.choice))
            return compiler.compile_grammar(params.grammar)
        except RuntimeError as exc:
            reason = _XGRAMMAR_PREFIX.sub("", str(exc).strip()).strip()
            raise ParamError("structured_outputs", f"structured_outputs.{kind} could not be compiled: {reason}") from None

    def new_state(self, compiled: xgrammar.CompiledGrammar) -> GrammarState:
        """A fresh matcher over a compiled grammar, for one sample."""
        return GrammarState(compiled)


def choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar whose only sentences are the given strings (JSON string literals are
    xgrammar's EBNF literals: quotes, backslashes and control characters escaped)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)
