"""bench.py with the decode kernel's PROGRAMS_PER_SM set first: python pps_bench.py PPS [bench.py flags]."""
import runpy
import sys

import nanovllm.kernels.decode_attention as decode_attention

decode_attention.PROGRAMS_PER_SM = int(sys.argv.pop(1))
sys.argv[0] = "bench.py"
runpy.run_path("bench.py", run_name="__main__")
