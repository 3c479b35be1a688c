"""Batch jobs under faults (issue 26, item 9): a poison line (top_k 2**63, a lone surrogate, a
request the engine fails on while it runs) becomes an error line and every other line gets the
result a run without it gives; an existing output that is not this job's results is refused and
left as it was (--overwrite replaces it); an input that changes under a running job, or a line
left without a result, ends the job with an error; an unwritable output is one line at start."""
import json
import os
import re

import pytest

from nanovllm.entrypoints.batch import job as batch_module
from nanovllm.entrypoints.batch.job import BatchJob, BatchJobError, EngineBatcher, run_batch
from nanovllm.entrypoints.cli.main import main
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.runner.model_runner import ModelRunner
from batching import GREEDY, JOB_ENGINE, JOB_FLAGS, by_line, read_results, request_lines, write_lines

# The prompt of a line the engine fails on while it runs (token ids no generated line starts with).
FAULT_PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
POISON_LINES = {  # a line that passes the server's request models but would poison the engine -> its param
    json.dumps({"custom_id": "huge-top-k", "body": {"prompt": "hi", "top_k": 2 ** 63, "max_tokens": 4}}): "top_k",
    '{"custom_id": "surrogate", "body": {"prompt": "a\\ud800b", "max_tokens": 4}}': "prompt",
    '{"custom_id": "chat-surrogate", "body": {"messages": [{"role": "user", "content": "\\udc00"}]}}':
        "messages[0].content",
    '{"prompt": "x", "stop": ["\\ud800"]}': "stop[0]",
}


def job(model: str, inp: str, out, **kwargs) -> BatchJob:
    return BatchJob(model, inp, str(out), JOB_ENGINE, GREEDY, progress=False, **kwargs)


def without_line(result: dict) -> dict:
    """A result as it compares across inputs: its line number differs when lines are inserted."""
    return {k: v for k, v in result.items() if k != "line"}


@pytest.fixture(scope="module")
def clean(tmp_path_factory, qwen3_tiny):
    """Good lines, and their results by custom_id from a run without any poison line."""
    lines = request_lines(15, max_tokens=6)
    lines = [json.dumps({"custom_id": f"bare{i}", **json.loads(line)}) if "custom_id" not in line else line
             for i, line in enumerate(lines)]  # each line names itself, so results compare by custom_id
    folder = tmp_path_factory.mktemp("clean")
    run_batch(job(qwen3_tiny, write_lines(folder / "in.jsonl", lines), folder / "out.jsonl"))
    results = {r["custom_id"]: without_line(r) for r in read_results(folder / "out.jsonl")}
    assert len(results) == len(lines) and all(r["error"] is None for r in results.values())
    return lines, results


def with_poison(lines: list[str], poison: list[str]) -> list[str]:
    """The good lines with the poison ones among them (the first one first of all)."""
    mixed = list(lines)
    for i, bad in enumerate(poison):
        mixed.insert(0 if i == 0 else 3 * i + 1, bad)
    return mixed


def check_results(out, clean_results: dict, poison: dict[str, str]) -> None:
    """Each poison line has an error line naming `poison[line]`'s field; every other line its clean result."""
    results = by_line(read_results(out))
    assert len(results) == len(clean_results) + len(poison)
    errors = [r for r in results.values() if r["error"] is not None]
    assert sorted(e["error"]["param"] or "" for e in errors) == sorted(p or "" for p in poison.values())
    for result in results.values():
        if result["error"] is None:
            assert without_line(result) == clean_results[result["custom_id"]]


# --- (a) poison lines ---

def test_poison_lines_become_error_lines_and_the_rest_is_unchanged(clean, qwen3_tiny, tmp_path):
    lines, clean_results = clean
    inp = write_lines(tmp_path / "in.jsonl", with_poison(lines, list(POISON_LINES)))
    out = tmp_path / "out.jsonl"
    summary = run_batch(job(qwen3_tiny, inp, out))
    assert summary.num_errors == len(POISON_LINES)
    check_results(out, clean_results, POISON_LINES)
    messages = {r["custom_id"]: r["error"]["message"] for r in read_results(out) if r["error"]}
    assert "top_k" in messages["huge-top-k"] and str(2 ** 63) in messages["huge-top-k"]
    assert "lone surrogate" in messages["surrogate"] and "lone surrogate" in messages["chat-surrogate"]
    before = out.read_bytes()
    # Running the same command again finds every line done: it succeeds and writes nothing.
    assert main(["batch", qwen3_tiny, "--input", inp, "--output", str(out), "--temperature", "0", "--no-progress",
                 *JOB_FLAGS]) == 0
    assert out.read_bytes() == before


def _fail_on(failing_prompt, calls: list[int]):
    """ModelRunner.launch that raises whenever a step holds a sequence whose prompt
    `failing_prompt(prompt)` says fails."""
    launch = ModelRunner.launch

    def failing(self, seqs, *args, **kwargs):
        if any(failing_prompt(seq.prompt_token_ids) for seq in seqs):
            calls.append(len(seqs))
            raise RuntimeError("injected fault")
        return launch(self, seqs, *args, **kwargs)
    return failing


def test_a_request_the_engine_fails_on_becomes_an_error_line(clean, qwen3_tiny, tmp_path, monkeypatch):
    """A fault inside the model pass (not a bad value: the runner raises while running the
    request): the engine fails that step's requests (or, an older engine, raises from step()), and
    the job reruns them apart until the one at fault runs alone."""
    lines, clean_results = clean
    fault = json.dumps({"custom_id": "fault", "body": {"prompt": FAULT_PROMPT, "max_tokens": 4}})
    poison = {**POISON_LINES, fault: None}
    inp = write_lines(tmp_path / "in.jsonl", with_poison(lines, [fault, *POISON_LINES]))
    calls: list[int] = []
    monkeypatch.setattr(ModelRunner, "launch", _fail_on(lambda prompt: prompt == FAULT_PROMPT, calls))
    out = tmp_path / "out.jsonl"
    summary = run_batch(job(qwen3_tiny, inp, out, max_in_flight=6))
    assert calls and calls[0] > 1 and calls[-1] == 1  # it failed among others first, then alone
    assert summary.num_errors == len(poison)
    check_results(out, clean_results, poison)
    error = next(r["error"] for r in read_results(out) if r["custom_id"] == "fault")
    assert error["message"] and error["param"] is None


def test_an_engine_whose_step_raises_is_rebuilt_and_the_fault_isolated(clean, qwen3_tiny, tmp_path, monkeypatch):
    """step() itself raising leaves the engine's state unknown: the job builds a new engine and
    reruns every request that was in flight, halving them until the one at fault runs alone."""
    lines, clean_results = clean
    fault = json.dumps({"custom_id": "fault", "body": {"prompt": FAULT_PROMPT, "max_tokens": 4}})
    inp = write_lines(tmp_path / "in.jsonl", with_poison(lines, [fault]))
    step = LLMEngine._step
    raised: list[int] = []

    def raising_step(self):
        live = [r for r in self._requests.values() if any(not seq.is_finished for seq in r.seqs)]
        if any(r.prompt_token_ids == FAULT_PROMPT for r in live):
            raised.append(len(live))
            raise RuntimeError("injected fault")
        return step(self)

    monkeypatch.setattr(LLMEngine, "_step", raising_step)
    built = []
    factory = batch_module.engine_factory
    monkeypatch.setattr(batch_module, "engine_factory", lambda *a: lambda: built.append(1) or factory(*a)())
    out = tmp_path / "out.jsonl"
    summary = run_batch(job(qwen3_tiny, inp, out, max_in_flight=6))
    assert raised[0] > 1 and raised[-1] == 1  # among others first, then alone
    assert len(built) == 1 + len(raised)  # a new engine after each raise
    assert summary.num_errors == 1
    check_results(out, clean_results, {fault: None})
    error = next(r["error"] for r in read_results(out) if r["custom_id"] == "fault")
    assert "RuntimeError: injected fault" in error["message"] and error["param"] is None


def test_a_request_the_engine_reports_failed_becomes_an_error_line(clean, qwen3_tiny, tmp_path, monkeypatch):
    """An engine that fails a request alone reports it in the final output (finish_reason "abort",
    an "error" message) and may fail the others of that step with it: those run again and get
    their results; the one that fails alone gets an error line with the engine's message."""
    lines, clean_results = clean
    fault = json.dumps({"custom_id": "fault", "body": {"prompt": FAULT_PROMPT, "max_tokens": 4}})
    inp = write_lines(tmp_path / "in.jsonl", with_poison(lines, [fault]))
    real_step = EngineBatcher._step
    failed_together = []

    def step_with_reported_faults(self):
        """Turn the step's results into what such an engine reports: every request of a step
        holding the fault's prompt fails with an "error" (simulated on the batcher's side)."""
        in_flight = dict(self._requests)
        if not any(r.prompt == FAULT_PROMPT for r, _ in in_flight.values()):
            return real_step(self)
        failed_together.append(len(in_flight))
        self.llm.exit()
        self.llm = self._make_llm()  # the engine drops the failed requests; it goes on with none
        self._requests.clear()
        return [], [batch_module._Fault(r, tag, "the request failed in the engine") for r, tag in in_flight.values()]

    monkeypatch.setattr(EngineBatcher, "_step", step_with_reported_faults)
    out = tmp_path / "out.jsonl"
    run_batch(job(qwen3_tiny, inp, out, max_in_flight=6))
    assert failed_together[0] > 1 and failed_together[-1] == 1
    check_results(out, clean_results, {fault: None})


def test_an_output_with_an_error_key_is_an_error_line(qwen3_tiny, tmp_path, monkeypatch):
    """The engine's own report of a failed request: a final output with `error` set."""
    from nanovllm import LLM

    pop = LLM._pop

    def pop_with_error(self, request_id):
        output = pop(self, request_id)
        if output.finished and output.final.prompt_token_ids == FAULT_PROMPT:
            output.final.error = "internal error (request id x)"
            for sample in output.final.outputs:
                sample.finish_reason = "abort"
        return output

    monkeypatch.setattr(LLM, "_pop", pop_with_error)
    inp = write_lines(tmp_path / "in.jsonl", [json.dumps({"custom_id": "ok", "prompt": [5, 6], "max_tokens": 3}),
                                              json.dumps({"custom_id": "bad", "prompt": FAULT_PROMPT,
                                                          "max_tokens": 3})])
    out = tmp_path / "out.jsonl"
    run_batch(job(qwen3_tiny, inp, out))
    results = {r["custom_id"]: r for r in read_results(out)}
    assert results["ok"]["error"] is None and results["ok"]["text"] is not None
    assert results["bad"]["error"] == {"message": "internal error (request id x)", "param": None}
    assert "text" not in results["bad"]


def test_an_engine_that_fails_every_request_stops_the_job(qwen3_tiny, tmp_path, monkeypatch):
    """Not a request's fault: failing alone again and again, the job stops with an error (the
    results so far kept) rather than write an error line for every remaining line."""
    inp = write_lines(tmp_path / "in.jsonl", [json.dumps({"prompt": FAULT_PROMPT + [i], "max_tokens": 3})
                                              for i in range(30)])
    calls: list[int] = []
    monkeypatch.setattr(ModelRunner, "launch", _fail_on(lambda prompt: prompt[:-1] == FAULT_PROMPT, calls))
    out = tmp_path / "out.jsonl"
    with pytest.raises(BatchJobError, match="failed on 9 requests in a row, each run alone.*resume"):
        run_batch(job(qwen3_tiny, inp, out, max_in_flight=4))
    assert len(read_results(out)) == batch_module.MAX_FAULTS_WITHOUT_A_RESULT  # kept, resumable


# --- (b) an existing output that is not this job's ---

def run_cli(model: str, inp: str, out, *flags: str) -> int:
    return main(["batch", model, "--input", inp, "--output", str(out), "--temperature", "0", "--no-progress",
                 *JOB_FLAGS, *flags])


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("nanovllm: error:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("content", [
    "my notes, no trailing newline",
    "line one\nline two",
    '{"id": 1, "text": "an export of something else"}\n{"id": 2, "text": "more"}\n',
    '{"custom_id": "c0", "line": 1, "error": null}\n{"custom_id": "someone-else", "line": 2, "error": null}\n',
])
def test_an_output_that_is_not_this_jobs_is_refused_then_overwritten(clean, qwen3_tiny, tmp_path, capsys, content):
    lines, clean_results = clean
    inp = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    out.write_text(content)
    assert run_cli(qwen3_tiny, inp, out) == 1
    assert re.search(r"output=.* (is not this job's results|holds the results of another input).*--overwrite",
                     one_line_error(capsys))
    assert out.read_text() == content  # neither truncated nor appended to
    assert run_cli(qwen3_tiny, inp, out, "--overwrite") == 0
    assert {r["custom_id"]: without_line(r) for r in read_results(out)} == clean_results


def test_this_jobs_own_output_is_resumed(clean, qwen3_tiny, tmp_path):
    """The other side of the refusal: results of this input (with a torn last line) are kept."""
    lines, clean_results = clean
    inp = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    run_batch(job(qwen3_tiny, inp, out))
    full = out.read_bytes()
    kept = full.splitlines(keepends=True)[:5]
    out.write_bytes(b"".join(kept) + full.splitlines(keepends=True)[5][:30])
    summary = run_batch(job(qwen3_tiny, inp, out))
    assert summary.num_resumed == 5
    assert out.read_bytes().startswith(b"".join(kept))
    assert {r["custom_id"]: without_line(r) for r in read_results(out)} == clean_results


# --- (c) an input that changes under the job; a line without a result ---

def _change_input_after_first_step(monkeypatch, change) -> None:
    step = EngineBatcher.step
    state = {"changed": False}

    def changing(self):
        if not state["changed"]:
            state["changed"] = True
            change()
        return step(self)
    monkeypatch.setattr(EngineBatcher, "step", changing)


def test_an_input_truncated_during_the_run_fails_the_job(qwen3_tiny, tmp_path, monkeypatch, capsys):
    lines = request_lines(40, max_tokens=3)
    inp = write_lines(tmp_path / "in.jsonl", lines)
    keep = "".join(line + "\n" for line in lines[:10])

    def truncate():
        with open(inp, "r+") as f:  # in place, as `> file` or another writer would
            f.truncate(len(keep.encode()))
    _change_input_after_first_step(monkeypatch, truncate)
    out = tmp_path / "out.jsonl"
    assert run_cli(qwen3_tiny, inp, out, "--max-in-flight", "4") == 1
    error = one_line_error(capsys)
    assert "changed while the job ran: it had 40 lines" in error and "has 10" in error
    assert len(read_results(out)) < 40


def test_an_input_changed_in_place_during_the_run_fails_the_job(qwen3_tiny, tmp_path, monkeypatch):
    """Same size, same line count: only the contents tell."""
    lines = request_lines(20, max_tokens=3)
    inp = write_lines(tmp_path / "in.jsonl", lines)
    stat = os.stat(inp)

    def rewrite_last_line():
        data = open(inp, "rb").read()
        at = data.rindex(b"the")
        with open(inp, "r+b") as f:
            f.seek(at)
            f.write(b"THE")
        os.utime(inp, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # even with its old modification time
    if b"the" not in open(inp, "rb").read().rsplit(b"\n", 2)[-2]:
        pytest.skip("the generated last line has no 'the' to change")
    _change_input_after_first_step(monkeypatch, rewrite_last_line)
    with pytest.raises(BatchJobError, match="changed while the job ran: its size is the same but its contents"):
        run_batch(job(qwen3_tiny, inp, tmp_path / "out.jsonl", max_in_flight=4))


def test_a_line_left_without_a_result_fails_the_job(qwen3_tiny, tmp_path, monkeypatch):
    inp = write_lines(tmp_path / "in.jsonl", request_lines(8, max_tokens=3))
    pending = batch_module.pending_lines
    monkeypatch.setattr(batch_module, "pending_lines",
                        lambda path, done: (line for line in pending(path, done) if line.number != 5))
    out = tmp_path / "out.jsonl"
    with pytest.raises(BatchJobError, match="1 of 8 input lines have no result.*resume"):
        run_batch(job(qwen3_tiny, inp, out))
    assert sorted(r["line"] for r in read_results(out)) == [1, 2, 3, 4, 6, 7, 8]
    monkeypatch.setattr(batch_module, "pending_lines", pending)
    assert run_batch(job(qwen3_tiny, inp, out)).num_resumed == 7  # running it again completes it
    assert sorted(by_line(read_results(out))) == list(range(1, 9))


# --- (d) an unwritable output ---

def _unwritable(tmp_path) -> str:
    if os.geteuid() != 0:
        folder = tmp_path / "read-only"
        folder.mkdir()
        folder.chmod(0o500)
        return str(folder / "out.jsonl")
    return "/sys/nanovllm-batch-test.jsonl"  # root may write anywhere but sysfs


@pytest.mark.parametrize("where,message", [
    ("missing", "is in a directory that does not exist"),
    ("directory", "is a directory; it must be a file path"),
    ("no-permission", "cannot be opened for writing: Permission denied"),
])
def test_an_unwritable_output_is_one_line_at_start(qwen3_tiny, tmp_path, capsys, where, message):
    inp = write_lines(tmp_path / "in.jsonl", request_lines(2, max_tokens=2))
    out = {"missing": str(tmp_path / "no" / "such" / "out.jsonl"), "directory": str(tmp_path),
           "no-permission": _unwritable(tmp_path)}[where]
    if where == "no-permission" and os.access(os.path.dirname(out), os.W_OK) and os.geteuid() != 0:
        pytest.skip("this file system lets every user write everywhere")
    assert run_cli(qwen3_tiny, inp, out) == 1
    error = one_line_error(capsys)
    assert f"output={out!r}" in error and message in error
