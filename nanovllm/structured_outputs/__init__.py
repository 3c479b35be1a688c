"""Structured outputs: a request's StructuredOutputsParams compiled into an xgrammar grammar, and
each of its samples' matcher state.

`GrammarCompiler` (compiler.py) turns a constraint into a compiled grammar for one tokenizer,
caching it per constraint (xgrammar's own cache: equal schemas compile once), and refuses a bad
one with a ValueError naming the field. It is called where requests are admitted, never inside
a step: the server compiles in its prompt thread, and the engine builds the request with it.
`GrammarState` (state.py) is one sample's matcher: the sampling pipeline reads its token bitmask
(layers/logits_processors.py, GrammarMask), and the stop checker advances it with each token
the sequence keeps (scheduling/stop_checker.py). engine/ holds it as an opaque object and never
imports this package (xgrammar imports torch).
"""
from nanovllm.structured_outputs.compiler import GrammarCompiler
from nanovllm.structured_outputs.state import GrammarState

__all__ = ["GrammarCompiler", "GrammarState"]
