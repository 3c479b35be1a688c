#!/usr/bin/env bash
# One device call, 2026-11-26 (seventh session), head 0a98b53: gpu_check's measuring stages (bench.py
# now with MIN_TOKENS_PER_SPLIT 64), then pytest on CUDA for what never ran on a GPU: the 13 tests
# fixed on CPU after the H100 run, the three OpenAI-client files (wheels carried), the files never
# run there; alongside, the CPU-kernel test files on this machine's (other) CPU, with CUDA hidden.
start=$(date +%s)
left() { echo $(( 565 - ($(date +%s) - start) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site PYTHON=python3 PYTHONUNBUFFERED=1
mkdir -p /tmp/r
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee /tmp/r/nvsmi.txt
(lscpu; grep -m1 '^flags' /proc/cpuinfo; which g++ c++; g++ --version) > /tmp/r/cpu.txt 2>&1
grep -m1 'Model name' /tmp/r/cpu.txt; grep -o -w 'avx2\|avx512f\|avx512_bf16\|amx_bf16' /tmp/r/cpu.txt | sort -u | tr '\n' ' '; echo
git rev-parse HEAD 2>/dev/null | tee /tmp/r/commit.txt
timeout -s INT 320 bash scripts/gpu_check.sh /tmp/r/gc --stages parity,decode_bandwidth,bench,step_profile 2>&1 | tail -9
echo "== gpu_check done at $(( $(date +%s) - start )) s"
export PYTHONPATH=.:/tmp/site
t=$(( $(left) - 10 ))
CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=2 timeout -s INT $t python3 -m pytest -q -p no:cacheprovider -n 5 -rfE \
  tests/test_cpu_paged_attention.py tests/test_cpu_linear.py tests/test_cpu_fused_kernels.py tests/test_cpu_decode.py \
  tests/test_cpu_compile_once.py tests/test_cpu_kernel_isa_builds.py tests/test_vs_vllm_cpu.py > /tmp/r/pytest-cpu.log 2>&1 &
timeout -s INT $t python3 -m pytest -q -p no:cacheprovider -rfE --durations=10 \
  tests/test_torch_attention.py::test_engine_greedy_equals_hf_and_logprobs_equal_the_oracle \
  tests/test_torch_attention.py::test_engine_on_cpu_defaults_equals_hf_greedy \
  tests/test_torch_attention.py::test_engine_applies_cpu_threads_and_malloc_tuning \
  tests/test_batch_scale.py::test_memory_stays_flat_over_a_long_input \
  tests/test_batch_scale.py::test_data_parallel_equals_single_engine \
  tests/test_sampling_pipeline.py::test_sampler_triton_race_and_verifier_apply_the_same_pipeline \
  tests/test_openai_server.py tests/test_tool_calling.py tests/test_openai_fidelity.py \
  tests/test_server_faults.py tests/test_cli.py tests/test_tensor_parallel.py tests/test_gpu_check.py \
  tests/test_kernels_compile.py tests/test_readme.py tests/test_server_fuzz.py tests/test_chat_ui.py \
  tests/test_lm_eval.py > /tmp/r/pytest-gpu.log 2>&1
echo "== gpu pytest done at $(( $(date +%s) - start )) s"; tail -25 /tmp/r/pytest-gpu.log
wait; echo "== cpu pytest done at $(( $(date +%s) - start )) s"; tail -12 /tmp/r/pytest-cpu.log
tar czf $OUT/results.tgz -C /tmp r
