"""The `nanovllm` command (also `python -m nanovllm`): serve, generate, chat, batch, bench.

One argparse parser per subcommand; the engine flags are generated from `Config` and the
sampling flags from `SamplingParams` (cli_args.py), so the CLI follows the API. Wrong flags exit
2 (argparse); a model directory that is missing, or an engine that refuses its settings, exits 1
with one line. It knows nothing of HTTP: `serve` hands over to openai_server.serve().
"""
import argparse
import json
import os
import runpy
import signal
import sys
import threading
from pathlib import Path

from nanovllm import LLM
from nanovllm.config import ATTENTION_BACKENDS, DEVICES, DTYPES, Config
from nanovllm.entrypoints.batch import add_job_flags
from nanovllm.entrypoints.cli_args import add_dataclass_flags, dataclass_kwargs
from nanovllm.entrypoints.server_settings import (DEFAULT_HOST, DEFAULT_PORT, DEFAULT_SHUTDOWN_TIMEOUT,
                                                  ServerSettings, api_key_from_env)
from nanovllm.sampling_params import SamplingParams

PROG = "nanovllm"
CONFIG_CHOICES = {"device": DEVICES, "attention_backend": ATTENTION_BACKENDS, "dtype": ("auto", *DTYPES)}
# bench.py lives at the repository root (a script, not part of the package): found from here.
BENCH_SCRIPT = Path(__file__).resolve().parents[2] / "bench.py"
CHAT_PROMPT = "> "
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


class CLIError(Exception):
    """A refusal to report in one line with exit status 1 (no traceback)."""


def _add_model(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="local checkpoint directory (config.json, *.safetensors, "
                        "tokenizer files); nothing is downloaded")


def _add_engine_flags(parser: argparse.ArgumentParser) -> list[str]:
    group = parser.add_argument_group("engine", "Config fields (nanovllm/config.py)")
    return add_dataclass_flags(group, Config, skip=("model",), choices=CONFIG_CHOICES)


def _add_sampling_flags(parser: argparse.ArgumentParser) -> list[str]:
    group = parser.add_argument_group("sampling", "SamplingParams fields (nanovllm/sampling_params.py)")
    return add_dataclass_flags(group, SamplingParams)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="nanovllm: a small LLM inference engine.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                           description="Serve MODEL over an OpenAI-compatible HTTP API (/v1/completions, "
                                       "/v1/chat/completions, /v1/models, /health, /metrics). SIGTERM or "
                                       "Ctrl-C stops it gracefully.")
    _add_model(serve)
    serve.add_argument("--host", default=DEFAULT_HOST, help="address to bind (default: %(default)s, loopback only)")
    serve.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to bind; 0 picks a free one "
                       "(default: %(default)s)")
    serve.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT,
                       help="seconds in-flight requests get to finish after SIGTERM/SIGINT before they are "
                            "aborted (default: %(default)s)")
    serve.add_argument("--log-level", default="info", choices=UVICORN_LOG_LEVELS, help="(default: %(default)s)")
    server_group = serve.add_argument_group("server", "ServerSettings fields (nanovllm/entrypoints/server_settings.py)")
    server_fields = add_dataclass_flags(server_group, ServerSettings, skip=("model", "engine_kwargs"))
    engine_fields = _add_engine_flags(serve)
    serve.set_defaults(run=_serve, engine_fields=engine_fields, server_fields=server_fields)

    generate = sub.add_parser("generate", help="complete prompts and print the completions",
                              description="Complete each PROMPT with MODEL and print the completions, one per "
                                          "prompt (--json: the output dict of LLM.generate, one JSON line each).")
    _add_model(generate)
    generate.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompt text")
    generate.add_argument("--json", action="store_true", help="print each output dict as one JSON line")
    engine_fields = _add_engine_flags(generate)
    sampling_fields = _add_sampling_flags(generate)
    generate.set_defaults(run=_generate, engine_fields=engine_fields, sampling_fields=sampling_fields)

    chat = sub.add_parser("chat", help="chat with a model in the terminal",
                          description="Chat with MODEL through its chat template; answers stream as they are "
                                      "made. /reset starts the conversation over, /exit (or Ctrl-D) quits, "
                                      "Ctrl-C stops the answer being written.")
    _add_model(chat)
    chat.add_argument("--system", default=None, help="a system message to open every conversation with")
    engine_fields = _add_engine_flags(chat)
    sampling_fields = _add_sampling_flags(chat)
    chat.set_defaults(run=_chat, engine_fields=engine_fields, sampling_fields=sampling_fields)

    # batch: the job's own flags live with the job (entrypoints/batch.py).
    batch = sub.add_parser("batch", help="run a JSONL file of requests into a JSONL file of results (resumable)",
                           description="Run every request line of --input with MODEL and append one result line "
                                       "per request to --output as it finishes. Killed and started again with the "
                                       "same command, it resumes where it stopped. The sampling flags are the "
                                       "defaults of every line; a line's own fields win.")
    _add_model(batch)
    add_job_flags(batch)
    engine_fields = _add_engine_flags(batch)
    sampling_fields = _add_sampling_flags(batch)
    batch.set_defaults(run=_batch, engine_fields=engine_fields, sampling_fields=sampling_fields)

    # Listed here for --help; its arguments go to bench.py untouched (see main).
    sub.add_parser("bench", help="run the throughput benchmark (bench.py; `nanovllm bench --help` for its flags)",
                   add_help=False)
    return parser


def _check_model_dir(model: str) -> None:
    if not os.path.isdir(model):
        raise CLIError(f"model directory {model!r} does not exist")
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise CLIError(f"{model!r} has no config.json; MODEL must be a checkpoint directory")


def _make_llm(args: argparse.Namespace) -> LLM:
    """The engine, or a one-line CLIError when it refuses the model or the settings."""
    _check_model_dir(args.model)
    try:
        return LLM(args.model, **dataclass_kwargs(args, args.engine_fields))
    except ValueError as exc:
        raise CLIError(str(exc)) from None


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    try:
        return SamplingParams(**dataclass_kwargs(args, args.sampling_fields))
    except ValueError as exc:
        raise CLIError(str(exc)) from None


def _serve(args: argparse.Namespace) -> int:
    from nanovllm.entrypoints.openai_server import serve  # the web stack, only when serving

    _check_model_dir(args.model)
    settings = ServerSettings(args.model, dataclass_kwargs(args, args.engine_fields),
                              **dataclass_kwargs(args, args.server_fields))
    if settings.api_key is None:
        settings.api_key = api_key_from_env()
    try:  # the engine is built later, inside the server: check its settings now, in one line
        Config.from_kwargs(args.model, settings.engine_kwargs)
        settings.check()
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
    from nanovllm.entrypoints.batch import BatchJob, BatchJobError, run_batch

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
                from nanovllm.integrations.ray import run_ray_batch
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


def _chat(args: argparse.Namespace) -> int:
    params = _sampling_params(args)
    if params.n != 1:
        raise CLIError(f"n={params.n} is not allowed in chat; a chat answers once (n=1)")
    llm = _make_llm(args)
    tokenizer = llm.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        llm.exit()
        raise CLIError(f"the tokenizer of {args.model!r} has no chat template; use `nanovllm generate`")
    opening = [{"role": "system", "content": args.system}] if args.system else []
    history = list(opening)
    print(f"chatting with {args.model}: /reset starts over, /exit or Ctrl-D quits, Ctrl-C stops an answer",
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
            if text in ("/exit", "/quit"):
                return 0
            if text == "/reset":
                history = list(opening)
                print("(conversation cleared)", flush=True)
                continue
            history.append({"role": "user", "content": line})
            rendered = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
            prompt = tokenizer.encode(rendered, add_special_tokens=False)
            try:
                answer = _stream_answer(llm, prompt, params)
            except ValueError as exc:  # e.g. the conversation outgrew max_model_len
                history.pop()
                print(f"{PROG}: {exc} (/reset starts over)", file=sys.stderr, flush=True)
                continue
            history.append({"role": "assistant", "content": answer})
    finally:
        llm.exit()


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
        if argv[:1] == ["bench"]:  # bench.py parses its own flags (and its own --help)
            return _bench(argv[1:])
        args = build_parser().parse_args(argv)
        return args.run(args)
    except CLIError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130  # the shell's status for a command stopped by Ctrl-C


if __name__ == "__main__":
    sys.exit(main())
