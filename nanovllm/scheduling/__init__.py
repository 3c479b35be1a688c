"""Plain-Python bookkeeping of what runs in each step: sequences, the KV cache's blocks (paged,
ref-counted, prefix-cached), the scheduler and the stop rules. No torch here
(tests/test_layering.py checks it), so all of it is unit-tested without a model; `runner/` turns
its sequences into tensors and `engine/` drives both."""
