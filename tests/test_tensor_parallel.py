"""Tensor parallelism across processes, on CPU over gloo: tensor_parallel_size=2 gives exactly the
greedy tokens of one process and of HF transformers; engines never collide; sizes that do not
divide are refused before any process starts; a worker that dies is a prompt, clear error."""
import copy
import gc
import json
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from helpers import greedy, hf_greedy, random_prompts
from nanovllm import LLM, SamplingParams
from nanovllm.scheduling.sequence import Sequence
from nanovllm.runner import worker_group
from nanovllm.runner.decode_inputs import DecodeInputs
from nanovllm.runner.model_runner import ModelRunner
from nanovllm.runner.step_inputs import StepMessage, prefill_inputs
from nanovllm.runner.worker import send
from nanovllm.runner.worker_group import TensorParallelError
from nanovllm.testing.synthetic import build_checkpoint

REPO_ROOT = Path(__file__).resolve().parents[1]
BLOCK = 16
MAX_TOKENS = 24
# A dead worker must surface well within this (gloo reports a lost peer at once).
FAILURE_DEADLINE_S = 15.0


def engine(path: str, tp: int, **kwargs) -> LLM:
    return LLM(path, device="cpu", tensor_parallel_size=tp, kvcache_block_size=BLOCK, **kwargs)


def pid_gone(pid: int, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def pid_ended(pid: int, within_s: float = 5.0) -> bool:
    """The process has exited, reaped or not (a child stays a zombie, state Z, until its parent
    joins it), as /proc says."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def call_with_deadline(fn, seconds: float):
    """fn() in a thread: (its result or exception, seconds taken); fails the test if it hangs."""
    box = {}

    def target():
        try:
            box["result"] = fn()
        except BaseException as error:  # handed to the test, which asserts on it
            box["error"] = error
    start = time.monotonic()
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s: hung"
    return box.get("error", box.get("result")), time.monotonic() - start


@pytest.fixture(scope="module")
def qwen2_tiny_tied(tmp_path_factory) -> str:
    """Qwen2 (q/k/v bias) with the LM head tied to the embedding; 6 heads / 2 KV heads divide by 2."""
    return build_checkpoint(str(tmp_path_factory.mktemp("qwen2_tiny_tied")), "qwen2", hidden_size=96,
                            tie_word_embeddings=True)


def test_step_message_carries_only_what_a_worker_runs():
    prompt = list(range(1000))
    seq = Sequence(7, prompt, SamplingParams(temperature=0.5, top_k=5, max_tokens=50), BLOCK)
    seq.block_table = list(range(63))
    seq.num_computed_tokens, seq.num_scheduled_tokens = 480, 40  # a prefill chunk
    short = Sequence(8, [5, 6, 7], SamplingParams(), BLOCK)
    short.block_table, short.num_scheduled_tokens = [70], 3  # a whole prompt
    chunk = pickle.loads(pickle.dumps(StepMessage.of([seq, short], is_prefill=True)))
    assert chunk.is_prefill and chunk.token_ids == prompt[480:520] + [5, 6, 7]
    assert (chunk.starts, chunk.ends, chunk.lengths) == ([480, 0], [520, 3], [1000, 3])
    assert chunk.block_tables == [seq.block_table, short.block_table]
    # Plain ints and lists: no sequence, sampling field, generator or detokenizer travels.
    assert all(type(x) is int for field in (chunk.token_ids, chunk.starts, chunk.ends, chunk.lengths) for x in field)
    assert all(type(x) is int for table in chunk.block_tables for x in table)

    seq.num_computed_tokens, seq.num_scheduled_tokens = 1000, 1  # decode: the sampled token is last
    seq.token_ids.append(4242)
    decode = pickle.loads(pickle.dumps(StepMessage.of([seq], is_prefill=False)))
    assert (decode.token_ids, decode.starts, decode.lengths) == ([4242], [1000], [1001])
    # A decode step's size depends on the block table, not on how many tokens the sequence holds.
    two = Sequence(9, [1, 2], SamplingParams(), BLOCK)
    two.block_table, two.num_computed_tokens, two.num_scheduled_tokens = list(range(63)), 1, 1
    sizes = [len(pickle.dumps(StepMessage.of([s], is_prefill=False))) for s in (seq, two)]
    assert abs(sizes[0] - sizes[1]) <= 8


def test_step_message_round_trips_into_the_same_inputs():
    """A worker builds its tensors from the unpickled message by the code rank 0 runs on the
    original: the inputs must be identical, for a prefill (chunk, cached prefix) and a decode."""
    seqs = [Sequence(i, list(range(10 * i, 10 * i + 20 + 7 * i)), SamplingParams(), BLOCK) for i in range(3)]
    for i, seq in enumerate(seqs):
        seq.block_table = [3 * i + j for j in range(seq.num_blocks)]
        seq.num_computed_tokens = BLOCK if i == 1 else 0  # a cached prefix
        seq.num_scheduled_tokens = len(seq) - seq.num_computed_tokens - (5 if i == 2 else 0)  # 2: a chunk
    prefill = StepMessage.of(seqs, is_prefill=True)
    for seq in seqs:
        seq.num_computed_tokens, seq.num_scheduled_tokens = len(seq), 1
        seq.token_ids.append(seq.seq_id + 500)
    decode = StepMessage.of(seqs, is_prefill=False)
    buffers = [DecodeInputs(4, 8, BLOCK, torch.device("cpu")) for _ in range(2)]
    for step in (prefill, decode):
        received = pickle.loads(pickle.dumps(step))
        assert received == step
        if step.is_prefill:
            here, there = (prefill_inputs(s, BLOCK, torch.device("cpu")) for s in (step, received))
            assert here.sample_indices == there.sample_indices == [0, 1]  # the chunk does not sample
        else:
            here, there = (b.fill(s, 4, full_width=True) for b, s in zip(buffers, (step, received)))
        for mine, theirs in zip(here, there):
            if isinstance(mine, torch.Tensor):
                assert torch.equal(mine, theirs)
        for name in ("slot_mapping", "cu_seqlens_q", "cu_seqlens_k", "context_lens", "block_tables"):
            mine, theirs = getattr(here.meta, name), getattr(there.meta, name)
            assert (mine is None and theirs is None) or torch.equal(mine, theirs), name


def test_deepcopy_of_a_sequence_is_a_full_working_copy():
    params = SamplingParams(temperature=0.7, stop_token_ids=[9], max_tokens=20)
    seq = Sequence(3, list(range(40)), params, BLOCK)
    seq.block_table, seq.num_computed_tokens = [4, 9, 2], 40
    seq.token_ids.append(77)
    twin = copy.deepcopy(seq)
    for name in ("seq_id", "status", "token_ids", "num_prompt_tokens", "block_table", "num_computed_tokens",
                 "sampling_params", "seed", "finish_reason"):
        assert getattr(twin, name) == getattr(seq, name), name
    assert (len(twin), twin.last_token, twin.num_blocks, twin.block(2)) == (41, 77, 3, list(range(32, 40)) + [77])
    assert twin.completion_token_ids == [77] and twin.prompt_token_ids == list(range(40))
    # Its own lists: changing the copy leaves the original alone, and it steps like the original.
    twin.token_ids.append(5)
    twin.block_table.append(11)
    assert seq.token_ids[-1] == 77 and seq.block_table == [4, 9, 2]
    assert StepMessage.of([twin], is_prefill=False).token_ids == [5]


@pytest.mark.parametrize("ckpt", ["qwen3_tiny", "qwen2_tiny_tied"])
def test_tp2_equals_tp1_and_hf_with_prefix_hits_chunking_and_preemption(ckpt, request):
    path = request.getfixturevalue(ckpt)
    shared = random_prompts(200, [48], seed=6)[0]
    prompts = [shared + tail for tail in random_prompts(200, [3, 17, 30, 1, 12], seed=7)]
    prompts += random_prompts(200, [5, 40, 64, 15, 16, 17], seed=8)
    expected = hf_greedy(path, prompts, MAX_TOKENS)
    # 14 blocks of 16 tokens cannot hold the batch at once: preemption; 40 tokens a step: chunking.
    small = dict(num_kvcache_blocks=14, max_num_batched_tokens=40)
    outputs = {}
    for tp in (1, 2):
        llm = engine(path, tp, **small)
        first = llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)
        second = llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)  # hits the blocks the first call cached
        assert llm.scheduler.num_preemptions > 0
        assert sum(o["num_cached_tokens"] for o in first + second) > 0
        assert llm.block_manager.num_blocks == 14
        outputs[tp] = [[o["token_ids"] for o in first], [o["token_ids"] for o in second]]
        llm.exit()
    assert outputs[2] == outputs[1] == [expected, expected]


@pytest.fixture(scope="module")
def gpt2_tiny_even(tmp_path_factory) -> str:
    """GPT-2 with 4 heads, which split over 2 ranks (gpt2_tiny's 5 do not)."""
    return build_checkpoint(str(tmp_path_factory.mktemp("gpt2_tiny_even")), "gpt2", n_positions=128)


@pytest.mark.parametrize("ckpt", ["llama_tiny", "qwen3_moe_mixed", "gpt2_tiny_even"])
def test_tp2_other_families_equal_hf_with_prefix_hits_and_preemption(ckpt, request):
    """Llama (llama3 rope scaling), Qwen3-MoE (experts split over their intermediate dimension, a
    dense layer, a tied head) and GPT-2 (biases on row-parallel layers, replicated positions):
    TP=1 and TP=2 give HF's greedy tokens."""
    path = request.getfixturevalue(ckpt)
    shared = random_prompts(200, [40], seed=30)[0]
    prompts = [shared + tail for tail in random_prompts(200, [1, 9], seed=31)] + random_prompts(200, [5, 33], seed=32)
    expected = hf_greedy(path, prompts, 12)
    for tp in (1, 2):
        # 6 blocks of 16 tokens: the first three prompts fill them and the first to grow preempts another.
        llm = engine(path, tp, num_kvcache_blocks=6)
        first = llm.generate(prompts[:1], greedy(12), use_tqdm=False)
        batch = llm.generate(prompts, greedy(12), use_tqdm=False)  # the shared prefix's blocks are cached
        assert [o["token_ids"] for o in first + batch] == expected[:1] + expected, f"tensor_parallel_size={tp}"
        assert llm.scheduler.num_preemptions > 0
        assert sum(o["num_cached_tokens"] for o in batch) >= 32
        llm.exit()


def test_step_message_larger_than_a_pipe_buffer(qwen3_tiny):
    """One prefill step of ~30k tokens: its message is far over the OS pipe buffer (64 KiB) and
    must reach the worker whole."""
    prompts = random_prompts(600, [1000] * 30, seed=12)
    config = dict(num_kvcache_blocks=2 * 30 * 64, max_num_batched_tokens=30_000, max_num_seqs=30)
    llm = engine(qwen3_tiny, 2, **config)
    sizes = []
    send_step = llm.model_runner.workers.send_step

    def measuring_send_step(step):
        sizes.append(len(pickle.dumps(step)))
        send_step(step)
    llm.model_runner.workers.send_step = measuring_send_step
    tp2 = llm.generate(prompts, greedy(2), use_tqdm=False)
    llm.exit()
    assert max(sizes) > 64 * 1024
    tp1 = engine(qwen3_tiny, 1, **config).generate(prompts, greedy(2), use_tqdm=False)
    assert [o["token_ids"] for o in tp2] == [o["token_ids"] for o in tp1]


def test_new_engine_after_exit_in_the_same_process(qwen3_tiny):
    threads = torch.get_num_threads()
    prompts = random_prompts(200, [7, 20, 33], seed=13)
    expected = hf_greedy(qwen3_tiny, prompts, 8)
    llm = engine(qwen3_tiny, 2, num_kvcache_blocks=64)
    pids = llm.model_runner.worker_pids
    assert [o["token_ids"] for o in llm.generate(prompts, greedy(8), use_tqdm=False)] == expected
    # Beside it: a one-process engine is unaffected by its process group; a second TP engine is refused.
    single = engine(qwen3_tiny, 1, num_kvcache_blocks=64)
    assert [o["token_ids"] for o in single.generate(prompts, greedy(8), use_tqdm=False)] == expected
    with pytest.raises(RuntimeError, match="exit"):
        engine(qwen3_tiny, 2, num_kvcache_blocks=64)
    llm.exit()
    llm.exit()  # idempotent
    assert all(pid_gone(pid) for pid in pids)
    assert not dist.is_initialized() and torch.get_num_threads() == threads
    with pytest.raises(RuntimeError, match="exited"):
        llm.generate(prompts, greedy(8), use_tqdm=False)
    again = engine(qwen3_tiny, 2, num_kvcache_blocks=64)
    assert [o["token_ids"] for o in again.generate(prompts, greedy(8), use_tqdm=False)] == expected
    again.exit()


def test_dropped_engine_stops_its_workers(qwen3_tiny):
    """The engine's exit hook holds it weakly: dropping a tensor-parallel engine without exit()
    lets the garbage collector free it, workers and process group included."""
    llm = engine(qwen3_tiny, 2, num_kvcache_blocks=64)
    pids = llm.model_runner.worker_pids
    llm.generate(random_prompts(200, [9], seed=17), greedy(4), use_tqdm=False)
    ref = weakref.ref(llm)
    del llm
    gc.collect()
    assert ref() is None
    assert all(pid_gone(pid) for pid in pids) and not dist.is_initialized()


# Each run of this script is an engine in a process of its own; it prints its tokens and worker pids.
# One run leaves the engine to interpreter exit (its exit hook), the other calls exit() itself.
ENGINE_SCRIPT = """
import json, sys
from nanovllm import LLM, SamplingParams
if __name__ == "__main__":
    path, prompts, call_exit = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] == "1"
    llm = LLM(path, device="cpu", tensor_parallel_size=2, kvcache_block_size=16, num_kvcache_blocks=64)
    out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    print(json.dumps({"tokens": [o["token_ids"] for o in out], "pids": llm.model_runner.worker_pids}))
    if call_exit:
        llm.exit()
"""


def test_two_engines_in_two_processes_at_once(qwen3_tiny):
    prompts = random_prompts(200, [5, 18, 40], seed=14)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    runs = [subprocess.Popen([sys.executable, "-c", ENGINE_SCRIPT, qwen3_tiny, json.dumps(prompts), call_exit],
                             cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for call_exit in ("1", "0")]
    reference = engine(qwen3_tiny, 1, num_kvcache_blocks=64).generate(prompts, greedy(12), use_tqdm=False)
    for run in runs:
        stdout, stderr = run.communicate(timeout=120)
        assert run.returncode == 0, stderr[-3000:]
        result = json.loads(stdout.strip().splitlines()[-1])
        assert result["tokens"] == [o["token_ids"] for o in reference]
        assert all(pid_gone(pid) for pid in result["pids"]), "a worker outlived its engine's process"


@pytest.mark.parametrize("ckpt, tp, field", [
    ("qwen3_tiny_tied", 2, "num_attention_heads=9"),  # 9 heads, 3 KV heads
    ("qwen3_tiny", 4, "num_attention_heads=6"),
    ("qwen3_tiny", 8, "num_attention_heads=6"),
])
def test_indivisible_sizes_refused_before_any_process_starts(ckpt, tp, field, request, monkeypatch):
    def no_spawning(*args, **kwargs):
        raise AssertionError("workers were started for a model that cannot be split")
    monkeypatch.setattr(worker_group.WorkerGroup, "__init__", no_spawning)
    children = multiprocessing.active_children()
    with pytest.raises(ValueError, match=f"tensor_parallel_size={tp}.*{field}.*allowed"):
        LLM(request.getfixturevalue(ckpt), device="cpu", tensor_parallel_size=tp)
    assert multiprocessing.active_children() == children and not dist.is_initialized()


def signal_worker_at_third_step(monkeypatch, pid: int, signum: int) -> list[bool]:
    """From now on, rank 0's third forward pass sends `signum` to the worker first: rank 0 has
    sent that step, so the worker dies (or stops) before or while running it. Returns the list of
    steps seen (is_prefill of each)."""
    steps = []
    forward = ModelRunner.forward

    def signalling_forward(self, step):
        steps.append(step.is_prefill)
        if len(steps) == 3:
            os.kill(pid, signum)
        return forward(self, step)
    monkeypatch.setattr(ModelRunner, "forward", signalling_forward)
    return steps


def test_killed_worker_fails_generate_promptly(qwen3_tiny, monkeypatch):
    """SIGKILL the worker in the middle of a step, while rank 0 is in the step's collectives."""
    llm = engine(qwen3_tiny, 2, num_kvcache_blocks=64)
    (pid,) = llm.model_runner.worker_pids
    prompts = random_prompts(200, [9, 30], seed=15)
    signal_worker_at_third_step(monkeypatch, pid, signal.SIGKILL)
    error, seconds = call_with_deadline(lambda: llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False),
                                        FAILURE_DEADLINE_S)
    assert isinstance(error, TensorParallelError) and isinstance(error, RuntimeError), error
    assert f"worker rank 1 (pid {pid}) was killed by SIGKILL" in str(error)
    assert seconds < FAILURE_DEADLINE_S
    # The group stays stopped: later calls fail at once with the same cause; exit() still cleans up.
    error, seconds = call_with_deadline(lambda: llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False),
                                        FAILURE_DEADLINE_S)
    assert isinstance(error, TensorParallelError) and "SIGKILL" in str(error) and seconds < 1
    _, seconds = call_with_deadline(llm.exit, FAILURE_DEADLINE_S)
    assert not dist.is_initialized()


def test_worker_exception_reported_with_its_traceback(qwen3_tiny):
    llm = engine(qwen3_tiny, 2, num_kvcache_blocks=64)
    prompts = random_prompts(200, [9], seed=16)
    llm.generate(prompts, greedy(4), use_tqdm=False)
    (worker,) = llm.model_runner.workers.workers
    send(worker.conn, "no-such-message")  # the worker raises ValueError on it
    error, _ = call_with_deadline(lambda: llm.generate(prompts, greedy(4), use_tqdm=False), FAILURE_DEADLINE_S)
    assert isinstance(error, TensorParallelError), error
    assert "worker rank 1" in str(error) and "Traceback" in str(error)
    assert "ValueError: unknown step message 'no-such-message'" in str(error)
    llm.exit()


# Shortened for the test (the default is 30 s); a stopped worker must be reported well within
# this plus FAILURE_DEADLINE_S, where without heartbeats rank 0 would wait out the process
# group's 30-minute timeout.
HEARTBEAT_TIMEOUT_S = 3.0


def test_stopped_worker_is_reported_by_its_silence_and_killed(qwen3_tiny, monkeypatch):
    """SIGSTOP the worker in the middle of a step: it neither dies nor answers, and rank 0 is
    blocked in the step's collectives until the watcher notices the missing heartbeats."""
    llm = engine(qwen3_tiny, 2, num_kvcache_blocks=64, tensor_parallel_heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    (pid,) = llm.model_runner.worker_pids
    prompts = random_prompts(200, [9, 30], seed=17)
    assert len(llm.generate(prompts, greedy(4), use_tqdm=False)) == 2  # healthy beats are not silence
    steps = signal_worker_at_third_step(monkeypatch, pid, signal.SIGSTOP)
    try:
        error, _ = call_with_deadline(lambda: llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False),
                                      HEARTBEAT_TIMEOUT_S + FAILURE_DEADLINE_S)
    finally:
        monkeypatch.undo()
    assert len(steps) >= 3, "the worker was never stopped"
    assert isinstance(error, TensorParallelError), error
    assert f"worker rank 1 (pid {pid}) sent no heartbeat" in str(error)
    assert "tensor_parallel_heartbeat_timeout_s=3" in str(error)
    assert pid_ended(pid), "the stopped worker was left in place, not killed"
    # The group stays stopped; exit() frees the rest, and no thread or process of it is left.
    error, _ = call_with_deadline(lambda: llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False), FAILURE_DEADLINE_S)
    assert isinstance(error, TensorParallelError) and "sent no heartbeat" in str(error)
    call_with_deadline(llm.exit, FAILURE_DEADLINE_S)
    assert pid_gone(pid)
    assert not dist.is_initialized() and not multiprocessing.active_children()
    assert not [t for t in threading.enumerate() if t.name == "nanovllm-tp-watcher"]
