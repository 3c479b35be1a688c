"""The CPU paged-attention kernel (kernels/cpu_paged_attention.cpp through platform/cpu/attention.py)
against the oracle written from attention's definition (tests/reference_attention.py), and the
choice and build around it.

Caches are random with their blocks shuffled; every slot no sequence owns holds large finite
garbage, so reading one changes the output. Covered: decode rows of ragged lengths (0, 1, on and
around block boundaries, many blocks), prefill chunks over a cached prefix beside one-token rows
(a mixed step), GQA groups 1/2/4/8, head dims 64 and 128, block sizes 16 and 32, sequences whose
tables share blocks (a prefix-cache hit), a strided q (a view of a fused qkv), float32 to rounding,
bfloat16 and float16 within their tolerance; bfloat16 prefill tiles on AMX where the CPU has it.
Then the engine: greedy tokens equal HF's with the kernel on every path (prefix hits, mixed steps,
chunked prefill), bf16 prompt logprobs with AMX prefill tiles as without, and the backend choice
falls back to torch, saying why, when the kernel cannot be built.
"""
import logging

import pytest
import torch

from conftest import build_checkpoint
from helpers import hf_greedy, random_prompts
from nanovllm import LLM, SamplingParams
from nanovllm.platform import attention
from nanovllm.platform.cpu.attention import CpuPagedBackend
from nanovllm.attention.torch_backend import TorchBackend
from nanovllm.kernels import cpu_build
from nanovllm.utils.context import AttentionMetadata
from reference_attention import ReferenceTorchBackend

GARBAGE = 1e3  # scale of the values in slots no sequence owns
TOLERANCE = {
    torch.float32: dict(atol=2e-6, rtol=1e-5),  # float32: summation order and exp's rounding only
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}
GROUPS = [1, 2, 4, 8]  # query heads per KV head
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def kernel():
    loaded = cpu_build.load()
    if isinstance(loaded, str):
        pytest.skip(loaded)  # no C++ compiler here: the engine falls back (tested below)
    return loaded


def paged_cache(lengths: list[int], block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                gen: torch.Generator, shared_blocks: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache, block_tables) holding lengths[i] random tokens for sequence i in shuffled
    blocks, every other slot garbage, tables padded with -1. With `shared_blocks`, every sequence's
    first that many blocks are the same blocks (a cached prefix they share), so their first
    shared_blocks * block_size tokens are the same."""
    blocks_per_seq = [-(-n // block_size) for n in lengths]
    own = [max(0, count - shared_blocks) for count in blocks_per_seq]
    num_blocks = shared_blocks + sum(own) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    shared, order = order[:shared_blocks], order[shared_blocks:]
    tables = torch.full((len(lengths), max(blocks_per_seq) + 2), -1, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k, v = (torch.randn(shape, generator=gen) * GARBAGE for _ in range(2))
    for cache in (k, v):  # the shared blocks' tokens, once
        cache[shared] = torch.randn(len(shared), block_size, num_kv_heads, head_dim, generator=gen)
    for i, (n, count) in enumerate(zip(lengths, blocks_per_seq)):
        table = (shared + order[:own[i]])[:count]
        order = order[own[i]:]
        tables[i, :count] = torch.tensor(table, dtype=torch.int32)
        start = min(n, shared_blocks * block_size)
        slots = (tables[i, :count].long().unsqueeze(1) * block_size + torch.arange(block_size)).flatten()[start:n]
        for cache in (k, v):
            cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(len(slots), num_kv_heads, head_dim,
                                                                        generator=gen)
    return k.to(dtype), v.to(dtype), tables


def prefill_meta(lens: list[tuple[int, int]], tables: torch.Tensor) -> AttentionMetadata:
    """A prefill step's metadata for (cached prefix, new tokens) per sequence."""
    seqlens_q, seqlens_k = [n for _, n in lens], [p + n for p, n in lens]
    cu = lambda xs: torch.tensor([0] + xs).cumsum(0).to(torch.int32)
    return AttentionMetadata(is_prefill=True, slot_mapping=torch.empty(0, dtype=torch.int64),
                             cu_seqlens_q=cu(seqlens_q), cu_seqlens_k=cu(seqlens_k), max_seqlen_q=max(seqlens_q),
                             max_seqlen_k=max(seqlens_k), block_tables=tables, seqlens_q=seqlens_q, seqlens_k=seqlens_k)


def decode_meta(lengths: list[int], tables: torch.Tensor) -> AttentionMetadata:
    return AttentionMetadata(is_prefill=False, slot_mapping=torch.empty(0, dtype=torch.int64),
                             context_lens=torch.tensor(lengths, dtype=torch.int32), block_tables=tables)


def assert_matches(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.isfinite().all(), "garbage or an unwritten row reached the output"
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", GROUPS)
# 64 and 128 as real models have them; 16, 32, 80 and 96 for the kernel's other paths (decode scores
# are summed 16 tokens at a time where head_dim is a multiple of 32, else one dot product per token;
# P x V takes 64 columns a pass, then 32).
@pytest.mark.parametrize("head_dim", [16, 32, 64, 80, 96, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_matches_reference(kernel, dtype, group, head_dim, block_size):
    gen = torch.Generator().manual_seed(group * 1000 + head_dim + block_size)
    num_kv_heads = 2
    lengths = [0, 1, block_size - 1, block_size, block_size + 1, 7, 9 * block_size + 3, 2, 3 * block_size - 1]
    k_cache, v_cache, tables = paged_cache(lengths, block_size, num_kv_heads, head_dim, dtype, gen)
    meta = decode_meta(lengths, tables)
    q = torch.randn(len(lengths), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    scale = head_dim ** -0.5
    out = CpuPagedBackend(kernel).decode(q, k_cache, v_cache, meta, scale)
    assert_matches(out, ReferenceTorchBackend().decode(q, k_cache, v_cache, meta, scale), dtype)
    assert (out[0] == 0).all()  # no context: zeros


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_over_cached_prefix_and_mixed_rows_match_reference(kernel, dtype, group, head_dim):
    """Chunks of many new tokens over cached prefixes (more than one query tile, prefixes on and
    off block boundaries) beside one-new-token rows, in one call."""
    gen = torch.Generator().manual_seed(group * 100 + head_dim)
    block_size, num_kv_heads = 16, 2
    lens = [(0, 1), (16, 1), (15, 2), (1, 15), (17, 40), (200, 31), (33, 1), (0, 20), (5, 17)]
    k_cache, v_cache, tables = paged_cache([p + n for p, n in lens], block_size, num_kv_heads, head_dim, dtype, gen)
    meta = prefill_meta(lens, tables)
    q = torch.randn(sum(meta.seqlens_q), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    scale = head_dim ** -0.5
    out = CpuPagedBackend(kernel).prefill(q, None, None, k_cache, v_cache, meta, scale)
    assert_matches(out, ReferenceTorchBackend().prefill(q, None, None, k_cache, v_cache, meta, scale), dtype)


# float16 takes the kernel's general tiles (K transposed per block); the others the lanes path.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("head_dim, block_size", [(64, 16), (80, 32), (128, 64)])
def test_prefill_tiles_of_many_rows_match_reference(kernel, dtype, group, head_dim, block_size):
    """The kernel's prefill tiles (16 or more query rows, rows in vector lanes): fresh prompts and
    chunks over prefixes whose rows are not a multiple of 16 (padding lanes), a single vector of
    rows and two, queries whose causal edge falls inside a block, beside shorter tiles."""
    gen = torch.Generator().manual_seed(group * 10 + head_dim + block_size)
    num_kv_heads = 2
    lens = [(0, 16), (0, 17), (0, 100), (3, 29), (block_size, 33), (block_size - 1, 2 * block_size + 5), (0, 5),
            (70, 48)]
    k_cache, v_cache, tables = paged_cache([p + n for p, n in lens], block_size, num_kv_heads, head_dim, dtype, gen)
    meta = prefill_meta(lens, tables)
    q = torch.randn(sum(meta.seqlens_q), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    scale = head_dim ** -0.5
    out = CpuPagedBackend(kernel).prefill(q, None, None, k_cache, v_cache, meta, scale)
    assert_matches(out, ReferenceTorchBackend().prefill(q, None, None, k_cache, v_cache, meta, scale), dtype)


@pytest.fixture
def amx_kernel(kernel):
    """The kernel with bfloat16 prefill tiles on AMX (the default where the CPU has it), put back
    on after the test; skips where this CPU or build has no AMX."""
    if not kernel.use_amx(True):
        pytest.skip("this CPU has no AMX (amx_bf16 + amx_tile), so bf16 prefill tiles stay on AVX-512")
    yield kernel
    kernel.use_amx(True)


def test_amx_prefill_says_which_tiles_take_it(amx_kernel):
    """bfloat16 caches whose head_dim is a multiple of 64 and blocks of a multiple of 32 tokens, while
    the setting is on; asking (use_amx()) leaves the setting as it is."""
    assert amx_kernel.use_amx() and amx_kernel.use_amx()
    assert amx_kernel.amx_prefill(torch.bfloat16, 64, 32) and amx_kernel.amx_prefill(torch.bfloat16, 128, 256)
    assert not amx_kernel.amx_prefill(torch.float32, 64, 32) and not amx_kernel.amx_prefill(torch.float16, 64, 32)
    assert not amx_kernel.amx_prefill(torch.bfloat16, 32, 32) and not amx_kernel.amx_prefill(torch.bfloat16, 96, 32)
    assert not amx_kernel.amx_prefill(torch.bfloat16, 64, 16)
    assert not amx_kernel.use_amx(False) and not amx_kernel.use_amx()
    assert not amx_kernel.amx_prefill(torch.bfloat16, 64, 32)


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("head_dim, block_size", [(64, 32), (64, 64), (128, 32), (256, 32)])
def test_amx_prefill_tiles_match_reference(amx_kernel, group, head_dim, block_size):
    """bfloat16 prefill tiles on AMX (cpu_amx_attention.cpp): fresh prompts of one tile of rows,
    part tiles and several items (over 256 rows), chunks over prefixes on and off 32-key
    boundaries, sequences sharing blocks, beside a few-row chunk and decode-sized rows that take the
    other paths. Within bf16's tolerance of the reference, no further from it than the AVX-512
    path's error allows (P is rounded to bf16 there, scores are not), and not the AVX-512 path's
    output bit for bit (the AMX path ran)."""
    gen = torch.Generator().manual_seed(group * 31 + head_dim + block_size)
    num_kv_heads = 2
    lens = [(0, 16), (0, 300), (17, 45), (block_size, 33), (3 * block_size - 5, 70), (0, 5), (40, 1), (64, 129)]
    k_cache, v_cache, tables = paged_cache([p + n for p, n in lens], block_size, num_kv_heads, head_dim,
                                           torch.bfloat16, gen, shared_blocks=1)
    meta = prefill_meta(lens, tables)
    q = torch.randn(sum(meta.seqlens_q), num_kv_heads * group, head_dim, generator=gen).to(torch.bfloat16)
    scale = head_dim ** -0.5
    expected = ReferenceTorchBackend().prefill(q.float(), None, None, k_cache.float(), v_cache.float(), meta, scale)
    out = CpuPagedBackend(amx_kernel).prefill(q, None, None, k_cache, v_cache, meta, scale)
    assert_matches(out, expected, torch.bfloat16)
    amx_kernel.use_amx(False)
    lanes = CpuPagedBackend(amx_kernel).prefill(q, None, None, k_cache, v_cache, meta, scale)
    assert not torch.equal(out, lanes)
    error, lanes_error = ((x.float() - expected).abs().mean().item() for x in (out, lanes))
    assert error <= 2 * lanes_error, (error, lanes_error)


def test_engine_bf16_prefill_on_amx_scores_prompts_as_the_avx512_path(tmp_path_factory, amx_kernel, caplog):
    """The bfloat16 engine with its prefill tiles on AMX (its start-up log says so), through chunked
    prefill (chunks over the prompt's own earlier chunks in the cache): every prompt token's logprob
    within bf16's reach of the AVX-512 path's, in the same engine (bf16 greedy tokens diverge on any
    rounding, so the comparison is of the distributions the two paths give)."""
    path = build_checkpoint(str(tmp_path_factory.mktemp("qwen3_head64")), "qwen3", hidden_size=256,
                            intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    prompts = random_prompts(500, [200, 90, 40], seed=8)
    with caplog.at_level(logging.INFO, logger="nanovllm"):
        llm = LLM(path, dtype="bfloat16", attention_backend="cpu", max_num_batched_tokens=128,
                  kvcache_block_size=32)
    assert "prefill attention on AMX tiles" in caplog.text
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    scored = {}
    for amx in (True, False):
        amx_kernel.use_amx(amx)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        scored[amx] = torch.tensor([out["prompt_logprobs"][k][prompt[k]]["logprob"]
                                    for out, prompt in zip(outputs, prompts) for k in range(1, len(prompt))])
    llm.exit()
    assert scored[True].isfinite().all() and scored[True].numel() == sum(len(p) - 1 for p in prompts)
    assert not torch.equal(scored[True], scored[False])  # the AMX path ran
    torch.testing.assert_close(scored[True], scored[False], atol=0.1, rtol=0.02)


@pytest.mark.parametrize("is_prefill", [False, True])
def test_sequences_sharing_blocks_match_reference(kernel, is_prefill):
    """Several sequences whose tables start with the same blocks (a shared cached prefix), read
    concurrently by the threads, each continuing into blocks of its own."""
    gen = torch.Generator().manual_seed(7)
    block_size, num_kv_heads, head_dim, group = 16, 4, 64, 2
    lens = [(48, 1), (50, 3), (64, 1), (33, 20)]
    k_cache, v_cache, tables = paged_cache([p + n for p, n in lens], block_size, num_kv_heads, head_dim,
                                           torch.float32, gen, shared_blocks=2)
    assert (tables[:, :2] == tables[0, :2]).all()
    if is_prefill:
        meta = prefill_meta(lens, tables)
    else:
        meta = decode_meta([p + n for p, n in lens], tables)
    q = torch.randn(sum(meta.seqlens_q) if is_prefill else len(lens), num_kv_heads * group, head_dim, generator=gen)
    backend, reference = CpuPagedBackend(kernel), ReferenceTorchBackend()
    if is_prefill:
        out = backend.prefill(q, None, None, k_cache, v_cache, meta, 0.125)
        expected = reference.prefill(q, None, None, k_cache, v_cache, meta, 0.125)
    else:
        out = backend.decode(q, k_cache, v_cache, meta, 0.125)
        expected = reference.decode(q, k_cache, v_cache, meta, 0.125)
    assert_matches(out, expected, torch.float32)


def test_strided_query_and_per_step_reuse(kernel):
    """q as a view of a fused qkv tensor (strided tokens) reads right; a second layer of the same
    step reuses the step's kernel arguments, and the next step's metadata remakes them."""
    gen = torch.Generator().manual_seed(11)
    num_heads, num_kv_heads, head_dim = 8, 2, 64
    lengths = [5, 40, 17]
    k_cache, v_cache, tables = paged_cache(lengths, 16, num_kv_heads, head_dim, torch.float32, gen)
    qkv = torch.randn(len(lengths), (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    q = qkv[:, :num_heads * head_dim].view(-1, num_heads, head_dim)
    assert not q.is_contiguous()
    backend, meta = CpuPagedBackend(kernel), decode_meta(lengths, tables)
    expected = ReferenceTorchBackend().decode(q, k_cache, v_cache, meta, 0.125)
    assert_matches(backend.decode(q, k_cache, v_cache, meta, 0.125), expected, torch.float32)
    steps = backend._steps
    backend.decode(q, v_cache, k_cache, meta, 0.125)
    assert backend._steps is steps
    backend.decode(q, k_cache, v_cache, decode_meta(lengths, tables), 0.125)
    assert backend._steps is not steps


def test_prefill_without_block_tables_goes_to_sdpa():
    """A prefill given no block tables (the start-up warm-up, which has no cache) attends its own
    contiguous K/V through the torch backend's SDPA: the kernel is not called."""
    calls = []
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(6, 4, 64, generator=gen), torch.randn(6, 2, 64, generator=gen)
    meta = prefill_meta([(0, 6)], None)
    out = CpuPagedBackend(lambda *args: calls.append(args)).prefill(q, k, k, torch.empty(0), torch.empty(0), meta,
                                                                    0.125)
    torch.testing.assert_close(out, TorchBackend().prefill(q, k, k, torch.empty(0), torch.empty(0), meta, 0.125))
    assert not calls


def test_backend_choice_and_fallback(monkeypatch, caplog):
    assert attention.resolve_backend_name("auto", "cpu", 32) == "cpu"
    assert attention.resolve_backend_name("auto", "cpu", 32, "fp8_e4m3") == "torch"
    with pytest.raises(ValueError, match="attention_backend='cpu' needs device 'cpu'"):
        attention.resolve_backend_name("cpu", "cuda", 32)
    monkeypatch.setattr(cpu_build, "load", lambda: "no C++ compiler found (set CXX, or install g++)")
    with caplog.at_level(logging.WARNING, logger="nanovllm"):
        assert isinstance(attention.create_backend("auto", "cpu", 32), TorchBackend)
    assert "no C++ compiler found" in caplog.text
    with pytest.raises(ValueError, match="attention_backend='cpu': no C\\+\\+ compiler found"):
        attention.create_backend("cpu", "cpu", 32)


def test_build_is_cached_and_a_missing_compiler_is_a_reason(tmp_path, monkeypatch, kernel):
    path = cpu_build.build(tmp_path)
    mtime = path.stat().st_mtime_ns
    assert cpu_build.build(tmp_path) == path and path.stat().st_mtime_ns == mtime  # not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left behind
    monkeypatch.setattr(cpu_build.shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler found"):
        cpu_build.build(tmp_path / "other")


def test_engine_with_kernel_equals_hf_greedy(qwen3_tiny, kernel):
    """The kernel on every path of the engine: a prefix-cache hit, chunked prefills over their
    own earlier chunks, mixed steps of chunks beside decode rows; greedy tokens are HF's."""
    llm = LLM(qwen3_tiny, attention_backend="cpu", kvcache_block_size=16, max_num_batched_tokens=48)
    backend = llm.model_runner.backend
    assert backend.name == "cpu" and backend.prefill_from_cache
    tables_given = []  # per prefill call: whether it read from the cache (never SDPA on a fresh prompt)
    prefill = backend.prefill
    backend.prefill = lambda q, k, v, kc, vc, meta, *a: tables_given.append(meta.block_tables is not None) or \
        prefill(q, k, v, kc, vc, meta, *a)
    shared = random_prompts(200, [40], seed=60)[0]
    prompts = random_prompts(200, [1, 16, 17, 100], seed=61) + [shared + [3], shared + [4, 5]]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm.generate([shared], params, use_tqdm=False)  # publishes the shared prefix's blocks
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert outputs[-1]["num_cached_tokens"] == 32 and llm.stats().mixed_steps >= 1
    assert tables_given and all(tables_given)
    llm.exit()
    assert [o["token_ids"] for o in outputs] == hf_greedy(qwen3_tiny, prompts, MAX_TOKENS)
