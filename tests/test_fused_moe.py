"""The fused MoE Triton kernel against the torch loop (layers/fused_moe.py), its oracle; the
sort by expert it runs on; routing; and the checks of its wrapper.

Without a GPU the kernel runs under TRITON_INTERPRET=1 on CPU tensors, in fp32 and fp16 only
(the interpreter does not do bf16 arithmetic correctly) and on tiny shapes. Routings are built
to hit what grouped GEMMs get wrong: experts with no tokens, experts with more tokens than one
row block and runs that end mid-block, one token, hidden and intermediate sizes that are not
multiples of the tiles, and both tile heights.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must happen before triton is first imported: kernels decorated without it compile for a GPU.
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed, so the Triton kernels cannot run")

from helpers import kernel_test_device  # noqa: E402

from nanovllm.kernels.fused_moe import (MoeTiles, _grouped_gemm_kernel, align_by_expert, fused_moe,  # noqa: E402
                                        max_padded_rows)
from nanovllm.layers.fused_moe import route  # noqa: E402
from nanovllm.platform.torch import fused_experts_torch  # noqa: E402

DEVICE = kernel_test_device(_grouped_gemm_kernel)
INTERPRET = DEVICE.type == "cpu"
DTYPES = [torch.float32, torch.float16]
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-2)}
NUM_EXPERTS = 8
TILES = [MoeTiles(16, 16, 16, 4, 2), MoeTiles(32, 32, 16, 4, 2)]


def uneven_routing(num_tokens: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
    """[num_tokens, top_k] distinct experts per token, skewed: expert 1 takes most tokens, experts
    3 and 6 none, the rest a few each."""
    weights = torch.tensor([4.0, 30.0, 3.0, 0.0, 2.0, 1.0, 0.0, 5.0])
    return torch.multinomial(weights.expand(num_tokens, -1), top_k, replacement=False, generator=gen)


def case(num_tokens: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(NUM_EXPERTS, 2 * inter, hidden, generator=gen) * hidden ** -0.5
    w2 = torch.randn(NUM_EXPERTS, hidden, inter, generator=gen) * inter ** -0.5
    ids = uneven_routing(num_tokens, top_k, gen)
    weights = torch.rand(num_tokens, top_k, generator=gen)
    return [t.to(DEVICE, dtype) for t in (x, w13, w2)] + [weights.to(DEVICE), ids.to(DEVICE)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tiles", TILES, ids=["block_m16", "block_m32"])
@pytest.mark.parametrize("num_tokens,hidden,inter,top_k", [(37, 48, 40, 2), (1, 32, 16, 2), (20, 24, 36, 3)])
def test_fused_moe_matches_torch(dtype, tiles, num_tokens, hidden, inter, top_k):
    x, w13, w2, weights, ids = case(num_tokens, hidden, inter, top_k, dtype, seed=num_tokens)
    counts = torch.bincount(ids.flatten().cpu(), minlength=NUM_EXPERTS)
    assert (counts == 0).any(), "the routing must leave some expert without tokens"
    out = fused_moe(x, w13, w2, weights, ids, tiles=tiles)
    expected = fused_experts_torch(x.float(), w13.float(), w2.float(), weights, ids)
    assert out.dtype == dtype and out.shape == (num_tokens, hidden)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), expected, **TOLERANCE[dtype])


def test_fused_moe_with_int32_ids_and_weights_in_the_input_dtype():
    x, w13, w2, weights, ids = case(19, 32, 32, 2, torch.float16, seed=5)
    out = fused_moe(x, w13, w2, weights.half(), ids.int(), tiles=TILES[0])
    expected = fused_experts_torch(x.float(), w13.float(), w2.float(), weights.half().float(), ids)
    torch.testing.assert_close(out.float(), expected, **TOLERANCE[torch.float16])


@pytest.mark.parametrize("block_m", [16, 32])
def test_align_by_expert_groups_and_pads_every_pair_once(block_m):
    gen = torch.Generator().manual_seed(7)
    ids = uneven_routing(45, 2, gen)
    alignment = align_by_expert(ids, NUM_EXPERTS, block_m)
    num_pairs = ids.numel()
    flat = ids.flatten()
    num_padded = int(alignment.num_padded)
    assert num_padded % block_m == 0 and num_padded <= max_padded_rows(num_pairs, NUM_EXPERTS, block_m)
    rows = alignment.sorted_pair_ids[:num_padded].long()
    real = rows[rows < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs)), "each pair exactly once"
    assert (alignment.sorted_pair_ids[num_padded:] == num_pairs).all(), "rows past the end are padding"
    for block, expert in enumerate(alignment.block_experts.tolist()):
        block_rows = rows[block * block_m:(block + 1) * block_m] if block * block_m < num_padded else None
        if block_rows is None:
            assert expert == NUM_EXPERTS  # unused blocks point past the last expert
            continue
        pairs = block_rows[block_rows < num_pairs]
        assert len(pairs) > 0, "a block in use holds at least one real pair"
        assert (flat[pairs] == expert).all(), "a block's pairs all go to its expert"
        assert pairs.tolist() == sorted(pairs.tolist()), "pairs keep their order within an expert"
    assert set(alignment.block_experts[:num_padded // block_m].tolist()) == set(flat.tolist())


@pytest.mark.parametrize("renormalize", [True, False])
def test_route_takes_the_top_k_softmax_probabilities(renormalize):
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(6, NUM_EXPERTS, generator=gen)
    routing = route(logits, 2, renormalize)
    probs = logits.softmax(-1)
    assert routing.expert_ids.tolist() == probs.topk(2).indices.tolist()
    chosen = probs.gather(1, routing.expert_ids)
    expected = chosen / chosen.sum(-1, keepdim=True) if renormalize else chosen
    torch.testing.assert_close(routing.weights, expected)


def test_fused_moe_rejects_bad_inputs():
    x, w13, w2, weights, ids = case(4, 32, 16, 2, torch.float32, seed=9)
    with pytest.raises(ValueError, match="w2 has shape"):
        fused_moe(x, w13, w2[:, :, :8], weights, ids)
    with pytest.raises(ValueError, match="w13 has shape"):
        fused_moe(x, w13[:, :, :16], w2, weights, ids)
    with pytest.raises(ValueError, match="dtype"):
        fused_moe(x, w13.half(), w2, weights, ids)
    with pytest.raises(ValueError, match="topk_ids"):
        fused_moe(x, w13, w2, weights, ids[:3])
    with pytest.raises(ValueError, match="topk_ids"):
        fused_moe(x, w13, w2, weights, ids.float())
    with pytest.raises(ValueError, match="stride"):
        fused_moe(x.t().contiguous().t(), w13, w2, weights, ids)
    assert fused_moe(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, 32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(INTERPRET, reason="checks the compiled kernel, but TRITON_INTERPRET=1 is set")
@pytest.mark.parametrize("num_tokens", [1, 8, 300])
def test_bf16_qwen3_30b_a3b_layer_and_cuda_graph_replay(num_tokens):
    """One Qwen3-30B-A3B MoE layer's shapes (128 experts of 768, top-8, hidden 2048) in bf16 with
    the default tiles, against fp32 torch math; then captured in a CUDA graph and replayed on a new
    routing, as the decode graphs do."""
    gen = torch.Generator().manual_seed(11)
    hidden, inter, experts, top_k = 2048, 768, 128, 8
    x = torch.randn(num_tokens, hidden, generator=gen).cuda().bfloat16()
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5).cuda().bfloat16()
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5).cuda().bfloat16()
    logits = torch.randn(num_tokens, experts, generator=gen).cuda()
    routing = route(logits, top_k, renormalize=True)
    out = fused_moe(x, w13, w2, routing.weights, routing.expert_ids)
    expected = fused_experts_torch(x.float(), w13.float(), w2.float(), routing.weights, routing.expert_ids)
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)

    ids, weights = routing.expert_ids.clone(), routing.weights.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = fused_moe(x, w13, w2, weights, ids)
    new = route(torch.randn(num_tokens, experts, generator=gen).cuda(), top_k, renormalize=True)
    ids.copy_(new.expert_ids)
    weights.copy_(new.weights)
    graph.replay()
    torch.testing.assert_close(graph_out, fused_moe(x, w13, w2, new.weights, new.expert_ids), atol=0, rtol=0)
