"""What a server is told at start-up, and the defaults of `nanovllm serve`.

A module of its own so the CLI can build its flags from `ServerSettings` without importing the
web stack. It knows nothing of how the server uses them.
"""
import os
from dataclasses import dataclass, field

DEFAULT_HOST = "127.0.0.1"  # loopback: exposing the server is a deliberate --host choice
DEFAULT_PORT = 8000  # vLLM's
# Sequences that may wait for their first token; beyond it a request gets 503 (no unbounded backlog).
DEFAULT_MAX_QUEUE_LEN = 1024
# Seconds a refused client is told to wait: about one batch of short requests on a busy server.
RETRY_AFTER_SECONDS = 1
# Seconds in-flight requests get to finish after SIGTERM/SIGINT before they are aborted.
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
API_KEY_ENV = "NANOVLLM_API_KEY"


@dataclass
class ServerSettings:
    model: str  # checkpoint directory
    engine_kwargs: dict = field(default_factory=dict)  # Config fields for LLM(model, **engine_kwargs)
    served_model_name: str | None = None  # the name clients pass as "model"; default: MODEL as given
    api_key: str | None = None  # required as "Authorization: Bearer KEY" on /v1/*; default: $NANOVLLM_API_KEY
    max_queue_len: int = DEFAULT_MAX_QUEUE_LEN  # sequences that may wait for their first token; more get 503

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def check(self) -> None:
        """Refuse settings a server cannot work with (ValueError naming the field)."""
        if not isinstance(self.max_queue_len, int) or self.max_queue_len < 1:
            raise ValueError(f"max_queue_len={self.max_queue_len!r} is not allowed; it must be an integer >= 1")
        if self.engine_kwargs.get("skip_tokenizer_init"):
            raise ValueError("skip_tokenizer_init=True is not allowed when serving: the OpenAI API takes and "
                             "returns text, which needs the tokenizer")


def api_key_from_env() -> str | None:
    return os.environ.get(API_KEY_ENV) or None
