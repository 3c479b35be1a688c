#!/usr/bin/env bash
# Second device call: the decode kernel's split count swept by shape, then bench.py at batch 16, 64
# and 256 with the split rule's PROGRAMS_PER_SM at 2 (the code's), 8 and 16, alternating.
start=$(date +%s)
el() { echo $(( $(date +%s) - start )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
d=docs/bench/gpu-2026-11-26d-h200
timeout 90 python3 benchmarks/decode_bandwidth.py --batch 1 4 16 64 128 --context 1024 4096 --splits 1 2 4 8 16 32 > $OUT/sweep.log 2>&1
grep -v '^{' $OUT/sweep.log; echo "== sweep done at $(el) s"
for n in 16 64 256; do for pps in 2 8 16; do
  [ $(el) -lt 200 ] || break 2
  timeout 80 python3 $d/pps_bench.py $pps --synthetic qwen3-0.6b --num-seqs $n --json-out /tmp/b_${n}_$pps.json > /tmp/b_${n}_$pps.log 2>&1
  echo "n=$n pps=$pps $(python3 -c "import json;j=json.load(open('/tmp/b_${n}_$pps.json'));print(j['throughput_tok_s'], j['itl_mean_ms'], j['time_s'])" 2>&1 | tail -1)"
done; done
cat /tmp/b_*.json > $OUT/benches.jsonl; echo "== all done at $(el) s"
