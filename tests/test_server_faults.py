"""The server's side of failures (docs/reliability.md, "Requests fail alone"): a request the
engine fails is a 500 in OpenAI's error JSON carrying its request id (a stream: its "abort" chunk,
an error event, then [DONE]), the requests beside it are answered as always and /health stays
200; a shutdown whose grace period runs out ends open streams with an "abort" chunk and [DONE]
and answers waiting non-streaming requests with a 503, with no traceback in the log."""
import asyncio
import json
import logging
import time

import pytest

from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.detokenizer import Detokenizer
from nanovllm.scheduling.stop_checker import StopChecker
from serving import httpx, metric, server_thread

PROMPT = "Hello world! How are"
LONG = 1000  # tokens: within the test checkpoint's context (1024) with the prompt
STEP_S = 0.01  # the shortest engine step in the shutdown test: LONG steps last well past its grace period
VICTIM_MAX_TOKENS = 7  # the fault hits only requests asking for this many tokens
MAX_TOKENS = 6
TIMEOUT = 120.0


def sse_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line]


def events(lines: list[str]) -> list[dict | str]:
    return [line[len("data: "):] if line == "data: [DONE]" else json.loads(line[len("data: "):]) for line in lines]


@pytest.fixture
def faulty_stop_check(monkeypatch):
    """The stop check raises for a victim's request (every engine in this process)."""
    check = StopChecker.check

    def faulty(self, seq):
        if seq.sampling_params.max_tokens == VICTIM_MAX_TOKENS and seq.num_completion_tokens >= 2:
            raise RuntimeError("/secret/path injected fault")
        return check(self, seq)
    monkeypatch.setattr(StopChecker, "check", faulty)


def test_a_failed_request_is_a_500_and_the_others_are_served(qwen3_tiny, faulty_stop_check):
    with server_thread(qwen3_tiny) as server:
        url = server.base_url + "/completions"
        name = server.settings.model_name

        async def run():
            async with httpx.AsyncClient(timeout=TIMEOUT) as http:
                def body(max_tokens: int, **extra) -> dict:
                    return {"model": name, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True, **extra}
                return await asyncio.gather(
                    http.post(url, json=body(VICTIM_MAX_TOKENS)),
                    http.post(url, json=body(VICTIM_MAX_TOKENS, stream=True)),
                    http.post(server.base_url + "/chat/completions", json={
                        "model": name, "messages": [{"role": "user", "content": "Hi"}],
                        "max_tokens": VICTIM_MAX_TOKENS, "temperature": 0, "stream": True, "ignore_eos": True}),
                    *[http.post(url, json=body(MAX_TOKENS, stream=i % 2 == 1)) for i in range(4)])

        failed, failed_stream, failed_chat_stream, *served = asyncio.run(run())
        assert failed.status_code == 500
        error = failed.json()["error"]
        assert error["type"] == "server_error" and "cmpl-" in error["message"]  # its request id
        assert "secret" not in error["message"] and "RuntimeError" not in error["message"]
        for response in (failed_stream, failed_chat_stream):
            assert response.status_code == 200  # the stream had begun
            stream = events(sse_lines(response.text))
            assert stream[-1] == "[DONE]"
            assert "secret" not in stream[-2]["error"]["message"] and stream[-2]["error"]["type"] == "server_error"
            last_chunk = stream[-3]["choices"][0]
            assert last_chunk["finish_reason"] == "abort"
        for response in served:
            assert response.status_code == 200
            if response.headers["content-type"].startswith("text/event-stream"):
                stream = events(sse_lines(response.text))
                assert stream[-1] == "[DONE]" and stream[-2]["choices"][0]["finish_reason"] == "length"
            else:
                assert response.json()["choices"][0]["finish_reason"] == "length"
                assert response.json()["usage"]["completion_tokens"] == MAX_TOKENS
        assert httpx.get(server.url + "/health").status_code == 200
        metrics = httpx.get(server.url + "/metrics").text
        assert metric(metrics, "nanovllm_num_requests_running") == 0


def test_a_request_failed_as_it_is_built_is_answered_at_once(qwen3_tiny, monkeypatch):
    """A fault while the engine builds the request (nothing of it is ever scheduled): its
    response still comes, a 500 or an error event, and the server serves on."""
    init = Detokenizer.__init__

    def faulty(self, tokenizer, params, *args):
        if params.max_tokens == VICTIM_MAX_TOKENS:
            raise RuntimeError("/secret/path injected fault")
        init(self, tokenizer, params, *args)
    monkeypatch.setattr(Detokenizer, "__init__", faulty)
    with server_thread(qwen3_tiny) as server:
        url = server.base_url + "/completions"
        body = {"model": server.settings.model_name, "prompt": PROMPT, "max_tokens": VICTIM_MAX_TOKENS,
                "temperature": 0}
        failed = httpx.post(url, json=body, timeout=TIMEOUT)
        assert failed.status_code == 500 and "cmpl-" in failed.json()["error"]["message"]
        stream = events(sse_lines(httpx.post(url, json={**body, "stream": True}, timeout=TIMEOUT).text))
        assert stream[-1] == "[DONE]" and "error" in stream[-2]
        assert stream[-3]["choices"][0]["finish_reason"] == "abort"
        served = httpx.post(url, json={**body, "max_tokens": MAX_TOKENS, "ignore_eos": True}, timeout=TIMEOUT)
        assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == MAX_TOKENS
        assert httpx.get(server.url + "/health").status_code == 200


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_shutdown_past_the_grace_period_ends_every_response(qwen3_tiny, monkeypatch):
    """A stream and a non-streaming request that cannot finish within the grace period: the
    stream ends with an "abort" chunk and [DONE], the other gets a 503; the log has no traceback."""
    # Each step takes at least STEP_S, so the context's worth of tokens outlasts the grace period.
    step = LLMEngine._step
    monkeypatch.setattr(LLMEngine, "_step", lambda self: time.sleep(STEP_S) or step(self))
    records = Records()
    loggers = [logging.getLogger(name) for name in ("uvicorn", "uvicorn.error", "nanovllm")]
    with server_thread(qwen3_tiny, shutdown_timeout=2.0) as server:
        for logger in loggers:
            logger.addHandler(records)
        body = {"model": server.settings.model_name, "prompt": PROMPT, "max_tokens": LONG, "temperature": 0,
                "ignore_eos": True}

        async def run():
            async with httpx.AsyncClient(timeout=TIMEOUT) as http:
                async with http.stream("POST", server.base_url + "/completions", json={**body, "stream": True}) as r:
                    lines = r.aiter_lines()
                    first = await anext(lines)  # it is generating
                    plain = asyncio.ensure_future(http.post(server.base_url + "/completions", json=body))
                    deadline = time.monotonic() + TIMEOUT
                    while metric((await http.get(server.url + "/metrics")).text,
                                 "nanovllm_num_requests_running") < 2:
                        assert time.monotonic() < deadline, "the two requests never ran together"
                        await asyncio.sleep(0.05)
                    server.uvicorn.should_exit = True  # what SIGTERM does
                    rest = [line async for line in lines]
                return [first, *rest], await plain

        try:
            lines, plain = asyncio.run(run())
        finally:
            for logger in loggers:
                logger.removeHandler(records)
    stream = events(sse_lines("\n".join(lines)))
    assert stream[-1] == "[DONE]"
    assert stream[-2]["choices"][0]["finish_reason"] == "abort"
    assert all(chunk["choices"][0]["finish_reason"] is None for chunk in stream[:-2])
    assert plain.status_code == 503
    error = plain.json()["error"]
    assert error["type"] == "server_error" and "shutting down" in error["message"]
    assert not server.app.state.engine_client.is_running
    assert not [r for r in records.records if r.exc_info or r.levelno >= logging.ERROR], \
        [r.getMessage() for r in records.records]
