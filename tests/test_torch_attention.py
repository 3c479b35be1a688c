"""The torch backend (the CPU path) against the oracle written from attention's definition
(tests/reference_attention.py: explicit float64 scores, mask and softmax, no code shared with the
backends), and the CPU settings that come with it (platform/cpu/linear.py, platform/device_host.py).

Decode and prefill run on random paged caches whose blocks are shuffled and whose every slot no
sequence owns holds large finite garbage, so reading one changes the output: lengths of zero and
one token, on and around block boundaries and across many blocks, GQA groups of 1 to 4, tiles of
one row and of many. Float32 must agree to rounding, bf16 within its tolerance; the whole engine
must still give HF's greedy tokens, and logprobs within 1e-5 of the oracle's. An fp8 cache
is dequantised a tile at a time and must give what the oracle gives on the whole cache
dequantised.
"""
import platform

import pytest
import torch
from torch import nn

from helpers import hf_greedy, random_prompts
from nanovllm import LLM, SamplingParams
from nanovllm.attention import torch_backend
from nanovllm.attention.kv_quant import FP8_DTYPES, KVScales, dequantize, quantize
from nanovllm.attention.torch_backend import DECODE_TILE_BYTES, TorchBackend, plan_decode
from nanovllm.config import Config
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.linear import ColumnParallelLinear
from nanovllm.platform import device_host
from nanovllm.platform.context import building_for
from nanovllm.platform.cpu import CpuTorchPlatform
from nanovllm.platform.cpu.linear import cpu_linear, hold_matmul_weights_in_float32, native_half_matmul
from nanovllm.utils.context import AttentionMetadata
from reference_attention import ReferenceTorchBackend

HEAD_DIM = 32
SCALE = HEAD_DIM ** -0.5
GARBAGE = 1e3  # scale of the values in slots no sequence owns
# (num_heads, num_kv_heads): GQA groups of 1, 2, 3 and 4, and one and four KV heads (float32 decode
# attends by matmul with one or two KV heads and through SDPA with more: both are covered).
HEAD_LAYOUTS = [(2, 2), (4, 2), (6, 2), (8, 2), (3, 1), (12, 4)]
FP32_TOLERANCE = dict(atol=1e-6, rtol=1e-5)  # float32: different summation order only
BF16_TOLERANCE = dict(atol=2e-2, rtol=2e-2)
# Tile budgets (bytes of gathered K+V): one row per tile, a few rows per tile, the default.
TILE_BYTES = [1, 16 << 10, DECODE_TILE_BYTES]


def decode_lengths(block_size: int) -> list[int]:
    return [0, 1, block_size - 1, block_size, block_size + 1, 7, 20 * block_size + 3, 0, 2, 3 * block_size - 1, 1]


def paged_cache(lengths: list[int], block_size: int, num_kv_heads: int, dtype: torch.dtype, gen: torch.Generator,
                spare_columns: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache, block_tables) holding lengths[i] random tokens for sequence i in shuffled
    blocks; every other slot is garbage of scale GARBAGE; tables padded with -1."""
    blocks_per_seq = [-(-n // block_size) for n in lengths]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(lengths), max(blocks_per_seq) + spare_columns), -1, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, HEAD_DIM)
    k, v = (torch.randn(shape, generator=gen) * GARBAGE for _ in range(2))
    for i, (n, count) in enumerate(zip(lengths, blocks_per_seq)):
        tables[i, :count] = torch.tensor(order[:count], dtype=torch.int32)
        order = order[count:]
        slots = (tables[i, :count].long().unsqueeze(1) * block_size + torch.arange(block_size)).flatten()[:n]
        for cache in (k, v):
            cache.view(-1, num_kv_heads, HEAD_DIM)[slots] = torch.randn(n, num_kv_heads, HEAD_DIM, generator=gen)
    return k.to(dtype), v.to(dtype), tables


def decode_meta(lengths: list[int], tables: torch.Tensor) -> AttentionMetadata:
    return AttentionMetadata(is_prefill=False, slot_mapping=torch.empty(0, dtype=torch.int64),
                             context_lens=torch.tensor(lengths, dtype=torch.int32), block_tables=tables)


def assert_matches_reference(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.isfinite().all(), "garbage or an unwritten row reached the output"
    torch.testing.assert_close(out.float(), expected.float(),
                               **(FP32_TOLERANCE if dtype == torch.float32 else BF16_TOLERANCE))


# --- decode ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEAD_LAYOUTS)
@pytest.mark.parametrize("tile_bytes", TILE_BYTES)
def test_decode_matches_reference(dtype, block_size, num_heads, num_kv_heads, tile_bytes):
    gen = torch.Generator().manual_seed(block_size + num_heads)
    lengths = decode_lengths(block_size)
    k_cache, v_cache, tables = paged_cache(lengths, block_size, num_kv_heads, dtype, gen)
    q = torch.randn(len(lengths), num_heads, HEAD_DIM, generator=gen).to(dtype)
    meta = decode_meta(lengths, tables)
    # The reference in float32 on the same (bf16-rounded) inputs: the truth bf16 is held to.
    expected = ReferenceTorchBackend().decode(q.float(), k_cache.float(), v_cache.float(), meta, SCALE)
    out = TorchBackend(tile_bytes).decode(q, k_cache, v_cache, meta, SCALE)
    assert_matches_reference(out, expected, dtype)
    assert (out[meta.context_lens == 0] == 0).all(), "a zero-length row must output exactly 0"


@pytest.mark.parametrize("dtype,num_kv_heads,by_matmul", [
    (torch.float32, 1, True), (torch.float32, 2, True), (torch.float32, 4, False), (torch.bfloat16, 2, False)])
def test_decode_attends_by_matmul_only_in_float32_with_few_kv_heads(monkeypatch, dtype, num_kv_heads, by_matmul):
    calls = []
    real = torch_backend.attend_by_matmul
    monkeypatch.setattr(torch_backend, "attend_by_matmul", lambda *args: calls.append(1) or real(*args))
    gen = torch.Generator().manual_seed(3)
    lengths = [40, 1, 17]
    k_cache, v_cache, tables = paged_cache(lengths, 16, num_kv_heads, dtype, gen)
    q = torch.randn(len(lengths), 2 * num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
    TorchBackend().decode(q, k_cache, v_cache, decode_meta(lengths, tables), SCALE)
    assert bool(calls) == by_matmul


def test_decode_every_row_active_and_batch_of_one():
    gen = torch.Generator().manual_seed(1)
    for lengths in ([1], [333], [5, 5, 5], [40, 1, 17]):
        k_cache, v_cache, tables = paged_cache(lengths, 16, 2, torch.float32, gen, spare_columns=0)
        q = torch.randn(len(lengths), 4, HEAD_DIM, generator=gen)
        meta = decode_meta(lengths, tables)
        expected = ReferenceTorchBackend().decode(q, k_cache, v_cache, meta, SCALE)
        assert_matches_reference(TorchBackend().decode(q, k_cache, v_cache, meta, SCALE), expected, torch.float32)


def test_decode_plan_is_made_once_per_step_and_remade_for_the_next():
    """Layers of one step share the metadata and so the plan; the next step's metadata (other
    lengths, other blocks) must not be served the previous plan."""
    gen = torch.Generator().manual_seed(2)
    backend = TorchBackend(4 << 10)
    for lengths in ([30, 3, 0, 64], [31, 4, 1, 65], [2]):
        k_cache, v_cache, tables = paged_cache(lengths, 16, 2, torch.float32, gen)
        layers = [(k_cache, v_cache), (v_cache.flip(-1), k_cache * 0.5)]  # a second layer: other values
        meta = decode_meta(lengths, tables)
        q = torch.randn(len(lengths), 4, HEAD_DIM, generator=gen)
        plans = []
        for k_cache, v_cache in layers:
            out = backend.decode(q, k_cache, v_cache, meta, SCALE)
            plans.append(backend._plan)
            expected = ReferenceTorchBackend().decode(q, k_cache, v_cache, meta, SCALE)
            assert_matches_reference(out, expected, torch.float32)
        assert plans[0] is plans[1]


@pytest.mark.parametrize("tile_bytes", [1, 3000, 1 << 20])
def test_decode_plan_tiles_cover_the_batch_longest_first_within_budget(tile_bytes):
    block_size, bytes_per_token = 16, 2 * 2 * HEAD_DIM * 4
    lengths = [0, 5, 300, 17, 0, 64, 1, 129, 33]
    tables = torch.arange(len(lengths) * 20, dtype=torch.int32).view(len(lengths), 20)
    plan = plan_decode(torch.tensor(lengths, dtype=torch.int32), tables, block_size, bytes_per_token, torch.float32,
                       tile_bytes)
    order = plan.order.tolist()
    assert sorted(order) == [i for i, n in enumerate(lengths) if n > 0] and not plan.all_active
    assert [lengths[i] for i in order] == sorted((n for n in lengths if n > 0), reverse=True)
    assert [(t.start, t.end) for t in plan.tiles] == list(zip([0] + [t.end for t in plan.tiles][:-1],
                                                             [t.end for t in plan.tiles]))
    assert plan.tiles[-1].end == len(order)
    for tile in plan.tiles:
        rows = order[tile.start:tile.end]
        blocks = -(-tile.num_tokens // block_size)
        assert tile.num_tokens == lengths[rows[0]]
        assert tile.block_ids.tolist() == tables[rows, :blocks].flatten().tolist()
        assert len(rows) == 1 or len(rows) * blocks * block_size * bytes_per_token <= tile_bytes
        if tile.mask is None:
            assert all(lengths[r] == tile.num_tokens for r in rows)
        else:
            visible = (tile.mask == 0).view(len(rows), -1).sum(1).tolist()
            assert visible == [lengths[r] for r in rows]


# --- prefill ---------------------------------------------------------------------------------------

def prefill_meta(lens: list[tuple[int, int]], tables: torch.Tensor | None) -> AttentionMetadata:
    seqlens_q, seqlens_k = [n for _, n in lens], [p + n for p, n in lens]
    cu = lambda xs: torch.tensor([0] + xs).cumsum(0).to(torch.int32)
    return AttentionMetadata(is_prefill=True, slot_mapping=torch.empty(0, dtype=torch.int64),
                             cu_seqlens_q=cu(seqlens_q), cu_seqlens_k=cu(seqlens_k), max_seqlen_q=max(seqlens_q),
                             max_seqlen_k=max(seqlens_k), block_tables=tables, seqlens_q=seqlens_q, seqlens_k=seqlens_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEAD_LAYOUTS)
def test_prefill_over_cached_prefix_matches_reference(dtype, num_heads, num_kv_heads):
    """Sequences of several new tokens over a cached prefix (through SDPA) and of one new token
    (through the tiled decode), on and around block boundaries."""
    gen = torch.Generator().manual_seed(3)
    lens = [(0, 1), (16, 1), (15, 2), (1, 15), (17, 16), (200, 31), (33, 0)]  # (cached prefix, new tokens)
    k_cache, v_cache, tables = paged_cache([p + n for p, n in lens], 16, num_kv_heads, dtype, gen)
    meta = prefill_meta(lens, tables)
    q = torch.randn(sum(meta.seqlens_q), num_heads, HEAD_DIM, generator=gen).to(dtype)
    expected = ReferenceTorchBackend().prefill(q, None, None, k_cache, v_cache, meta, SCALE)
    out = TorchBackend().prefill(q, None, None, k_cache, v_cache, meta, SCALE)
    assert_matches_reference(out, expected, dtype)


@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEAD_LAYOUTS)
@pytest.mark.parametrize("tile_bytes", TILE_BYTES)
def test_mixed_step_decode_rows_match_reference(block_size, num_heads, num_kv_heads, tile_bytes):
    """A mixed step: prefill chunks (with and without a cached prefix) beside one-new-token rows,
    which go through the same tiled decode as a decode step, sorted and tiled among themselves."""
    gen = torch.Generator().manual_seed(block_size * 10 + num_heads)
    lens = [(0, 20), (3 * block_size + 1, 1), (block_size - 1, 1), (block_size, 9), (0, 1), (47, 1),
            (12 * block_size, 1), (5, 2)]  # (cached, new) per sequence
    k_cache, v_cache, tables = paged_cache([p + n for p, n in lens], block_size, num_kv_heads, torch.float32, gen)
    meta = prefill_meta(lens, tables)
    q = torch.randn(sum(meta.seqlens_q), num_heads, HEAD_DIM, generator=gen)
    backend = TorchBackend(tile_bytes)
    expected = ReferenceTorchBackend().prefill(q, None, None, k_cache, v_cache, meta, SCALE)
    assert_matches_reference(backend.prefill(q, None, None, k_cache, v_cache, meta, SCALE), expected, torch.float32)
    plan = backend._plan
    assert plan.decode_rows.numel() == 5 and [p.len_q for p in plan.prefills] == [20, 9, 2]
    # A second layer of the same step reuses the plan.
    out = backend.prefill(q, None, None, v_cache, k_cache, meta, SCALE)
    assert backend._plan is plan
    assert_matches_reference(out, ReferenceTorchBackend().prefill(q, None, None, v_cache, k_cache, meta, SCALE),
                             torch.float32)


@pytest.mark.parametrize("fp8", list(FP8_DTYPES.values()))
@pytest.mark.parametrize("tile_bytes", TILE_BYTES)
def test_fp8_cache_is_dequantized_per_tile_as_the_whole_cache(fp8, tile_bytes):
    """Decode and a mixed step over an fp8 cache (per-head scales; the garbage slots clamp to fp8's
    range) equal the oracle over the whole cache dequantised; the gathered tiles stay fp8."""
    gen = torch.Generator().manual_seed(7)
    block_size, num_heads, num_kv_heads = 16, 6, 2
    kv_scales = KVScales(torch.tensor([0.01, 0.03]), torch.tensor([0.02, 0.005]))
    lengths = decode_lengths(block_size)
    k_float, v_float, tables = paged_cache(lengths, block_size, num_kv_heads, torch.float32, gen)
    k_cache, v_cache = quantize(k_float, kv_scales.k, fp8), quantize(v_float, kv_scales.v, fp8)
    k_read, v_read = dequantize(k_cache, kv_scales.k, torch.float32), dequantize(v_cache, kv_scales.v, torch.float32)
    q = torch.randn(len(lengths), num_heads, HEAD_DIM, generator=gen)
    meta = decode_meta(lengths, tables)
    backend = TorchBackend(tile_bytes)
    out = backend.decode(q, k_cache, v_cache, meta, SCALE, kv_scales)
    assert_matches_reference(out, ReferenceTorchBackend().decode(q, k_read, v_read, meta, SCALE), torch.float32)
    assert backend._k_tile.dtype == fp8  # tiles are gathered as stored, then dequantised
    lens = [(0, 20), (3 * block_size + 1, 1), (block_size, 9), (0, 1), (12 * block_size, 1)]  # (cached, new)
    k_float, v_float, tables = paged_cache([p + n for p, n in lens], block_size, num_kv_heads, torch.float32, gen)
    k_cache, v_cache = quantize(k_float, kv_scales.k, fp8), quantize(v_float, kv_scales.v, fp8)
    k_read, v_read = dequantize(k_cache, kv_scales.k, torch.float32), dequantize(v_cache, kv_scales.v, torch.float32)
    meta = prefill_meta(lens, tables)
    q = torch.randn(sum(meta.seqlens_q), num_heads, HEAD_DIM, generator=gen)
    out = backend.prefill(q, None, None, k_cache, v_cache, meta, SCALE, kv_scales)
    expected = ReferenceTorchBackend().prefill(q, None, None, k_read, v_read, meta, SCALE)
    assert_matches_reference(out, expected, torch.float32)


@pytest.mark.parametrize("skip_every", [0, 3])  # every token stored (no masked copy), or padding rows skipped
def test_store_kv_writes_each_token_to_its_slot_and_nothing_else(skip_every):
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, num_tokens = 4, 16, 23
    qkv = torch.randn(num_tokens, 3, 2, HEAD_DIM, generator=gen)
    k, v = qkv[:, 1], qkv[:, 2]  # strided views, as the model's split of its fused projection gives
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    if skip_every:
        slots[::skip_every] = -1
    shape = (num_blocks, block_size, 2, HEAD_DIM)
    k_cache, v_cache = (torch.full(shape, float("nan")) for _ in range(2))
    TorchBackend().store_kv(k, v, k_cache, v_cache, slots.to(torch.int32))
    for cache, source in ((k_cache, k), (v_cache, v)):
        flat = cache.view(-1, 2, HEAD_DIM)
        written = slots >= 0
        assert torch.equal(flat[slots[written]], source[written])
        untouched = torch.ones(len(flat), dtype=torch.bool)
        untouched[slots[written]] = False
        assert flat[untouched].isnan().all()


@pytest.mark.parametrize("num_heads,num_kv_heads", HEAD_LAYOUTS)
def test_prefill_without_cache_matches_reference(num_heads, num_kv_heads):
    gen = torch.Generator().manual_seed(4)
    lengths = [1, 15, 16, 17, 90]
    meta = prefill_meta([(0, n) for n in lengths], None)
    qkv = torch.randn(sum(lengths), (num_heads + 2 * num_kv_heads) * HEAD_DIM, generator=gen)
    q, k, v = qkv.split([num_heads * HEAD_DIM, num_kv_heads * HEAD_DIM, num_kv_heads * HEAD_DIM], -1)
    q, k, v = q.view(-1, num_heads, HEAD_DIM), k.view(-1, num_kv_heads, HEAD_DIM), v.view(-1, num_kv_heads, HEAD_DIM)
    expected = ReferenceTorchBackend().prefill(q, k, v, None, None, meta, SCALE)
    assert_matches_reference(TorchBackend().prefill(q, k, v, None, None, meta, SCALE), expected, torch.float32)


# --- the whole engine ------------------------------------------------------------------------------

MAX_TOKENS = 8


def greedy(logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=logprobs)


def test_engine_greedy_equals_hf_and_logprobs_equal_the_oracle(qwen3_tiny, monkeypatch):
    """Prompts of 1..70 tokens and two with a shared prefix (cache hits and prefill over a cached
    prefix), tiles of one and of several rows; the oracle swapped into a second engine."""
    # 16 KiB holds 64 tokens of K+V at head_dim 16 with 2 KV heads: the longer rows get a tile
    # each, the shorter ones share.
    plans = []
    plan_decode_ = torch_backend.plan_decode
    monkeypatch.setattr(torch_backend, "plan_decode", lambda *args: plans.append(plan_decode_(*args)) or plans[-1])
    shared = random_prompts(200, [33], seed=50)[0]
    prompts = random_prompts(200, [1, 16, 17, 70], seed=51) + [shared + [3], shared + [4, 5]]
    outputs = {}
    for name in ("new", "oracle"):
        llm = LLM(qwen3_tiny, attention_backend="torch", kvcache_block_size=16, num_kvcache_blocks=64,
                  max_num_batched_tokens=64)
        llm.model_runner.backend.decode_tile_bytes = 16 << 10
        if name == "oracle":
            reference = ReferenceTorchBackend()
            for layer in llm.model_runner.attention_layers:
                layer.backend = reference
        llm.generate([shared], greedy(), use_tqdm=False)  # publishes the shared prefix's blocks
        outputs[name] = llm.generate(prompts, greedy(logprobs=2), use_tqdm=False)
        llm.exit()
    assert [o["token_ids"] for o in outputs["new"]] == hf_greedy(qwen3_tiny, prompts, MAX_TOKENS)
    assert outputs["new"][-1]["num_cached_tokens"] == 32
    tile_rows = {tile.end - tile.start for plan in plans for tile in plan.tiles}
    assert 1 in tile_rows and max(tile_rows) > 1, tile_rows
    for new, old in zip(outputs["new"], outputs["oracle"]):
        assert new["token_ids"] == old["token_ids"]
        for a, b in zip(new["logprobs"], old["logprobs"]):
            assert abs(a["logprob"] - b["logprob"]) <= 1e-5
            assert a["top_logprobs"].keys() == b["top_logprobs"].keys()
            assert all(abs(a["top_logprobs"][t] - b["top_logprobs"][t]) <= 1e-5 for t in a["top_logprobs"])


def test_engine_on_cpu_defaults_equals_hf_greedy(qwen3_tiny):
    """Nothing but the model given: block size 32, mixed steps (a long prompt's chunks beside the
    others' decode rows), the tiled decode; greedy tokens are HF's on every prompt."""
    llm = LLM(qwen3_tiny, device="cpu", max_num_batched_tokens=96)  # "cpu": CUDA has its own defaults
    assert llm.config.kvcache_block_size == 32 and llm.config.scheduling_policy == "mixed"
    prompts = random_prompts(200, [1, 31, 32, 33, 150, 7], seed=53)
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert llm.stats().mixed_steps >= 1
    llm.exit()
    assert [o["token_ids"] for o in outputs] == hf_greedy(qwen3_tiny, prompts, MAX_TOKENS)


# --- CPU settings ----------------------------------------------------------------------------------

def test_half_precision_linear_in_float32_keeps_values_dtypes_and_tied_embeddings():
    gen = torch.Generator().manual_seed(5)
    model = nn.Module()
    with building_for(CpuTorchPlatform(torch.bfloat16)):
        model.proj = ColumnParallelLinear(32, 48, bias=True).to(torch.bfloat16)
        model.embed = VocabParallelEmbedding(64, 32).to(torch.bfloat16)
        model.head = ParallelLMHead(64, 32).to(torch.bfloat16)
    model.head.weight = model.embed.weight  # tied
    for param in model.parameters():
        param.data.copy_(torch.randn(param.shape, generator=gen))
    x = torch.randn(5, 32, generator=gen).to(torch.bfloat16)
    before = model.proj(x), model.head(x), model.embed.weight.clone()

    assert hold_matmul_weights_in_float32(model) == 3  # proj weight and bias, the head's weight
    assert model.proj.weight.dtype == model.proj.bias.dtype == model.head.weight.dtype == torch.float32
    assert model.embed.weight.dtype == torch.bfloat16 and model.embed.weight is not model.head.weight
    assert torch.equal(model.head.weight, before[2].float()) and torch.equal(model.embed.weight, before[2])
    for layer, old in zip((model.proj, model.head), before):
        new = layer(x)
        assert new.dtype == torch.bfloat16
        torch.testing.assert_close(new.float(), old.float(), atol=0.1, rtol=2e-2)  # bf16 rounding of |y| ~ 6
        exact = torch.nn.functional.linear(x.float(), layer.weight, getattr(layer, "bias", None)).to(torch.bfloat16)
        assert torch.equal(new, exact)
    assert torch.equal(cpu_linear(x, model.embed.weight, None), torch.nn.functional.linear(x, model.embed.weight))


def test_native_half_matmul_check():
    assert native_half_matmul(torch.float32)
    assert isinstance(native_half_matmul(torch.bfloat16), bool)


def test_cpu_threads_follow_affinity_and_quota_unless_set(qwen3_tiny, monkeypatch, tmp_path):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("NANOVLLM_CPU_THREADS", raising=False)
    monkeypatch.setattr(device_host.os, "sched_getaffinity", lambda pid: {0, 1, 2, 5})
    monkeypatch.setattr(device_host, "CGROUP_CPU_MAX", str(tmp_path / "absent"))
    assert device_host.available_cpus() == 4
    assert Config(qwen3_tiny, device="cpu").cpu_threads == 4
    assert Config(qwen3_tiny, device="cpu", tensor_parallel_size=2).cpu_threads == 2  # shared among the ranks
    quota = tmp_path / "cpu.max"
    monkeypatch.setattr(device_host, "CGROUP_CPU_MAX", str(quota))
    quota.write_text("300000 100000\n")  # docker --cpus=3
    assert device_host.available_cpus() == 3
    quota.write_text("max 100000\n")
    assert device_host.available_cpus() == 4
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert Config(qwen3_tiny, device="cpu").cpu_threads == 3
    assert Config(qwen3_tiny, device="cpu", cpu_threads=7).cpu_threads == 7  # the field wins
    for bad in ("0", "two", ""):
        monkeypatch.setenv("OMP_NUM_THREADS", bad)
        with pytest.raises(ValueError, match="OMP_NUM_THREADS"):
            Config(qwen3_tiny, device="cpu")
    monkeypatch.setenv("NANOVLLM_CPU_THREADS", "5")  # nanovllm's own setting wins over OMP_NUM_THREADS
    assert Config(qwen3_tiny, device="cpu").cpu_threads == 5
    monkeypatch.setenv("NANOVLLM_CPU_THREADS", "-1")
    with pytest.raises(ValueError, match="NANOVLLM_CPU_THREADS='-1'"):
        Config(qwen3_tiny, device="cpu")


def test_cpu_threads_on_cuda_is_said_not_silently_dropped(qwen3_tiny, monkeypatch, caplog):
    """cpu_threads sets the CPU engine's threads: on CUDA it changes nothing, and the engine says so
    (Config alone, CUDA's presence faked where there is none; nothing touches the device)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with caplog.at_level("WARNING", logger="nanovllm"):
        Config(qwen3_tiny, device="cuda", cpu_threads=3)
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        "cpu_threads=3 has no effect: it sets the CPU engine's threads, and this one runs on cuda"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="nanovllm"):
        Config(qwen3_tiny, device="cuda")
        Config(qwen3_tiny, device="cpu", cpu_threads=3)
    assert not [r for r in caplog.records if "cpu_threads" in r.getMessage()]


def test_cpu_threads_default_to_one_per_physical_core(qwen3_tiny, monkeypatch, tmp_path):
    """Two hyper-threads of one core count once: CPUs 0 and 1 are siblings of core 0, CPU 2 is
    core 1, CPU 3's topology cannot be read (a core of its own)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("NANOVLLM_CPU_THREADS", raising=False)
    for n, core in ((0, 0), (1, 0), (2, 1)):
        topology = tmp_path / f"cpu{n}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text("0\n")
        (topology / "core_id").write_text(f"{core}\n")
    monkeypatch.setattr(device_host, "SYSFS_CPU", str(tmp_path / "cpu{}"))
    monkeypatch.setattr(device_host, "CGROUP_CPU_MAX", str(tmp_path / "absent"))
    monkeypatch.setattr(device_host.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert device_host.available_cpus() == 4 and device_host.available_cores() == 3
    assert Config(qwen3_tiny, device="cpu").cpu_threads == 3


def test_engine_applies_cpu_threads_and_malloc_tuning(qwen3_tiny, monkeypatch):
    before = torch.get_num_threads()
    tuned = []
    monkeypatch.setattr(device_host, "keep_freed_memory", lambda: tuned.append(True) or True)
    try:
        llm = LLM(qwen3_tiny, device="cpu", cpu_threads=1, cpu_malloc_tuning=False, num_kvcache_blocks=16)
        assert torch.get_num_threads() == 1 and not tuned
        llm.exit()
        LLM(qwen3_tiny, device="cpu", cpu_threads=2, num_kvcache_blocks=16).exit()
        assert torch.get_num_threads() == 2 and tuned == [True]
    finally:
        torch.set_num_threads(before)


def test_malloc_tuning_applies_on_glibc():
    assert device_host.keep_freed_memory() is (platform.system() == "Linux" and platform.libc_ver()[0] == "glibc")


def test_bf16_engine_on_cpu_keeps_activations_bf16(qwen3_tiny):
    llm = LLM(qwen3_tiny, dtype="bfloat16", kvcache_block_size=16, num_kvcache_blocks=16)
    model = llm.model_runner.model
    emulated = not native_half_matmul(torch.bfloat16)
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == (torch.float32 if emulated else torch.bfloat16)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert llm.model_runner.kv_cache.dtype == torch.bfloat16
    hidden = []
    handle = model.model.layers[0].register_forward_hook(lambda module, args, out: hidden.append(out[0].dtype))
    outputs = llm.generate(random_prompts(200, [5, 40], seed=52), greedy(), use_tqdm=False)
    handle.remove()
    assert [len(o["token_ids"]) for o in outputs] == [MAX_TOKENS] * 2 and set(hidden) == {torch.bfloat16}
    llm.exit()
