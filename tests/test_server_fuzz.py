"""Property-based fuzz of the request bodies, from the server's own OpenAPI schema (schemathesis
builds the cases, hypothesis runs them) against an in-process server on a tiny model: valid and
invalid bodies alike must never get a 5xx, every refusal is OpenAI's error JSON, and /health is
200 afterwards. Bounded: a fixed number of examples per endpoint, and max_tokens and n kept small
so a generated request costs milliseconds on CPU."""
import json

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings, strategies as st

from nanovllm.entrypoints.openai.api_server import build_app
from nanovllm.entrypoints.openai.server_settings import ServerSettings
from serving import httpx, server_thread

EXAMPLES_PER_ENDPOINT = 40
MAX_MODEL_LEN = 256
MAX_TOKENS = 4  # what a generated max_tokens above it (or a missing one) becomes
MAX_N = 2
TIMEOUT_S = 120.0

# The schema of a server like any other: routes and request models do not depend on the settings.
SCHEMA = schemathesis.openapi.from_dict(build_app(ServerSettings("unused")).openapi())


@pytest.fixture(scope="module")
def server(qwen3_tiny):
    with server_thread(qwen3_tiny, engine_overrides={"max_model_len": MAX_MODEL_LEN}) as running:
        yield running


def cases(path: str) -> st.SearchStrategy:
    operation = SCHEMA[path]["POST"]
    return st.one_of(operation.as_strategy(schemathesis.GenerationMode.POSITIVE),
                     operation.as_strategy(schemathesis.GenerationMode.NEGATIVE))


def bounded(body):
    """The body with its generation kept short: valid big max_tokens / n made small, a missing
    max_tokens given (a chat's default is the whole context). Invalid values stay as generated."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if name not in body or (isinstance(value, int) and not isinstance(value, bool) and value > MAX_TOKENS):
            body[name] = MAX_TOKENS
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n > MAX_N:
        body["n"] = MAX_N
    return body


def check(server, path: str, case) -> None:
    body = bounded(case.body)
    try:
        content = json.dumps(body).encode()
    except (TypeError, ValueError):  # not JSON at all (schemathesis can make such): sent as text
        content = str(body).encode()
    response = httpx.post(server.url + path, content=content, headers={"Content-Type": "application/json"},
                          timeout=TIMEOUT_S)
    assert response.status_code < 500, (path, body, response.text)
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], (body, error)
    elif response.headers["content-type"].startswith("text/event-stream"):  # a valid body with stream=true
        assert response.text.rstrip().endswith("data: [DONE]"), (body, response.text[-300:])
    else:
        assert response.json()["choices"], (body, response.text)


FUZZ_SETTINGS = settings(max_examples=EXAMPLES_PER_ENDPOINT, deadline=None, database=None, derandomize=True,
                         suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_fuzzed_bodies_never_get_5xx(server, path):
    @FUZZ_SETTINGS
    @given(case=cases(path))
    def run(case):
        check(server, path, case)

    run()
    assert httpx.get(server.url + "/health", timeout=TIMEOUT_S).status_code == 200
    good = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=TIMEOUT_S)
    assert good.status_code == 200
