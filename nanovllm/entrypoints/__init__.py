"""Ways to run the engine from outside Python, one package per product: `openai` (the HTTP server),
`batch` (JSONL jobs, Ray scale-out) and `cli` (the `nanovllm` command, on top of both)."""
