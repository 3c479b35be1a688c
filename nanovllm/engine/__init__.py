"""The engine: `LLMEngine` (engine/llm_engine.py) and the step it drives (`EngineCore`,
engine/engine_core.py), and what turns callers' input into requests and steps' results into
outputs: the request builder and table, detokenization, chat rendering, outputs and stats.
It sits above `runner/` and `scheduling/`; the products (nanovllm/llm.py, entrypoints/) sit on it."""
