"""Inputs and readers shared by the batch-job tests (test_batch.py, test_batch_scale.py)."""
import json
import os
import random

from nanovllm.entrypoints.batch.lines import default_sampling
from serving import ENGINE_FLAGS, ENGINE_KWARGS

# Small batches, so a job takes many steps (and a kill lands mid-job).
JOB_ENGINE = {**ENGINE_KWARGS, "max_num_seqs": 4}
JOB_FLAGS = [*ENGINE_FLAGS, "--max-num-seqs", "4"]
GREEDY = {**default_sampling(), "temperature": 0.0}
# One torch thread per subprocess: several competing ones thrash a busy 2-core machine.
SUBPROCESS_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def request_lines(n: int, max_tokens: int) -> list[str]:
    """n valid request lines of every form: OpenAI batch completions and chats, bare bodies (no
    custom_id), token-id prompts, n=2."""
    words = "the quick brown fox jumps over the lazy dog while the cache keeps every block".split()
    rng = random.Random(0)
    lines = []
    for i in range(n):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(2, 9)))
        kind = i % 5
        if kind == 0:
            lines.append({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                          "body": {"model": "any", "prompt": text, "max_tokens": max_tokens}})
        elif kind == 1:
            lines.append({"custom_id": f"chat{i}", "url": "/v1/chat/completions",
                          "body": {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}})
        elif kind == 2:
            lines.append({"prompt": text, "max_tokens": max_tokens})  # bare body: custom_id line-N
        elif kind == 3:
            lines.append({"custom_id": f"ids{i}", "body": {"prompt": [rng.randrange(1, 500) for _ in range(5)],
                                                           "max_tokens": max_tokens}})
        else:
            lines.append({"custom_id": f"n2-{i}", "body": {"prompt": text, "n": 2, "max_tokens": max_tokens}})
    return [json.dumps(line) for line in lines]


BAD_LINES = {  # a bad line -> the field its error names (None: the line as a whole)
    "this is not JSON": None,
    "[1, 2, 3]": None,
    "": None,
    json.dumps({"custom_id": "no-prompt", "body": {"max_tokens": 3}}): "prompt",
    json.dumps({"custom_id": "bad-temp", "body": {"prompt": "hi", "temperature": -1}}): "temperature",
    json.dumps({"custom_id": "bad-top-p", "body": {"prompt": "hi", "top_p": 0}}): "top_p",
    json.dumps({"custom_id": "str-tokens", "body": {"prompt": "hi", "max_tokens": "five"}}): "max_tokens",
    json.dumps({"custom_id": "bad-role", "body": {"messages": [{"role": "wizard", "content": "x"}]}}):
        "messages[0].role",
    json.dumps({"custom_id": "two-prompts", "body": {"prompt": ["a", "b"]}}): "prompt",
    json.dumps({"custom_id": "wrong-url", "url": "/v1/embeddings", "body": {"prompt": "x"}}): "url",
    json.dumps({"custom_id": "vocab", "body": {"prompt": [10 ** 9]}}): "prompt",  # refused by the engine
}


def write_lines(path, lines: list[str]) -> str:
    with open(path, "w") as f:
        f.write("".join(line + "\n" for line in lines))
    return str(path)


def read_results(path) -> list[dict]:
    with open(path, "rb") as f:
        data = f.read()
    assert not data or data.endswith(b"\n"), "the output ends with a torn line"
    return [json.loads(line) for line in data.splitlines()]


def by_line(results: list[dict]) -> dict[int, dict]:
    lines = [r["line"] for r in results]
    assert len(lines) == len(set(lines)), "an input line has two results"
    return {r["line"]: r for r in results}
