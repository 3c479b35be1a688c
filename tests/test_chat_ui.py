"""chat_ui.py, the Streamlit chat page, run by streamlit.testing's AppTest against a live server:
messages in, streamed answers out (equal to the server's own non-streaming answer for the same
conversation), the history kept and cleared, and a clear message when the server is down."""
import os
import socket
import subprocess
import sys

import openai
import pytest
from streamlit.testing.v1 import AppTest

from serving import REPO_ROOT, server_thread

CHAT_UI = os.path.join(REPO_ROOT, "chat_ui.py")
MODEL = "tiny"
MAX_TOKENS = 8
RUN_TIMEOUT = 120  # seconds for one run of the page (an answer on a busy machine)


@pytest.fixture(scope="module")
def server(qwen3_tiny):
    with server_thread(qwen3_tiny, served_model_name=MODEL) as running:
        yield running


def page(base_url: str, monkeypatch) -> AppTest:
    monkeypatch.setenv("NANOVLLM_BASE_URL", base_url)
    monkeypatch.delenv("NANOVLLM_MODEL", raising=False)
    monkeypatch.delenv("NANOVLLM_API_KEY", raising=False)
    app = AppTest.from_file(CHAT_UI, default_timeout=RUN_TIMEOUT)
    app.run()
    return app


def test_chat_page_streams_answers_and_keeps_history(server, monkeypatch):
    app = page(server.base_url, monkeypatch)
    assert not app.exception and not app.error
    assert MODEL in app.caption[0].value  # found the server's model by itself
    temperature, max_tokens = app.sidebar.slider
    temperature.set_value(0.0)
    max_tokens.set_value(MAX_TOKENS)
    client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=RUN_TIMEOUT)
    conversation = []
    for text in ("Hello", "And then?"):
        app.chat_input[0].set_value(text).run()
        assert not app.exception and not app.error
        conversation.append({"role": "user", "content": text})
        expected = client.chat.completions.create(model=MODEL, messages=conversation, temperature=0,
                                                  max_tokens=MAX_TOKENS).choices[0].message.content
        conversation.append({"role": "assistant", "content": expected})
        assert app.session_state["messages"] == conversation  # the second answer saw the first turn
        assert [m.name for m in app.chat_message] == [m["role"] for m in conversation]
    app.sidebar.button[0].click().run()  # Clear conversation
    assert app.session_state["messages"] == [] and not app.chat_message


def test_chat_page_says_when_the_server_is_down(monkeypatch):
    with socket.socket() as sock:  # a loopback port that nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    app = page(f"http://127.0.0.1:{port}/v1", monkeypatch)
    assert not app.exception
    assert "down or unreachable" in app.error[0].value
    assert app.chat_input[0].disabled


def test_screenshot_script_names_its_missing_package():
    """scripts/screenshot_chat_ui.py needs `websockets`, which nanovllm does not require: without
    it the script stops before doing anything, saying what to install."""
    blocked = "import sys; sys.modules.update(dict.fromkeys(['websockets', 'websockets.sync', 'websockets.sync.client']))"
    # (a None entry in sys.modules makes its import fail, as if the package were not installed)
    run = f"{blocked}; import runpy; runpy.run_path({os.path.join(REPO_ROOT, 'scripts', 'screenshot_chat_ui.py')!r}, run_name='__main__')"
    result = subprocess.run([sys.executable, "-c", run], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode != 0
    assert "pip install websockets" in result.stderr
