"""The HTTP server against hostile and unlucky clients (issue 26): poison field values, bodies
over the size limit, prompts and max_tokens past the context, a long prompt tokenized while
others stream, too many connections, headers and bodies that never finish, leaky error bodies,
an empty API key, the served model name, and the tensor-parallel store's address. Each refusal
is OpenAI's error JSON, and the server answers the next request as before."""
import asyncio
import json
import logging
import os
import socket
import subprocess
import threading

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.entrypoints.openai import http_guard, serving_completion
from nanovllm.entrypoints.openai.http_guard import RateLimitFilter
from nanovllm.entrypoints.openai.api_server import build_app
from nanovllm.entrypoints.openai.server_settings import API_KEY_ENV, ServerSettings, api_key_from_env
from serving import REPO_ROOT, cli, httpx, server_thread

MAX_MODEL_LEN = 128  # small, so prompts past the context are cheap to make
MAX_REQUEST_BYTES = 64 * 1024
WAIT_S = 60.0  # the longest any single wait here may take on a loaded machine
ERROR_FIELDS = {"message", "type", "param", "code"}
BIG = str(2**63)  # a top_k (or any count) no tensor holds


@pytest.fixture(scope="module")
def model_as_typed(qwen3_tiny) -> str:
    """The checkpoint as a user might type it: relative, with a trailing slash (not normalised)."""
    return os.path.relpath(qwen3_tiny) + "/"


@pytest.fixture(scope="module")
def server(model_as_typed):
    with server_thread(model_as_typed, engine_overrides={"max_model_len": MAX_MODEL_LEN},
                       max_request_bytes=MAX_REQUEST_BYTES) as running:
        yield running


@pytest.fixture(scope="module")
def guarded(qwen3_tiny):
    """A server with a tiny connection cap and one-second header and body timeouts."""
    with server_thread(qwen3_tiny, max_connections=3, header_timeout=1.0, body_timeout=1.0) as running:
        yield running


def post(server, path: str, body: str | dict, **kwargs) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, headers={"Content-Type": "application/json"},
                      timeout=WAIT_S, **kwargs)


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_FIELDS, body
    return body["error"]


GOOD = {"/v1/completions": {"prompt": "Hello there", "max_tokens": 2, "temperature": 0},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2,
                                 "temperature": 0}}
CHAT_HI = '"messages": [{"role": "user", "content": "hi"}]'
# (path, raw JSON body, the param the 400 names). "\\ud800" is JSON's escape for a lone surrogate.
POISON = [
    ("/v1/completions", f'{{"prompt": "hi", "top_k": {BIG}}}', "top_k"),
    ("/v1/completions", '{"prompt": "\\ud800"}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "x\\udc00"]}', "prompt"),
    ("/v1/completions", '{"prompt": "hi", "stop": ["a", "\\ud800"]}', "stop[1]"),
    ("/v1/completions", '{"prompt": "hi", "model": "\\ud800"}', "model"),
    ("/v1/completions", '{"prompt": "hi", "user": "\\ud800"}', "user"),
    ("/v1/completions", '{"prompt": "hi", "seed": 18446744073709551616}', "seed"),
    ("/v1/completions", f'{{"prompt": "hi", "n": {BIG}}}', "n"),
    ("/v1/completions", f'{{"prompt": "hi", "max_tokens": {BIG}}}', "max_tokens"),
    ("/v1/completions", f'{{"prompt": [1, {BIG}]}}', "prompt"),
    ("/v1/completions", f'{{"prompt": "hi", "stop_token_ids": [{BIG}]}}', "stop_token_ids[0]"),
    ("/v1/completions", json.dumps({"prompt": "hi", "stop": ["x"] * 65}), "stop"),
    ("/v1/chat/completions", f'{{{CHAT_HI}, "top_k": {BIG}}}', "top_k"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udbff"}]}]}',
     "messages[0].content[0].text"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi", "name": "\\udfff"}]}',
     "messages[0].name"),
    ("/v1/chat/completions", f'{{{CHAT_HI}, "stop": "\\ud800"}}', "stop"),
    ("/v1/chat/completions", f'{{{CHAT_HI}, "max_completion_tokens": {BIG}}}', "max_completion_tokens"),
]


def test_poison_values_get_400_and_the_next_request_200(server):
    for path, body, param in POISON:
        refused = post(server, path, body)
        assert refused.status_code == 400, (body, refused.text)
        error = error_of(refused)
        assert error["param"] == param and error["type"] == "invalid_request_error", (body, error)
        after = post(server, path, GOOD[path])
        assert after.status_code == 200, (body, after.text)
    assert httpx.get(server.url + "/health").status_code == 200


def test_served_model_name_is_the_model_as_typed(server, model_as_typed):
    assert [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]] == [model_as_typed]
    assert post(server, "/v1/completions", GOOD["/v1/completions"]).json()["model"] == model_as_typed
    with_name = ServerSettings(model_as_typed, served_model_name="my-model")
    assert with_name.model_name == "my-model"
    with pytest.raises(ValueError, match="served_model_name"):
        ServerSettings(model_as_typed, served_model_name=" ").check()


def test_prompt_and_max_tokens_past_the_context_get_400(server):
    long_ids = [7] * (MAX_MODEL_LEN + 1)
    for body, param in [({"prompt": long_ids}, "prompt"), ({"prompt": "hi " * 400}, "prompt"),
                        ({"prompt": [7] * MAX_MODEL_LEN}, "prompt"),  # no room left for one token
                        ({"prompt": [7] * 10, "max_tokens": MAX_MODEL_LEN - 9}, "max_tokens")]:
        error = error_of(response := post(server, "/v1/completions", body))
        assert response.status_code == 400 and error["param"] == param, (body, error)
        assert error["code"] == "context_length_exceeded"
        assert error["message"].startswith(f"This model's maximum context length is {MAX_MODEL_LEN} tokens.")
    error = error_of(post(server, "/v1/completions", {"prompt": [7] * 10, "max_tokens": MAX_MODEL_LEN - 9}))
    assert f"you requested {MAX_MODEL_LEN + 1} tokens (10 in the prompt, {MAX_MODEL_LEN - 9} for the " \
           "completion)" in error["message"]
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                 "max_completion_tokens": MAX_MODEL_LEN})
    assert chat.status_code == 400 and error_of(chat)["param"] == "max_completion_tokens"
    # Up to the context exactly is fine; an omitted max_tokens (16) is cut to what is left.
    prompt = [7] * (MAX_MODEL_LEN - 6)
    fits = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 6, "ignore_eos": True})
    assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] == 6
    cut = post(server, "/v1/completions", {"prompt": prompt, "ignore_eos": True}).json()
    assert cut["usage"]["completion_tokens"] == 6 and cut["choices"][0]["finish_reason"] == "length"


def test_bodies_over_the_size_limit_get_413(server):
    too_big = json.dumps({"prompt": "a" * MAX_REQUEST_BYTES})
    by_length = post(server, "/v1/completions", too_big)
    assert by_length.status_code == 413 and error_of(by_length)["code"] == "request_too_large"

    def chunks():  # no Content-Length: the server must count
        for i in range(0, len(too_big), 4096):
            yield too_big[i:i + 4096].encode()
    counted = httpx.post(server.url + "/v1/completions", content=chunks(), timeout=WAIT_S,
                         headers={"Content-Type": "application/json"})
    assert counted.status_code == 413 and error_of(counted)["code"] == "request_too_large"
    # Just under the limit, the body is read and its prompt judged on its merits.
    allowed = post(server, "/v1/completions", {"prompt": "a " * (MAX_REQUEST_BYTES // 2 - 64)})
    assert allowed.status_code == 400 and error_of(allowed)["code"] == "context_length_exceeded"
    assert post(server, "/v1/completions", GOOD["/v1/completions"]).status_code == 200


def test_tokenizing_a_long_prompt_does_not_stall_a_running_stream(server, monkeypatch):
    """A long prompt is held inside tokenization (patched to wait for an event) while another
    request streams: the stream finishes while the tokenization is still held, so neither the
    event loop nor the engine waits for it."""
    marker = "MARKER "
    entered, release = threading.Event(), threading.Event()
    encode = serving_completion._encode

    def held_encode(tokenizer, prompts, *args):
        if any(isinstance(p, str) and p.startswith(marker) for p in prompts):
            entered.set()
            release.wait(WAIT_S)
        return encode(tokenizer, prompts, *args)
    monkeypatch.setattr(serving_completion, "_encode", held_encode)
    stream_body = {"prompt": [7, 8, 9], "max_tokens": 24, "ignore_eos": True, "temperature": 0, "stream": True,
                   "stream_options": {"include_usage": True}}

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as http:
            async with http.stream("POST", "/v1/completions", json=stream_body) as stream:
                lines = aiter(stream.aiter_lines())
                first = await anext(lines)  # the stream is running
                long_request = asyncio.ensure_future(http.post("/v1/completions", json={
                    "prompt": marker + "word " * 5000, "max_tokens": 1}))
                assert await asyncio.to_thread(entered.wait, WAIT_S)
                rest = [line async for line in lines]
                finished_while_held = not release.is_set() and not long_request.done()
            release.set()
            return first, rest, finished_while_held, await long_request

    first, rest, finished_while_held, long_response = asyncio.run(run())
    assert finished_while_held
    events = [json.loads(line[len("data: "):]) for line in [first, *rest] if line.startswith("data: {")]
    assert events[-1]["usage"]["completion_tokens"] == 24 and "data: [DONE]" in rest
    assert long_response.status_code == 400  # held, then tokenized: longer than the context
    assert error_of(long_response)["code"] == "context_length_exceeded"


def test_error_bodies_hold_a_request_id_and_no_internals(server, monkeypatch, caplog):
    def broken_encode(tokenizer, prompts, *args):
        raise RuntimeError("cannot read /secret/weights/model.safetensors")
    with monkeypatch.context() as patch:
        patch.setattr(serving_completion, "_encode", broken_encode)
        with caplog.at_level(logging.ERROR, logger="nanovllm"):
            response = post(server, "/v1/completions", GOOD["/v1/completions"])
    assert response.status_code == 500
    error = error_of(response)
    request_id = response.headers["x-request-id"]
    assert request_id in error["message"] and error["type"] == "server_error"
    for leak in ("/secret", "safetensors", "RuntimeError", "Traceback"):
        assert leak not in response.text
    logged = [r for r in caplog.records if request_id in r.getMessage()]
    assert logged and logged[0].exc_info is not None  # the log has the traceback, under the id

    tokenizer = server.app.state.prompt_tokenizer
    chat = GOOD["/v1/chat/completions"]
    with monkeypatch.context() as patch:
        patch.setattr(tokenizer, "chat_template", "{{ raise_exception('roles must alternate') }}")
        refused = post(server, "/v1/chat/completions", chat)
        assert refused.status_code == 400 and error_of(refused)["param"] == "messages"
        assert error_of(refused)["message"] == "messages: the chat template refused these messages: roles must alternate"
        patch.setattr(tokenizer, "chat_template", "{% for x in %}{{ secret_template_text }}")
        broken = post(server, "/v1/chat/completions", chat)
        assert broken.status_code == 500 and error_of(broken)["code"] == "chat_template_error"
        assert "secret_template_text" not in broken.text and "line" not in error_of(broken)["message"]
    for path, body in GOOD.items():
        ok = post(server, path, body)
        assert ok.status_code == 200 and ok.headers["x-request-id"] in ok.json()["id"]


def test_empty_api_key_is_refused_at_start_up(qwen3_tiny, monkeypatch):
    for key in ("", "  ", " key"):
        with pytest.raises(ValueError, match="api_key"):
            ServerSettings(qwen3_tiny, api_key=key).check()
        with pytest.raises(ValueError, match="api_key"):
            build_app(ServerSettings(qwen3_tiny, api_key=key))
    monkeypatch.setenv(API_KEY_ENV, "")
    assert api_key_from_env() == ""  # set but empty: kept, for check() to refuse
    monkeypatch.delenv(API_KEY_ENV)
    assert api_key_from_env() is None
    ServerSettings(qwen3_tiny, api_key="k").check()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for args, extra_env in [(["--api-key", ""], {}), ([], {API_KEY_ENV: ""})]:
        done = subprocess.run(cli("serve", qwen3_tiny, "--port", "0", *args), cwd=REPO_ROOT, env={**env, **extra_env},
                              capture_output=True, text=True, timeout=WAIT_S * 2)
        assert done.returncode == 1, done.stderr
        assert done.stderr.startswith("nanovllm: error: api_key='' is not allowed") and "Traceback" not in done.stderr


# ---- connections ----

def read_until_closed(sock: socket.socket) -> bytes:
    """What the server sends until it closes the connection (a bounded wait)."""
    sock.settimeout(WAIT_S)
    chunks = []
    while True:
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            break
        if not data:
            break
        chunks.append(data)
    sock.close()
    return b"".join(chunks)


def parse(raw: bytes) -> tuple[int, dict[str, str], dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in header_lines)
    return int(status_line.split()[1]), headers, json.loads(body)


def address(server) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").split(":")
    return host, int(port)


def count(caplog, logger: str, text: str) -> int:
    """Log records of `logger` holding `text` (each once, though it may reach caplog twice)."""
    return len({id(r) for r in caplog.records if r.name == logger and text in r.getMessage()})


def test_connections_over_the_cap_get_503_and_one_log_line(guarded, monkeypatch, caplog):
    monkeypatch.setattr(http_guard._connection_filter, "_last", {})  # a fresh interval for this test
    cap = guarded.settings.max_connections
    with caplog.at_level(logging.WARNING, logger="nanovllm.connections"):
        held = [socket.create_connection(address(guarded)) for _ in range(cap)]
        extra = [socket.create_connection(address(guarded)) for _ in range(3)]
        refusals = [parse(read_until_closed(sock)) for sock in extra]
        # The held connections sent nothing: past the header timeout they are closed, unanswered.
        assert [read_until_closed(sock) for sock in held] == [b""] * cap
    for status, headers, body in refusals:
        assert status == 503 and headers["connection"] == "close" and headers["retry-after"].isdigit()
        assert body["error"]["code"] == "too_many_connections" and set(body["error"]) == ERROR_FIELDS
    assert count(caplog, "nanovllm.connections", "refused a connection") == 1  # three refusals, one line
    assert httpx.get(guarded.url + "/health", timeout=WAIT_S).status_code == 200


def test_unfinished_headers_and_bodies_are_cut_off(guarded, monkeypatch, caplog):
    monkeypatch.setattr(http_guard._connection_filter, "_last", {})
    monkeypatch.setattr(http_guard._uvicorn_filter, "_last", {})
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addHandler(caplog.handler)  # in case uvicorn's logging config keeps it from the root logger
    half_headers = b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
    short_body = (b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n" + b'{"prompt": "')
    try:
        with caplog.at_level(logging.WARNING):
            for payload, status in [(half_headers, 408), (short_body, 408), (b"NONSENSE\r\n\r\n", 400)]:
                socks = [socket.create_connection(address(guarded)) for _ in range(2)]  # within the cap
                for sock in socks:
                    sock.sendall(payload)
                answers = [read_until_closed(sock) for sock in socks]
                for answer in answers:
                    assert answer.startswith(f"HTTP/1.1 {status}".encode()), answer
                    if status == 408:
                        assert parse(answer)[2]["error"]["code"] == "request_timeout"
    finally:
        uvicorn_log.removeHandler(caplog.handler)
    assert count(caplog, "nanovllm.connections", "request headers were not complete") == 1
    assert count(caplog, "nanovllm.connections", "body was not complete") == 1
    assert count(caplog, "uvicorn.error", "Invalid HTTP request received.") == 1
    ok = httpx.post(guarded.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=WAIT_S)
    assert ok.status_code == 200


def test_rate_limit_filter_lets_one_line_through_per_interval():
    now = [0.0]
    limit = RateLimitFilter(interval_s=10.0, templates=("refused %d",), clock=lambda: now[0])

    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord("t", logging.WARNING, __file__, 1, msg, (1,), None)
    assert [limit.filter(record("refused %d")) for _ in range(5)] == [True, False, False, False, False]
    assert limit.filter(record("something else %d"))  # not a limited template
    now[0] = 10.5
    passed = record("refused %d")
    assert limit.filter(passed) and "4 more like it" in passed.getMessage()
    assert not limit.filter(record("refused %d"))


def test_tensor_parallel_store_listens_on_loopback_only(qwen3_tiny):
    llm = LLM(qwen3_tiny, device="cpu", tensor_parallel_size=2, kvcache_block_size=16, num_kvcache_blocks=64)
    try:
        port = llm.model_runner.workers.store.port
        listening = []
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            for line in open(table).read().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                    listening.append(local.rsplit(":", 1)[0])
        assert listening == ["0100007F"]  # 127.0.0.1 only; not 0.0.0.0, not ::
        assert len(llm.generate([[7, 8, 9]], SamplingParams(max_tokens=3, ignore_eos=True),
                                use_tqdm=False)[0]["token_ids"]) == 3
    finally:
        llm.exit()


def test_serving_on_cpu_prefills_a_bounded_number_of_tokens_per_step(qwen3_tiny):
    """Left unset (the CLI's default too), max_num_batched_tokens is vLLM's CPU serving budget, so a
    burst of prompts is prefilled a few per step; a given value, or another device, keeps its own."""
    from nanovllm.entrypoints.openai.server_settings import CPU_SERVING_MAX_BATCHED_TOKENS
    assert ServerSettings(qwen3_tiny, {"device": "cpu"}).engine_kwargs["max_num_batched_tokens"] == \
        CPU_SERVING_MAX_BATCHED_TOKENS
    assert ServerSettings(qwen3_tiny, {"device": "cpu", "max_num_batched_tokens": None}).engine_kwargs[
        "max_num_batched_tokens"] == CPU_SERVING_MAX_BATCHED_TOKENS
    assert ServerSettings(qwen3_tiny, {"device": "cpu", "max_num_batched_tokens": 512}).engine_kwargs[
        "max_num_batched_tokens"] == 512
    assert "max_num_batched_tokens" not in ServerSettings(qwen3_tiny, {"device": "cuda"}).engine_kwargs
    from nanovllm.entrypoints.cli.main import build_parser
    args = build_parser().parse_args(["serve", qwen3_tiny])
    assert args.max_num_batched_tokens is None
