#!/usr/bin/env bash
# Session 5, call 7 (kind nvidia-h200): the kernel GPU tests with the warp-specialised kernel in
# the package, then the kernel benchmark (grouped, tma, ws, auto; the do_bench numbers).
source benchmarks/device_env.sh
t0=$(date +%s)
MPGPT_AUTOTUNE=0 timeout 200 python3 -m pytest -q -p no:cacheprovider -m "sm80 or not sm80" -k "gpu or compiles or ws" tests/test_kernels.py 2>&1 | tee $LOG/gpu_tests.log | tail -6
echo "gpu tests: $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 330 python3 -m mpgpt.bench kernels --out-dir "$OUT" > $LOG/bench.log 2>&1
grep "x)\|wrote\|rror" $LOG/bench.log | cut -c1-220
echo "bench: $(( $(date +%s) - t0 )) s"
tar czf $OUT/logs-s5-call7.tgz -C /tmp logs
