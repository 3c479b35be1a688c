"""The `nanovllm` command (also `python -m nanovllm`): serve, generate, chat, batch, bench, ui, demo-model.

One argparse parser per subcommand, each added by its own `_add_<command>` function; the engine
flags are generated from `Config` and the sampling flags from `SamplingParams` (cli_args.py), so
the CLI follows the API, choices included. Wrong flags exit 2 (argparse); a model directory that
is missing, or an engine that refuses its settings, exits 1 with one line; Ctrl-C exits 130 with
one line (`serve` shuts down in order and exits 0). It knows nothing of HTTP: `serve` hands over
to openai_server.serve(), and `ui` to Streamlit running chat_ui.py.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import runpy
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import nanovllm  # the package alone: torch comes with the first engine module (see main)
from nanovllm.entrypoints.cli.args import add_dataclass_flags, dataclass_kwargs, json_object
from nanovllm.entrypoints.openai.reasoning import REASONING_PARSERS
from nanovllm.entrypoints.openai.server_settings import (DEFAULT_HOST, DEFAULT_PORT, DEFAULT_SHUTDOWN_TIMEOUT,
                                                  ServerSettings, api_key_from_env)

if TYPE_CHECKING:
    from nanovllm import LLM, SamplingParams

PROG = "nanovllm"
# bench.py and chat_ui.py live at the repository root (scripts, not part of the package): found from here.
REPO_ROOT = Path(__file__).resolve().parents[3]
BENCH_SCRIPT = REPO_ROOT / "bench.py"
CHAT_UI_SCRIPT = REPO_ROOT / "chat_ui.py"
CHAT_PROMPT = "> "
# The chat's slash commands, with what /help says of each; "//" starts a message with a slash.
CHAT_COMMANDS = {
    "/help": "list these commands",
    "/clear": "start the conversation over (also /reset)",
    "/exit": "quit (also /quit, or Ctrl-D)",
}
CHAT_ALIASES = {"/reset": "/clear", "/quit": "/exit"}
UI_HOST = "127.0.0.1"  # loopback: exposing the chat page is a deliberate --host choice
UI_PORT = 8501  # Streamlit's default
# The chat page's settings come to chat_ui.py through its environment (see its docstring).
UI_BASE_URL_ENV, UI_MODEL_ENV = "NANOVLLM_BASE_URL", "NANOVLLM_MODEL"
INTERRUPTED_EXIT = 130  # the shell's status for a command stopped by Ctrl-C (128 + SIGINT)
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


# The commands whose MODEL is optional: without it they run the demo model (built once, cached).
DEMO_MODEL_COMMANDS = ("serve", "generate", "chat")


class CLIError(Exception):
    """A refusal to report in one line with exit status 1 (no traceback)."""


def _add_model(parser: argparse.ArgumentParser, optional: bool = False) -> None:
    if optional:  # None: the demo model, resolved in main()
        parser.add_argument("model", metavar="MODEL", nargs="?", help="local checkpoint directory (config.json, "
                            "*.safetensors, tokenizer files); nothing is downloaded. Default: the demo model "
                            "(`nanovllm demo-model`), built once into the cache")
        return
    parser.add_argument("model", metavar="MODEL", help="local checkpoint directory (config.json, *.safetensors, "
                        "tokenizer files); nothing is downloaded")


def _add_engine_flags(parser: argparse.ArgumentParser) -> list[str]:
    from nanovllm.config import Config

    group = parser.add_argument_group("engine", "Config fields (nanovllm/config.py)")
    return add_dataclass_flags(group, Config, skip=("model",))  # choices from the fields' Literal types


def _add_sampling_flags(parser: argparse.ArgumentParser) -> list[str]:
    from nanovllm.sampling_params import SamplingParams

    group = parser.add_argument_group("sampling", "SamplingParams fields (nanovllm/sampling_params.py)")
    return add_dataclass_flags(group, SamplingParams)


def package_version() -> str:
    """The installed package's version, or the source tree's when it is run from a checkout."""
    try:
        return importlib.metadata.version("nanovllm")
    except importlib.metadata.PackageNotFoundError:
        return nanovllm.__version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="nanovllm: a small LLM inference engine.")
    parser.add_argument("--version", action="version", version=f"{PROG} {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_serve, _add_generate, _add_chat, _add_batch, _add_bench, _add_ui, _add_demo_model):
        add(sub)
    return parser


def _add_serve(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                           description="Serve MODEL over an OpenAI-compatible HTTP API (/v1/completions, "
                                       "/v1/chat/completions, /v1/models, /health, /metrics). SIGTERM or "
                                       "Ctrl-C stops it gracefully.")
    _add_model(serve, optional=True)
    serve.add_argument("--host", default=DEFAULT_HOST, help="address to bind (default: %(default)s, loopback only)")
    serve.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to bind; 0 picks a free one "
                       "(default: %(default)s)")
    serve.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT,
                       help="seconds in-flight requests get to finish after SIGTERM/SIGINT before they are "
                            "aborted (default: %(default)s)")
    serve.add_argument("--log-level", default="info", choices=UVICORN_LOG_LEVELS, help="(default: %(default)s)")
    server_group = serve.add_argument_group("server", "ServerSettings fields (nanovllm/entrypoints/openai/server_settings.py)")
    server_fields = add_dataclass_flags(server_group, ServerSettings, skip=("model", "engine_kwargs"),
                                        choices={"reasoning_parser": tuple(REASONING_PARSERS)})
    engine_fields = _add_engine_flags(serve)
    # Left unset, the server picks it (server_settings.CPU_SERVING_MAX_BATCHED_TOKENS on CPU).
    serve.set_defaults(run=_serve, engine_fields=engine_fields, server_fields=server_fields,
                       max_num_batched_tokens=None)


def _add_generate(sub: argparse._SubParsersAction) -> None:
    generate = sub.add_parser("generate", help="complete prompts and print the completions",
                              description="Complete each PROMPT with MODEL and print the completions, one per "
                                          "prompt (--json: the output dict of LLM.generate, one JSON line each).")
    _add_model(generate, optional=True)
    generate.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompt text")
    generate.add_argument("--json", action="store_true", help="print each output dict as one JSON line")
    engine_fields = _add_engine_flags(generate)
    sampling_fields = _add_sampling_flags(generate)
    generate.set_defaults(run=_generate, engine_fields=engine_fields, sampling_fields=sampling_fields)


def _add_chat(sub: argparse._SubParsersAction) -> None:
    chat = sub.add_parser("chat", help="chat with a model in the terminal",
                          description="Chat with MODEL through its chat template; answers stream as they are "
                                      "made. A line starting with / is a command, never sent to the model: "
                                      "/help lists them, /clear starts the conversation over, /exit (or Ctrl-D) "
                                      "quits; // sends a line that starts with /. Ctrl-C stops the answer being "
                                      "written.")
    _add_model(chat, optional=True)
    chat.add_argument("--system", default=None, help="a system message to open every conversation with")
    chat.add_argument("--chat-template", default=None, help="a chat template to use instead of the checkpoint's: "
                      "a file, or the template itself")
    chat.add_argument("--chat-template-kwargs", type=json_object, default={}, metavar="JSON",
                      help="extra chat template variables, as a JSON object (Qwen3: '{\"enable_thinking\": false}')")
    engine_fields = _add_engine_flags(chat)
    sampling_fields = _add_sampling_flags(chat)
    chat.set_defaults(run=_chat, engine_fields=engine_fields, sampling_fields=sampling_fields)


def _add_batch(sub: argparse._SubParsersAction) -> None:
    # batch: the job's own flags live with the job (entrypoints/batch/job.py).
    batch = sub.add_parser("batch", help="run a JSONL file of requests into a JSONL file of results (resumable)",
                           description="Run every request line of --input with MODEL and append one result line "
                                       "per request to --output as it finishes. Killed and started again with the "
                                       "same command, it resumes where it stopped. The sampling flags are the "
                                       "defaults of every line; a line's own fields win.")
    _add_model(batch)
    from nanovllm.entrypoints.batch.job import add_job_flags

    add_job_flags(batch)
    engine_fields = _add_engine_flags(batch)
    sampling_fields = _add_sampling_flags(batch)
    batch.set_defaults(run=_batch, engine_fields=engine_fields, sampling_fields=sampling_fields)



def _add_demo_model(sub: argparse._SubParsersAction) -> None:
    from nanovllm import demo_model
    demo_model.add_subcommand(sub)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    # Listed here for --help; its arguments go to bench.py untouched (see main).
    sub.add_parser("bench", help="run the throughput benchmark (bench.py; `nanovllm bench --help` for its flags)",
                   add_help=False)


def _add_ui(sub: argparse._SubParsersAction) -> None:
    ui = sub.add_parser("ui", help="open the chat page (Streamlit) for a running `nanovllm serve`",
                        description="Run chat_ui.py, the Streamlit chat page, for a running `nanovllm serve`: it "
                                    "listens on loopback only and sends Streamlit no usage statistics. Needs "
                                    'the ui extra: pip install -e ".[ui]".')
    server = ui.add_mutually_exclusive_group()
    server.add_argument("--server-url", help="the server's OpenAI base URL (default: $NANOVLLM_BASE_URL, else "
                        "http://127.0.0.1:8000/v1, `nanovllm serve`'s)")
    server.add_argument("--server-port", type=int, help="the port of a server on this machine, for "
                        "http://127.0.0.1:PORT/v1")
    ui.add_argument("--model", help="the model name to ask for (default: $NANOVLLM_MODEL, else the server's)")
    ui.add_argument("--host", default=UI_HOST, help="address the page binds (default: %(default)s, loopback only)")
    ui.add_argument("--port", type=int, default=UI_PORT, help="port the page listens on (default: %(default)s)")
    ui.set_defaults(run=_ui)


def _check_model_dir(model: str) -> None:
    if not os.path.isdir(model):
        raise CLIError(f"model directory {model!r} does not exist")
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise CLIError(f"{model!r} has no config.json; MODEL must be a checkpoint directory")


def _make_llm(args: argparse.Namespace) -> LLM:
    """The engine, or a one-line CLIError when it refuses the model or the settings."""
    from nanovllm import LLM

    _check_model_dir(args.model)
    try:
        return LLM(args.model, **dataclass_kwargs(args, args.engine_fields))
    except ValueError as exc:
        raise CLIError(str(exc)) from None


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    from nanovllm import SamplingParams

    try:
        return SamplingParams(**dataclass_kwargs(args, args.sampling_fields))
    except ValueError as exc:
        raise CLIError(str(exc)) from None


def _serve(args: argparse.Namespace) -> int:
    from nanovllm.config import Config
    from nanovllm.entrypoints.openai.api_server import serve  # the web stack, only when serving

    _check_model_dir(args.model)
    settings = ServerSettings(args.model, dataclass_kwargs(args, args.engine_fields),
                              **dataclass_kwargs(args, args.server_fields))
    if settings.api_key is None:
        settings.api_key = api_key_from_env()
    try:  # the engine is built later, inside the server: check its settings now, in one line
        settings.check()  # first: the server's own settings need no checkpoint read
        Config.from_kwargs(args.model, settings.engine_kwargs)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    try:
        return serve(settings, args.host, args.port, args.shutdown_timeout, args.log_level)
    except OSError as exc:  # from binding the address, the only OSError serve() lets out
        raise CLIError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from None


def _generate(args: argparse.Namespace) -> int:
    params = _sampling_params(args)
    llm = _make_llm(args)
    try:
        outputs = llm.generate(args.prompts, params, use_tqdm=False)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    finally:
        llm.exit()
    for output in outputs:
        print(json.dumps(output) if args.json else output["text"], flush=True)
    return 0


def _batch(args: argparse.Namespace) -> int:
    from nanovllm.entrypoints.batch.job import BatchJob, BatchJobError, run_batch

    _check_model_dir(args.model)
    _sampling_params(args)  # the defaults every line starts from: checked once, before any work
    if not args.ray and args.replicas != 1:
        raise CLIError(f"--replicas={args.replicas} needs --ray (without Ray, use --data-parallel)")
    job = BatchJob(args.model, args.input, args.output, dataclass_kwargs(args, args.engine_fields),
                   dataclass_kwargs(args, args.sampling_fields), args.max_in_flight, args.data_parallel,
                   args.flush_interval, args.progress, args.overwrite)
    try:
        if args.ray:
            try:
                from nanovllm.entrypoints.batch.ray import run_ray_batch
            except ImportError as exc:
                raise CLIError(f"--ray needs Ray Data ({exc}); pip install 'nanovllm[ray]'") from None
            run_ray_batch(job, args.replicas, args.ray_address, args.cpus_per_replica)
        else:
            run_batch(job)
    except (ValueError, BatchJobError) as exc:  # refused before any work, or a job that cannot end whole
        raise CLIError(str(exc)) from None
    return 0


def _stream_answer(llm, prompt: list[int], params: SamplingParams) -> str:
    """Print the answer as it streams; Ctrl-C stops it (the request is aborted, the session goes on).
    Returns the text printed."""
    stop = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda signum, frame: stop.set())
    pieces = []
    stream = llm.stream([prompt], params)
    try:
        for output in stream:
            print(output.text, end="", flush=True)
            pieces.append(output.text)
            if stop.is_set():
                print(" [stopped]", end="")
                break
    finally:
        stream.close()  # an unfinished request is aborted, its KV blocks freed
        signal.signal(signal.SIGINT, previous)
        print(flush=True)
    return "".join(pieces)


def _chat_help() -> str:
    width = max(map(len, CHAT_COMMANDS))
    return "\n".join(f"{name:<{width}}  {what}" for name, what in CHAT_COMMANDS.items()) + \
        "\n//text sends a message that starts with /text; Ctrl-C stops an answer"


def _chat(args: argparse.Namespace) -> int:
    from nanovllm.engine.chat import ChatOptions, load_chat_template, render_chat
    params = _sampling_params(args)
    if params.n != 1:
        raise CLIError(f"n={params.n} is not allowed in chat; a chat answers once (n=1)")
    try:  # before the model loads: a bad template or variable fails at once
        template = None if args.chat_template is None else load_chat_template(args.chat_template)
        options = ChatOptions(chat_template=template, chat_template_kwargs=args.chat_template_kwargs)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    llm = _make_llm(args)
    tokenizer = llm.tokenizer
    if not (options.chat_template or getattr(tokenizer, "chat_template", None)):
        llm.exit()
        raise CLIError(f"the tokenizer of {args.model!r} has no chat template; use `nanovllm generate`")
    opening = [{"role": "system", "content": args.system}] if args.system else []
    history = list(opening)
    print(f"chatting with {args.model}: /help lists the commands, /exit or Ctrl-D quits, Ctrl-C stops an answer",
          flush=True)
    try:
        while True:
            try:
                line = input(CHAT_PROMPT)
            except EOFError:
                print()
                return 0
            except KeyboardInterrupt:  # at the prompt: a fresh line, as a shell does
                print()
                continue
            text = line.strip()
            if not text:
                continue
            if text.startswith("/") and not text.startswith("//"):  # a command, never sent to the model
                word = text.split()[0]
                command = CHAT_ALIASES.get(word, word)
                if command == "/exit":
                    return 0
                if command == "/clear":
                    history = list(opening)
                    print("(conversation cleared)", flush=True)
                elif command == "/help":
                    print(_chat_help(), flush=True)
                else:
                    print(f"unknown command {word}; /help lists them", flush=True)
                continue
            if text.startswith("//"):
                line = line.replace("/", "", 1)
            history.append({"role": "user", "content": line})
            try:
                answer = _stream_answer(llm, render_chat(tokenizer, history, options), params)
            except ValueError as exc:  # e.g. the conversation outgrew max_model_len, or the template refused it
                history.pop()
                print(f"{PROG}: {exc} (/clear starts over)", file=sys.stderr, flush=True)
                continue
            history.append({"role": "assistant", "content": answer})
    finally:
        llm.exit()


class UICommand(NamedTuple):
    argv: list[str]  # the Streamlit command line
    env: dict[str, str]  # its environment: chat_ui.py reads its defaults from there


def ui_command(args: argparse.Namespace) -> UICommand:
    """`streamlit run chat_ui.py` on loopback (unless --host), with no usage statistics sent and no
    e-mail prompt, the server's URL and model passed to chat_ui.py through its environment."""
    argv = [sys.executable, "-m", "streamlit", "run", str(CHAT_UI_SCRIPT),
            "--server.address", args.host, "--server.port", str(args.port),
            "--browser.gatherUsageStats", "false", "--server.showEmailPrompt", "false"]
    env = dict(os.environ)
    if args.server_port is not None:
        env[UI_BASE_URL_ENV] = f"http://127.0.0.1:{args.server_port}/v1"
    elif args.server_url is not None:
        env[UI_BASE_URL_ENV] = args.server_url
    if args.model is not None:
        env[UI_MODEL_ENV] = args.model
    return UICommand(argv, env)


def _streamlit_installed() -> bool:
    return importlib.util.find_spec("streamlit") is not None


def _ui(args: argparse.Namespace) -> int:
    if not _streamlit_installed():
        raise CLIError('the chat page needs Streamlit, which is not installed: pip install -e ".[ui]"')
    if not CHAT_UI_SCRIPT.is_file():
        raise CLIError(f"chat_ui.py is not at {CHAT_UI_SCRIPT}; `nanovllm ui` runs it from a source checkout")
    command = ui_command(args)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(command.argv[0], command.argv, command.env)  # Streamlit takes over this process (and Ctrl-C)


def _bench(argv: list[str]) -> int:
    if not BENCH_SCRIPT.is_file():
        raise CLIError(f"bench.py is not at {BENCH_SCRIPT}; `nanovllm bench` runs it from a source checkout")
    saved = sys.argv
    sys.argv = [f"{PROG} bench", *argv]
    try:
        runpy.run_path(str(BENCH_SCRIPT), run_name="__main__")
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = saved
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv == ["--version"]:  # at once: building the parser imports torch for the engine flags
            print(f"{PROG} {package_version()}")
            return 0
        if argv[:1] == ["bench"]:  # bench.py parses its own flags (and its own --help)
            return _bench(argv[1:])
        args = build_parser().parse_args(argv)
        if args.command in DEMO_MODEL_COMMANDS and args.model is None:  # no MODEL given
            from nanovllm.demo_model import default_model
            args.model = default_model()
        return args.run(args)
    except CLIError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # one line, no traceback; a shell's prompt then starts on a fresh line
        print(f"\n{PROG}: interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT


if __name__ == "__main__":
    sys.exit(main())
