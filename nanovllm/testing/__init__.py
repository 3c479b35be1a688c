"""Helpers for tests, examples and benchmarks: random-weight checkpoints and a small tokenizer
(`synthetic.py`). Nothing in the engine imports this package."""
