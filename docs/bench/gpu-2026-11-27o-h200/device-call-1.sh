#!/usr/bin/env bash
# Device call 1, 2026-11-27 (fifteenth session), head 722ec5b: gpu_check's parity and
# decode_bandwidth stages on the code of sessions 10-14 (first time on CUDA); bench.py without HF
# (throughput on this head); the decode kernel at batch 16 across split counts (PROGRAMS_PER_SM > 2
# never measured); then pytest on CUDA for the files never finished there: test_server_fuzz,
# test_chat_ui, the batch memory test, the rest of test_readme, test_engine_loop (the engine process).
start=$(date +%s)
left() { echo $(( 540 - ($(date +%s) - start) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site PYTHON=python3 PYTHONUNBUFFERED=1
mkdir -p /tmp/r
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee /tmp/r/nvsmi.txt
(lscpu; grep -m1 '^flags' /proc/cpuinfo) > /tmp/r/cpu.txt 2>&1
git rev-parse HEAD 2>/dev/null | tee /tmp/r/commit.txt
timeout -s INT 150 bash scripts/gpu_check.sh /tmp/r/gc --stages parity,decode_bandwidth 2>&1 | tail -5
echo "== gpu_check done at $(( $(date +%s) - start )) s"
export PYTHONPATH=.:/tmp/site
timeout 110 python3 bench.py --synthetic qwen3-0.6b > /tmp/r/bench.log 2>&1
echo "bench: $(tail -1 /tmp/r/bench.log | grep -o '"\(throughput_tok_s\|time_s\|startup_s\)": [0-9.]*' | tr '\n' ' ')"
echo "== bench done at $(( $(date +%s) - start )) s"
timeout 50 python3 benchmarks/decode_bandwidth.py --batch 16 --context 1024 4096 --splits 1 2 4 8 16 32 > /tmp/r/decode_bw_splits.log 2>&1
tail -16 /tmp/r/decode_bw_splits.log
echo "== splits done at $(( $(date +%s) - start )) s; pytest gets $(( $(left) - 15 )) s"
timeout -s INT $(( $(left) - 15 )) python3 -m pytest -q -p no:cacheprovider -rfE --durations=12 \
  tests/test_server_fuzz.py tests/test_chat_ui.py tests/test_batch_scale.py::test_memory_stays_flat_over_a_long_input \
  tests/test_readme.py tests/test_engine_loop.py > /tmp/r/pytest-gpu.log 2>&1
echo "== pytest done at $(( $(date +%s) - start )) s"; tail -30 /tmp/r/pytest-gpu.log
tar czf $OUT/results.tgz -C /tmp r
