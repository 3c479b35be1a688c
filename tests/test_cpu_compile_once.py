"""Nothing compiles inside generate() on the CPU path, whatever the batch brings.

Start-up builds (or loads) the C++ kernel library and, with compile_mode "on" and the torch layer
functions (fused_kernels="torch": the CPU's own kernels and sampler race compile nothing), compiles
the small layer functions (utils/compile.py); after that, generate() calls with batch sizes, prompt
lengths, mixed steps and sampling options start-up never saw must build nothing: dynamo's
counters stay where start-up left them and the kernel library is never built again. With the
compiled functions the greedy tokens equal the eager engine's. (The Triton path's own check,
with every kernel specialisation recorded, is tests/test_compile_once.py.)
"""
import pytest
import torch
from torch._dynamo.utils import counters

from nanovllm import LLM, SamplingParams
from nanovllm.kernels import cpu_build

ENGINE = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=256, max_num_batched_tokens=128)
# Lengths and counts start-up's warm-up never ran: 1, 3 and 7 prompts, a prompt longer than a
# step's token budget (a chunked prefill beside decode rows), greedy and sampled rows together.
PROMPTS = [[(7 * i + j) % 500 + 3 for j in range(9 + 41 * i)] for i in range(7)]
CALLS = [(1, SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)),
         (3, [SamplingParams(temperature=0.8, top_k=5, seed=1, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=1.0, top_p=0.9, repetition_penalty=1.1, max_tokens=6, ignore_eos=True)]),
         (7, SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True))]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Compiled functions are compiled once per process (utils/compile.py); reset dynamo after
    each test so a later test that compiles them (tests/test_cuda_path.py) compiles anew."""
    yield
    torch._dynamo.reset()


def dynamo_counts() -> dict:
    return {group: dict(values) for group, values in counters.items()}


def run_calls(llm: LLM) -> list[list[int]]:
    outputs = []
    for n, params in CALLS:
        outputs += [o["token_ids"] for o in llm.generate(PROMPTS[:n], params, use_tqdm=False)]
    return outputs


@pytest.mark.parametrize("compile_mode", ["off", "on"])
def test_generate_compiles_and_builds_nothing_after_start_up(qwen3_tiny, compile_mode, monkeypatch):
    fused = "torch" if compile_mode == "on" else "auto"
    with LLM(qwen3_tiny, compile_mode=compile_mode, fused_kernels=fused, **ENGINE) as llm:
        before = dynamo_counts()
        if compile_mode == "on":
            assert before.get("stats", {}).get("unique_graphs", 0) > 0, "start-up compiled nothing: the test tests nothing"

        def no_build(*args, **kwargs):
            raise AssertionError("the CPU kernel library was built inside generate()")
        monkeypatch.setattr(cpu_build, "build", no_build)
        outputs = run_calls(llm)
        assert dynamo_counts() == before
    assert sum(map(len, outputs)) > 0


def test_compiled_layers_keep_the_eager_greedy_tokens(qwen3_tiny):
    greedy = SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True)
    tokens = {}
    for mode in ("off", "on"):
        with LLM(qwen3_tiny, compile_mode=mode, fused_kernels="torch" if mode == "on" else "auto", **ENGINE) as llm:
            tokens[mode] = [o["token_ids"] for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    assert tokens["on"] == tokens["off"]
