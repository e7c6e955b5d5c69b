#!/usr/bin/env bash
# Session 5, call 8 (kind nvidia-h200), on the final code (kernel="auto" picks the warp-specialised
# kernel by ws_preferred): the kernel GPU tests, the kernel benchmark (the do_bench
# numbers), the eager training rows with and without the Triton layers, and chapter 6 under nbval.
# Call 7 ran the first two steps on the code before ws_preferred (h200_s5_final.sh, commit 13c63fa).
source benchmarks/device_env.sh
t0=$(date +%s)
MPGPT_AUTOTUNE=0 timeout 200 python3 -m pytest -q -p no:cacheprovider -m "sm80 or not sm80" -k "gpu or compiles or ws" tests/test_kernels.py 2>&1 | tee $LOG/gpu_tests.log | tail -3
echo "gpu tests: $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 200 python3 -m mpgpt.bench kernels --out-dir "$OUT" > $LOG/bench.log 2>&1
grep "x)\|wrote\|rror" $LOG/bench.log | cut -c1-220
echo "bench: $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 100 python3 -m mpgpt.bench train --configs bf16,bf16+triton --warmup 10 --steps 30 --out-dir "$OUT" --tag train-triton-s5 2>&1 | tee $LOG/train.log | grep "tok/s\|rror"
echo "train: $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 150 python3 -m pytest -q -p no:cacheprovider --nbval-lax notebooks/06_triton_kernel.ipynb 2>&1 | tee $LOG/nb06.log | tail -3
echo "notebook 06: $(( $(date +%s) - t0 )) s"
tar czf $OUT/logs-s5-call8.tgz -C /tmp logs
