"""Helpers for the serving tests: an OpenAI-compatible server on a free loopback port (in a
background thread of the test process, or as a `python -m nanovllm serve` subprocess), and
Prometheus text parsing. Every wait here is bounded."""
import os
import re
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import uvicorn
from fastapi import FastAPI

try:  # the HTTP client the installed `openai` is built on: httpx2 for openai 3, httpx before
    import httpx2 as httpx
except ImportError:
    import httpx  # noqa: F401 (re-exported for the tests)

from nanovllm.entrypoints.openai.api_server import GracefulServer, build_app, listening_socket, uvicorn_config
from nanovllm.entrypoints.openai.server_settings import ServerSettings

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Small blocks so tiny prompts span several; plenty of them so 200 concurrent requests fit.
ENGINE_KWARGS = {"kvcache_block_size": 16, "num_kvcache_blocks": 2048}
ENGINE_FLAGS = ["--kvcache-block-size", "16", "--num-kvcache-blocks", "2048"]
START_TIMEOUT = 180.0  # seconds for a server to build its engine on a busy 2-core machine
STOP_TIMEOUT = 60.0
LISTENING = re.compile(r"listening on (http://[^\s]+)")


@dataclass
class RunningServer:
    url: str  # http://127.0.0.1:PORT
    settings: ServerSettings
    app: FastAPI
    uvicorn: uvicorn.Server  # setting its should_exit is what SIGTERM does

    @property
    def base_url(self) -> str:
        return self.url + "/v1"


@contextmanager
def server_thread(model: str, engine_overrides: dict | None = None, shutdown_timeout: float = STOP_TIMEOUT,
                  **settings_kwargs) -> Iterator[RunningServer]:
    """A server (engine included) in a background thread of this process, on a free loopback port."""
    settings = ServerSettings(model, {**ENGINE_KWARGS, **(engine_overrides or {})}, **settings_kwargs)
    sock = listening_socket("127.0.0.1", 0)
    app = build_app(settings)
    server = GracefulServer(uvicorn_config(app, shutdown_timeout, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="test-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT
    while not server.started:  # uvicorn's flag: set once the lifespan (engine build) is done
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)
    try:
        yield RunningServer(f"http://127.0.0.1:{sock.getsockname()[1]}", settings, app, server)
    finally:
        server.should_exit = True
        thread.join(STOP_TIMEOUT)
        sock.close()
        assert not thread.is_alive(), "the test server did not stop"


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "nanovllm", *args]


def start_cli(*args: str, **popen_kwargs) -> subprocess.Popen:
    """`python -m nanovllm ARGS` from the repository root, stdout and stderr piped as text."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    popen_kwargs.setdefault("stdout", subprocess.PIPE)
    popen_kwargs.setdefault("stderr", subprocess.PIPE)
    return subprocess.Popen(cli(*args), cwd=REPO_ROOT, env=env, text=True, **popen_kwargs)


def wait_for_listening(proc: subprocess.Popen) -> tuple[str, list[str]]:
    """The URL a `serve` subprocess announces on stderr, and the stderr lines read so far."""
    lines = []
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        match = LISTENING.search(line)
        if match:
            return match.group(1), lines
    proc.kill()
    raise RuntimeError("the server subprocess never said where it listens:\n" + "".join(lines))


def metric(text: str, name: str, labels: str = "") -> float:
    """The value of sample `name{labels}` in Prometheus text (0 when absent, as for an unseen label)."""
    match = re.search(rf"^{re.escape(name)}{re.escape('{' + labels + '}' if labels else '')} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0
