"""Plain-Python bookkeeping of requests: sequences, the KV cache's blocks, scheduling, stopping
rules, detokenization and what each caller is handed. No torch here (tests/test_layering.py
checks it), so all of it is unit-tested without a model; `runner/` turns its sequences into
tensors, and the loop (`nanovllm/llm_engine.py`) drives both."""
