#!/usr/bin/env bash
# Device call 2, 2026-11-26 (ninth session), head 92f778a: pytest on CUDA for the files never
# finished there (the rest of test_tensor_parallel, test_gpu_check, test_kernels_compile,
# test_readme, test_lm_eval; test_chat_ui / test_server_fuzz with their wheels carried), the
# tool-calling file since its parallel-calls test was split, and the batch memory test again.
start=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=.:/tmp/site PYTHON=python3 PYTHONUNBUFFERED=1
mkdir -p /tmp/r2
git rev-parse HEAD 2>/dev/null | tee /tmp/r2/commit.txt
timeout -s INT 330 python3 -m pytest -q -p no:cacheprovider -rfE --durations=12 \
  tests/test_tensor_parallel.py tests/test_tool_calling.py tests/test_gpu_check.py tests/test_kernels_compile.py \
  tests/test_lm_eval.py tests/test_readme.py tests/test_batch_scale.py::test_memory_stays_flat_over_a_long_input \
  tests/test_chat_ui.py tests/test_server_fuzz.py tests/test_cli.py::test_ui_options_are_streamlits_and_the_command_is_run \
  > /tmp/r2/pytest-gpu.log 2>&1
echo "== pytest done at $(( $(date +%s) - start )) s"; tail -40 /tmp/r2/pytest-gpu.log
tar czf $OUT/results2.tgz -C /tmp r2
