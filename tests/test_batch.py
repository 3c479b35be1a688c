"""Batch jobs (`nanovllm batch`): what a line means (parsing, defaults, per-line errors), the
output log (torn last line repaired, foreign or duplicate results refused), a job's results equal
LLM.generate/chat greedy, resume after a partial run, the Ray predictor class called directly,
and a job killed with SIGKILL at random points of its progress and restarted ending exactly as
an uninterrupted run. Scale-out and memory are in test_batch_scale.py."""
import dataclasses
import json
import os
import random
import re
import signal
import subprocess
import sys

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.config import Config
from nanovllm.entrypoints.batch.job import BatchJob, EngineBatcher, run_batch
from nanovllm.entrypoints.batch.lines import BatchRequest, LineError, parse_line, resolve_sampling_defaults
from nanovllm.entrypoints.batch.log import DoneLines, ResultLog, pending_lines, stamp_input
from nanovllm.entrypoints.cli.main import main
from batching import (BAD_LINES, GREEDY, JOB_ENGINE, JOB_FLAGS, SUBPROCESS_ENV, by_line, read_results,
                      request_lines, write_lines)
from serving import REPO_ROOT, cli

NUM_KILLS = 3
RUN_TIMEOUT = 300


# --- what a line means ---

def test_parse_openai_batch_line_with_defaults():
    defaults = {**GREEDY, "max_tokens": 7, "stop": ["\n"]}
    line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                       "body": {"model": "m", "prompt": "hi", "top_k": 5, "temperature": None}})
    request = parse_line(line, 3, defaults)
    assert isinstance(request, BatchRequest)
    assert (request.custom_id, request.line, request.prompt, request.messages) == ("a", 3, "hi", None)
    # The body's fields win; the job's defaults fill the rest (null counts as unset).
    assert (request.params.top_k, request.params.max_tokens, request.params.temperature) == (5, 7, 0.0)
    assert request.params.stop_strings == ("\n",)


def test_parse_chat_and_bare_lines():
    chat = parse_line(json.dumps({"custom_id": "c", "body": {"messages": [{"role": "user", "content": "x"}],
                                                             "max_completion_tokens": 3, "logprobs": True,
                                                             "top_logprobs": 2}}), 1, GREEDY)
    assert chat.messages == [{"role": "user", "content": "x"}] and chat.prompt is None
    assert (chat.params.max_tokens, chat.params.logprobs) == (3, 2)
    bare = parse_line(b'{"prompt": [1, 2, 3], "max_tokens": 2}\r\n', 12, None)
    assert (bare.custom_id, bare.prompt, bare.params.max_tokens) == ("line-12", [1, 2, 3], 2)
    assert bare.params.temperature == SamplingParams().temperature  # no defaults given: SamplingParams'


def test_sampling_defaults_are_checked_once():
    assert resolve_sampling_defaults({"temperature": 0})["max_tokens"] == SamplingParams().max_tokens
    with pytest.raises(ValueError, match="unknown key.*'temprature'"):
        resolve_sampling_defaults({"temprature": 0})
    with pytest.raises(ValueError, match="top_p=2"):
        resolve_sampling_defaults({"top_p": 2})


@pytest.mark.parametrize("raw,param", [(k, v) for k, v in BAD_LINES.items() if "vocab" not in k])
def test_bad_lines_become_errors(raw, param):
    err = parse_line(raw, 9, GREEDY)
    assert isinstance(err, LineError), err
    assert err.param == param and err.message
    obj = json.loads(err.to_json())
    expected_id = json.loads(raw).get("custom_id", "line-9") if raw.startswith("{") else "line-9"
    assert obj == {"custom_id": expected_id, "line": 9, "error": {"message": err.message, "param": param}}


# --- the output log ---

def test_done_lines_stay_compact():
    done = DoneLines()
    order = list(range(1, 10_001))
    for i in range(0, len(order) - 8, 8):  # lines finish out of order within a window of 8
        order[i:i + 8] = reversed(order[i:i + 8])
    for line in order:
        assert done.add(line)
        assert len(done._above) <= 8
    assert not done.add(5)
    assert len(done) == 10_000 and done.watermark == 10_001 and 10_000 in done and 10_001 not in done


def test_log_repairs_a_torn_last_line(tmp_path):
    path = tmp_path / "out.jsonl"
    whole = [json.dumps({"custom_id": f"x{i}", "line": i, "error": None}) for i in (2, 1, 4)]
    torn = json.dumps({"custom_id": "x3", "line": 3, "text": "abc"})[:17]
    path.write_bytes(("\n".join(whole) + "\n" + torn).encode())
    with ResultLog(str(path), flush_interval=0) as log:
        assert log.torn_bytes == len(torn) and log.num_existing == 3
        assert not path.read_bytes().endswith(b"\n")  # nothing is cut before the results are matched to the input
        log.resume(6, {1: "x1", 2: "x2", 4: "x4"})
        assert [n for n in range(1, 6) if n in log.done] == [1, 2, 4]
        assert path.read_bytes().endswith(b"\n")  # cut back to the last whole line at once
        log.append(3, json.dumps({"custom_id": "x3", "line": 3, "error": None}))
    assert [r["line"] for r in read_results(path)] == [2, 1, 4, 3]
    inputs = write_lines(tmp_path / "in.jsonl", [f"l{i}" for i in range(1, 7)])
    stamp = stamp_input(inputs)
    assert stamp.num_lines == 6 and stamp.size == os.path.getsize(inputs)
    with open(inputs, "ab") as f:  # a last line without a newline counts, and changes the stamp
        f.write(b"l7")
    assert stamp_input(inputs).num_lines == 7 and stamp_input(inputs) != stamp
    seen = []
    assert stamp_input(inputs, lambda number, raw: seen.append((number, raw))) == stamp_input(inputs)
    assert seen[-2:] == [(6, b"l6"), (7, b"l7")]
    assert [(n, raw) for n, raw in pending_lines(inputs, log.done)] == [(5, b"l5"), (6, b"l6"), (7, b"l7")]


RESULT_1 = '{"custom_id": "a", "line": 1, "error": null}'


@pytest.mark.parametrize("content,message", [
    (f"{RESULT_1}\n{RESULT_1}\n", "line 2 is a second result for input line 1"),
    (f"{RESULT_1}\nnot ours\n", "line 2 is b'not ours\\n', not a result line"),
    ('{"custom_id": "x", "line": 1}\n', "not a result line with keys"),
    ('{"line": 1}\n', "not a result line with keys"),
    ('{"custom_id": "x", "line": "1", "error": null}\n', "has line='1'"),
    ("a note without a trailing newline", "line 1 is b'a note without a trailing newline', with no newline"),
    (f"{RESULT_1}\nnotes", "line 2 is b'notes', with no newline"),
    ("\n", "not a result line"),
])
def test_log_refuses_a_foreign_file_and_leaves_it_alone(tmp_path, content, message):
    path = tmp_path / "out.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=f"is not this job's results.*{re.escape(message)}.*--overwrite"):
        ResultLog(str(path))
    assert path.read_text() == content
    with ResultLog(str(path), overwrite=True) as log:  # --overwrite: replaced, whatever it held
        assert log.num_existing == 0
    assert path.read_bytes() == b""


def test_log_refuses_a_second_writer(tmp_path):
    path = str(tmp_path / "out.jsonl")
    with ResultLog(path):
        with pytest.raises(ValueError, match="being written by another running job"):
            ResultLog(path)
    ResultLog(path).close()  # free again once the first has closed


@pytest.mark.parametrize("custom_ids,message", [
    ({1: "a"}, "result for input line 7 but the input has 5 lines"),
    ({1: "b", 7: "c"}, "custom_id 'a' for input line 1, where the input has 'b'"),
])
def test_log_refuses_results_of_another_input(tmp_path, custom_ids, message):
    path = tmp_path / "out.jsonl"
    content = RESULT_1 + '\n{"custom_id": "c", "line": 7, "error": null}\n{"custom_id": "d", "li'
    path.write_text(content)
    with ResultLog(str(path)) as log, pytest.raises(ValueError, match=f"{re.escape(message)}.*another input"):
        log.resume(5 if 7 not in custom_ids else 7, custom_ids)
    assert path.read_text() == content  # the torn-looking tail is not cut from a file that is not ours


# --- jobs on a tiny model ---

@pytest.fixture(scope="module")
def llm(qwen3_tiny):
    engine = LLM(qwen3_tiny, **JOB_ENGINE)
    yield engine
    engine.exit()


@pytest.fixture(scope="module")
def job_input(tmp_path_factory):
    """Good lines with bad ones among them (bad lines at fixed places)."""
    good = request_lines(20, max_tokens=10)
    lines = list(good)
    for i, bad in enumerate(BAD_LINES):
        lines.insert(2 + 2 * i, bad)
    return write_lines(tmp_path_factory.mktemp("batch") / "in.jsonl", lines)


@pytest.fixture(scope="module")
def reference(qwen3_tiny, job_input, tmp_path_factory) -> dict[int, dict]:
    """An uninterrupted in-process run, greedy: results by input line."""
    out = tmp_path_factory.mktemp("reference") / "out.jsonl"
    summary = run_batch(BatchJob(qwen3_tiny, job_input, str(out), JOB_ENGINE, GREEDY, progress=False))
    assert summary.num_lines == stamp_input(job_input).num_lines and summary.num_resumed == 0
    return by_line(read_results(out))


def expected_outputs(llm, raws: dict[int, str]) -> dict[int, dict]:
    """What LLM.generate/chat give for good lines, greedy, by line number."""
    bodies = {number: json.loads(raw) for number, raw in raws.items()}
    bodies = {number: obj.get("body", obj) for number, obj in bodies.items()}
    chats = [n for n, body in bodies.items() if "messages" in body]
    completions = [n for n in bodies if n not in chats]

    def params(body: dict) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=body["max_tokens"], n=body.get("n", 1))

    outputs = llm.generate([bodies[n]["prompt"] for n in completions], [params(bodies[n]) for n in completions],
                           use_tqdm=False)
    assert len({bodies[n]["max_tokens"] for n in chats}) == 1
    outputs += llm.chat([bodies[n]["messages"] for n in chats], params(bodies[chats[0]]), use_tqdm=False)
    return dict(zip(completions + chats, outputs))


def test_job_results_equal_generate_and_bad_lines_are_errors(reference, job_input, llm):
    with open(job_input) as f:
        raws = f.read().splitlines()
    assert sorted(reference) == list(range(1, len(raws) + 1))  # one result per input line
    expected = expected_outputs(llm, {n: raw for n, raw in enumerate(raws, start=1) if raw not in BAD_LINES})
    for number, raw in enumerate(raws, start=1):
        result = reference[number]
        if raw in BAD_LINES:
            assert result["error"]["message"] and result["error"]["param"] == BAD_LINES[raw], result
            assert "text" not in result
            continue
        assert result["error"] is None
        obj = json.loads(raw)
        assert result["custom_id"] == obj.get("custom_id", f"line-{number}")
        want = expected[number]
        assert (result["text"], result["token_ids"], result["finish_reason"]) == \
            (want["text"], want["token_ids"], want["finish_reason"])
        samples = want.get("outputs", [want])
        if len(samples) > 1:
            assert [s["token_ids"] for s in result["outputs"]] == [s["token_ids"] for s in samples]
        completion = sum(len(s["token_ids"]) for s in samples)
        assert result["usage"] == {"prompt_tokens": len(want["prompt_token_ids"]), "completion_tokens": completion,
                                   "total_tokens": len(want["prompt_token_ids"]) + completion}


def test_resume_skips_done_lines_and_repairs_a_torn_line(reference, job_input, qwen3_tiny, tmp_path):
    out = tmp_path / "out.jsonl"
    done = [reference[n] for n in (3, 1, 2, 5, *range(8, len(reference) - 3))]  # most done, out of order
    torn = json.dumps(reference[4])[:25]
    out.write_bytes(("".join(json.dumps(r) + "\n" for r in done) + torn).encode())
    summary = run_batch(BatchJob(qwen3_tiny, job_input, str(out), JOB_ENGINE, GREEDY, progress=False))
    assert summary.num_resumed == len(done)
    results = read_results(out)
    assert results[:len(done)] == done  # kept as they were, not written again
    assert by_line(results) == reference


def test_predictor_class_called_directly(reference, job_input, qwen3_tiny):
    """The Ray Data callable class on a batch of raw lines (no Ray needed to call it)."""
    from nanovllm.entrypoints.batch.ray import NanoVLLMPredictor

    with open(job_input, "rb") as f:
        raws = f.read().splitlines()
    predictor = NanoVLLMPredictor(qwen3_tiny, JOB_ENGINE, {"temperature": 0.0})  # the rest: SamplingParams'
    try:
        numbers = list(range(1, len(raws) + 1))
        out = predictor({"text": raws, "line": numbers})
        assert out["line"] == numbers
        assert [json.loads(text) for text in out["result"]] == [reference[n] for n in numbers]
        assert out["custom_id"] == [reference[n]["custom_id"] for n in numbers]
        assert out["ok"] == [reference[n]["error"] is None for n in numbers]
        # Rows without line numbers (as ray.data.read_text gives them): the same outputs.
        good = [n for n in numbers if reference[n]["error"] is None][:6]
        unnumbered = predictor({"text": [raws[n - 1].decode() for n in good]})
        for text, number in zip(unnumbered["result"], good, strict=True):
            result, want = json.loads(text), reference[number]
            assert result["line"] is None
            assert {k: v for k, v in result.items() if k not in ("line", "custom_id")} == \
                {k: v for k, v in want.items() if k not in ("line", "custom_id")}
    finally:
        predictor.llm.exit()


def test_every_config_and_sampling_field_is_a_batch_flag(capsys):
    with pytest.raises(SystemExit) as info:
        main(["batch", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    names = [f.name for f in dataclasses.fields(Config)  # but those kept out of --help (config.py, CLI_HIDDEN)
             if f.init and f.name != "model" and not f.metadata.get("cli_hidden")]
    names += [f.name for f in dataclasses.fields(SamplingParams) if f.init]
    names += ["input", "output", "max_in_flight", "data_parallel", "ray", "replicas", "ray_address"]
    for name in names:
        assert "--" + name.replace("_", "-") in out, name


def test_bad_job_settings_exit_1(tmp_path, qwen3_tiny, capsys):
    assert main(["batch", qwen3_tiny, "--input", str(tmp_path / "missing.jsonl"), "--output",
                 str(tmp_path / "o.jsonl")]) == 1
    assert "input=" in capsys.readouterr().err
    inp = write_lines(tmp_path / "in.jsonl", ['{"prompt": "x"}'])
    assert main(["batch", qwen3_tiny, "--input", inp, "--output", str(tmp_path / "o.jsonl"), "--data-parallel",
                 "0"]) == 1
    assert "data_parallel=0" in capsys.readouterr().err
    assert main(["batch", qwen3_tiny, "--input", inp, "--output", str(tmp_path / "o.jsonl"), "--temperature",
                 "-1"]) == 1
    assert "temperature" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()


# --- killed with SIGKILL and restarted ---

# `nanovllm batch` that kills itself with SIGKILL once it has written `argv[1]` result lines, after
# writing the first `argv[2]` bytes of the next one (a torn line): a kill point fixed by progress,
# not by the clock, so it always lands mid-job however fast the machine is. Writing part of a
# chunk and dying is what the kernel leaves on disk when a kill lands inside write().
KILL_AT_PROGRESS = """
import os, signal, sys
from nanovllm.entrypoints.batch import log as batch_log
from nanovllm.entrypoints.cli.main import main

kill_after, torn_bytes = int(sys.argv[1]), int(sys.argv[2])
flush = batch_log.ResultLog.flush
written = 0

def flush_or_die(self):
    global written
    if written + len(self._pending) > kill_after:
        keep = kill_after - written
        self._file.write(b"".join(self._pending[:keep]) + self._pending[keep][:torn_bytes])
        self._file.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    written += len(self._pending)
    flush(self)

batch_log.ResultLog.flush = flush_or_die
sys.exit(main(sys.argv[3:]))
"""


def whole_results(path) -> dict[int, dict]:
    """The whole result lines in a killed job's output (a torn last line left out), by input line."""
    data = path.read_bytes() if path.exists() else b""
    return by_line([json.loads(line) for line in data[:data.rfind(b"\n") + 1].splitlines()])


def test_sigkill_at_random_points_then_resume_is_exact(reference, job_input, qwen3_tiny, tmp_path):
    """Killed NUM_KILLS times, each after a random number of the lines still to do (and inside
    a random line), then run to the end: exactly the uninterrupted run's results."""
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    out = tmp_path / "out.jsonl"
    num_lines = len(reference)
    command = ["batch", qwen3_tiny, "--input", job_input, "--output", str(out), "--temperature", "0",
               "--flush-interval", "0", "--max-in-flight", "4", "--no-progress", *JOB_FLAGS]
    for attempt in range(NUM_KILLS):
        before = len(whole_results(out))
        # Leave lines for the kills still to come; a kill after the last line would find the job done.
        kill_after = rng.randint(0, (num_lines - before - 1) // (NUM_KILLS - attempt))
        torn_bytes = rng.choice([0, rng.randint(1, 120)])
        with open(tmp_path / f"stderr{attempt}.txt", "w") as err:
            proc = subprocess.run([sys.executable, "-c", KILL_AT_PROGRESS, str(kill_after), str(torn_bytes),
                                   *command], cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=err,
                                  env=SUBPROCESS_ENV, timeout=RUN_TIMEOUT)
        where = f"seed {seed}, kill {attempt} after {kill_after} lines + {torn_bytes} bytes"
        assert proc.returncode == -signal.SIGKILL, (where, (tmp_path / f"stderr{attempt}.txt").read_text()[-3000:])
        results = whole_results(out)
        assert before + kill_after <= len(results) < num_lines, where
        assert all(results[n] == reference[n] for n in results), where  # whatever is whole is exact
    with open(tmp_path / "stderr_final.txt", "w") as err:
        proc = subprocess.run(cli(*command), cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=err,
                              env=SUBPROCESS_ENV, timeout=RUN_TIMEOUT)
    assert proc.returncode == 0, (tmp_path / "stderr_final.txt").read_text()
    results = read_results(out)
    custom_ids = [r["custom_id"] for r in results]
    assert len(custom_ids) == len(set(custom_ids)) == num_lines, f"seed {seed}"
    assert by_line(results) == reference, f"seed {seed}"


def test_progress_shows_lines_done_of_total_and_rates(job_input, qwen3_tiny, tmp_path, capsys):
    """The bar on stderr: lines done / total, lines per second, tokens per second, error lines."""
    out = tmp_path / "out.jsonl"
    run_batch(BatchJob(qwen3_tiny, job_input, str(out), JOB_ENGINE, GREEDY, progress=True))
    total = stamp_input(job_input).num_lines
    last = capsys.readouterr().err.replace("\r", "\n").splitlines()
    bar = [line for line in last if line.startswith("batch:")][-1]
    assert f" {total}/{total} " in bar and ("line/s" in bar or "s/line" in bar) and "tok/s=" in bar, bar
    assert f"errors={len(BAD_LINES)}" in bar, bar


def test_the_engines_refusal_of_a_line_names_its_field(llm):
    """A line the engine refuses is an error line naming the field at fault: top_k past the
    vocabulary (within what a request may carry) is "top_k", a token id outside it "prompt"."""
    batcher = EngineBatcher(lambda: llm)
    vocab_size = llm.config.hf_config.vocab_size
    for body, param, needle in (({"prompt": "hi", "top_k": vocab_size + 1}, "top_k", f"top_k={vocab_size + 1}"),
                                ({"messages": [{"role": "user", "content": "hi"}], "top_k": vocab_size + 1}, "top_k",
                                 f"top_k={vocab_size + 1}"),
                                ({"prompt": [vocab_size]}, "prompt", f"token id {vocab_size}")):
        refused = batcher.submit(parse_line(json.dumps({"custom_id": "x", "body": body}), 3))
        error = json.loads(refused.text)["error"]
        assert not refused.ok and error["param"] == param and needle in error["message"], error
    assert batcher.num_in_flight == 0
