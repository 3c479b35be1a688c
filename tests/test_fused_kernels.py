"""The fused Triton kernels against their torch references: residual add + RMSNorm, q/k norm + rotary
+ KV store, SiLU-and-mul, and the sampler's race (with its Philox noise against a numpy Philox).

Without a GPU the kernels run under TRITON_INTERPRET=1 on CPU tensors, in fp32 and fp16 (the
interpreter does not do bf16 arithmetic correctly; bf16 runs only in the `gpu` tests), on small and
odd sizes: widths that are not powers of two, single rows, more rows than one program takes.
Outputs and caches start as NaN, so an element a kernel fails to write, or a cache slot it must
not touch but does, shows. References are the layer functions the CPU path runs.
"""
import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

pytest.importorskip("triton", reason="triton is not installed, so the Triton kernels cannot run")

from helpers import kernel_test_device  # noqa: E402

from nanovllm.attention.torch_backend import TorchBackend  # noqa: E402
from nanovllm.kernels import sampling as sampling_mod  # noqa: E402
from nanovllm.kernels.qk_norm_rope import qk_norm_rope_store  # noqa: E402
from nanovllm.kernels.rms_norm import _rms_norm_kernel, rms_norm  # noqa: E402
from nanovllm.kernels.sampling import sample_tokens  # noqa: E402
from nanovllm.kernels.silu_mul import silu_and_mul  # noqa: E402
from nanovllm.layers import sampler  # noqa: E402
from nanovllm.platform import torch as reference  # noqa: E402
from nanovllm.layers.rotary_embedding import RopeConfig, RotaryEmbedding, rotate_qk  # noqa: E402

DEVICE = kernel_test_device(_rms_norm_kernel)
INTERPRET = DEVICE.type == "cpu"
DTYPES = [torch.float32, torch.float16]
# fp32: the same operations as torch, summed in another order (a few ulps); fp16: one ulp of rounding.
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
             torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
EPS = 1e-6


def poisoned(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def randn(*shape: int, dtype: torch.dtype, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert not actual.isnan().any(), "NaN in the output: an element left unwritten"
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCE[dtype])


# ---------------------------------------------------------------------------------------------- RMSNorm

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 1), (5, 100), (37, 64), (3, 2500)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_torch(dtype, rows, hidden, with_residual):
    gen = torch.Generator().manual_seed(hidden + rows)
    # Rows of a wider tensor (row stride != hidden), as a slice of a fused output would be.
    x = randn(rows, hidden + 3, dtype=dtype, gen=gen)[:, :hidden]
    weight = (1 + randn(hidden, dtype=torch.float32, gen=gen, scale=0.1)).to(dtype)
    residual = randn(rows, hidden, dtype=dtype, gen=gen) if with_residual else None
    out = poisoned(rows, hidden, dtype=dtype)
    residual_out = poisoned(rows, hidden, dtype=dtype) if with_residual else None
    result = rms_norm(x, weight, EPS, residual, out=out, residual_out=residual_out)
    assert result.out is out
    if with_residual:
        expected, expected_residual = reference.add_rms_norm(x, residual, weight, EPS)
        assert result.residual is residual_out
        torch.testing.assert_close(residual_out, expected_residual, rtol=0, atol=0)  # the same one addition
    else:
        expected = reference.rms_norm(x, weight, EPS)
        assert result.residual is None
    assert_close(out, expected, dtype)


def test_rms_norm_rejects_bad_inputs():
    x = torch.randn(4, 8, device=DEVICE)
    w = torch.ones(8, device=DEVICE)
    with pytest.raises(ValueError, match="weight has 7"):
        rms_norm(x, w[:7], EPS)
    with pytest.raises(ValueError, match="dtype"):
        rms_norm(x, w.half(), EPS)
    with pytest.raises(ValueError, match="residual has shape"):
        rms_norm(x, w, EPS, x[:3])
    with pytest.raises(ValueError, match="eps"):
        rms_norm(x, w, 0.0)
    with pytest.raises(ValueError, match="stride"):
        rms_norm(x.t().contiguous().t(), w, EPS)


# ---------------------------------------------------------------------------------------------- SiLU

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 1), (3, 37), (40, 64), (2, 1100)])
def test_silu_and_mul_matches_torch(dtype, rows, width):
    gen = torch.Generator().manual_seed(width)
    x = randn(rows, 2 * width + 5, dtype=dtype, gen=gen, scale=3.0)[:, :2 * width]  # row stride != 2 * width
    out = poisoned(rows, width, dtype=dtype)
    assert silu_and_mul(x, out) is out
    assert_close(out, reference.silu_and_mul(x), dtype)


def test_silu_and_mul_rejects_bad_inputs():
    with pytest.raises(ValueError, match="gate and up"):
        silu_and_mul(torch.randn(2, 5, device=DEVICE))
    with pytest.raises(ValueError, match="out has shape"):
        silu_and_mul(torch.randn(2, 6, device=DEVICE), torch.empty(2, 6, device=DEVICE))


# ---------------------------------------------------------------------------------------------- q/k norm, rotary, store

def qkv_views(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
              gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as the model has them: views of one fused [num_tokens, (Hq + 2 Hkv) * D] output."""
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, gen=gen, scale=2.0)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return (q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim),
            v.view(num_tokens, num_kv_heads, head_dim))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(6, 2, 16), (4, 4, 80), (8, 1, 32), (2, 2, 2)])
@pytest.mark.parametrize("with_norm", [True, False])
@pytest.mark.parametrize("num_tokens", [1, 19])
def test_qk_norm_rope_store_matches_torch(dtype, num_heads, num_kv_heads, head_dim, with_norm, num_tokens):
    gen = torch.Generator().manual_seed(num_heads * 100 + head_dim + num_tokens)
    max_position, block_size, num_blocks = 512, 16, 5
    q, k, v = qkv_views(num_tokens, num_heads, num_kv_heads, head_dim, dtype, gen)
    rotary = RotaryEmbedding(head_dim, max_position, RopeConfig(10000.0, "default", {})).to(DEVICE)
    positions = torch.randint(0, max_position, (num_tokens,), generator=gen).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::3] = -1  # padding rows store nothing
    slot_mapping = slots.to(DEVICE)
    weights = [(1 + randn(head_dim, dtype=torch.float32, gen=gen, scale=0.1)).to(dtype) for _ in range(2)]

    # The torch path: norms, rotary, then the torch backend's store.
    q_ref, k_ref = q.clone(), k.clone()
    if with_norm:
        q_ref, k_ref = reference.rms_norm(q_ref, weights[0], EPS), reference.rms_norm(k_ref, weights[1], EPS)
    q_ref, k_ref = rotate_qk(positions, q_ref, k_ref, rotary.cos_sin_cache)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache_ref, v_cache_ref = poisoned(*shape, dtype=dtype), poisoned(*shape, dtype=dtype)
    TorchBackend().store_kv(k_ref, v, k_cache_ref, v_cache_ref, slot_mapping)

    v_before = v.clone()
    k_cache, v_cache = poisoned(*shape, dtype=dtype), poisoned(*shape, dtype=dtype)
    norm = dict(q_weight=weights[0], k_weight=weights[1], eps=EPS) if with_norm else {}
    qk_norm_rope_store(q, k, v, positions, rotary.cos_sin_cache, **norm, k_cache=k_cache, v_cache=v_cache,
                       slot_mapping=slot_mapping)
    assert_close(q, q_ref, dtype)
    assert_close(k, k_ref, dtype)
    torch.testing.assert_close(v, v_before, rtol=0, atol=0)  # v is only read
    written = slot_mapping[slot_mapping >= 0]
    flat = (-1, num_kv_heads, head_dim)
    assert_close(k_cache.view(flat)[written], k_cache_ref.view(flat)[written], dtype)
    torch.testing.assert_close(v_cache.view(flat)[written], v.view(flat)[slot_mapping >= 0], rtol=0, atol=0)
    # The cache holds exactly the rotated k the kernel left in place.
    torch.testing.assert_close(k_cache.view(flat)[written], k[slot_mapping >= 0], rtol=0, atol=0)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    untouched[written] = False
    assert k_cache.view(flat)[untouched].isnan().all() and v_cache.view(flat)[untouched].isnan().all()


def test_qk_norm_rope_without_cache_only_rotates():
    gen = torch.Generator().manual_seed(3)
    q, k, v = qkv_views(5, 4, 2, 16, torch.float32, gen)
    rotary = RotaryEmbedding(16, 64, RopeConfig(10000.0, "default", {})).to(DEVICE)
    positions = torch.arange(5, device=DEVICE)
    q_ref, k_ref = rotate_qk(positions, q, k, rotary.cos_sin_cache)
    qk_norm_rope_store(q, k, v, positions, rotary.cos_sin_cache)
    assert_close(q, q_ref, torch.float32)
    assert_close(k, k_ref, torch.float32)


def test_qk_norm_rope_rejects_bad_inputs():
    gen = torch.Generator().manual_seed(4)
    q, k, v = qkv_views(3, 4, 2, 16, torch.float32, gen)
    cos_sin = RotaryEmbedding(16, 64, RopeConfig(10000.0, "default", {})).cos_sin_cache.to(DEVICE)
    positions = torch.arange(3, device=DEVICE)
    w = torch.ones(16, device=DEVICE)
    with pytest.raises(ValueError, match="together"):
        qk_norm_rope_store(q, k, v, positions, cos_sin, q_weight=w)
    with pytest.raises(ValueError, match="positions has 2"):
        qk_norm_rope_store(q, k, v, positions[:2], cos_sin)
    with pytest.raises(ValueError, match="cos_sin_cache rows"):
        qk_norm_rope_store(q, k, v, positions, cos_sin[:, :, :8])
    cache = torch.zeros(2, 16, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="given together or not at all"):
        qk_norm_rope_store(q, k, v, positions, cos_sin, k_cache=cache, v_cache=cache)
    with pytest.raises(ValueError, match="slot_mapping has 1"):
        qk_norm_rope_store(q, k, v, positions, cos_sin, k_cache=cache, v_cache=cache.clone(),
                           slot_mapping=positions[:1])


# ---------------------------------------------------------------------------------------------- the sampler's race

def philox_uint32(keys: np.ndarray, counters: np.ndarray, vocab: int) -> np.ndarray:
    """Philox-4x32-10's first word for counter (v, counter lo, counter hi, 0) and key (seed lo, seed hi),
    for every row and vocabulary index v: [rows, vocab] uint32. Textbook Philox (Salmon et al.),
    written in numpy uint64 so that each 32x32-bit product is exact."""
    mask = np.uint64(0xFFFFFFFF)
    keys, counters = keys.astype(np.int64).view(np.uint64), counters.astype(np.int64).view(np.uint64)
    rows = len(keys)
    c0 = np.broadcast_to(np.arange(vocab, dtype=np.uint64), (rows, vocab)).copy()
    c1 = np.broadcast_to((counters & mask)[:, None], (rows, vocab)).copy()
    c2 = np.broadcast_to((counters >> np.uint64(32))[:, None], (rows, vocab)).copy()
    c3 = np.zeros((rows, vocab), dtype=np.uint64)
    k0, k1 = (keys & mask)[:, None], (keys >> np.uint64(32))[:, None]
    a, b = np.uint64(sampling_mod.PHILOX_ROUND_A.value), np.uint64(sampling_mod.PHILOX_ROUND_B.value)
    for _ in range(sampling_mod.PHILOX_ROUNDS.value):
        pa, pb = a * c0, b * c2  # exact: both factors < 2**32
        c0, c1, c2, c3 = (pb >> np.uint64(32)) ^ c1 ^ k0, pb & mask, (pa >> np.uint64(32)) ^ c3 ^ k1, pa & mask
        k0 = (k0 + np.uint64(sampling_mod.PHILOX_KEY_A.value)) & mask
        k1 = (k1 + np.uint64(sampling_mod.PHILOX_KEY_B.value)) & mask
    return c0.astype(np.uint32)


def reference_noise(keys: list[int], counters: list[int], vocab: int) -> torch.Tensor:
    """The kernel's Exp(1) noise as documented in kernels/sampling.py: E = -log1p(-u), u = (x + 0.5) * 2^-32."""
    x = philox_uint32(np.array(keys), np.array(counters), vocab)
    u = (x.astype(np.float64) + 0.5) * 2.0 ** -32
    return torch.from_numpy(-np.log1p(-u)).float()


def torch_sampler_tokens(logits: torch.Tensor, temperatures: torch.Tensor, noise: torch.Tensor) -> list[int]:
    """What the torch Sampler draws for these logits and this noise (layers/sampler.py's own functions)."""
    logits = logits.float()
    sampled = sampler.exponential_race(sampler.scale_by_temperature(logits, temperatures), noise)
    return torch.where(temperatures > 0, sampled, logits.argmax(dim=-1)).tolist()


def race(logits, temperatures, keys, counters, noise=None) -> list[int]:
    rows = logits.size(0)
    out = torch.full((rows,), -7, dtype=torch.int64, device=DEVICE)
    result = sample_tokens(logits.to(DEVICE), temperatures.to(DEVICE), torch.tensor(keys, device=DEVICE),
                           torch.tensor(counters, device=DEVICE),
                           noise=None if noise is None else noise.to(DEVICE), out=out)
    assert result is out
    return out.tolist()


@pytest.mark.parametrize("dtype,vocab", [(torch.float32, 1), (torch.float32, 640), (torch.float16, 640),
                                         (torch.float32, 20000), (torch.bfloat16, 20000)])
def test_race_with_injected_noise_matches_torch_sampler(dtype, vocab):
    """Greedy and sampled rows mixed, over one or several vocabulary chunks: the kernel's tokens are
    the torch sampler's for the same noise. (bf16 logits are only loaded and widened here, which the
    interpreter does exactly.)"""
    gen = torch.Generator().manual_seed(vocab)
    temperatures = torch.tensor([0.0, 0.6, 1.0, 0.0, 1.7, 0.3, 1.0])
    rows = len(temperatures)
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
    noise = torch.empty(rows, vocab).exponential_(generator=gen)
    keys = counters = [0] * rows
    assert race(logits, temperatures, keys, counters, noise) == torch_sampler_tokens(logits, temperatures, noise)


def test_greedy_rows_take_the_first_maximum():
    vocab = 20000  # three chunks: ties inside a tile, across tiles and across chunks
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(5))
    for row, positions in enumerate([(3, 900), (1500, 1024), (9000, 17000), (8191, 8192), (0, vocab - 1)]):
        logits[row, list(positions)] = 50.0
    logits[4, 1:] = float("-inf")
    tokens = race(logits, torch.zeros(5), [0] * 5, [0] * 5)
    assert tokens == logits.argmax(dim=-1).tolist() == [3, 1024, 9000, 8191, 0]


def test_in_kernel_noise_is_the_documented_philox_stream():
    """Flat logits at temperature 1: the token is the index of the smallest E, so it is decided by the
    noise alone. The kernel's own noise and the numpy Philox reference pick the same tokens, for
    seeds across the int64 range and counters past 32 bits."""
    vocab = 640
    keys = [0, 1, -1, 2**63 - 1, -2**63, 123456789, 987654321987654321, 42]
    counters = [0, 1, 2**32 + 5, 7, 0, 3, 2**40, 1]
    logits = torch.zeros(len(keys), vocab)
    temperatures = torch.ones(len(keys))
    expected = reference_noise(keys, counters, vocab).argmin(dim=-1).tolist()
    assert race(logits, temperatures, keys, counters) == expected
    assert len(set(expected)) > 1  # different keys/counters, different draws


def test_a_rows_draws_depend_only_on_its_key_and_counter():
    gen = torch.Generator().manual_seed(6)
    vocab = 640
    row = torch.randn(1, vocab, generator=gen) * 2
    alone = race(row, torch.tensor([0.8]), [99], [5])
    others = torch.randn(6, vocab, generator=gen) * 2
    batch = torch.cat([others[:4], row, others[4:]])
    temperatures = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.8, 1.0, 0.0])
    tokens = race(batch, temperatures, [1, 2, 3, 4, 99, 5, 6], [0, 0, 0, 0, 5, 0, 0])
    assert tokens[4] == alone[0]
    # The next counter is a new draw: over many counters the row's tokens vary.
    draws = race(row.expand(32, vocab).contiguous(), torch.full((32,), 5.0), [99] * 32, list(range(32)))
    assert len(set(draws)) > 8


def test_race_draws_follow_softmax():
    """Counters 0..N-1 of one seed are N independent draws from softmax(logits / T): frequencies
    within 5 standard errors of the probabilities (fixed seed, so the outcome is fixed too)."""
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005])
    temperature, draws = 0.7, 6000
    logits = (probs.log() * temperature).expand(draws, -1).contiguous()
    tokens = race(logits, torch.full((draws,), temperature), [7] * draws, list(range(draws)))
    freq = torch.bincount(torch.tensor(tokens), minlength=len(probs)).float() / draws
    stderr = (probs * (1 - probs) / draws).sqrt()
    assert ((freq - probs).abs() < 5 * stderr).all(), (freq, probs)


def test_race_rejects_bad_inputs():
    logits = torch.zeros(3, 10, device=DEVICE)
    ok = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    t = torch.zeros(3, device=DEVICE)
    with pytest.raises(ValueError, match="temperatures has 2"):
        sample_tokens(logits, t[:2], ok, ok)
    with pytest.raises(ValueError, match="seeds has dtype"):
        sample_tokens(logits, t, ok.int(), ok)
    with pytest.raises(ValueError, match="noise has shape"):
        sample_tokens(logits, t, ok, ok, noise=torch.ones(3, 9, device=DEVICE))


# ---------------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(INTERPRET, reason="checks the compiled kernels, but TRITON_INTERPRET=1 is set")
def test_bf16_kernels_on_gpu():
    """Qwen3-0.6B shapes in bf16, compiled, against the torch functions on the same GPU."""
    gen = torch.Generator().manual_seed(11)
    dtype, rows = torch.bfloat16, 33
    x, r = randn(rows, 1024, dtype=dtype, gen=gen), randn(rows, 1024, dtype=dtype, gen=gen)
    w = (1 + randn(1024, dtype=torch.float32, gen=gen, scale=0.1)).to(dtype)
    out = rms_norm(x, w, EPS, r)
    expected, expected_residual = reference.add_rms_norm(x, r, w, EPS)
    assert_close(out.out, expected, dtype)
    torch.testing.assert_close(out.residual, expected_residual, rtol=0, atol=0)
    y = randn(rows, 2 * 3072, dtype=dtype, gen=gen, scale=3.0)
    assert_close(silu_and_mul(y), reference.silu_and_mul(y), dtype)
    q, k, v = qkv_views(rows, 16, 8, 128, dtype, gen)
    rotary = RotaryEmbedding(128, 4096, RopeConfig(1e6, "default", {})).to(DEVICE)
    positions = torch.randint(0, 4096, (rows,), generator=gen).to(DEVICE)
    wq, wk = w[:128].clone(), w[128:256].clone()
    q_ref, k_ref = rotate_qk(positions, reference.rms_norm(q, wq, EPS), reference.rms_norm(k, wk, EPS),
                             rotary.cos_sin_cache)
    qk_norm_rope_store(q, k, v, positions, rotary.cos_sin_cache, wq, wk, EPS)
    assert_close(q, q_ref, dtype)
    assert_close(k, k_ref, dtype)
    logits = (torch.randn(8, 151936, generator=gen) * 3).to(DEVICE, dtype)
    temperatures = torch.tensor([0.0, 0.6, 1.0, 0.0, 1.7, 0.3, 1.0, 0.0])
    noise = torch.empty(8, 151936).exponential_(generator=gen)
    assert race(logits, temperatures, [0] * 8, [0] * 8, noise) == \
        torch_sampler_tokens(logits.cpu(), temperatures, noise)


class LaunchRecorder:
    """Stands in for a Triton kernel: `kernel[grid](*args, **launch)` records the launch and runs
    nothing, so a wrapper's launch options can be checked without CUDA."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **launch: self.launches.append(launch)


def is_power_of_2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(6, 2, 16), (9, 3, 16), (12, 4, 32), (16, 8, 128),
                                                              (5, 1, 64), (3, 3, 32), (40, 8, 128), (14, 2, 64)])
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_qk_norm_rope_launches_a_power_of_2_warps(monkeypatch, num_heads, num_kv_heads, head_dim, num_tokens):
    # On CUDA Triton refuses any other warp count; the interpreter ignores it. 6 query heads + 2 KV
    # heads pad to 8 + 2 x 2 = 12 rows, which gave 3 or 6 warps and failed the first H200 parity run.
    from nanovllm.kernels import qk_norm_rope as module
    recorder = LaunchRecorder()
    monkeypatch.setattr(module, "_qk_norm_rope_store_kernel", recorder)
    q, k, v = qkv_views(num_tokens, num_heads, num_kv_heads, head_dim, torch.float32, torch.Generator().manual_seed(0))
    rotary = RotaryEmbedding(head_dim, 512, RopeConfig(10000.0, "default", {})).to(DEVICE)
    qk_norm_rope_store(q, k, v, torch.arange(num_tokens, device=DEVICE) % 512, rotary.cos_sin_cache)
    (launch,) = recorder.launches
    assert is_power_of_2(launch["num_warps"]) and launch["num_warps"] <= module.MAX_WARPS, launch["num_warps"]


@pytest.mark.parametrize("hidden", [1, 48, 96, 1000, 1024, 2048, 4096, 5120])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_rms_norm_launches_a_power_of_2_warps(monkeypatch, hidden, rows):
    from nanovllm.kernels import rms_norm as module
    recorder = LaunchRecorder()
    monkeypatch.setattr(module, "_rms_norm_kernel", recorder)
    x = torch.randn(rows, hidden, device=DEVICE)
    rms_norm(x, torch.ones(hidden, device=DEVICE), EPS)
    (launch,) = recorder.launches
    assert is_power_of_2(launch["num_warps"]) and launch["num_warps"] <= module.MAX_WARPS, launch["num_warps"]
