"""RSS of `nanovllm batch` against lines done (the batch memory test's job, traced): which part of
the run the growth the H200 showed (123 MB after the first tenth, engine on CPU) comes in.
Usage: python rss_trace.py LABEL LINES [extra CLI flags...]; env passes through."""
import json, os, random, subprocess, sys, time
from pathlib import Path
from nanovllm.testing.synthetic import build_checkpoint

label, lines, extra = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
ck = "/tmp/rss_ck"
if not Path(ck, "config.json").exists():
    build_checkpoint(ck, "qwen3")
rng = random.Random(0)
words = "the quick brown fox jumps over the lazy dog cache block token".split()
inp, out = Path(f"/tmp/rss_{label}.jsonl"), Path(f"/tmp/rss_{label}_out.jsonl")
with open(inp, "w") as f:
    for i in range(lines):
        prompt = " ".join(rng.choice(words) for _ in range(4))
        f.write(json.dumps({"custom_id": f"r{i}", "body": {"prompt": prompt, "max_tokens": 1}}) + "\n")
cmd = [sys.executable, "-m", "nanovllm", "batch", ck, "--input", str(inp), "--output", str(out), "--temperature", "0",
       "--max-num-seqs", "64", "--no-progress", "--kvcache-block-size", "16", "--num-kvcache-blocks", "2048",
       "--device", "cpu", *extra]
env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
t0 = time.monotonic()
proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(f"/tmp/rss_{label}.err", "w"), env=env)
samples, tail, done = [], None, 0
while proc.poll() is None:
    try:
        fields = dict(l.split(":", 1) for l in open(f"/proc/{proc.pid}/status"))
        rss = int(fields["VmRSS"].split()[0])
    except (OSError, KeyError):
        break
    if tail is None and out.exists():
        tail = open(out, "rb")
    if tail is not None:
        done += tail.read().count(b"\n")
    samples.append((round(time.monotonic() - t0, 2), done, rss))
    time.sleep(0.2)
print(f"{label}: rc {proc.wait()}, {time.monotonic() - t0:.1f} s")
marks = {}
for t, d, r in samples:
    marks.setdefault(min(10, d * 10 // lines), (t, d, r))
for k in sorted(marks):
    t, d, r = marks[k]
    print(f"  {label} {d:6d} done at {t:6.1f} s: RSS {r / 1024:7.1f} MiB")
print(json.dumps({"rss_trace": label, "lines": lines, "extra": extra,
                  "samples": samples[:: max(1, len(samples) // 200)]}))
