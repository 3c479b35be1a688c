"""What a server is told at start-up, and the defaults of `nanovllm serve`.

A module of its own so the CLI can build its flags from `ServerSettings` without importing the
web stack. It knows nothing of how the server uses them; docs/reliability.md lists every limit
here with what a client sees when it is hit.
"""
import math
import os
from dataclasses import dataclass, field

from nanovllm.entrypoints.openai.reasoning import REASONING_PARSERS

DEFAULT_HOST = "127.0.0.1"  # loopback: exposing the server is a deliberate --host choice
DEFAULT_PORT = 8000  # vLLM's
# Sequences that may wait for their first token; beyond it a request gets 503 (no unbounded backlog).
DEFAULT_MAX_QUEUE_LEN = 1024
# Seconds a refused client is told to wait: about one batch of short requests on a busy server.
RETRY_AFTER_SECONDS = 1
# Seconds in-flight requests get to finish after SIGTERM/SIGINT before they are aborted.
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
# Bytes of one request body: a prompt of the longest usual context (128k tokens, ~4 bytes each
# as text, ~7 as JSON token ids) fits with room to spare; a 100 MB body does not.
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
# Open connections at once: a full queue (DEFAULT_MAX_QUEUE_LEN) and a full batch streaming,
# each on a connection of its own, plus idle keep-alive ones; well under a typical fd limit.
DEFAULT_MAX_CONNECTIONS = 2048
# Seconds a client has to send a request's headers, from connecting (or from the end of its
# previous response): far longer than any real client needs, short enough to drop a slow-loris.
DEFAULT_HEADER_TIMEOUT = 10.0
# Seconds a client has to send a request's whole body once its headers are in: DEFAULT_MAX_REQUEST_BYTES
# at a slow 1 Mbit/s.
DEFAULT_BODY_TIMEOUT = 40.0
API_KEY_ENV = "NANOVLLM_API_KEY"
# Tokens one step computes when serving on CPU, unless max_num_batched_tokens is given (vLLM's CPU
# default for its server): a burst of prompts is prefilled a few per step, so the first streams
# start before the last prompt is prefilled and running streams keep stepping in between. (On CUDA,
# and offline, Config's default stands: a step's prefill is short there, or no one waits on it.)
CPU_SERVING_MAX_BATCHED_TOKENS = 2048


@dataclass
class ServerSettings:
    model: str  # checkpoint directory
    engine_kwargs: dict = field(default_factory=dict)  # Config fields for LLM(model, **engine_kwargs)
    served_model_name: str | None = None  # the name clients pass as "model"; default: MODEL as given
    # required as "Authorization: Bearer KEY" on /v1/*; default: $NANOVLLM_API_KEY (an empty key is refused)
    api_key: str | None = None
    max_queue_len: int = DEFAULT_MAX_QUEUE_LEN  # sequences that may wait for their first token; more get 503
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # largest request body in bytes; a larger one gets 413
    max_connections: int = DEFAULT_MAX_CONNECTIONS  # open connections at once; one more is answered 503 and closed
    # seconds a client has to send a request's headers (from connecting, or after its previous response)
    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    body_timeout: float = DEFAULT_BODY_TIMEOUT  # seconds a client has to send a whole request body; then 408
    # the chat template to render conversations with instead of the checkpoint's: a file, or the template itself
    chat_template: str | None = None
    # let a chat request carry its own chat_template (it runs in Jinja's sandbox, but costs what it costs)
    trust_request_chat_template: bool = False
    # split <think>...</think> off chat answers into reasoning_content: one of REASONING_PARSERS (qwen3)
    reasoning_parser: str | None = None
    # how tool calls are found in a chat answer under tool_choice "auto" (e.g. hermes, as Qwen writes them)
    tool_call_parser: str | None = None
    # run the engine in a process of its own, as vLLM does: a crash or kill of the engine leaves the
    # server answering 503s; on 2 CPU cores it served no faster than the engine thread of the
    # server's process, and starts ~2 s later (docs/BENCHMARKS.md, "Serving: the engine in its own
    # process"), so off by default
    engine_process: bool = False

    def __post_init__(self):
        self.engine_kwargs = dict(self.engine_kwargs)  # the caller's dict stays as it was
        if self.engine_kwargs.get("max_num_batched_tokens", None) is None:
            self.engine_kwargs.pop("max_num_batched_tokens", None)
            if _prefills_slowly(self.engine_kwargs.get("device", "auto")):
                self.engine_kwargs["max_num_batched_tokens"] = CPU_SERVING_MAX_BATCHED_TOKENS

    @property
    def model_name(self) -> str:
        return self.model if self.served_model_name is None else self.served_model_name

    def check(self) -> None:
        """Refuse settings a server cannot work with (ValueError naming the field)."""
        for name in ("max_queue_len", "max_request_bytes", "max_connections"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} is not allowed; it must be an integer >= 1")
        for name in ("header_timeout", "body_timeout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not (math.isfinite(value)
                                                                                       and value > 0):
                raise ValueError(f"{name}={value!r} is not allowed; it must be a finite number of seconds > 0")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key.strip()
                                         or self.api_key != self.api_key.strip()):
            raise ValueError(f"api_key={self.api_key!r} is not allowed (from --api-key or ${API_KEY_ENV}): an empty "
                             "key would let every client in, and spaces around one cannot be sent in a header. Give "
                             f"a non-empty key, or leave both --api-key and ${API_KEY_ENV} unset to serve without one")
        if self.served_model_name is not None and (not isinstance(self.served_model_name, str)
                                                   or not self.served_model_name.strip()):
            raise ValueError(f"served_model_name={self.served_model_name!r} is not allowed; it must be a non-empty "
                             "name, or left out to serve MODEL under the name it was given as")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser={self.reasoning_parser!r} is not allowed; it must be one of "
                             f"{sorted(REASONING_PARSERS)}")
        if self.chat_template is not None:
            # Here, not at the top: the CLI builds its flags from this module without transformers.
            from nanovllm.engine.chat import load_chat_template
            load_chat_template(self.chat_template)
        if self.tool_call_parser is not None:
            from nanovllm.entrypoints.openai.tool_parsers import TOOL_PARSERS  # plain Python, no web stack
            if self.tool_call_parser not in TOOL_PARSERS:
                raise ValueError(f"tool_call_parser={self.tool_call_parser!r} is not allowed; it must be one of "
                                 f"{sorted(TOOL_PARSERS)}")
        if self.engine_kwargs.get("skip_tokenizer_init"):
            raise ValueError("skip_tokenizer_init=True is not allowed when serving: the OpenAI API takes and "
                             "returns text, which needs the tokenizer")


def api_key_from_env() -> str | None:
    """$NANOVLLM_API_KEY; None when unset. Set but empty is returned as "" for check() to refuse:
    an empty variable is more often a missing secret than a wish to serve without a key."""
    return os.environ.get(API_KEY_ENV)


def _prefills_slowly(device: str) -> bool:
    """Whether a full prefill step takes long on `device` (the CPU), so serving bounds its tokens."""
    from nanovllm.platform.device import auto_device, device_platform  # here: the CLI builds its flags without torch
    return device_platform(auto_device(device)).slow_prefill
