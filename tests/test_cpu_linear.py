"""CPU linear layers on oneDNN-packed weights (platform/cpu/linear.py pack_weight, cpu_linear()):
every linear layer and the LM head of a model gets a packed weight in float32 (and in
bf16 where this CPU multiplies it natively); the packed product equals F.linear on the plain weight
(float32 to rounding, bf16 within its tolerance), for 1, 2-D and 3-D inputs, with and without a
bias, and for half-precision activations over float32-held weights. The engine on packed weights
gives HF's greedy tokens: tests/test_parity.py and the engine tests run with them (the default).

The CPU's few-row product (kernels/cpu_linear.cpp), which cpu_linear() takes for decode steps of a few
sequences, equals the float64 product to float32 rounding (bf16: within its tolerance and next to
oneDNN's), for every row count it takes, weights whose rows and width leave tails, strided rows
and a bias; the engine switches every linear layer and the LM head to it.

The AMX product (kernels/cpu_amx_linear.cpp), which cpu_linear() takes for decode steps of up to 256
sequences on a CPU with AMX, equals the float64 product within bf16's rounding (bf16), and within
float32's own rounding of the product (float32, as bf16x3), for row counts that fill whole tiles
and ones it pads, strided rows, a bias, and weight widths of one or several tiles; it takes only
bfloat16 and float32 weights of whole tiles; cpu_linear() takes it between its min_rows and max_rows;
the engine gives it to every linear layer whose weight it takes, and to the LM head in float32 only
(from AMX_HEAD_MIN_ROWS rows).
"""
import pytest
import torch
import torch.nn.functional as F

from nanovllm import LLM
from nanovllm.kernels.cpu_build import AMX_HEAD_MIN_ROWS, AMX_MAX_ROWS, AMX_PREFILL_MIN_K
from nanovllm.layers.linear import LinearBase
from nanovllm.platform.cpu.linear import (BUCKETED_PACKED_ROWS, EXACT_PACKED_ROWS, MIN_PACKED_ROWS, PACK_BATCH_HINT,
                                          cpu_linear, native_half_matmul, packed_rows)
from conftest import build_checkpoint
from helpers import greedy, hf_greedy, random_prompts

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch has no oneDNN here")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 1-3 rows are padded with zero rows to MIN_PACKED_ROWS inside cpu_linear(), 5 and 64 are not, 65 and
# 300 go to F.linear, 1030 is padded to its bucket (1152), 2 x 3 is a 3-D input.
@pytest.mark.parametrize("shape", [(1, 64), (2, 64), (3, 64), (5, 64), (2, 3, 64), (1, 1, 64), (64, 64), (65, 64),
                                   (300, 64), (1030, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear(dtype, shape, bias):
    if not native_half_matmul(dtype):
        pytest.skip(f"{dtype} matmul is emulated here: its weights are held in float32, not packed as {dtype}")
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 64, generator=gen).to(dtype)
    b = torch.randn(48, generator=gen).to(dtype) if bias else None
    x = torch.randn(*shape, generator=gen).to(dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
    out = cpu_linear(x, weight, b, packed)
    assert out.shape == (*shape[:-1], 48) and out.dtype == dtype and out.is_contiguous()
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out, F.linear(x, weight, b), **tolerance)


def test_packed_row_buckets_are_few_and_pad_little():
    """oneDNN caches a primitive per row count: decode-sized counts exactly, prefill chunks from
    BUCKETED_PACKED_ROWS in at most 8 buckets per doubling, each under an eighth larger than the
    rows it holds; the counts between go to F.linear (None)."""
    counts = {rows: packed_rows(rows) for rows in range(1, 16385)}
    assert {counts[rows] for rows in range(1, MIN_PACKED_ROWS)} == {MIN_PACKED_ROWS}
    assert all(counts[rows] == rows for rows in range(MIN_PACKED_ROWS, EXACT_PACKED_ROWS + 1))
    assert all(counts[rows] is None for rows in range(EXACT_PACKED_ROWS + 1, BUCKETED_PACKED_ROWS))
    large = {rows: padded for rows, padded in counts.items() if rows >= BUCKETED_PACKED_ROWS}
    assert all(rows <= padded < rows * 9 / 8 + 1 for rows, padded in large.items())
    assert len(set(large.values())) <= 8 * 4 + 1  # 1024 .. 16384: four doublings


def test_half_activations_over_float32_weights():
    """A CPU without native bf16 holds the weights in float32 (and packs those): bf16 activations in, bf16 out."""
    gen = torch.Generator().manual_seed(1)
    weight, x = torch.randn(32, 16, generator=gen), torch.randn(4, 16, generator=gen).bfloat16()
    out = cpu_linear(x, weight, None, torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, F.linear(x.float(), weight).bfloat16())


def test_engine_packs_every_linear_layer_and_the_lm_head(qwen3_tiny):
    llm = LLM(qwen3_tiny, num_kvcache_blocks=16)
    model = llm.model_runner.model
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    # packed for oneDNN, unless (float32 on AMX) the few-row and AMX products take every row count
    methods = [m.linear_method for m in linears]
    assert linears and all((m.packed is None) == (
        m.few_rows is not None and m.amx is not None and m.amx.takes_every_row_count_above(m.few_rows.max_rows))
        for m in methods)
    assert model.lm_head.linear_method.packed is not None  # its AMX product, if any, takes 64 rows or more only
    llm.exit()



def few_rows_for(cpu_kernels, dtype):
    product = cpu_kernels.few_rows_linear(dtype)
    if product is None:
        pytest.skip(f"this CPU's build has no few-row product for {dtype} (float32 needs AVX-512F, bfloat16 AVX512-BF16)")
    return product


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# Widths: whole vector pairs, a single vector's tail, odd tails; rows of the weight: whole groups
# of 16 / rows, a last group cut short, fewer than one group; the LM head's shape.
@pytest.mark.parametrize("n,k", [(48, 64), (33, 100), (5, 7), (1, 1), (1000, 512), (300, 1536), (32000, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_few_rows_product_equals_the_exact_product(cpu_kernels, dtype, n, k, bias):
    product = few_rows_for(cpu_kernels, dtype)
    gen = torch.Generator().manual_seed(n + k)
    weight = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    for rows in range(1, product.max_rows + 1):
        x = torch.randn(rows, 2 * k, generator=gen).to(dtype)[:, k // 2:k // 2 + k]  # strided rows
        out = cpu_linear(x, weight, b, few_rows=product)
        assert out.shape == (rows, n) and out.dtype == dtype and out.is_contiguous()
        exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
        if dtype == torch.float32:
            # float32 sums in another order than F.linear's: within a few ulps of the row's magnitudes
            scale = (x.double().abs() @ weight.double().abs().T) + (0 if b is None else b.double().abs())
            assert ((out.double() - exact).abs() <= 1e-6 * scale + 1e-30).all()
        else:  # float32 sums of exact products, rounded once to bf16: within one unit of rounding
            assert ((out.double() - exact).abs() <= 2 ** -8 * exact.abs() + 1e-3 * exact.abs().max()).all()
            torch.testing.assert_close(out, F.linear(x, weight, b), atol=2e-2, rtol=2e-2)


def test_linear_takes_the_few_row_product_only_for_its_rows(cpu_kernels):
    product = few_rows_for(cpu_kernels, torch.float32)
    calls = []

    class Counting:
        max_rows = product.max_rows

        def __call__(self, *args):
            calls.append(args[0].size(0))
            return product(*args)

    weight = torch.randn(24, 32)
    for shape in [(1, 32), (product.max_rows, 32), (product.max_rows + 1, 32), (2, 1, 32), (1, 32)]:
        cpu_linear(torch.randn(*shape), weight, None, None, Counting())
    # bf16 activations over float32 weights (a CPU without native bf16 matmul): in as float32, out as bf16
    x = torch.randn(2, 32).bfloat16()
    out = cpu_linear(x, weight, None, None, Counting())
    assert calls == [1, product.max_rows, 1, 2]
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, F.linear(x.float(), weight).bfloat16())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_gives_linear_layers_and_the_lm_head_the_few_row_product(qwen3_tiny, cpu_kernels, dtype):
    llm = LLM(qwen3_tiny, num_kvcache_blocks=16, dtype=dtype)
    model = llm.model_runner.model
    expected = cpu_kernels.few_rows_linear(getattr(torch, dtype))
    layers = [m for m in model.modules() if isinstance(m, LinearBase)] + [model.lm_head]
    if expected is None or not native_half_matmul(getattr(torch, dtype)):
        assert all(m.linear_method.few_rows is None or m.weight.dtype != getattr(torch, dtype) for m in layers)
    else:
        assert all(m.linear_method.few_rows is not None and m.linear_method.few_rows.max_rows == expected.max_rows
                   for m in layers)
    llm.exit()


def amx_for(cpu_kernels, weight):
    product = cpu_kernels.amx_linear(weight)
    if product is None and cpu_kernels.amx_linear(torch.zeros(32, 32, dtype=torch.bfloat16)) is None:
        pytest.skip("this CPU's build has no AMX product (it needs AMX-TILE, AMX-BF16 and AVX512-BF16)")
    return product


# Widths: one tile of K and one pair of column blocks; the real model's qkv and down shapes.
@pytest.mark.parametrize("n,k", [(32, 32), (1024, 512), (512, 1536), (96, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_amx_product_equals_the_exact_product(cpu_kernels, n, k, bias):
    gen = torch.Generator().manual_seed(n + k)
    weight = torch.randn(n, k, generator=gen).bfloat16()
    product = amx_for(cpu_kernels, weight)
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    # Whole tiles (16, 32, 64, 256), a lone tile of rows after pairs (48), rows padded (1, 5, 17, 100).
    for rows in (1, 5, 16, 17, 32, 48, 64, 100, 256):
        x = torch.randn(rows, 2 * k, generator=gen).bfloat16()[:, k // 2:k // 2 + k]  # strided rows
        out = cpu_linear(x, weight, b, amx=product)
        assert out.shape == (rows, n) and out.dtype == torch.bfloat16
        exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
        # float32 sums of exact products, rounded once to bf16: within one unit of rounding
        assert ((out.double() - exact).abs() <= 2 ** -8 * exact.abs() + 1e-3 * exact.abs().max()).all(), rows
        torch.testing.assert_close(out, F.linear(x, weight, b), atol=2e-2, rtol=2e-2)


# Float32 as bf16x3 (three bf16 parts of x and w, six products): about as close to the float64
# product as float32's own F.linear, so it is a float32 product, not a bf16 one. Weights with a wide range of
# magnitudes, so that the parts past the first matter; the rows of a prefill chunk past 256 too
# (the kernel's row chunks).
@pytest.mark.parametrize("n,k", [(32, 32), (1024, 512), (512, 1536), (96, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_amx_float32_product_is_as_close_as_float32s_own(cpu_kernels, n, k, bias):
    gen = torch.Generator().manual_seed(n * k)
    weight = torch.randn(n, k, generator=gen) * torch.exp2(torch.randint(-8, 8, (n, k), generator=gen).float())
    product = amx_for(cpu_kernels, weight)
    b = torch.randn(n, generator=gen) if bias else None
    for rows in (1, 5, 16, 17, 48, 64, 100, 256, 700):
        x = torch.randn(rows, 2 * k, generator=gen)[:, k // 2:k // 2 + k]  # strided rows
        out = product(x, b)
        assert out.shape == (rows, n) and out.dtype == torch.float32
        exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
        own = (F.linear(x, weight, b).double() - exact).abs()
        err = (out.double() - exact).abs()
        # measured: mean error 0.55-1.6x F.linear's (fewer rows: more), the largest 0.4-3.3x
        assert err.mean() <= 2 * own.mean() and err.max() <= 4 * own.max(), (rows, err.max(), own.max())
        bf16 = (F.linear(x.bfloat16(), weight.bfloat16(), None if b is None else b.bfloat16()).double() - exact)
        assert err.max() * 100 < bf16.abs().max(), rows  # far from a single bf16 product's error


def test_amx_product_takes_only_bfloat16_and_float32_weights_of_whole_tiles(cpu_kernels):
    assert amx_for(cpu_kernels, torch.zeros(64, 64, dtype=torch.bfloat16)) is not None
    assert cpu_kernels.amx_linear(torch.zeros(64, 64)) is not None
    for weight in (torch.zeros(64, 64, dtype=torch.float16), torch.zeros(64, 64, dtype=torch.float64),
                   torch.zeros(48, 64, dtype=torch.bfloat16), torch.zeros(64, 48), torch.zeros(64, 64).t()[:32]):
        assert cpu_kernels.amx_linear(weight) is None, (weight.dtype, weight.shape)


def test_linear_takes_the_amx_product_above_the_few_rows(cpu_kernels):
    weight = torch.randn(64, 64).bfloat16()
    product = amx_for(cpu_kernels, weight)
    few = few_rows_for(cpu_kernels, torch.bfloat16)
    calls = []

    def counting(real, name):
        class Counting:
            max_rows = real.max_rows
            min_rows = getattr(real, "min_rows", 1)  # the AMX product's (the few-row one has none)

            def __call__(self, x, *args):
                calls.append((name, x.size(0)))
                return real(x, *args)
        return Counting()

    for rows in (1, few.max_rows, few.max_rows + 1, product.max_rows, product.max_rows + 1):
        cpu_linear(torch.randn(rows, 64).bfloat16(), weight, None, None, counting(few, "few"), counting(product, "amx"))
    cpu_linear(torch.randn(8, 64), weight, None, None, None, counting(product, "amx"))  # activations in another dtype
    assert calls == [("few", 1), ("few", few.max_rows), ("amx", few.max_rows + 1), ("amx", product.max_rows)]
    calls.clear()
    head = cpu_kernels.amx_linear(torch.randn(64, AMX_PREFILL_MIN_K), min_rows=32)  # the float32 LM head's kind
    assert head.max_rows >= 1 << 40  # float32 of AMX_PREFILL_MIN_K columns or more: prefill chunks of any size too
    for rows in (16, 31, 32, 3000):
        cpu_linear(torch.randn(rows, AMX_PREFILL_MIN_K), torch.randn(64, AMX_PREFILL_MIN_K), None, None, None,
               counting(head, "amx"))
    assert calls == [("amx", 32), ("amx", 3000)]
    narrow = cpu_kernels.amx_linear(torch.randn(64, AMX_PREFILL_MIN_K - 32))  # fewer columns: decode rows only
    assert narrow.max_rows == product.max_rows == AMX_MAX_ROWS


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_gives_linear_layers_the_amx_product(qwen3_tiny, cpu_kernels, dtype):
    amx_for(cpu_kernels, torch.zeros(32, 32, dtype=torch.bfloat16))
    llm = LLM(qwen3_tiny, num_kvcache_blocks=16, dtype=dtype)
    model = llm.model_runner.model
    layers = [m for m in model.modules() if isinstance(m, LinearBase)]
    if dtype == "bfloat16" and not native_half_matmul(torch.bfloat16):  # bf16 layers hold float32 weights
        assert all(m.weight.dtype == torch.float32 for m in layers)
    assert layers and all((m.linear_method.amx is not None) == (m.weight.size(0) % 32 == 0
                                                                and m.weight.size(1) % 32 == 0)
                          for m in layers)
    assert any(m.linear_method.amx is not None for m in layers)
    head = model.lm_head
    if head.weight.dtype == torch.float32 and head.weight.size(0) % 32 == 0 and head.weight.size(1) % 32 == 0:
        assert head.linear_method.amx is not None and head.linear_method.amx.min_rows == AMX_HEAD_MIN_ROWS
    else:
        assert head.linear_method.amx is None
    llm.exit()


@pytest.fixture(scope="module")
def qwen3_wide(tmp_path_factory) -> str:
    """Qwen3 whose products have K >= AMX_PREFILL_MIN_K (hidden and MLP 512), so that float32 prefill
    chunks go to the AMX product too, not only decode steps."""
    return build_checkpoint(str(tmp_path_factory.mktemp("qwen3_wide")), "qwen3", hidden_size=AMX_PREFILL_MIN_K,
                            intermediate_size=AMX_PREFILL_MIN_K, num_attention_heads=8, num_key_value_heads=4,
                            head_dim=64)


def test_engine_on_float32_amx_products_gives_hf_greedy_tokens(qwen3_wide, cpu_kernels, monkeypatch):
    """The whole float32 engine with every product of more than 4 rows on bf16x3 (prefill chunks,
    decode batches, the one-call decode step) gives HF's greedy tokens: fresh prompts in a batch,
    prefill chunks (max_num_batched_tokens smaller than the prompts), and prefix-cache hits."""
    amx_for(cpu_kernels, torch.zeros(32, 32, dtype=torch.bfloat16))
    prompts = random_prompts(500, [300, 7, 130, 1, 64, 257], seed=5)
    prompts += [prompts[0][:200] + p[:40] for p in prompts[2:5]]  # a cached prefix of 192 tokens, then new ones
    llm = LLM(qwen3_wide, max_num_batched_tokens=384, num_kvcache_blocks=96, kvcache_block_size=16)
    layers = [m for m in llm.model_runner.model.modules() if isinstance(m, LinearBase)]
    # no oneDNN copy left
    assert layers and all(m.linear_method.amx is not None and m.linear_method.packed is None for m in layers)
    rows, product = [], type(layers[0].linear_method.amx)
    real = product.__call__
    monkeypatch.setattr(product, "__call__", lambda self, x, bias: (rows.append(x.size(0)), real(self, x, bias))[1])
    first = llm.generate(prompts[:6], greedy(10), use_tqdm=False)
    again = llm.generate(prompts[6:], greedy(10), use_tqdm=False)
    assert [o["token_ids"] for o in first + again] == hf_greedy(qwen3_wide, prompts, 10)
    assert max(rows) > AMX_MAX_ROWS  # prefill chunks went through it
    assert sum(o["num_cached_tokens"] for o in again) >= 3 * 192
    llm.exit()
