"""Nothing compiles after start-up, and the engine on the fused Triton kernels is HF's greedy engine.

One engine on the Triton path (attention backend "triton", fused_kernels "triton", compile_mode
"on" so that any fall-back to a torch.compile'd function would show) is built while every Triton
launch is recorded with its specialisation key, the key Triton's kernel cache is keyed by
(nanovllm/testing/kernel_launches.py; without a GPU the kernels run under TRITON_INTERPRET=1,
which has no cache, but the keys are Triton's own). Then generate() runs what start-up never saw:
batch sizes 3 to 6, mixed steps (decode rows beside prefill chunks: the default scheduling
policy), a chunked prefill, prefix-cache hits, every sampling option, priorities, swap preemption
under a small cache, contexts long enough for decode to split them. Every key launched then must
be one start-up launched, and dynamo's counters must not move. The same run's greedy outputs must
equal HF transformers', and a seeded request must draw the same tokens alone as beside requests
that take the sampler's general path (and after being swapped out and in). On a GPU the same
checks run compiled, plus Triton's real kernel caches. The other model families (Llama, GPT-2,
Qwen3-MoE through the fused MoE kernel) get the same launch check and HF parity on a shorter run.
"""
import copy

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from helpers import GPU_ONLY, TRITON_DEVICES, TRITON_ON_CPU, hf_greedy, random_prompts  # noqa: E402
from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.kernels import decode_attention  # noqa: E402
from nanovllm.platform.torch import TorchPlatform  # noqa: E402
from nanovllm.platform.triton import CudaPlatform, TritonPlatform  # noqa: E402
from nanovllm.testing.kernel_launches import recording, triton_kernels  # noqa: E402

BLOCK = 16
MAX_TOKENS = 6
SEEDED = SamplingParams(temperature=0.8, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)
# Every option of the sampler's general path at once (and n = 2).
GENERAL = SamplingParams(n=2, temperature=1.0, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.2,
                         presence_penalty=0.5, frequency_penalty=0.3, logprobs=2, min_tokens=2, max_tokens=3,
                         ignore_eos=True)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Splits of 16 tokens (instead of 256) make decode split the short contexts of this test, so
# the number of splits, a constexpr of the decode kernel, varies within generate().
TOKENS_PER_SPLIT = 16


def dynamo_counts() -> dict:
    from torch._dynamo.utils import counters
    return copy.deepcopy({name: dict(counter) for name, counter in counters.items()})


def kernel_cache_sizes(kernels: dict) -> dict[str, int]:
    """Compiled variants in each kernel's cache (compiled mode only: JITFunction.device_caches)."""
    return {name: sum(len(caches[0]) for caches in getattr(kernel, "device_caches", {}).values())
            for name, kernel in kernels.items()}


def run_workload(qwen3_tiny: str, device: str, eager: bool, kv_cache_dtype: str = "auto") -> dict:
    """Start an engine on the Triton path while recording launches, then run what start-up never saw."""
    kernels = triton_kernels()
    # Lengths at block ends (47, 31, 32, 15): the second call's rows all need a new block at once.
    prompts = random_prompts(200, [47, 9, 31, 32, 15], seed=60)
    long, short, mid, other, seeded = prompts
    # max_num_batched_tokens=32 chunks the 47-token prompt's prefill; 8 blocks hold the first call
    # but not the second, whose lower-priority rows are swapped out.
    config = dict(device=device, enforce_eager=eager, attention_backend="triton", fused_kernels="triton",
                  compile_mode="on", kvcache_block_size=BLOCK, num_kvcache_blocks=8, max_num_seqs=8,
                  max_num_batched_tokens=32, max_model_len=128, preemption_mode="swap", swap_space=0.01,
                  kv_cache_dtype=kv_cache_dtype)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(decode_attention, "MIN_TOKENS_PER_SPLIT", TOKENS_PER_SPLIT)
        dynamo_before = dynamo_counts()
        with recording(kernels) as launches:
            llm = LLM(qwen3_tiny, **config)
            at_start = len(launches)
            caches_at_start = kernel_cache_sizes(kernels)
            first = llm.generate([long, short, mid], GREEDY, use_tqdm=False)  # batch 3, chunked prefill
            # Prefix hits (the long prompt again, its first blocks cached), a seeded row beside general-path
            # rows (n = 2), a new batch size.
            second = llm.generate([long, seeded, other, mid], [GREEDY, SEEDED, GENERAL, GREEDY], use_tqdm=False,
                                  priority=[0, 2, 1, 0])
            stats = llm.stats()
            alone = llm.generate([seeded], SEEDED, use_tqdm=False)
            caches_after = kernel_cache_sizes(kernels)
        llm.exit()
    return dict(prompts=prompts, first=first, second=second, alone=alone, launches=launches, at_start=at_start,
                dynamo_before=dynamo_before, dynamo_after=dynamo_counts(), caches=(caches_at_start, caches_after),
                kernels=kernels, stats=stats)


@pytest.fixture(scope="module", params=[pytest.param(("cpu", True), marks=TRITON_ON_CPU),
                                        *[pytest.param(("cuda", eager), marks=GPU_ONLY) for eager in (False, True)]],
                ids=lambda p: f"{p[0]}-{'eager' if p[1] else 'graphs'}")
def run(request, qwen3_tiny):
    device, eager = request.param
    return run_workload(qwen3_tiny, device, eager)


def assert_no_new_variant(run: dict) -> None:
    launches, at_start = run["launches"], run["at_start"]
    start_keys, later = set(launches[:at_start]), launches[at_start:]
    new = sorted({launch.kernel for launch in later if launch not in start_keys})
    assert not new, f"these kernels compiled a new variant inside generate(): {new}"
    launched = {launch.kernel for launch in later}
    # The run reached every kernel the Triton path has (so the check above covered them).
    assert {"rms_norm._rms_norm_kernel", "silu_mul._silu_and_mul_kernel", "qk_norm_rope._qk_norm_rope_store_kernel",
            "sampling._race_chunk_kernel", "sampling._pick_kernel", "prefill_attention._prefill_kernel"} <= launched
    if "decode_attention._decode_kernel" in launched:  # eager decode (with graphs, decode replays)
        assert "decode_attention._reduce_kernel" in launched, "decode never split: the split variants went unchecked"
    caches_at_start, caches_after = run["caches"]
    assert caches_after == caches_at_start  # compiled mode: Triton's own caches (all zero under the interpreter)


def test_no_kernel_variant_is_new_after_start_up(run):
    assert_no_new_variant(run)


@pytest.mark.parametrize("device,eager", [pytest.param("cpu", True, marks=TRITON_ON_CPU),
                                          pytest.param("cuda", False, marks=GPU_ONLY)])
def test_fp8_kv_cache_compiles_nothing_after_start_up(qwen3_tiny, device, eager):
    """The same run with an fp8 cache: the kernels' quantised variants (store, fused rotary + store,
    paged prefill, which an fp8 cache takes for every prompt, and decode) are all launched at
    start-up, after calibration set the scales. Its tokens differ from HF's by fp8's rounding
    (tests/test_kv_cache_fp8.py measures that), so only the launches are checked here."""
    result = run_workload(qwen3_tiny, device, eager, kv_cache_dtype="fp8_e4m3")
    assert_no_new_variant(result)
    assert result["dynamo_after"] == result["dynamo_before"]
    stats = result["stats"]
    assert stats.mixed_steps > 0 and stats.preemptions_swap > 0 and stats.swap_ins > 0


def test_nothing_goes_through_torch_compile(run):
    assert run["dynamo_after"] == run["dynamo_before"]


def test_the_run_had_mixed_steps_and_swaps(run):
    """What the launch check above is about really happened inside generate()."""
    stats = run["stats"]
    assert stats.mixed_steps > 0 and stats.preemptions_swap > 0 and stats.swap_ins > 0


def test_greedy_outputs_equal_hf(run, qwen3_tiny):
    long, short, mid, other, _ = run["prompts"]
    expected = hf_greedy(qwen3_tiny, [long, short, mid], MAX_TOKENS)
    assert [o["token_ids"] for o in run["first"]] == expected
    second = run["second"]
    assert [second[0]["token_ids"], second[3]["token_ids"]] == [expected[0], expected[2]]
    assert second[0]["num_cached_tokens"] == 32  # two full blocks of the long prompt


def test_seeded_request_draws_the_same_alone_and_beside_general_rows(run):
    beside, alone = run["second"][1], run["alone"][0]
    assert len(alone["token_ids"]) == MAX_TOKENS
    assert beside["token_ids"] == alone["token_ids"]
    general = run["second"][2]  # n = 2, logprobs=2: both samples made their tokens, each with its top 2
    assert len(general["outputs"]) == 2
    for sample in general["outputs"]:
        assert len(sample["token_ids"]) == 3 and len(sample["logprobs"]) == 3
        assert all(len(entry["top_logprobs"]) == 2 for entry in sample["logprobs"])


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_fused_kernels_without_qk_norm_equal_hf(qwen2_tiny, device):
    """Qwen2: q/k/v biases and no q/k norm (the kernel's no-norm variant), with the torch attention
    backend, so only the fused layer kernels and the sampler are Triton's."""
    prompts = random_prompts(200, [11, 23], seed=61)
    llm = LLM(qwen2_tiny, device=device, fused_kernels="triton", attention_backend="torch",
              kvcache_block_size=BLOCK, num_kvcache_blocks=32, max_model_len=128)
    assert all(isinstance(layer.platform, TritonPlatform) for layer in llm.model_runner.attention_layers)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    llm.exit()
    assert [o["token_ids"] for o in outputs] == hf_greedy(qwen2_tiny, prompts, MAX_TOKENS)


@pytest.mark.parametrize("num_kv_heads,block_size,sms", [(8, 256, 132), (2, 16, 64), (1, 512, 108)])
def test_warmup_decode_shapes_cover_every_split_count(num_kv_heads, block_size, sms):
    """The eager decode warm-up launches one (batch, width) per split count; every (batch, width) an
    eager step can have must need one of those counts, or its first launch would compile."""
    max_batch, max_blocks = 64, 40
    shapes = decode_attention.split_shapes(max_batch, num_kv_heads, max_blocks, block_size, sms)
    for splits, (batch, width) in shapes.items():
        assert decode_attention.choose_num_splits(batch, num_kv_heads, width, block_size, sms) == splits
    reachable = {decode_attention.choose_num_splits(b, num_kv_heads, w, block_size, sms)
                 for b in range(1, max_batch + 1) for w in range(1, max_blocks + 1)}
    assert reachable == set(shapes)


FAMILY_PROMPTS = random_prompts(200, [20, 30], seed=62)
FAMILY_TOKENS = 3
FAMILY_GREEDY = SamplingParams(temperature=0, max_tokens=FAMILY_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("ckpt", ["llama_tiny", "gpt2_tiny", "qwen3_moe_tiny"])
def test_every_family_on_the_fused_kernels_compiles_nothing_after_start_up(ckpt, request, monkeypatch):
    """Llama (llama3 rope through the fused q/k kernel), GPT-2 (LayerNorm, GELU and learned
    positions stay torch's; the Triton sampler and attention) and Qwen3-MoE (the fused MoE kernel,
    which runs only on CUDA unless told otherwise): a chunked prefill beside decode rows (mixed
    steps, paged attention like a prefix hit's) launches no kernel variant start-up did not, and
    the greedy tokens are HF's. Eager, in float32, on the device there is."""
    path = request.getfixturevalue(ckpt)
    monkeypatch.setattr(TorchPlatform, "fused_experts", CudaPlatform.fused_experts)  # the kernel on the CPU too
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kernels = triton_kernels()
    with recording(kernels) as launches:
        llm = LLM(path, device=device, dtype="float32", enforce_eager=True, attention_backend="triton",
                  fused_kernels="triton", kvcache_block_size=BLOCK, num_kvcache_blocks=16, max_num_batched_tokens=24,
                  max_model_len=128)
        at_start = len(launches)
        outputs = llm.generate(FAMILY_PROMPTS, FAMILY_GREEDY, use_tqdm=False)  # chunked, decode rows beside
        mixed_steps = llm.stats().mixed_steps
        llm.exit()
    start_keys = set(launches[:at_start])
    new = sorted({launch.kernel for launch in launches[at_start:] if launch not in start_keys})
    assert not new, f"these kernels compiled a new variant inside generate(): {new}"
    launched = {launch.kernel for launch in launches[at_start:]}
    assert ("fused_moe._grouped_gemm_kernel" in launched) == (ckpt == "qwen3_moe_tiny")
    assert ("qk_norm_rope._qk_norm_rope_store_kernel" in launched) == (ckpt != "gpt2_tiny")
    assert mixed_steps > 0
    assert [o["token_ids"] for o in outputs] == hf_greedy(path, FAMILY_PROMPTS, FAMILY_TOKENS)
