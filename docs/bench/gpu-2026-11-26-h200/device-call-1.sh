#!/usr/bin/env bash
# One device call, 2026-11-26: gpu_check's four measuring stages, an FP8-KV bench, the CUDA tests.
start=$(date +%s)
left() { echo $(( 575 - ($(date +%s) - start) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site PYTHON=python3 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee $OUT/nvsmi.txt
python3 -c "import xgrammar, torch, triton, transformers; print('xgrammar', xgrammar.__version__, 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
mkdir -p /tmp/gc
timeout -s INT 420 bash scripts/gpu_check.sh /tmp/gc --stages parity,decode_bandwidth,bench,step_profile 2>&1 | tail -40
echo "== gpu_check done at $(( $(date +%s) - start )) s"
tar czf $OUT/gpu_check.tgz -C /tmp gc
t=$(( $(left) - 125 )); [ $t -gt 120 ] && t=120
if [ $t -gt 40 ]; then
  PYTHONPATH=.:/tmp/site timeout -s INT $t python3 bench.py --synthetic qwen3-0.6b --kv-cache-dtype fp8_e4m3 --json-out $OUT/bench_fp8.json > $OUT/bench_fp8.log 2>&1
  tail -25 $OUT/bench_fp8.log
fi
echo "== fp8 done at $(( $(date +%s) - start )) s"
t=$(( $(left) - 5 ))
PYTHONPATH=.:/tmp/site timeout -s INT $t python3 -m pytest -q -p no:cacheprovider -rfE \
  tests/test_kernels.py tests/test_fused_kernels.py tests/test_kv_cache_fp8_kernels.py tests/test_fused_moe.py \
  tests/test_compile_once.py tests/test_api.py tests/test_attention_backends.py tests/test_scheduling_parity.py \
  tests/test_prompt_logprobs.py tests/test_structured_outputs.py tests/test_sampling.py > $OUT/pytest.log 2>&1
tail -40 $OUT/pytest.log
echo "== all done at $(( $(date +%s) - start )) s"
