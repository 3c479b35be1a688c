"""The `nanovllm` command through subprocesses (`python -m nanovllm`): --version, --help (every
choice listed from Config's own types, internals hidden), wrong flags (exit 2), a missing model
(exit 1, one line), `generate` equal to LLM.generate, `chat` driven through a pseudo-terminal
(two turns, Ctrl-C, /reset, slash words as commands), Ctrl-C ending `generate` in one line (exit
130) and `serve` in order (exit 0), `serve` stopped by SIGTERM with requests in flight (exit 0),
the `ui` command line, and the INFO line when the checkpoint caps max_model_len. The
subprocesses of the simple cases start together, so their start-ups overlap."""
import asyncio
import dataclasses
import fcntl
import json
import logging
import os
import pty
import select
import signal
import subprocess
import sys
import termios
import time
import tomllib
import typing
import urllib.request

import openai
import pytest

import nanovllm
import nanovllm.entrypoints.cli.main as cli_module
from nanovllm import LLM, SamplingParams
from nanovllm.config import Config
from nanovllm.entrypoints.cli.main import CHAT_UI_SCRIPT, build_parser, main, ui_command
from serving import ENGINE_FLAGS, ENGINE_KWARGS, REPO_ROOT, cli, start_cli, wait_for_listening

PROMPTS = ["Hello world! How are", "The cache is split into"]
RUN_TIMEOUT = 300  # seconds for one CLI run on a busy machine (most of it importing torch)
CHAT_MAX_TOKENS = 64  # long enough that a Ctrl-C sent at the first streamed bytes lands mid-answer


@pytest.fixture(scope="module")
def runs(qwen3_tiny):
    """The one-shot commands, started at once; each test reads its own."""
    commands = {
        "help": ["--help"],
        "version": ["--version"],
        "bad_flags": ["generate", qwen3_tiny, "hi", "--temperature", "hot", "--no-such-flag"],
        "missing": ["generate", os.path.join(qwen3_tiny, "no-such-model"), "hi"],
        "generate": ["generate", qwen3_tiny, *PROMPTS, "--json", "--temperature", "0", "--max-tokens", "6",
                     *ENGINE_FLAGS],
    }
    procs = {name: start_cli(*args) for name, args in commands.items()}
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=RUN_TIMEOUT)
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def offline(qwen3_tiny):
    llm = LLM(qwen3_tiny, **ENGINE_KWARGS)
    yield llm
    llm.exit()


def test_help(runs):
    rc, out, err = finish(runs["help"])
    assert rc == 0, err
    for command in ("serve", "generate", "chat", "bench"):
        assert command in out


def test_version_is_the_package_version(runs):
    rc, out, err = finish(runs["version"])
    assert rc == 0, err
    with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as f:
        declared = tomllib.load(f)["project"]["version"]
    assert out == f"nanovllm {nanovllm.__version__}\n" and nanovllm.__version__ == declared


def hidden(field: dataclasses.Field) -> bool:
    return bool(field.metadata.get("cli_hidden"))


def help_text(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as info:
        main([*args, "--help"])
    assert info.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command", ["serve", "generate", "chat"])
def test_every_config_field_is_a_flag(command, capsys):
    out = help_text(capsys, command)
    fields = [f.name for f in dataclasses.fields(Config) if f.init and f.name != "model" and not hidden(f)]
    if command != "serve":
        fields += [f.name for f in dataclasses.fields(SamplingParams) if f.init]
    for name in fields:
        assert "--" + name.replace("_", "-") in out, name


@pytest.mark.parametrize("command", ["serve", "generate", "chat", "batch"])
def test_help_lists_every_choice_from_configs_types_and_hides_internals(command, capsys):
    out = help_text(capsys, command)
    hints = typing.get_type_hints(Config)
    literal_fields = 0
    for f in dataclasses.fields(Config):
        literals = [arg for arg in (typing.get_args(hints[f.name]) or (hints[f.name],))
                    if typing.get_origin(arg) is typing.Literal] + \
            ([hints[f.name]] if typing.get_origin(hints[f.name]) is typing.Literal else [])
        if f.init and literals:
            literal_fields += 1
            choices = ",".join(typing.get_args(literals[0]))
            assert f"--{f.name.replace('_', '-')} {{{choices}}}" in out, f.name
    assert literal_fields >= 9  # device, dtype, kv_cache_dtype, attention_backend, policies, modes, ...
    for shown in ("--dtype {auto,float32,float16,bfloat16}", "--device {auto,cuda,cpu}",
                  "--kv-cache-dtype {auto,fp8_e4m3,fp8_e5m2}", "--scheduling-policy {mixed,prefill_first}",
                  "--preemption-mode {recompute,swap}"):
        assert shown in out
    internal = [f.name for f in dataclasses.fields(Config) if hidden(f)]
    assert internal and not any("--" + name.replace("_", "-") in out for name in internal)


def test_hidden_flags_are_still_taken_and_choices_checked(qwen3_tiny, capsys):
    args = build_parser().parse_args(["generate", qwen3_tiny, "hi", "--no-cpu-malloc-tuning",
                                      "--tensor-parallel-heartbeat-timeout-s", "5", "--kv-cache-dtype", "fp8_e5m2"])
    assert args.cpu_malloc_tuning is False and args.tensor_parallel_heartbeat_timeout_s == 5.0
    assert args.kv_cache_dtype == "fp8_e5m2"
    with pytest.raises(SystemExit) as info:
        main(["generate", qwen3_tiny, "hi", "--kv-cache-dtype", "fp4"])
    assert info.value.code == 2 and "invalid choice: 'fp4'" in capsys.readouterr().err


def test_max_model_len_capped_by_the_checkpoint_is_logged(gpt2_tiny, caplog):
    with caplog.at_level(logging.INFO, logger="nanovllm"):
        assert Config(gpt2_tiny, max_model_len=4096).max_model_len == 128
    assert "max_model_len=4096 capped to 128: the checkpoint's n_positions" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="nanovllm"):
        Config(gpt2_tiny, max_model_len=100)
    assert "capped" not in caplog.text


def test_bench_help_is_bench_py_help(capsys):
    assert main(["bench", "--help"]) == 0
    assert "--compare-hf" in capsys.readouterr().out


def test_wrong_flags_exit_2(runs, qwen3_tiny, capsys):
    rc, _, err = finish(runs["bad_flags"])
    assert rc == 2 and "invalid float value: 'hot'" in err and "Traceback" not in err, err
    for args in (["serve", qwen3_tiny, "--no-such-flag"], ["chat", qwen3_tiny, "--device", "tpu"], ["generate"]):
        with pytest.raises(SystemExit) as info:
            main(args)
        assert info.value.code == 2
        assert "error:" in capsys.readouterr().err


def test_missing_model_exits_1_with_one_line(runs):
    rc, out, err = finish(runs["missing"])
    assert rc == 1
    assert err.strip().count("\n") == 0 and "does not exist" in err and "Traceback" not in err


@pytest.mark.parametrize("flags, named", [(["--kvcache-block-size", "17"], "kvcache_block_size=17"),
                                          (["--max-queue-len", "0"], "max_queue_len=0"),
                                          (["--skip-tokenizer-init"], "skip_tokenizer_init")])
def test_serve_refuses_bad_settings_before_starting(qwen3_tiny, capsys, flags, named):
    assert main(["serve", qwen3_tiny, *flags, "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err


def test_generate_json_equals_llm_generate(runs, offline):
    rc, out, err = finish(runs["generate"])
    assert rc == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    expected = offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert [(o["token_ids"], o["text"], o["finish_reason"]) for o in lines] == \
        [(e["token_ids"], e["text"], e["finish_reason"]) for e in expected]


def test_generate_prints_the_completion(qwen3_tiny, offline, capsys):
    args = ["generate", qwen3_tiny, PROMPTS[0], "--temperature", "0", "--max-tokens", "5", *ENGINE_FLAGS]
    assert main(args) == 0
    expected = offline.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    assert capsys.readouterr().out == expected["text"] + "\n"


def test_dict_fields_take_json(qwen3_tiny, offline, capsys):
    """--speculative-config takes a JSON object (as vLLM's); the output is the greedy one still."""
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 2})
    args = ["generate", qwen3_tiny, PROMPTS[0], "--temperature", "0", "--max-tokens", "5", *ENGINE_FLAGS]
    assert main([*args, "--speculative-config", spec]) == 0
    expected = offline.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    assert capsys.readouterr().out == expected["text"] + "\n"
    for bad, says in (("{method: ngram}", "is not JSON"), ("[1, 2]", "is not a JSON object")):
        with pytest.raises(SystemExit) as info:
            main([*args, "--speculative-config", bad])
        assert info.value.code == 2 and says in capsys.readouterr().err


class Terminal:
    """A command on a pseudo-terminal that is its controlling terminal, so Ctrl-C is SIGINT."""

    def __init__(self, args: list[str]):
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, cwd=REPO_ROOT,
                                     start_new_session=True,
                                     preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
        os.close(slave)
        self.buffer = b""

    def read_until(self, marker: bytes, timeout: float = RUN_TIMEOUT) -> bytes:
        """Everything up to and including `marker` (bounded by `timeout`)."""
        deadline = time.monotonic() + timeout
        while marker not in self.buffer:
            assert time.monotonic() < deadline, f"no {marker!r} in {self.buffer[-400:]!r}"
            ready, _, _ = select.select([self.master], [], [], 0.2)
            if ready:
                try:
                    self.buffer += os.read(self.master, 65536)
                except OSError:  # the command exited
                    assert marker in self.buffer, f"exited before {marker!r}: {self.buffer[-400:]!r}"
        end = self.buffer.index(marker) + len(marker)
        seen, self.buffer = self.buffer[:end], self.buffer[end:]
        return seen

    def wait_for_output(self, timeout: float = RUN_TIMEOUT) -> None:
        """Until something not yet read has arrived."""
        deadline = time.monotonic() + timeout
        while not self.buffer:
            assert time.monotonic() < deadline, "no output"
            ready, _, _ = select.select([self.master], [], [], 0.2)
            if ready:
                self.buffer += os.read(self.master, 65536)

    def send(self, data: bytes) -> None:
        os.write(self.master, data)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(RUN_TIMEOUT)
        os.close(self.master)


def test_chat_through_a_terminal(qwen3_tiny, offline):
    params = SamplingParams(temperature=0, max_tokens=CHAT_MAX_TOKENS)

    def answer(conversation: list[dict]) -> bytes:
        text = offline.chat(conversation, params, use_tqdm=False)[0]["text"]
        return text.encode().replace(b"\n", b"\r\n")  # the terminal turns "\n" into "\r\n"

    turn1 = [{"role": "user", "content": "Hello"}]
    first = answer(turn1)
    turn2 = turn1 + [{"role": "assistant", "content": first.decode().replace("\r\n", "\n")},
                     {"role": "user", "content": "And then?"}]
    second = answer(turn2)
    prompt = b"\r\n> "
    term = Terminal(cli("chat", qwen3_tiny, "--temperature", "0", "--max-tokens", str(CHAT_MAX_TOKENS),
                        *ENGINE_FLAGS))
    try:
        term.read_until(prompt)
        term.send(b"Hello\n")
        assert term.read_until(prompt) == b"Hello\r\n" + first + prompt
        term.send(b"And then?\n")  # the answer depends on the first turn: the conversation is kept
        assert term.read_until(prompt) == b"And then?\r\n" + second + prompt
        term.send(b"Tell me more\n")
        term.read_until(b"Tell me more\r\n")
        term.wait_for_output()  # the answer has started streaming: stop it
        term.send(b"\x03")
        assert b"[stopped]" in term.read_until(prompt)
        term.send(b"/reset\n")
        term.read_until(b"(conversation cleared)" + prompt)
        term.send(b"/clear\n")
        term.read_until(b"(conversation cleared)" + prompt)
        term.send(b"Hello\n")  # as the first turn again: the history is gone
        assert term.read_until(prompt) == b"Hello\r\n" + first + prompt
        term.send(b"\x04")  # Ctrl-D ends the session
        assert term.proc.wait(RUN_TIMEOUT) == 0
    finally:
        term.close()


def test_chat_template_flags(qwen3_tiny, offline, tmp_path):
    """--chat-template and --chat-template-kwargs render the conversation as LLM.chat does with
    the same options; a template that does not compile fails before the model loads."""
    template = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
                "{% if shout %}{{ 'LOUD ' }}{% endif %}{{ 'assistant:' }}")
    path = tmp_path / "template.jinja"
    path.write_text(template)
    params = SamplingParams(temperature=0, max_tokens=CHAT_MAX_TOKENS)
    expected = offline.chat([{"role": "user", "content": "Hello"}], params, use_tqdm=False, chat_template=template,
                            chat_template_kwargs={"shout": True})[0]
    assert expected["prompt_token_ids"] != offline.chat([{"role": "user", "content": "Hello"}], params,
                                                        use_tqdm=False, chat_template=template)[0]["prompt_token_ids"]
    prompt = b"\r\n> "
    term = Terminal(cli("chat", qwen3_tiny, "--temperature", "0", "--max-tokens", str(CHAT_MAX_TOKENS),
                        "--chat-template", str(path), "--chat-template-kwargs", '{"shout": true}', *ENGINE_FLAGS))
    try:
        term.read_until(prompt)
        term.send(b"Hello\n")
        assert term.read_until(prompt) == b"Hello\r\n" + expected["text"].encode().replace(b"\n", b"\r\n") + prompt
        term.send(b"\x04")
        assert term.proc.wait(RUN_TIMEOUT) == 0
    finally:
        term.close()
    bad = subprocess.run(cli("chat", qwen3_tiny, "--chat-template", "{% for %}"), cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert bad.returncode != 0 and "does not compile" in bad.stderr and "Traceback" not in bad.stderr


def session_members(session: int) -> list[int]:
    """The live (not zombie) processes of a session, from /proc."""
    members = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, _, _, sid = f.read().rsplit(")", 1)[1].split()[:4]
        except OSError:  # it has just gone
            continue
        if int(sid) == session and state != "Z":
            members.append(int(entry))
    return members


@pytest.mark.parametrize("ctrl_c", [False, True], ids=["sigterm_to_the_server", "sigint_to_the_process_group"])
def test_serve_sigterm_finishes_in_flight_requests_and_exits_0(qwen3_tiny, offline, ctrl_c):
    """SIGTERM to the server, or Ctrl-C (SIGINT to every process of the group) to a server with
    --engine-process (the engine process ignores it), while a stream is running: the server stops
    accepting, the stream still gets every token, then the engine is freed, every process of the
    server ends and the server exits 0 (the cut-off at the end of the grace period is tested in
    test_openai_server.py)."""
    max_tokens = 48
    proc = start_cli("serve", qwen3_tiny, "--port", "0", "--shutdown-timeout", str(RUN_TIMEOUT), *ENGINE_FLAGS,
                     *(["--engine-process"] if ctrl_c else []), start_new_session=True)
    try:
        url, _ = wait_for_listening(proc)

        async def run() -> str:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=RUN_TIMEOUT)
            async with client:
                stream = await client.completions.create(model=qwen3_tiny, prompt=PROMPTS[0], max_tokens=max_tokens,
                                                         temperature=0, stream=True, extra_body={"ignore_eos": True})
                first = await anext(aiter(stream))  # it is generating
                if ctrl_c:
                    os.killpg(proc.pid, signal.SIGINT)
                else:
                    proc.send_signal(signal.SIGTERM)
                return first.choices[0].text + "".join([c.choices[0].text async for c in stream])

        text = asyncio.run(run())
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        assert text == offline.generate(PROMPTS[:1], params, use_tqdm=False)[0]["text"]
        assert proc.wait(RUN_TIMEOUT) == 0
        err = proc.stderr.read()
        assert "engine stopped" in err and "Traceback" not in err, err
        deadline = time.monotonic() + 10
        while session_members(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert session_members(proc.pid) == []  # the engine process has ended with the server
    finally:
        if proc.poll() is None:
            proc.kill()


def test_chat_slash_words_are_commands(qwen3_tiny, offline):
    """/help lists the commands, an unknown /word says so, and neither reaches the model: the
    next message is answered as the first of a conversation. "//" sends a line starting with "/";
    /exit quits."""
    params = SamplingParams(temperature=0, max_tokens=CHAT_MAX_TOKENS)
    first = offline.chat([{"role": "user", "content": "Hello"}], params, use_tqdm=False)[0]["text"]
    slashed = offline.chat([{"role": "user", "content": "/etc is"}], params, use_tqdm=False)[0]["text"]
    prompt = b"\r\n> "
    term = Terminal(cli("chat", qwen3_tiny, "--temperature", "0", "--max-tokens", str(CHAT_MAX_TOKENS),
                        *ENGINE_FLAGS))
    try:
        assert b"/help lists the commands" in term.read_until(prompt)
        term.send(b"/help\n")
        listed = term.read_until(prompt)
        assert all(word in listed for word in (b"/help", b"/clear", b"/exit"))
        term.send(b"/nope and more\n")
        assert term.read_until(prompt) == b"/nope and more\r\nunknown command /nope; /help lists them" + prompt
        term.send(b"Hello\n")
        assert term.read_until(prompt) == b"Hello\r\n" + first.encode().replace(b"\n", b"\r\n") + prompt
        term.send(b"/clear\n")
        term.read_until(b"(conversation cleared)" + prompt)
        term.send(b"//etc is\n")  # "//" sends a message that starts with "/"
        assert term.read_until(prompt) == b"//etc is\r\n" + slashed.encode().replace(b"\n", b"\r\n") + prompt
        term.send(b"/exit\n")
        assert term.proc.wait(RUN_TIMEOUT) == 0
    finally:
        term.close()


def read_stderr_until(proc: subprocess.Popen, marker: str) -> str:
    lines = []
    deadline = time.monotonic() + RUN_TIMEOUT
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        assert line, "exited before " + marker + ":\n" + "".join(lines)
        lines.append(line)
        if marker in line:
            return "".join(lines)
    raise AssertionError("no " + marker)


@pytest.fixture
def interruptible_children():
    """Children that start with SIGINT at its default, as from a terminal. A test run started in
    the background by a non-interactive shell has SIGINT ignored, which children inherit, and
    Python then installs no KeyboardInterrupt handler: a Ctrl-C test would see its child run on."""
    previous = signal.getsignal(signal.SIGINT)
    if previous == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # exec resets a handler to SIG_DFL
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_during_generate_prints_one_line_and_exits_130(qwen3_tiny, interruptible_children):
    proc = start_cli("generate", qwen3_tiny, "Hello", "--max-tokens", "1000000", "--ignore-eos", *ENGINE_FLAGS)
    try:
        read_stderr_until(proc, "start-up")  # the engine is built: it is generating now
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=RUN_TIMEOUT)
        assert proc.returncode == 130
        assert err.strip() == "nanovllm: interrupted" and out == "", err
    finally:
        if proc.poll() is None:
            proc.kill()


def test_ctrl_c_stops_serve_in_order_with_exit_0(qwen3_tiny):
    proc = start_cli("serve", qwen3_tiny, "--port", "0", *ENGINE_FLAGS)
    try:
        url, _ = wait_for_listening(proc)
        read_stderr_until(proc, "engine ready")
        with urllib.request.urlopen(url + "/health", timeout=RUN_TIMEOUT) as response:
            assert response.status == 200
        proc.send_signal(signal.SIGINT)
        assert proc.wait(RUN_TIMEOUT) == 0
        err = proc.stderr.read()
        assert "engine stopped" in err and "Traceback" not in err and "interrupted" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()


def test_ui_runs_streamlit_on_loopback_without_usage_statistics(monkeypatch):
    monkeypatch.delenv("NANOVLLM_BASE_URL", raising=False)
    command = ui_command(build_parser().parse_args(["ui"]))
    assert command.argv[:5] == [sys.executable, "-m", "streamlit", "run", str(CHAT_UI_SCRIPT)]
    options = dict(zip(command.argv[5::2], command.argv[6::2]))
    assert options == {"--server.address": "127.0.0.1", "--server.port": "8501",
                       "--browser.gatherUsageStats": "false", "--server.showEmailPrompt": "false"}
    assert "NANOVLLM_BASE_URL" not in command.env  # chat_ui.py's own default: serve's address
    command = ui_command(build_parser().parse_args(["ui", "--server-port", "8123", "--model", "m", "--port", "9000"]))
    assert command.env["NANOVLLM_BASE_URL"] == "http://127.0.0.1:8123/v1" and command.env["NANOVLLM_MODEL"] == "m"
    assert command.argv[command.argv.index("--server.port") + 1] == "9000"
    url = "http://10.0.0.5:8000/v1"
    assert ui_command(build_parser().parse_args(["ui", "--server-url", url])).env["NANOVLLM_BASE_URL"] == url


def test_ui_options_are_streamlits_and_the_command_is_run(monkeypatch):
    """Each option is one Streamlit knows, and `nanovllm ui` hands the process over to that command."""
    from streamlit import config as streamlit_config

    argv = ui_command(build_parser().parse_args(["ui"])).argv
    for option in argv[5::2]:
        assert option.removeprefix("--") in streamlit_config._config_options_template, option

    class Exec(Exception):
        pass

    def execve(path, args, env):
        raise Exec(path, args, env)
    monkeypatch.setattr(cli_module.os, "execve", execve)
    with pytest.raises(Exec) as ran:
        main(["ui", "--model", "m"])
    assert ran.value.args[1] == argv and ran.value.args[2]["NANOVLLM_MODEL"] == "m"


def test_ui_without_streamlit_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setattr(cli_module, "_streamlit_installed", lambda: False)
    monkeypatch.setattr(cli_module.os, "execve", lambda *args: pytest.fail("ran without streamlit"))
    assert main(["ui"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and 'pip install -e ".[ui]"' in err and "Streamlit" in err
