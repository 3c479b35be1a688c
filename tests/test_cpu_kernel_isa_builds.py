"""The CPU kernels as other CPUs build them, run here (cpu_build.CPU_ISAS, the builds
$NANOVLLM_CPU_ISA picks): an AVX2-only CPU gets `-march=x86-64-v3` (no AVX-512: the kernels' plain
loops, which the native build on an AVX-512 machine never runs), an AVX-512 CPU without
AVX512-BF16 gets `-march=x86-64-v4` (bfloat16 scores through widened FMAs instead of dot
products). Each build is checked against the same oracles as the native one
(tests/reference_attention.py, the torch layer functions), on a compact set of cases: decode and
prefill (chunks over a prefix, tiles of many rows) for every dtype, head dims that take each path,
GQA groups 1/2/4; the fused residual add + RMSNorm and SiLU-and-mul; the greedy LM head (its AVX2
form: 7-bit rows through vpmaddubsw, where the native build has VNNI); and the whole engine built for
each, through $NANOVLLM_CPU_ISA, against HF's greedy tokens. A build is skipped, saying so, where
this CPU lacks what it needs."""
import logging

import pytest
import torch

from nanovllm import LLM
from nanovllm.kernels import cpu_build
from nanovllm.layers.logits_processors import LOGIT_LIMIT
from nanovllm.platform import cpu as cpu_platform
from nanovllm.platform.cpu import linear as cpu_linear
from nanovllm.platform.cpu.attention import CpuPagedBackend
from nanovllm.platform.torch import add_rms_norm, silu_and_mul
from nanovllm.runner.step_inputs import HeadDraw
from reference_attention import ReferenceTorchBackend
from conftest import build_checkpoint
from helpers import greedy, hf_greedy, integer_head, random_prompts, rounded_logits
from test_cpu_fused_kernels import assert_close, randn
from test_cpu_paged_attention import assert_matches, decode_meta, paged_cache, prefill_meta

# The builds below this CPU's own that each test runs (names of cpu_build.CPU_ISAS).
ISA_BUILDS = ("avx2", "avx512")


def skip_unless_buildable(isa: str) -> None:
    missing = cpu_build.CPU_ISAS[isa][1] - set((cpu_build.cpu_flags_line() or "").split())
    if missing:
        pytest.skip(f"this CPU lacks {sorted(missing)}, which the {isa} build's code needs")
    if cpu_build.compiler() is None:
        pytest.skip("no C++ compiler here")


@pytest.fixture(scope="module", params=ISA_BUILDS)
def library(request):
    skip_unless_buildable(request.param)
    flags = cpu_build.CPU_ISAS[request.param][0]
    return cpu_build.open_library(cpu_build.build(extra_flags=flags))  # the cache, where NANOVLLM_CPU_ISA finds it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", [32, 64, 80, 128])
def test_attention_build_matches_reference(library, dtype, head_dim):
    backend, reference = CpuPagedBackend(cpu_build.PagedAttentionKernel(library, library.path)), ReferenceTorchBackend()
    for group in (1, 2, 4):
        gen = torch.Generator().manual_seed(group * 1000 + head_dim)
        block_size, num_kv_heads, scale = 16, 2, head_dim ** -0.5
        lengths = [0, 1, block_size, block_size + 1, 5 * block_size + 3, 7]
        k_cache, v_cache, tables = paged_cache(lengths, block_size, num_kv_heads, head_dim, dtype, gen)
        meta = decode_meta(lengths, tables)
        q = torch.randn(len(lengths), num_kv_heads * group, head_dim, generator=gen).to(dtype)
        assert_matches(backend.decode(q, k_cache, v_cache, meta, scale),
                       reference.decode(q, k_cache, v_cache, meta, scale), dtype)
        lens = [(0, 1), (15, 2), (17, 40), (0, 33), (40, 20)]  # one-token rows, chunks, tiles of 16+ rows
        k_cache, v_cache, tables = paged_cache([p + n for p, n in lens], block_size, num_kv_heads, head_dim, dtype,
                                               gen)
        meta = prefill_meta(lens, tables)
        q = torch.randn(sum(meta.seqlens_q), num_kv_heads * group, head_dim, generator=gen).to(dtype)
        assert_matches(backend.prefill(q, None, None, k_cache, v_cache, meta, scale),
                       reference.prefill(q, None, None, k_cache, v_cache, meta, scale), dtype)


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_few_rows_product_build_matches_the_exact_product(library, rows):
    """The float32 few-row product every build has (AVX2: 8 lanes, sum8) against float64, with K
    past whole vectors (the masked tail), a bias, and strided rows of x."""
    product = cpu_build.FusedKernels(library).few_rows_linear(torch.float32)
    assert product is not None and product.max_rows >= rows
    for n, k in ((96, 64), (37, 203)):
        x = randn(rows, 2 * k, dtype=torch.float32, seed=rows)[:, :k]
        weight, bias = randn(n, k, dtype=torch.float32, seed=7), randn(n, dtype=torch.float32, seed=8)
        for b in (None, bias):
            exact = x.double() @ weight.double().T + (0 if b is None else b.double())
            assert torch.allclose(product(x, weight, b).double(), exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_fused_build_matches_torch(library, dtype):
    kernels = cpu_build.FusedKernels(library)
    x = randn(70, 2 * 300, dtype=dtype, seed=3, scale=3.0)[:, :300]  # rows past one thread's share, strided
    weight, residual = randn(300, dtype=dtype, seed=1), randn(70, 300, dtype=dtype, seed=2)
    out = kernels.rms_norm(x, weight, 1e-6, residual)
    expected, expected_residual = add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(out.residual, expected_residual)
    assert_close(out.out, expected)
    gate_up = randn(33, 2 * 200, dtype=dtype, seed=4, scale=4.0)
    assert_close(kernels.silu_and_mul(gate_up), silu_and_mul(gate_up))


def test_cpu_isa_env_picks_the_build_flags(monkeypatch):
    monkeypatch.delenv(cpu_build.CPU_ISA_ENV, raising=False)
    assert cpu_build.isa_flags_from_env() == ()
    monkeypatch.setattr(cpu_build, "cpu_flags_line", lambda: "flags\t: sse2 avx avx2 fma bmi2 avx512f avx512bw "
                                                             "avx512dq avx512vl\n")
    for isa in ("native", "avx2", "avx512"):
        monkeypatch.setenv(cpu_build.CPU_ISA_ENV, isa)
        assert cpu_build.isa_flags_from_env() == cpu_build.CPU_ISAS[isa][0]
    assert "-march=x86-64-v3" in cpu_build.CPU_ISAS["avx2"][0]
    # a class this CPU lacks would stop on an illegal instruction: refused, saying what is missing
    monkeypatch.setenv(cpu_build.CPU_ISA_ENV, "avx512_bf16")
    with pytest.raises(ValueError, match=r"NANOVLLM_CPU_ISA='avx512_bf16' needs \['avx512_bf16', 'avx512_vnni'\]"):
        cpu_build.isa_flags_from_env()
    monkeypatch.setenv(cpu_build.CPU_ISA_ENV, "sse")
    with pytest.raises(ValueError, match="NANOVLLM_CPU_ISA='sse' is not a known ISA; allowed: native, avx512_bf16"):
        cpu_build.isa_flags_from_env()


def test_bad_cpu_isa_env_stops_the_engine_before_it_loads(qwen3_tiny, monkeypatch):
    monkeypatch.setattr(cpu_build, "_loaded", None)  # as in a fresh process: the library not tried yet
    monkeypatch.setenv(cpu_build.CPU_ISA_ENV, "avx1024")
    with pytest.raises(ValueError, match="NANOVLLM_CPU_ISA='avx1024'"):
        LLM(qwen3_tiny, num_kvcache_blocks=16)


@pytest.fixture(scope="module")
def qwen3_head64(tmp_path_factory) -> str:
    """Qwen3 with head_dim 64 and GQA 2: the shapes of the paged kernel's tiles a real model takes."""
    return build_checkpoint(str(tmp_path_factory.mktemp("qwen3_head64")), "qwen3", hidden_size=128,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=64)


@pytest.mark.parametrize("isa", ISA_BUILDS)
def test_engine_built_for_another_isa_gives_hf_greedy_tokens(qwen3_head64, isa, monkeypatch, caplog):
    """The whole float32 engine on the kernels an AVX2-only or an AVX-512 (no BF16, no AMX) CPU
    builds, as $NANOVLLM_CPU_ISA asks for them: fresh prompts in a batch, prefill chunks over
    several steps and prefix-cache hits give HF's greedy tokens, with no product on AMX tiles."""
    skip_unless_buildable(isa)
    monkeypatch.setattr(cpu_build, "_loaded", None)  # the next engine loads the library anew, for `isa`
    monkeypatch.setenv(cpu_build.CPU_ISA_ENV, isa)
    prompts = random_prompts(500, [200, 7, 90, 1, 33], seed=11)
    prompts += [prompts[0][:160] + p[:30] for p in prompts[1:3]]  # a cached prefix of 160 tokens, then new ones
    with caplog.at_level(logging.INFO, logger="nanovllm"):
        llm = LLM(qwen3_head64, max_num_batched_tokens=128, num_kvcache_blocks=64, kvcache_block_size=16)
    assert f"kernels built for {isa}" in caplog.text and "prefill attention in vector registers" in caplog.text
    assert llm.model_runner.backend.name == "cpu"
    library = cpu_build.load_library()
    assert library.path == cpu_build.build(extra_flags=cpu_build.CPU_ISAS[isa][0]) != cpu_build.build()
    assert not library.nanovllm_amx_linear_supported()
    assert library.nanovllm_few_rows_supported(0)  # the float32 few-row product: AVX-512F or AVX2 + FMA
    first = llm.generate(prompts[:5], greedy(8), use_tqdm=False)
    again = llm.generate(prompts[5:], greedy(8), use_tqdm=False)
    assert [o["token_ids"] for o in first + again] == hf_greedy(qwen3_head64, prompts, 8)
    assert sum(o["num_cached_tokens"] for o in again) >= 2 * 160
    llm.exit()


def test_row_product_build_matches_float64(library):
    """The build's float32 product of rows with a weight (cpu_linear.cpp): the few-row form up to 4
    rows, and on the AVX2 build the blocked form up to 128 (4 x 3 blocks, tails of rows, weight
    rows and K, a bias, a strided x); the AVX-512 build takes 4 rows and leaves more to oneDNN."""
    kernels = cpu_build.FusedKernels(library)
    product = kernels.few_rows_linear(torch.float32)
    avx2_only = library.path == cpu_build.build(extra_flags=cpu_build.CPU_ISAS["avx2"][0])
    assert product.max_rows == (128 if avx2_only else 4)
    gen = torch.Generator().manual_seed(3)
    for rows in sorted(r for r in {1, 3, 4, 5, 7, 64, 127, 128} if r <= product.max_rows):
        for n, k in ((1, 8), (7, 13), (301, 260)):
            base = torch.randn(rows, 2 * k, generator=gen)
            x = base[:, :k]  # rows with a stride of 2k
            w, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
            for b in (None, bias):
                expected = x.double() @ w.double().T + (0 if b is None else b.double())
                got = product(x, w, b)
                assert got.shape == (rows, n) and got.dtype == torch.float32
                assert (got.double() - expected).abs().max() <= 1e-5 * (1 + expected.abs().max())


def test_bf16_row_product_build_matches_float64(library):
    """bf16 rows by a bf16 weight (cpu_linear.cpp): the AVX2 build has no dot-product instruction and
    widens both to float32 FMAs, 1-4 rows (K past whole cache lines and vectors, a bias, a strided x),
    each result the float32 sum rounded once to bf16; the AVX-512 build without AVX512-BF16 has no
    bf16 product (oneDNN keeps those rows)."""
    product = cpu_build.FusedKernels(library).few_rows_linear(torch.bfloat16)
    if library.path != cpu_build.build(extra_flags=cpu_build.CPU_ISAS["avx2"][0]):
        assert product is None
        return
    assert product.max_rows == 4
    gen = torch.Generator().manual_seed(5)
    for rows in (1, 2, 3, 4):
        for n, k in ((1, 8), (7, 13), (301, 260), (33, 1536)):
            x = torch.randn(rows, 2 * k, generator=gen).bfloat16()[:, :k]
            w, bias = torch.randn(n, k, generator=gen).bfloat16(), torch.randn(n, generator=gen).bfloat16()
            for b in (None, bias):
                exact = x.double() @ w.double().T + (0 if b is None else b.double())
                got = product(x, w, b)
                assert got.shape == (rows, n) and got.dtype == torch.bfloat16
                error = (got.double() - exact).abs()
                assert (error <= exact.abs() * 2 ** -8 + 1e-5 * (1 + exact.abs().max())).all()


def avx2_bf16_engine(path: str, monkeypatch) -> LLM:
    """A bf16 engine on the AVX2 build with bf16 matmul not native, as on an AVX2-only CPU (the layers
    then hold float32 for oneDNN)."""
    skip_unless_buildable("avx2")
    monkeypatch.setattr(cpu_build, "_loaded", None)
    monkeypatch.setenv(cpu_build.CPU_ISA_ENV, "avx2")
    for module in (cpu_platform, cpu_linear):  # the platform's choice and the packing's
        monkeypatch.setattr(module, "native_half_matmul", lambda dtype: dtype == torch.float32)
    return LLM(path, dtype="bfloat16", enable_prefix_caching=False, num_kvcache_blocks=64, kvcache_block_size=16)


def test_tied_bf16_head_on_float32_held_weights_reads_the_embedding(qwen3_tiny_tied, monkeypatch):
    """A tied head held in float32 on the AVX2 build reads the embedding's bf16 tensor for its few-row
    product (no copy of its own), whose values are the float32 head's."""
    llm = avx2_bf16_engine(qwen3_tiny_tied, monkeypatch)
    model = llm.model_runner.model
    head, embed = model.lm_head, model.model.embed_tokens
    assert head.weight.dtype == torch.float32 and embed.weight.dtype == torch.bfloat16
    half_rows = head.linear_method.half_rows
    assert half_rows.weight.data_ptr() == embed.weight.data_ptr()
    assert torch.equal(half_rows.weight.float(), head.weight)
    llm.exit()


def test_bf16_engine_on_float32_held_weights_reads_bf16_copies(qwen3_head64, monkeypatch):
    """A bf16 model on the AVX2 build where bf16 matmul is not native (an AVX2-only CPU: the layers
    hold float32 for oneDNN): each linear layer and the LM head keep a bf16 copy for decode steps of
    1-4 rows (platform/cpu/linear.py HalfRows), the one-call decode step takes those steps over the copies,
    bit for bit the Python layers (tokens and logprobs), and the head's greedy int8 form (the AVX2
    one) is made from its float32 values, for its bf16 rows."""
    from test_cpu_decode import record_rows
    llm = avx2_bf16_engine(qwen3_head64, monkeypatch)
    model = llm.model_runner.model
    for layer in (model.model.layers[0].self_attn.qkv_proj, model.model.layers[-1].mlp.down_proj, model.lm_head):
        half_rows = layer.linear_method.half_rows
        assert layer.weight.dtype == torch.float32 and half_rows.dtype == torch.bfloat16
        assert torch.equal(half_rows.weight.float(), layer.weight)
    assert isinstance(llm.model_runner.sampler.head, cpu_build.GreedyHead)
    fused = model.model.fused_decode
    assert fused is not None and fused.max_rows == 4
    rows = record_rows(fused)
    prompts = random_prompts(500, [30, 7, 20, 12, 9], seed=5)
    results = {}
    for mode in ("fused", "python"):
        model.model.fused_decode = fused if mode == "fused" else None
        results[mode] = [(o["token_ids"], o["logprobs"]) for n in (1, 4, 5)
                         for o in llm.generate(prompts[:n], greedy(8, logprobs=2), use_tqdm=False)]
    assert results["fused"] == results["python"]
    assert sorted(rows) == sorted(n for n in (1, 4) for _ in range(7))  # 7 decode steps; 5 rows: the Python layers
    llm.exit()


def test_greedy_head_build_gives_the_exact_argmax(library):
    kernels = cpu_build.FusedKernels(library)
    for vocab, width, rows in ((3000, 512, 64), (1000, 100, 7), (50, 64, 1), (4097, 260, 70)):
        gen = torch.Generator().manual_seed(vocab + rows)
        w = torch.randn(vocab, width, generator=gen) * 0.05
        x = torch.randn(rows, width, generator=gen)
        head = kernels.greedy_head(w, LOGIT_LIMIT)
        assert head is not None  # every build here has AVX2 at least
        assert torch.equal(head(x), (x.double() @ w.double().T).argmax(1))
        assert int(head.candidates) <= rows * max(8, vocab // 20)  # the bound still prunes at 7 bits
    tied = torch.cat([w, w])  # exact ties: the first index
    assert torch.equal(kernels.greedy_head(tied, LOGIT_LIMIT)(x), (x.double() @ w.double().T).argmax(1))
    # bf16 rows: the first of the largest logits rounded to bf16 (small integers: exact float32 sums)
    x, w = integer_head(640, 256, 64, seed=11)
    logits = rounded_logits(x, w)
    for head_dtype in (torch.bfloat16, torch.float32):
        assert torch.equal(kernels.greedy_head(w.to(head_dtype), LOGIT_LIMIT)(x), logits.float().argmax(1))


def test_sampled_head_build_draws_the_races_token(library):
    """Sampled rows through this build's form of the head (the AVX2 one on the avx2 build) draw the
    token its race draws from the float32 logits (tests/test_cpu_race.py on the native build)."""
    kernels = cpu_build.FusedKernels(library)
    gen = torch.Generator().manual_seed(12)
    w = torch.randn(4097, 260, generator=gen) * 0.05
    x = torch.randn(70, 260, generator=gen)
    temperatures = [(0.0, 0.05, 1.0, 3.0)[r % 4] for r in range(70)]
    keys, counters = list(range(5, 75)), [r // 3 for r in range(70)]
    tokens = kernels.greedy_head(w, LOGIT_LIMIT)(x, HeadDraw(temperatures, keys, counters))
    expected = kernels.race_tokens(x @ w.T, torch.tensor(temperatures), torch.tensor(keys), torch.tensor(counters),
                                   LOGIT_LIMIT)
    assert torch.equal(tokens, expected)
