#!/usr/bin/env bash
# Device call 1, 2026-11-26 (ninth session), head 92f778a: gpu_check's parity, decode_bandwidth and
# bench stages on the prefill pruning (keep_rows) for the first time on CUDA; the decode kernel's
# bandwidth at small batches against the eager copy; then bench.py with MIN_TOKENS_PER_SPLIT 256
# against 64, alternated on this one machine.
start=$(date +%s)
left() { echo $(( 400 - ($(date +%s) - start) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site PYTHON=python3 PYTHONUNBUFFERED=1
mkdir -p /tmp/r
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee /tmp/r/nvsmi.txt
(lscpu; grep -m1 '^flags' /proc/cpuinfo) > /tmp/r/cpu.txt 2>&1
git rev-parse HEAD 2>/dev/null | tee /tmp/r/commit.txt
timeout -s INT 280 bash scripts/gpu_check.sh /tmp/r/gc --stages parity,decode_bandwidth,bench 2>&1 | tail -6
echo "== gpu_check done at $(( $(date +%s) - start )) s"
export PYTHONPATH=.:/tmp/site
timeout 40 python3 benchmarks/decode_bandwidth.py --batch 4 16 64 --context 1024 4096 > /tmp/r/decode_bw_small.log 2>&1
tail -12 /tmp/r/decode_bw_small.log
ab() {  # bench.py on the bench stage's checkpoint with MIN_TOKENS_PER_SPLIT = $1
  python3 -c "import sys, runpy, nanovllm.kernels.decode_attention as d; d.MIN_TOKENS_PER_SPLIT = $1; sys.argv = ['bench.py', '--synthetic', 'qwen3-0.6b']; runpy.run_path('bench.py', run_name='__main__')" > /tmp/r/ab-$1-$2.log 2>&1
  echo "split $1 run $2: $(tail -1 /tmp/r/ab-$1-$2.log | grep -o '"\(throughput_tok_s\|time_s\|startup_s\)": [0-9.]*' | tr '\n' ' ')"
}
for i in 1 2; do
  for m in 256 64; do
    [ $(left) -gt 45 ] && timeout $(( $(left) - 5 )) bash -c "$(declare -f ab); ab $m $i"
  done
done
echo "== done at $(( $(date +%s) - start )) s"
tar czf $OUT/results.tgz -C /tmp r
