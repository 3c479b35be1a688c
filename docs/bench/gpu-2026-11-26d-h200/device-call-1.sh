#!/usr/bin/env bash
# One device call, 2026-11-26 (fourth session): gpu_check's four measuring stages on the current
# head, then what the first H200 run left unmeasured (batch 1/16 latency, async scheduling off,
# decode bandwidth at batch 16 and 4), then CUDA test files not run on a GPU before.
start=$(date +%s)
left() { echo $(( 570 - ($(date +%s) - start) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site PYTHON=python3 PYTHONUNBUFFERED=1
mkdir -p /tmp/r
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee /tmp/r/nvsmi.txt
timeout -s INT 330 bash scripts/gpu_check.sh /tmp/r/gc --stages parity,decode_bandwidth,bench,step_profile 2>&1 | tail -12
echo "== gpu_check done at $(( $(date +%s) - start )) s"
export PYTHONPATH=.:/tmp/site
for b in "16 1024" "4 4096" "16 4096"; do set -- $b
  timeout 30 python3 benchmarks/decode_bandwidth.py --batch $1 --context $2 > /tmp/r/bw_$1_$2.log 2>&1; tail -1 /tmp/r/bw_$1_$2.log; done
echo "== bandwidth done at $(( $(date +%s) - start )) s"
for a in "n1 --num-seqs 1" "n16 --num-seqs 16" "async_off --async-scheduling off"; do set -- $a; n=$1; shift
  [ $(left) -gt 150 ] || break
  timeout 60 python3 bench.py --synthetic qwen3-0.6b "$@" --json-out /tmp/r/bench_$n.json > /tmp/r/bench_$n.log 2>&1
  echo "$n: $(tail -c 600 /tmp/r/bench_$n.json)"; done
echo "== benches done at $(( $(date +%s) - start )) s"
t=$(( $(left) - 15 ))
timeout -s INT $t python3 -m pytest -q -p no:cacheprovider -rfE --durations=10 \
  tests/test_async_scheduling.py tests/test_kv_cache_fp8.py tests/test_speculative.py tests/test_models.py \
  tests/test_engine_loop.py tests/test_add_requests.py tests/test_lifetime.py tests/test_step_profile.py \
  tests/test_engine_units.py tests/test_scheduling.py tests/test_bench.py > /tmp/r/pytest.log 2>&1
tail -30 /tmp/r/pytest.log
echo "== all done at $(( $(date +%s) - start )) s"
tar czf $OUT/results.tgz -C /tmp r
