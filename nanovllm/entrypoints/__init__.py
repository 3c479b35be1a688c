"""Ways to run the engine from outside Python: an OpenAI-compatible HTTP server and the `nanovllm` CLI."""
