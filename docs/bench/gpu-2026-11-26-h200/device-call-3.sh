#!/usr/bin/env bash
# Third device call: the CUDA-relevant test files again, with opentelemetry carried (fastapi 0.165 imports it).
start=$(date +%s)
left() { echo $(( 470 - ($(date +%s) - start) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site PYTHON=python3 PYTHONUNBUFFERED=1
mkdir -p /tmp/gc
true
true
echo "== parity done at $(( $(date +%s) - start )) s"
t=$(( $(left) - 5 ))
PYTHONPATH=.:/tmp/site timeout -s INT $t python3 -m pytest -q -p no:cacheprovider -rfE --durations=15 --continue-on-collection-errors \
  tests/test_fused_kernels.py tests/test_kernels.py tests/test_kv_cache_fp8_kernels.py tests/test_fused_moe.py \
  tests/test_cuda_path.py tests/test_compile_once.py tests/test_api.py tests/test_attention_backends.py \
  tests/test_prompt_logprobs.py tests/test_structured_outputs.py tests/test_scheduling_parity.py \
  tests/test_sampling.py tests/test_parity.py > $OUT/pytest.log 2>&1
tail -60 $OUT/pytest.log
echo "== all done at $(( $(date +%s) - start )) s"
