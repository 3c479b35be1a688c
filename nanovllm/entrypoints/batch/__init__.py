"""Offline batch jobs over OpenAI batch-format JSONL: one line's parsing (`lines`), the job and its
engine driver (`job`), the crash-safe result log (`log`) and scale-out over Ray Data (`ray`)."""
