"""benchmarks/step_profile.py without a GPU: it refuses to run, clearly; its step instrumentation
and summary, which are device-neutral, run on a tiny CPU engine and must account for every step."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nanovllm import LLM

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def step_profile():
    spec = importlib.util.spec_from_file_location("step_profile", REPO / "benchmarks" / "step_profile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_refuses_without_cuda(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "step_profile.py")], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "needs one; torch sees none" in result.stderr
    assert not list(tmp_path.iterdir()), "it built or wrote nothing before refusing"


def test_every_step_is_recorded_and_split(step_profile, qwen3_tiny):
    llm = LLM(qwen3_tiny, device="cpu", kvcache_block_size=16, num_kvcache_blocks=64, max_num_batched_tokens=64)
    prompts, params = step_profile.bench.make_workload(5, 20, 40, llm.config.hf_config.vocab_size, seed=3)
    profiler = step_profile.StepProfiler(llm)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    llm.exit()
    records = profiler.records
    prefill = [r for r in records if r.kind == step_profile.PREFILL]
    mixed = [r for r in records if r.kind == step_profile.MIXED]
    decode = [r for r in records if r.kind == step_profile.DECODE]
    # Every prompt token was prefilled once (random prompts share no cached block), over several
    # chunked steps of at most 64 tokens, some beside decode rows (the mixed policy); every output
    # token after the first came from a decode row, in a decode step or a mixed one.
    assert sum(r.num_tokens - r.decode_rows for r in prefill + mixed) == sum(map(len, prompts))
    assert prefill and mixed and all(r.num_tokens <= 64 for r in prefill + mixed)
    assert all(r.decode_rows == 0 for r in prefill) and all(0 < r.decode_rows < r.num_seqs for r in mixed)
    assert sum(r.decode_rows for r in decode + mixed) == sum(len(o["token_ids"]) - 1 for o in outputs)
    for r in decode:
        assert r.num_tokens == r.num_seqs == r.decode_rows and r.context_tokens > r.num_seqs
    for r in records:
        assert min(r.model_s, r.lmhead_s, r.sampler_s) >= 0 and r.host_s >= 0
        assert r.model_s + r.lmhead_s + r.sampler_s <= r.step_s

    summary = step_profile.summarize(records, kv_bytes_per_token=1000, copy_bytes_per_s=1e9,
                                     output_tokens=sum(p.max_tokens for p in params), wall_s=10.0)
    assert summary["decode_steps"] == len(decode) and summary["prefill_steps"] == len(prefill)
    assert summary["mixed_steps"] == len(mixed) and summary["mixed_decode_rows"] == sum(r.decode_rows for r in mixed)
    assert sum(b["steps"] for b in summary["decode_buckets"]) == len(decode)
    assert summary["kv_read_tb"] == pytest.approx(sum(r.context_tokens for r in decode) * 1000 / 1e12, abs=1e-4)
    assert summary["kv_floor_s"] == pytest.approx(sum(r.context_tokens for r in decode) * 1000 / 1e9, abs=1e-3)
    step_profile.print_run("test", summary, 1e9)  # the table prints from a real summary


def test_batch_buckets(step_profile):
    assert [step_profile.bucket_of(b) for b in (1, 8, 9, 32, 256, 257, 512, 513)] == \
        ["1-8", "1-8", "9-32", "9-32", "193-256", "257-384", "385-512", "513+"]
