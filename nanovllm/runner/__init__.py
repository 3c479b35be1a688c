"""Everything that builds or runs tensors: the model runner (model, KV cache, sampler), the
per-step inputs it builds from scheduled sequences, CUDA graphs, tensor parallelism and
speculative decoding. Every runner is a `Runner` (`protocol.py`): the loop drives them alike.

It sits below the engine (`engine/`) and above `scheduling/` (plain-Python bookkeeping), whose
sequences it reads but never changes except for their sampling generator.
"""
