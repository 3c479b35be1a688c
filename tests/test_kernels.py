"""The Triton kernels against the torch backend, the oracle: store_kv, decode and prefill/extend.

Without a GPU the kernels run under TRITON_INTERPRET=1 on CPU tensors, in fp32 and fp16 only (the
interpreter does not do bf16 arithmetic correctly) and on tiny shapes (it runs programs one after
another). With a GPU the same tests run compiled, plus a bf16 test marked `gpu`.

Inputs are built to catch the usual kernel bugs: q/k/v are strided views of a fused qkv tensor,
block tables are shuffled and padded with -1, lengths sit on and around block boundaries,
decode batches carry zero-length padding rows, and everything a kernel must not read (cache slots
past a context, unused blocks) or must write (outputs, split scratch) starts as NaN.
"""
import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    # Must happen before triton is first imported: kernels decorated without it compile for a GPU.
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed, so the Triton kernels cannot run")

from helpers import kernel_test_device  # noqa: E402

from nanovllm.attention.torch_backend import TorchBackend  # noqa: E402
from nanovllm.platform.attention import triton_backend as make_triton_backend  # noqa: E402
from nanovllm.kernels import decode_attention as decode_mod  # noqa: E402
from nanovllm.kernels.decode_attention import DecodeTiles, choose_num_splits, decode_attention  # noqa: E402
from nanovllm.kernels.prefill_attention import PrefillTiles, prefill_attention  # noqa: E402
from nanovllm.kernels.store_kv import _store_kv_kernel, store_kv  # noqa: E402
from nanovllm.utils.context import AttentionMetadata  # noqa: E402

DEVICE = kernel_test_device(_store_kv_kernel)
INTERPRET = DEVICE.type == "cpu"

HEAD_DIM = 32  # small: the interpreter's cost grows with every tile element
SCALE = HEAD_DIM ** -0.5
# (num_heads, num_kv_heads): GQA groups of 1, 2, 3 (not a power of two) and 8.
HEAD_LAYOUTS = [(2, 2), (4, 2), (6, 2), (8, 1)]
DTYPES = [torch.float32, torch.float16]
TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.float16: dict(atol=1e-2, rtol=1e-2),
             torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
# Context lengths on and around block boundaries, per block size.
DECODE_LENGTHS = {16: [0, 1, 15, 16, 17, 33, 0, 48], 64: [0, 1, 63, 64, 65, 129, 16, 0]}
# (cached prefix, new tokens) per sequence of a prefill batch.
EXTEND_LENGTHS = {16: [(0, 17), (16, 1), (15, 2), (1, 15), (17, 16), (33, 31)],
                  64: [(0, 65), (64, 1), (63, 2), (1, 63), (70, 20)]}
PREFILL_LENGTHS = [1, 15, 16, 17, 33]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def fused_qkv(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
              gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as the model produces them: strided views of one [num_tokens, (Hq + 2 Hkv) * D] tensor."""
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(DEVICE, dtype)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return (q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim),
            v.view(num_tokens, num_kv_heads, head_dim))


class PagedCache:
    """A paged K/V cache holding `lengths[i]` random tokens for sequence i in shuffled blocks.

    Every slot no sequence owns is NaN in `k`/`v` (what the kernels read, so reading one shows
    up as NaN in the output) and 0 in `k_clean`/`v_clean` (what the oracle reads: it gathers whole
    blocks and even the -1 padding, then masks the scores, and 0 * NaN would poison it)."""

    def __init__(self, lengths: list[int], block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, gen: torch.Generator, spare_blocks: int = 3, spare_columns: int = 1):
        blocks_per_seq = [cdiv(n, block_size) for n in lengths]
        num_blocks = sum(blocks_per_seq) + spare_blocks
        order = torch.randperm(num_blocks, generator=gen).tolist()
        width = max(blocks_per_seq, default=0) + spare_columns
        tables = torch.full((len(lengths), width), -1, dtype=torch.int32)
        k = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
        v = k.clone()
        for i, (n, count) in enumerate(zip(lengths, blocks_per_seq)):
            tables[i, :count] = torch.tensor(order[:count], dtype=torch.int32)
            order = order[count:]
            flat = tables[i, :count].long()
            for which in (k, v):
                values = torch.full((count * block_size, num_kv_heads, head_dim), float("nan"))
                values[:n] = torch.randn(n, num_kv_heads, head_dim, generator=gen)
                which[flat] = values.view(count, block_size, num_kv_heads, head_dim)
        self.k, self.v = k.to(DEVICE, dtype), v.to(DEVICE, dtype)
        self.k_clean, self.v_clean = self.k.nan_to_num(0.0), self.v.nan_to_num(0.0)
        self.block_tables = tables.to(DEVICE)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert not actual.isnan().any(), "NaN in the output: an element left unwritten or a padding slot read"
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCE[dtype])


# ---------------------------------------------------------------------------------------------- store_kv

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_store_kv_matches_torch(dtype, block_size, slot_dtype):
    gen = torch.Generator().manual_seed(0)
    num_blocks, num_tokens, num_kv_heads = 5, 37, 2
    _, k, v = fused_qkv(num_tokens, 4, num_kv_heads, HEAD_DIM, dtype, gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::5] = -1  # padding rows
    slots[1] = num_blocks * block_size - 1  # the very last slot
    slot_mapping = slots.to(DEVICE, slot_dtype)
    shape = (num_blocks, block_size, num_kv_heads, HEAD_DIM)
    k_cache, v_cache = (torch.full(shape, float("nan"), dtype=dtype, device=DEVICE) for _ in range(2))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    store_kv(k, v, k_cache, v_cache, slot_mapping)
    TorchBackend().store_kv(k, v, k_ref, v_ref, slot_mapping)
    # Bit-exact, and the slots nobody wrote are still NaN.
    torch.testing.assert_close(k_cache, k_ref, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_ref, rtol=0, atol=0, equal_nan=True)
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    assert k_cache.view(-1, num_kv_heads, HEAD_DIM)[written.to(DEVICE)].isfinite().all()
    assert k_cache.view(-1, num_kv_heads, HEAD_DIM)[~written.to(DEVICE)].isnan().all()


def test_store_kv_rejects_bad_inputs():
    k = torch.randn(4, 2, HEAD_DIM, device=DEVICE)
    cache = torch.zeros(2, 16, 2, HEAD_DIM, device=DEVICE)
    slots = torch.arange(4, device=DEVICE)
    with pytest.raises(ValueError, match="stride"):
        store_kv(k.transpose(1, 2).contiguous().transpose(1, 2), k, cache, cache, slots)
    with pytest.raises(ValueError, match="dtype"):
        store_kv(k, k, cache.half(), cache.half(), slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(k, k, cache, cache, slots[:3])
    with pytest.raises(ValueError, match="dtype"):
        store_kv(k, k, cache, cache, slots.float())


# ---------------------------------------------------------------------------------------------- decode

def decode_case(lengths: list[int], block_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                dtype: torch.dtype, gen: torch.Generator):
    cache = PagedCache(lengths, block_size, num_kv_heads, head_dim, dtype, gen)
    q, _, _ = fused_qkv(len(lengths), num_heads, num_kv_heads, head_dim, dtype, gen)
    context_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.empty(0, device=DEVICE),
                             context_lens=context_lens, block_tables=cache.block_tables)
    scale = head_dim ** -0.5
    expected = TorchBackend().decode(q.float(), cache.k_clean.float(), cache.v_clean.float(), meta, scale)
    return q, cache, context_lens, expected


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEAD_LAYOUTS)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_matches_torch(dtype, block_size, num_heads, num_kv_heads, num_splits):
    gen = torch.Generator().manual_seed(1)
    lengths = DECODE_LENGTHS[block_size]
    q, cache, context_lens, expected = decode_case(lengths, block_size, num_heads, num_kv_heads, HEAD_DIM, dtype, gen)
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=DEVICE)
    numel = decode_mod.scratch_numel(len(lengths), num_heads, HEAD_DIM, num_splits)
    scratch = torch.full((numel,), float("nan"), device=DEVICE)

    decode_attention(q, cache.k, cache.v, cache.block_tables, context_lens, SCALE,
                     num_splits=num_splits, scratch=scratch, out=out)
    assert_close(out, expected, dtype)
    assert (out[context_lens == 0] == 0).all(), "a zero-length row must output exactly 0"


@pytest.mark.parametrize("head_dim", [16, 80, 128])
def test_decode_head_dims(head_dim):
    gen = torch.Generator().manual_seed(2)
    lengths = [17, 0, 40]
    q, cache, context_lens, expected = decode_case(lengths, 16, 4, 2, head_dim, torch.float32, gen)
    out = decode_attention(q, cache.k, cache.v, cache.block_tables, context_lens, head_dim ** -0.5, num_splits=2)
    assert_close(out, expected, torch.float32)


def test_decode_tile_larger_than_block_and_int64_indices():
    # A 64-position tile spans four 16-slot blocks; int64 tables/lengths are accepted too.
    gen = torch.Generator().manual_seed(3)
    q, cache, context_lens, expected = decode_case([70, 5, 0], 16, 4, 2, HEAD_DIM, torch.float16, gen)
    out = decode_attention(q, cache.k, cache.v, cache.block_tables.long(), context_lens.long(), SCALE,
                           tiles=DecodeTiles(block_n=64, num_warps=4, num_stages=2))
    assert_close(out, expected, torch.float16)


def test_decode_rejects_bad_inputs():
    gen = torch.Generator().manual_seed(4)
    q, cache, context_lens, _ = decode_case([5, 9], 16, 4, 2, HEAD_DIM, torch.float32, gen)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        decode_attention(q[:, :3], cache.k, cache.v, cache.block_tables, context_lens, SCALE)
    with pytest.raises(ValueError, match="batch"):
        decode_attention(q, cache.k, cache.v, cache.block_tables[:1], context_lens, SCALE)
    with pytest.raises(ValueError, match="scratch"):
        decode_attention(q, cache.k, cache.v, cache.block_tables, context_lens, SCALE, num_splits=2,
                         scratch=torch.empty(3, device=DEVICE))


def test_num_splits_depend_only_on_shapes():
    sms = 132
    for batch in (1, 2, 8, 64, 256, 512):
        splits = choose_num_splits(batch, 8, 64, 256, sms)
        assert splits & (splits - 1) == 0 and 1 <= splits <= decode_mod.MAX_SPLITS
    assert choose_num_splits(256, 8, 64, 256, sms) == 1  # 2048 programs already fill the GPU
    assert choose_num_splits(1, 8, 64, 256, sms) > 1  # 8 programs would leave SMs idle
    assert choose_num_splits(1, 8, 1, 16, sms) == 1  # a 16-token context is not worth splitting
    # More splits for smaller batches, never fewer.
    counts = [choose_num_splits(b, 8, 64, 256, sms) for b in range(1, 65)]
    assert counts == sorted(counts, reverse=True)


# ---------------------------------------------------------------------------------------------- prefill

def prefill_meta(lens: list[tuple[int, int]], block_tables: torch.Tensor | None) -> AttentionMetadata:
    seqlens_q = [new for _, new in lens]
    seqlens_k = [prefix + new for prefix, new in lens]
    cu = lambda xs: torch.tensor([0] + xs, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(DEVICE)  # noqa: E731
    return AttentionMetadata(is_prefill=True, slot_mapping=torch.empty(0, device=DEVICE),
                             cu_seqlens_q=cu(seqlens_q), cu_seqlens_k=cu(seqlens_k),
                             max_seqlen_q=max(seqlens_q), max_seqlen_k=max(seqlens_k),
                             block_tables=block_tables, seqlens_q=seqlens_q, seqlens_k=seqlens_k)


def run_extend(lens, block_size, num_heads, num_kv_heads, head_dim, dtype, gen, tiles=None):
    """Prefill over a cache that already holds every key (prefix and new): kernel vs oracle."""
    cache = PagedCache([p + n for p, n in lens], block_size, num_kv_heads, head_dim, dtype, gen)
    meta = prefill_meta(lens, cache.block_tables)
    q, _, _ = fused_qkv(sum(meta.seqlens_q), num_heads, num_kv_heads, head_dim, dtype, gen)
    scale = head_dim ** -0.5
    expected = TorchBackend().prefill(q.float(), None, None, cache.k_clean.float(), cache.v_clean.float(), meta, scale)
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=DEVICE)
    prefill_attention(q, cache.k, cache.v, meta.cu_seqlens_q, meta.cu_seqlens_k, scale,
                      block_tables=cache.block_tables, out=out, tiles=tiles)
    return out, expected


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEAD_LAYOUTS)
def test_prefill_with_cached_prefix_matches_torch(dtype, block_size, num_heads, num_kv_heads):
    gen = torch.Generator().manual_seed(5)
    out, expected = run_extend(EXTEND_LENGTHS[block_size], block_size, num_heads, num_kv_heads, HEAD_DIM, dtype, gen)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads", HEAD_LAYOUTS)
@pytest.mark.parametrize("rotated_k", [False, True])
def test_prefill_without_cache_matches_torch(dtype, num_heads, num_kv_heads, rotated_k):
    # No cached prefix: keys are this step's (strided) k/v, Lk == Lq. In the model k is a fresh
    # tensor (rotary makes a copy) while v stays a view of qkv, so their strides differ.
    gen = torch.Generator().manual_seed(6)
    meta = prefill_meta([(0, n) for n in PREFILL_LENGTHS], None)
    q, k, v = fused_qkv(sum(PREFILL_LENGTHS), num_heads, num_kv_heads, HEAD_DIM, dtype, gen)
    if rotated_k:
        k = k.contiguous()
    expected = TorchBackend().prefill(q.float(), k.float(), v.float(), None, None, meta, SCALE)
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=DEVICE)
    prefill_attention(q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_k, SCALE, out=out)
    assert_close(out, expected, dtype)


def test_prefill_many_query_blocks_per_sequence():
    # 16-row tiles cut each sequence into many query blocks: exercises the search over
    # cu_seqlens_q, blocks that straddle the causal diagonal and an empty sequence in the middle.
    gen = torch.Generator().manual_seed(7)
    lens = [(3, 40), (0, 16), (20, 0), (16, 17), (0, 1)]
    out, expected = run_extend(lens, 16, 2, 1, HEAD_DIM, torch.float32, gen, tiles=PrefillTiles(16, 16, 4, 2))
    assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("head_dim", [16, 80, 128])
def test_prefill_head_dims(head_dim):
    gen = torch.Generator().manual_seed(8)
    out, expected = run_extend([(5, 12), (16, 3)], 16, 4, 2, head_dim, torch.float32, gen)
    assert_close(out, expected, torch.float32)


def test_prefill_rejects_bad_inputs():
    q = torch.randn(4, 4, HEAD_DIM, device=DEVICE)
    kv = torch.randn(4, 2, HEAD_DIM, device=DEVICE)
    cu = torch.tensor([0, 4], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="cu_seqlens"):
        prefill_attention(q, kv, kv, cu, torch.tensor([0, 2, 4], dtype=torch.int32, device=DEVICE), SCALE)
    with pytest.raises(ValueError, match="dtype"):
        prefill_attention(q, kv.half(), kv.half(), cu, cu, SCALE)
    with pytest.raises(ValueError, match="dimensions"):
        prefill_attention(q, kv, kv, cu, cu, SCALE, block_tables=torch.zeros(1, 1, dtype=torch.int32, device=DEVICE))


# ---------------------------------------------------------------------------------------------- backend

def test_triton_backend_matches_torch_backend():
    """Through the AttentionBackend interface, one engine-like sequence of steps: a warm-up prefill
    with no cache, a prefill of new tokens after cached prefixes, then a decode step with a
    padding row; each backend stores into its own copy of the cache."""
    gen = torch.Generator().manual_seed(9)
    num_heads, num_kv_heads, block_size, dtype = 4, 2, 16, torch.float32
    torch_backend, triton_backend = TorchBackend(), make_triton_backend()
    assert triton_backend.name == "triton"

    # 1. Warm-up prefill: no cache yet.
    meta = prefill_meta([(0, n) for n in (5, 16, 17)], None)
    q, k, v = fused_qkv(38, num_heads, num_kv_heads, HEAD_DIM, dtype, gen)
    assert_close(triton_backend.prefill(q, k, v, None, None, meta, SCALE),
                 torch_backend.prefill(q, k, v, None, None, meta, SCALE), dtype)

    # 2. Prefill after cached prefixes: store the new tokens, then attend over the cache.
    lens = [(16, 5), (0, 17), (33, 1)]
    final_lens = [p + n + 1 for p, n in lens]  # room for the decode token of step 3
    cache = PagedCache(final_lens, block_size, num_kv_heads, HEAD_DIM, dtype, gen, spare_columns=30)
    tables = cache.block_tables
    caches = {name: (cache.k_clean.clone(), cache.v_clean.clone()) for name in ("torch", "triton")}
    slots = [tables[i, pos // block_size].item() * block_size + pos % block_size
             for i, (p, n) in enumerate(lens) for pos in range(p, p + n)]
    meta = prefill_meta(lens, tables)
    meta.slot_mapping = torch.tensor(slots, device=DEVICE)
    q, k, v = fused_qkv(len(slots), num_heads, num_kv_heads, HEAD_DIM, dtype, gen)
    outs = {}
    for name, backend in (("torch", torch_backend), ("triton", triton_backend)):
        k_cache, v_cache = caches[name]
        backend.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        outs[name] = backend.prefill(q, k, v, k_cache, v_cache, meta, SCALE)
    torch.testing.assert_close(caches["triton"], caches["torch"], rtol=0, atol=0)
    assert_close(outs["triton"], outs["torch"], dtype)

    # 3. Decode one token per sequence plus a padding row (slot -1, context 0). The table's spare
    # columns make it wide enough (>= 512 positions) that the backend splits contexts (checked below).
    decode_tables = torch.cat([tables, torch.full_like(tables[:1], -1)])
    slots = [tables[i, (n - 1) // block_size].item() * block_size + (n - 1) % block_size
             for i, n in enumerate(final_lens)] + [-1]
    meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.tensor(slots, device=DEVICE),
                             context_lens=torch.tensor(final_lens + [0], dtype=torch.int32, device=DEVICE),
                             block_tables=decode_tables)
    q, k, v = fused_qkv(len(slots), num_heads, num_kv_heads, HEAD_DIM, dtype, gen)
    for name, backend in (("torch", torch_backend), ("triton", triton_backend)):
        k_cache, v_cache = caches[name]
        backend.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        outs[name] = backend.decode(q, k_cache, v_cache, meta, SCALE)
    torch.testing.assert_close(caches["triton"], caches["torch"], rtol=0, atol=0)
    assert_close(outs["triton"], outs["torch"], dtype)
    assert (outs["triton"][-1] == 0).all()

    # The split scratch was allocated once and is reused, not regrown, by an identical step.
    num_splits = choose_num_splits(4, num_kv_heads, decode_tables.size(1), block_size,
                                   decode_mod.num_sms(DEVICE))
    assert num_splits > 1 and triton_backend._scratch is not None
    scratch_ptr = triton_backend._scratch.data_ptr()
    triton_backend.decode(q, *caches["triton"], meta, SCALE)
    assert triton_backend._scratch.data_ptr() == scratch_ptr and not triton_backend._retired_scratch


def test_kernel_modules_load_lazily():
    # Importing the package, the backend module or nanovllm.kernels must not import triton-using
    # modules: that is what lets the tests set TRITON_INTERPRET=1 first and CPU installs skip triton.
    code = ("import sys, nanovllm, nanovllm.attention.triton_backend, nanovllm.kernels; "
            "eager = [m for m in sys.modules if m.startswith('nanovllm.kernels.')]; "
            "assert not eager, eager")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# ---------------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(INTERPRET, reason="checks the compiled kernels, but TRITON_INTERPRET=1 is set")
@pytest.mark.parametrize("block_size", [16, 256])
def test_bf16_accuracy_on_gpu(block_size):
    """Qwen3-0.6B attention shapes in bf16 through TritonBackend, against fp32 torch math."""
    gen = torch.Generator().manual_seed(10)
    num_heads, num_kv_heads, head_dim, dtype = 16, 8, 128, torch.bfloat16
    scale = head_dim ** -0.5
    backend = make_triton_backend()

    # Decode with a batch small enough to split, padding rows included.
    lengths = [0, 1, block_size - 1, block_size, block_size + 1, 1000, 3000, 0]
    q, cache, context_lens, expected = decode_case(lengths, block_size, num_heads, num_kv_heads, head_dim, dtype, gen)
    meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.empty(0, device=DEVICE),
                             context_lens=context_lens, block_tables=cache.block_tables)
    assert_close(backend.decode(q, cache.k, cache.v, meta, scale), expected, dtype)

    # Prefill with cached prefixes, and the warm-up prefill without a cache.
    lens = [(0, 300), (block_size, 1), (block_size - 1, 2), (700, 129)]
    out, expected = run_extend(lens, block_size, num_heads, num_kv_heads, head_dim, dtype, gen)
    assert_close(out, expected, dtype)
    meta = prefill_meta([(0, n) for n in (1, 255, 256, 513)], None)
    q, k, v = fused_qkv(sum(meta.seqlens_q), num_heads, num_kv_heads, head_dim, dtype, gen)
    expected = TorchBackend().prefill(q.float(), k.float(), v.float(), None, None, meta, scale)
    assert_close(backend.prefill(q, k, v, None, None, meta, scale), expected, dtype)
