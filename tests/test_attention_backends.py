"""The attention interface end to end: the backend choice, and the whole engine giving the same
greedy tokens with the Triton kernels (under TRITON_INTERPRET=1 without a GPU) and flash-attn
(where installed) as with the torch oracle."""
import importlib.util

import pytest
import torch

import nanovllm.platform.attention as attention
from helpers import AUTO_BACKEND_SMALL_BLOCKS, AUTO_DEVICE, greedy, random_prompts
from nanovllm import LLM

BLOCK = 16
HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None


def run_twice(path: str, backend: str, prompts, device: str = "cpu", **kwargs) -> tuple[list, list]:
    """Two generate() calls, so the second one hits the prefix cache."""
    llm = LLM(path, attention_backend=backend, device=device, kvcache_block_size=kwargs.pop("block", BLOCK),
              enforce_eager=True, **kwargs)
    assert llm.attention_backend == backend
    first = llm.generate(prompts, greedy(6), use_tqdm=False)
    second = llm.generate(prompts, greedy(6), use_tqdm=False)
    llm.exit()
    return first, second


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_backend_matches_torch_end_to_end(qwen3_tiny):
    shared = random_prompts(200, [33], seed=40)[0]
    prompts = [shared + [5], shared + [9, 10, 11], random_prompts(200, [17], seed=41)[0]]
    # max_num_batched_tokens=24 chunks the 36-token prompt's prefill.
    kwargs = dict(num_kvcache_blocks=32, max_num_batched_tokens=24)
    ref_first, ref_second = run_twice(qwen3_tiny, "torch", prompts, **kwargs)
    first, second = run_twice(qwen3_tiny, "triton", prompts, device="cuda" if torch.cuda.is_available() else "cpu",
                              **kwargs)
    assert [o["token_ids"] for o in first] == [o["token_ids"] for o in ref_first]
    assert [o["token_ids"] for o in second] == [o["token_ids"] for o in ref_second]
    assert [o["num_cached_tokens"] for o in second] == [32, 32, 16]


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_FLASH_ATTN and torch.cuda.is_available()),
                    reason="flash-attn is not installed here (it is an optional CUDA extra)")
def test_flash_attn_backend_matches_torch_end_to_end(qwen3_tiny):
    prompts = random_prompts(200, [300, 20, 257], seed=42)
    kwargs = dict(num_kvcache_blocks=16, block=256, dtype="float32")
    ref = run_twice(qwen3_tiny, "torch", prompts, device="cuda", **kwargs)
    got = run_twice(qwen3_tiny, "flash_attn", prompts, device="cuda", **kwargs)
    assert [o["token_ids"] for o in got[0] + got[1]] == [o["token_ids"] for o in ref[0] + ref[1]]


@pytest.fixture
def installed(monkeypatch):
    """Pretend a set of optional modules is (or is not) installed."""
    present: set[str] = set()
    monkeypatch.setattr(attention, "_installed", lambda module: module in present)
    return present


def test_auto_picks_flash_attn_then_triton_then_torch(installed):
    installed.update({"flash_attn", "triton"})
    assert attention.resolve_backend_name("auto", "cuda", 256) == "flash_attn"
    assert attention.resolve_backend_name("auto", "cuda", 16) == "triton"  # flash-attn can't page by 16
    installed.discard("flash_attn")
    assert attention.resolve_backend_name("auto", "cuda", 256) == "triton"
    installed.clear()
    assert attention.resolve_backend_name("auto", "cuda", 256) == "torch"
    installed.update({"flash_attn", "triton"})
    assert attention.resolve_backend_name("auto", "cpu", 256) == "cpu"  # the in-place kernel (torch if it cannot build)


def test_forcing_a_backend_that_cannot_run_is_a_clear_error(installed, monkeypatch):
    with pytest.raises(ValueError, match="flash_attn is not installed"):
        attention.resolve_backend_name("flash_attn", "cuda", 256)
    installed.add("flash_attn")
    with pytest.raises(ValueError, match="multiple of 256"):
        attention.resolve_backend_name("flash_attn", "cuda", 16)
    with pytest.raises(ValueError, match="CUDA device"):
        attention.resolve_backend_name("flash_attn", "cpu", 256)
    assert attention.resolve_backend_name("flash_attn", "cuda", 512) == "flash_attn"
    with pytest.raises(ValueError, match="triton is not installed"):
        attention.resolve_backend_name("triton", "cuda", 16)
    installed.add("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        attention.resolve_backend_name("triton", "cpu", 16)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert attention.resolve_backend_name("triton", "cpu", 16) == "triton"


def test_choice_is_logged_once(qwen3_tiny, caplog):
    """device="auto" too: the log names what "auto" must choose on the machine the test runs on."""
    with caplog.at_level("INFO", logger="nanovllm"):
        # max_num_seqs=4: on CUDA, a few graph captures rather than nano-vllm's 36.
        llm = LLM(qwen3_tiny, kvcache_block_size=BLOCK, num_kvcache_blocks=8, max_num_seqs=4)
    assert llm.config.device == AUTO_DEVICE
    assert caplog.text.count("attention backend: ") == 1
    assert f"attention backend: {AUTO_BACKEND_SMALL_BLOCKS} (requested 'auto', device {AUTO_DEVICE})" in caplog.text
    llm.exit()
