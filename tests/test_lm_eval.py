"""lm-eval end to end against the server: its `local-completions` model runs a small
multiple-choice task (loglikelihood: echo + logprobs + max_tokens 1, the path every MMLU-style
benchmark takes) and a small generation task (generate_until) defined here, over a local JSONL
(no download: the datasets library's own json loader, offline). The accuracy lm-eval reports
must equal the one computed offline from the engine's own prompt logprobs, and its exact match
the one of the engine's own greedy texts."""
import json
import math

import pytest
from transformers import AutoTokenizer

from nanovllm import LLM, SamplingParams
from serving import server_thread

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is in the test extra (pip install -e .[test])")

QUESTIONS = ["The capital of France is", "The cache is split into", "Greedy decoding always picks the",
             "Count from one to", "A large language model reads a", "The quick brown fox jumps over the"]
CHOICES = ["blocks", "Paris", "tokens", "ten", "the lazy dog"]
PROMPTS = ["Hello world! How are", "The scheduler pauses the", "Numbers like 0 1 2", "Write a short poem about"]
UNTIL = ["\n\n", "."]
MAX_GEN_TOKS = 6
TEMPLATE = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {output_type}
doc_to_text: "{{{{question}}}}"
{extra}
"""
MULTIPLE_CHOICE = """doc_to_choice: "{{choices}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""
GENERATION = f"""doc_to_target: target
generation_kwargs:
  until: {json.dumps(UNTIL)}
  max_gen_toks: {MAX_GEN_TOKS}
  do_sample: false
metric_list:
  - metric: exact_match
"""


def continuation_logprobs(llm: LLM, tokenizer, pairs: list[tuple[str, str]]) -> list[float]:
    """Each continuation's logprob given its context, from the engine's prompt logprobs, with the
    tokens split as lm-eval splits them (the context's tokens, then the rest of the whole's)."""
    wholes = [tokenizer.encode(context + continuation) for context, continuation in pairs]
    scored = llm.generate(wholes, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return [sum(out["prompt_logprobs"][k][whole[k]]["logprob"] for k in range(len(tokenizer.encode(context)), len(whole)))
            for (context, _), whole, out in zip(pairs, wholes, scored)]


def write_task(folder, task: str, output_type: str, extra: str, docs: list[dict]) -> None:
    data = folder / f"{task}.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    (folder / f"{task}.yaml").write_text(TEMPLATE.format(task=task, data=data, output_type=output_type, extra=extra))


def test_lm_eval_local_completions_matches_offline(qwen3_tiny, tmp_path, monkeypatch):
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets_cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    tokenizer = AutoTokenizer.from_pretrained(qwen3_tiny)
    # Offline: each question's most likely choice (by the engine's prompt logprobs) and greedy texts.
    with LLM(qwen3_tiny, device="cpu", kvcache_block_size=16) as llm:
        scores = continuation_logprobs(llm, tokenizer, [(q, " " + c) for q in QUESTIONS for c in CHOICES])
        per_question = [scores[i:i + len(CHOICES)] for i in range(0, len(scores), len(CHOICES))]
        assert all(len(set(s)) == len(s) and all(map(math.isfinite, s)) for s in per_question)  # no ties
        best = [s.index(max(s)) for s in per_question]
        texts = [out["text"] for out in llm.generate(
            [tokenizer.encode(p) for p in PROMPTS],
            SamplingParams(temperature=0, max_tokens=MAX_GEN_TOKS, stop=UNTIL), use_tqdm=False)]
    # The gold answers: the engine's choice for the first half, another for the rest, so only
    # logprobs that rank every question's choices as offline give the expected accuracy.
    half = len(QUESTIONS) // 2
    answers = [b if i < half else (b + 1) % len(CHOICES) for i, b in enumerate(best)]
    expected_acc = sum(a == b for a, b in zip(answers, best)) / len(QUESTIONS)
    targets = [t if i % 2 == 0 else t + " (not this)" for i, t in enumerate(texts)]
    expected_match = sum(t == g for t, g in zip(texts, targets)) / len(PROMPTS)
    write_task(tmp_path, "nanovllm_mc", "multiple_choice", MULTIPLE_CHOICE,
               [{"question": q, "choices": CHOICES, "answer": a} for q, a in zip(QUESTIONS, answers)])
    write_task(tmp_path, "nanovllm_gen", "generate_until", GENERATION,
               [{"question": p, "target": t} for p, t in zip(PROMPTS, targets)])

    from lm_eval.tasks import TaskManager
    with server_thread(qwen3_tiny) as server:
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args={"model": server.settings.model_name, "base_url": server.base_url + "/completions",
                        "tokenizer_backend": "huggingface", "tokenizer": qwen3_tiny, "tokenized_requests": True,
                        "num_concurrent": 1, "max_retries": 1, "batch_size": 4},
            tasks=["nanovllm_mc", "nanovllm_gen"], task_manager=TaskManager(include_path=str(tmp_path)),
            num_fewshot=0, log_samples=False, bootstrap_iters=0)
    reported = results["results"]
    assert reported["nanovllm_mc"]["acc,none"] == pytest.approx(expected_acc)
    assert reported["nanovllm_gen"]["exact_match,none"] == pytest.approx(expected_match)
    assert 0 < expected_acc < 1 and 0 < expected_match < 1  # both outcomes occur: the test can fail either way
