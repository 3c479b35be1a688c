"""Take docs/chat_ui.png: the Streamlit chat page (chat_ui.py) in headless Chromium, talking to
a running `nanovllm serve`.

    apt-get install -y chromium      # Debian's package
    python scripts/screenshot_chat_ui.py [--model DIR] [--out docs/chat_ui.png]

With no --model it builds the tiny random-weight Qwen3 checkpoint (nanovllm/testing/synthetic.py)
in a temporary directory, so the answers on the picture are meaningless text. It starts the
server and the page on free loopback ports, drives Chromium through the DevTools protocol (a
websocket; the `websockets` package comes with uvicorn's standard extras, or pip install it):
types each --message into the chat box, waits for the streamed answer, then saves the picture.
Every wait is bounded; everything it started is stopped at the end.
"""
import argparse
import base64
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

try:
    from websockets.sync.client import connect
except ImportError:  # not a requirement of nanovllm: only this script needs it
    sys.exit("screenshot_chat_ui.py needs the `websockets` package (Chromium's DevTools protocol is a "
             "websocket): pip install websockets")

REPO_ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT = 300.0  # seconds for the server (engine build) and the page to come up
ANSWER_TIMEOUT = 300.0
VIEWPORT = (1100, 720)  # pixels: the sidebar and two turns of conversation fit
CHAT_BOX = 'textarea[data-testid="stChatInputTextArea"]'
MESSAGES = ["Hello! What is the capital of France?", "Write a short poem about the sea."]
MAX_TOKENS = 40  # the page's max-tokens default here: two short answers fit on the picture


def start(args: list[str], **kwargs) -> subprocess.Popen:
    return subprocess.Popen(args, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, **kwargs)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def wait_for(what: str, ready, timeout: float = START_TIMEOUT, interval: float = 0.5):
    """Call ready() until it returns something truthy; give up after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = ready()
        if result:
            return result
        time.sleep(interval)
    raise TimeoutError(f"gave up waiting for {what}")


def start_server(model: str, log: Path, stack: ExitStack, one_thread: bool) -> str:
    """`nanovllm serve` on a free port; returns its base URL once the engine answers."""
    err = stack.enter_context(open(log, "w+"))
    # A tiny model gains nothing from more threads, and on a shared machine they only spin.
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if one_thread else None
    proc = start([sys.executable, "-m", "nanovllm", "serve", model, "--port", "0", "--served-model-name",
                  os.path.basename(os.path.normpath(model)), "--kvcache-block-size", "16",
                  "--num-kvcache-blocks", "256"], stderr=err, env=env)
    stack.callback(stop, proc)

    def url() -> str | None:
        assert proc.poll() is None, "the server exited:\n" + log.read_text()
        match = re.search(r"listening on (http://\S+)", log.read_text())
        return match.group(1) if match else None

    base = wait_for("the server's address", url)
    wait_for("the engine", lambda: _ok(base + "/health"))
    return base


def _ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_page(server: str, stack: ExitStack) -> str:
    port = free_port()
    env = {**os.environ, "NANOVLLM_BASE_URL": server + "/v1", "NANOVLLM_MAX_TOKENS": str(MAX_TOKENS)}
    proc = start([sys.executable, "-m", "streamlit", "run", "chat_ui.py", "--server.headless", "true",
                  "--server.address", "127.0.0.1", "--server.port", str(port), "--browser.gatherUsageStats",
                  "false", "--client.toolbarMode", "minimal"], env=env, stderr=subprocess.DEVNULL)
    stack.callback(stop, proc)
    url = f"http://127.0.0.1:{port}"
    wait_for("the Streamlit page", lambda: _ok(url + "/_stcore/health"))
    return url


class Browser:
    """Headless Chromium driven over the DevTools protocol (one page)."""

    def __init__(self, chromium: str, stack: ExitStack):
        profile = stack.enter_context(tempfile.TemporaryDirectory(prefix="chromium-"))
        proc = start([chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                      "--remote-debugging-port=0", f"--user-data-dir={profile}",
                      "about:blank"], stderr=subprocess.DEVNULL)
        stack.callback(stop, proc)
        port_file = Path(profile) / "DevToolsActivePort"  # Chromium writes the port it chose here
        port = wait_for("Chromium", lambda: port_file.is_file() and port_file.read_text().split("\n")[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as response:
            page = next(t for t in json.load(response) if t["type"] == "page")
        self.ws = stack.enter_context(connect(page["webSocketDebuggerUrl"], max_size=None))
        self.next_id = 0

    def call(self, method: str, **params) -> dict:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:  # skip events until our answer
            message = json.loads(self.ws.recv())
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    def js(self, expression: str):
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def send_chat(self, text: str) -> None:
        self.js(f"document.querySelector('{CHAT_BOX}').focus()")
        self.call("Input.insertText", text=text)
        for kind in ("keyDown", "keyUp"):
            self.call("Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter", windowsVirtualKeyCode=13)


def num_answered(server: str) -> int:
    """Requests the server has finished, from its /metrics."""
    with urllib.request.urlopen(server + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return int(sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("nanovllm_request_finished_total")))


def count_messages(browser: Browser) -> int:
    return browser.js('document.querySelectorAll(\'[data-testid="stChatMessage"]\').length') or 0


def is_idle(browser: Browser) -> bool:
    """The page has finished running its script (Streamlit shows a status widget while it runs)."""
    return browser.js('document.querySelector(\'[data-testid="stStatusWidget"]\') === null')


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint directory (default: a tiny random-weight one, built now)")
    parser.add_argument("--out", default=str(REPO_ROOT / "docs" / "chat_ui.png"), help="where to save the PNG")
    parser.add_argument("--message", action="append", help="a message to send (repeatable; default: two)")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "chromium", help="the browser binary")
    args = parser.parse_args()
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="chat-ui-shot-")))
        model = args.model
        if model is None:
            sys.path.insert(0, str(REPO_ROOT))  # run as a script from a checkout: the package is next door
            from nanovllm.testing.synthetic import build_checkpoint
            model = build_checkpoint(str(workdir / "tiny-random-qwen3"), "qwen3")
            print(f"built a tiny random-weight checkpoint in {model}", file=sys.stderr)
        server = start_server(model, workdir / "server.log", stack, one_thread=args.model is None)
        page = start_page(server, stack)
        browser = Browser(args.chromium, stack)
        browser.call("Page.enable")
        browser.call("Emulation.setDeviceMetricsOverride", width=VIEWPORT[0], height=VIEWPORT[1],
                     deviceScaleFactor=1, mobile=False)
        browser.call("Page.navigate", url=page)
        wait_for("the chat box", lambda: browser.js(f"document.querySelector('{CHAT_BOX}') !== null"))
        for message in args.message or MESSAGES:
            before = count_messages(browser)
            browser.send_chat(message)
            answered = num_answered(server) + 1

            def done() -> bool:
                # The server has sent the whole answer, and the page has shown it and finished its run
                # (the page alone cannot tell: right after Enter it looks idle before its run begins).
                return num_answered(server) >= answered and count_messages(browser) >= before + 2 and \
                    is_idle(browser)
            wait_for("the answer", done, timeout=ANSWER_TIMEOUT)
            wait_for("the page to settle", lambda: time.sleep(1.0) or is_idle(browser))
        shot = browser.call("Page.captureScreenshot", format="png")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_bytes(base64.b64decode(shot["data"]))
    print(f"saved {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
