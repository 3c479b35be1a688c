"""An engine's life (CPU): a dropped LLM is freed by the garbage collector (its exit hook holds it
weakly), so making and dropping engines does not grow memory; `with LLM(...)` frees on leaving;
after exit() every public method raises one clear RuntimeError before doing any work."""
import gc
import os
import weakref

import pytest

from helpers import greedy
from nanovllm import LLM

BLOCK = 16
# A KV cache big enough that keeping one alive per cycle would stand far above allocator noise.
KV_CACHE_TARGET_BYTES = 96 << 20
CYCLES = 5
WARMUP_CYCLES = 2


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def kv_cache_bytes(llm: LLM) -> int:
    cache = llm.model_runner.kv_cache
    return cache.numel() * cache.element_size()


def use_and_drop(path: str, num_blocks: int) -> tuple[weakref.ref, int]:
    """Make an engine, use every way of calling it (leaving a stream open and an online request
    unread), and drop it without exit(). Returns a weak reference to it and its cache size."""
    llm = LLM(path, device="cpu", kvcache_block_size=BLOCK, num_kvcache_blocks=num_blocks, max_model_len=256)
    llm.generate([[1, 2, 3]], greedy(6), use_tqdm=False)
    stream = llm.stream([[4, 5, 6], "hello"], greedy(20))
    next(stream)
    llm.add_request([7, 8], greedy(6))
    llm.step()
    llm.chat([{"role": "user", "content": "hi"}], greedy(2), use_tqdm=False)
    return weakref.ref(llm), kv_cache_bytes(llm)


@pytest.fixture(scope="module")
def blocks_for_target(qwen3_tiny) -> int:
    with LLM(qwen3_tiny, device="cpu", kvcache_block_size=BLOCK, num_kvcache_blocks=16, max_model_len=256) as probe:
        block_bytes = kv_cache_bytes(probe) // 16
    return KV_CACHE_TARGET_BYTES // block_bytes


def test_dropped_engine_is_freed_by_gc(qwen3_tiny):
    ref, _ = use_and_drop(qwen3_tiny, 64)
    gc.collect()
    assert ref() is None, f"still referred to by {[type(r).__name__ for r in gc.get_referrers(ref())]}"


def test_make_and_drop_does_not_grow_memory(qwen3_tiny, blocks_for_target):
    # Warm-up cycles: the first loads what stays loaded; with cpu_malloc_tuning glibc keeps freed
    # memory for reuse (never returned to the OS), so the heap grows towards its peak and stays.
    # A leak grows with every cycle after that.
    for _ in range(WARMUP_CYCLES):
        ref, cache_bytes = use_and_drop(qwen3_tiny, blocks_for_target)
        gc.collect()
        assert ref() is None and cache_bytes >= KV_CACHE_TARGET_BYTES * 0.9
    before = rss_bytes()
    for _ in range(CYCLES):
        ref, _ = use_and_drop(qwen3_tiny, blocks_for_target)
        gc.collect()
        assert ref() is None
    growth = rss_bytes() - before
    # Engines leaked by every cycle would add CYCLES caches. Allowed: one and a half, for the
    # allocator extending its heap once more when a free region was split by small allocations
    # (measured in the full suite: exactly one cache once, with one warm-up cycle).
    assert growth < 1.5 * cache_bytes, \
        f"RSS grew {growth >> 20} MiB over {CYCLES} cycles ({cache_bytes >> 20} MiB cache)"


def test_with_form_frees_on_leaving(qwen3_tiny):
    with LLM(qwen3_tiny, device="cpu", kvcache_block_size=BLOCK, num_kvcache_blocks=32) as llm:
        out = llm.generate([[1, 2, 3]], greedy(6), use_tqdm=False)
        assert len(out[0]["token_ids"]) == 6
    assert llm.model_runner.kv_cache is None
    with pytest.raises(RuntimeError, match="exited"):
        llm.generate([[1, 2, 3]], greedy(6), use_tqdm=False)
    # Leaving through an exception frees it too, and the exception goes on.
    with pytest.raises(KeyError):
        with LLM(qwen3_tiny, device="cpu", kvcache_block_size=BLOCK, num_kvcache_blocks=32) as failing:
            raise KeyError("in the block")
    assert failing.model_runner.kv_cache is None


def test_every_call_after_exit_raises_before_any_work(qwen3_tiny):
    llm = LLM(qwen3_tiny, device="cpu", kvcache_block_size=BLOCK, num_kvcache_blocks=32)
    rid = llm.add_request([1, 2, 3], greedy(6))
    open_stream = llm.stream([[4, 5]], greedy(6))
    next(open_stream)
    llm.exit()
    llm.exit()  # idempotent
    assert llm.model_runner.kv_cache is None
    calls = {
        # Bad arguments too: the exit is reported first, before any validation or queueing.
        "generate": lambda: llm.generate([[]], "not params", use_tqdm=False),
        "stream": lambda: llm.stream([[1, 2]], greedy(6)),
        "chat": lambda: llm.chat([{"role": "user", "content": "hi"}]),
        "add_request": lambda: llm.add_request([1, 2], greedy(6)),
        "step": llm.step,
        "abort": lambda: llm.abort(rid),
        "pop_output": lambda: llm.pop_output(rid),
        "open stream": lambda: next(open_stream),
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match="exited") as error:
            call()
        assert "exit()" in str(error.value), name
    open_stream.close()
