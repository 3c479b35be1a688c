"""/health latency while a burst of 32 streams runs: engine process vs engine thread (alternating)."""
import asyncio, json, os, re, subprocess, sys, time, statistics
import httpx
CKPT = sys.argv[1]; ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 2
PROMPT = list(range(100, 356))

def start(mode):
    args = [sys.executable, "-m", "nanovllm", "serve", CKPT, "--port", "0", "--dtype", "bfloat16", "--max-model-len", "1024",
            "--log-level", "warning"] + ([] if mode == "process" else ["--no-engine-process"])
    p = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, cwd="/work/main", env={**os.environ, "PYTHONPATH": "/work/main"})
    for line in p.stderr:
        m = re.search(r"listening on (http://\S+)", line)
        if m:
            return p, m.group(1)
    raise RuntimeError("no start")

async def burst(url):
    lat = []
    done = False
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        async def stream(i):
            body = {"model": CKPT, "prompt": PROMPT[i % 50:] , "max_tokens": 128, "ignore_eos": True, "stream": True, "temperature": 0}
            async with c.stream("POST", "/v1/completions", json=body) as r:
                async for _ in r.aiter_lines():
                    pass
        async def poll():
            while not done:
                t = time.perf_counter(); await c.get("/health"); lat.append((time.perf_counter() - t) * 1000)
                await asyncio.sleep(0.02)
        t0 = time.perf_counter()
        poller = asyncio.create_task(poll())
        await asyncio.gather(*(stream(i) for i in range(32)))
        wall = time.perf_counter() - t0
        done = True; await poller
    return wall, lat

for r in range(ROUNDS):
    for mode in (["process", "thread"] if r % 2 == 0 else ["thread", "process"]):
        p, url = start(mode)
        asyncio.run(burst(url))  # warm-up
        wall, lat = asyncio.run(burst(url))
        p.terminate(); p.wait(60)
        lat.sort()
        print(f"{mode:8s} burst {wall:.2f} s, {32*128/wall:.0f} tok/s; /health ms median {statistics.median(lat):.1f} p90 {lat[int(.9*len(lat))]:.1f} max {lat[-1]:.1f} (n={len(lat)})", flush=True)
