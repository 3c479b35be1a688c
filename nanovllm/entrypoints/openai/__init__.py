"""The OpenAI-compatible HTTP server: the app (`api_server`), its request/response models
(`protocol`), the engine-loop thread it talks to, its guards, settings and metrics."""
