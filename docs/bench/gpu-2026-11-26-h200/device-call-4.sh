#!/usr/bin/env bash
start=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
timeout -s INT 90 python3 -m pytest -q -p no:cacheprovider -rfEs tests/test_fused_kernels.py tests/test_compile_once.py \
  tests/test_scheduling_parity.py -k "launches or compile or fused_kernels_without or triton_backend" > $OUT/pytest3.log 2>&1
tail -25 $OUT/pytest3.log
echo "== tests done at $(( $(date +%s) - start )) s"
t=$(( 195 - ($(date +%s) - start) ))
[ $t -gt 50 ] && timeout -s INT $t python3 bench.py --synthetic qwen3-0.6b --enforce-eager --json-out $OUT/bench_eager.json > $OUT/bench_eager.log 2>&1
tail -22 $OUT/bench_eager.log
echo "== all done at $(( $(date +%s) - start )) s"
