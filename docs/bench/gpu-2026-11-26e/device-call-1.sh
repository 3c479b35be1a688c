#!/usr/bin/env bash
# One device call, 2026-11-26 (fifth session), commit 38ac0c2: gpu_check's four measuring stages,
# the decode kernel's split sweep timed by CUDA graph replay (the second H200 run's eager sweep
# timed launches), bench.py at float32 against HF, then CUDA test files never run on a GPU.
start=$(date +%s)
left() { echo $(( 560 - ($(date +%s) - start) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site PYTHON=python3 PYTHONUNBUFFERED=1
mkdir -p /tmp/r
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee /tmp/r/nvsmi.txt
git rev-parse HEAD 2>/dev/null | tee /tmp/r/commit.txt
timeout -s INT 340 bash scripts/gpu_check.sh /tmp/r/gc --stages parity,decode_bandwidth,bench,step_profile 2>&1 | tail -14
echo "== gpu_check done at $(( $(date +%s) - start )) s"
export PYTHONPATH=.:/tmp/site
timeout 100 python3 benchmarks/decode_bandwidth.py --batch 1 4 16 64 --context 1024 4096 --splits 1 2 4 8 16 32 > /tmp/r/sweep.log 2>&1
grep -v '^{' /tmp/r/sweep.log | tail -60; echo "== sweep done at $(( $(date +%s) - start )) s"
if [ $(left) -gt 230 ]; then
  timeout 150 python3 bench.py --synthetic qwen3-0.6b --dtype float32 --compare-hf --json-out /tmp/r/bench_fp32.json > /tmp/r/bench_fp32.log 2>&1
  tail -16 /tmp/r/bench_fp32.log
fi
echo "== fp32 bench done at $(( $(date +%s) - start )) s"
t=$(( $(left) - 15 ))
timeout -s INT $t python3 -m pytest -q -p no:cacheprovider -rfE --durations=10 \
  tests/test_sampling_pipeline.py tests/test_torch_attention.py tests/test_fuzz_sampling.py tests/test_batch.py \
  tests/test_openai_server.py tests/test_openai_fidelity.py tests/test_tool_calling.py tests/test_request_faults.py \
  tests/test_detokenizer.py tests/test_stop_checker.py tests/test_param_errors.py tests/test_checked_inputs.py \
  tests/test_runner_protocol.py tests/test_batch_faults.py > /tmp/r/pytest.log 2>&1
tail -30 /tmp/r/pytest.log
echo "== all done at $(( $(date +%s) - start )) s"
tar czf $OUT/results.tgz -C /tmp r
