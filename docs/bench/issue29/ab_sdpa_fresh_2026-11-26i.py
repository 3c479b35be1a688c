import sys, time, random
from nanovllm import LLM, SamplingParams
dtype = sys.argv[1]
llm = LLM("/work/main/checkpoints/qwen3-issue29-real", dtype=dtype, max_model_len=1024)
backend = llm.model_runner.backend
on = backend.sdpa_fresh_dtypes
print("sdpa dtypes on this machine:", on)
rng = random.Random(0)
def prompts(k): return [[rng.randrange(100, 31000) for _ in range(rng.randint(100, 500))] for _ in range(k)]
sp = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
llm.generate(prompts(64), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
res = {"sdpa": [], "kernel": []}
for order in (["sdpa", "kernel"], ["kernel", "sdpa"]) * 3:
    for mode in order:
        backend.sdpa_fresh_dtypes = on if mode == "sdpa" else frozenset()
        backend._steps_meta = None
        p = prompts(64); t = time.perf_counter(); llm.generate(p, sp, use_tqdm=False); dt = time.perf_counter() - t
        res[mode].append(64 * 128 / dt)
for k, v in res.items():
    v.sort(); print(k, [round(x) for x in v], "median", round((v[2] + v[3]) / 2))
llm.exit()
