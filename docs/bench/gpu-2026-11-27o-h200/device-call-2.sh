#!/usr/bin/env bash
# Device call 2, 2026-11-27 (fifteenth session), head 722ec5b + docs: the decode kernel's split
# counts at batches 1-32 (the rule's PROGRAMS_PER_SM), and the batch job's RSS traced against lines
# done (the batch memory test failed in call 1: +123 MB after the first tenth, engine on CPU).
start=$(date +%s)
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
mkdir -p /tmp/r2; d=docs/bench/gpu-2026-11-27o-h200
timeout 60 python3 benchmarks/decode_bandwidth.py --batch 1 4 8 32 --context 1024 4096 --splits 1 2 4 8 16 32 64 > /tmp/r2/decode_bw_splits_small.log 2>&1
grep -E "^ +[0-9]" /tmp/r2/decode_bw_splits_small.log
echo "== splits done at $(( $(date +%s) - start )) s"
timeout 80 python3 $d/rss_trace.py default 25000 > /tmp/r2/rss_default.log 2>&1; grep -v '^{' /tmp/r2/rss_default.log
timeout 70 python3 $d/rss_trace.py torchkernels 25000 --fused-kernels torch > /tmp/r2/rss_torch.log 2>&1; grep -v '^{' /tmp/r2/rss_torch.log
MALLOC_ARENA_MAX=1 timeout 70 python3 $d/rss_trace.py arena1 25000 > /tmp/r2/rss_arena1.log 2>&1; grep -v '^{' /tmp/r2/rss_arena1.log
echo "== rss done at $(( $(date +%s) - start )) s"
tail -3 /tmp/rss_default.err
cp /tmp/rss_*.err /tmp/r2/ 2>/dev/null
tar czf $OUT/results2.tgz -C /tmp r2
