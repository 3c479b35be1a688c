"""Compiles a request's StructuredOutputsParams into an xgrammar grammar for one tokenizer.

The tokenizer's vocabulary is read once (xgrammar.TokenizerInfo: byte-level BPE and
SentencePiece vocabularies, byte fallback included), at the first constrained request, so an
engine that never sees one pays nothing but the import. A WordPiece vocabulary (BERT's) is
given to xgrammar as the text each token adds after others (structured_outputs/wordpiece.py):
its decoder puts a space before every word token and glues "##" pieces on, so the grammar
constrains the text the caller gets. Compiling is thread-safe and cached by xgrammar per constraint text
(the schema is kept as canonical JSON, so equal schemas hit the cache): the server compiles in
its prompt thread as it admits a request, and the engine builds the request with that grammar
(an engine in a process of its own compiles it again: a compiled grammar does not pickle).
A constraint xgrammar cannot compile is a ValueError naming the field and xgrammar's reason, as
is (`check_satisfiable`, asked by the server) one no output can begin to follow.
"""
import json
import re
import threading

import xgrammar
from transformers import PreTrainedTokenizerBase

from nanovllm.sampling_params import StructuredOutputsParams
from nanovllm.structured_outputs.state import GrammarState
from nanovllm.structured_outputs.wordpiece import WordPieceText
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
        self._wordpiece: WordPieceText | None = None  # read with the vocabulary, for a WordPiece one

    def load(self) -> None:
        """Read the vocabulary now: the server does this in the engine's thread, so no other
        thread reads the engine's tokenizer later."""
        if self.tokenizer is not None:
            self._xgrammar_compiler()

    def _xgrammar_compiler(self) -> xgrammar.GrammarCompiler:
        with self._lock:  # the first two constrained requests may come from two threads
            if self._compiler is None:
                self._wordpiece = WordPieceText.of(self.tokenizer)
                if self._wordpiece is not None:
                    info = xgrammar.TokenizerInfo(self._wordpiece.vocabulary(self.vocab_size), xgrammar.VocabType.RAW,
                                                  vocab_size=self.vocab_size, stop_token_ids=[self.eos])
                else:
                    info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                                   stop_token_ids=[self.eos])
                self._compiler = xgrammar.GrammarCompiler(info, cache_limit_bytes=CACHE_LIMIT_BYTES)
            return self._compiler

    def text_tokenizer(self) -> WordPieceText | None:
        """What decodes a constrained request's text when the engine's tokenizer may not give the
        grammar's text (a WordPiece vocabulary: see wordpiece.py); None: the engine's own. Known
        once the vocabulary is read (the first compile)."""
        return self._wordpiece

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

    def check_satisfiable(self, compiled: xgrammar.CompiledGrammar, params: StructuredOutputsParams) -> None:
        """Refuse (a ValueError naming the field) a constraint whose output cannot even begin: no
        token is allowed first, as for a regex no text matches. The server asks this as it admits
        a request, so the client gets a 400; a request built without it fails alone at its first
        step (GrammarState.fill_bitmask)."""
        bitmask = xgrammar.allocate_token_bitmask(1, self.vocab_size)
        xgrammar.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
        if not bool(bitmask.any()):
            raise ParamError("structured_outputs", f"structured_outputs.{params.kind} cannot be satisfied: no output "
                             "can begin as it requires (no text matches it, or this tokenizer cannot spell its start)")

    def new_state(self, compiled: xgrammar.CompiledGrammar) -> GrammarState:
        """A fresh matcher over a compiled grammar, for one sample."""
        return GrammarState(compiled)


def choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar whose only sentences are the given strings (JSON string literals are
    xgrammar's EBNF literals: quotes, backslashes and control characters escaped)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)
