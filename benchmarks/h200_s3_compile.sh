#!/usr/bin/env bash
# Session 3, call 5 (kind nvidia-h200, .whl carried): TritonLinear's kernels as custom operators
# (mpgpt/kernels/ops.py). The kernel GPU tests and the one-graph compile test on the GPU, then the
# compiled training rows with and without the Triton layers.
source benchmarks/device_env.sh
t0=$(date +%s)
MPGPT_AUTOTUNE=0 timeout 120 python3 -m pytest -q -p no:cacheprovider -m "sm80 or not sm80" -k "gpu or compiles" tests/test_kernels.py 2>&1 | tee $LOG/gpu_tests.log | tail -4
echo "gpu tests: $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 200 python3 -m mpgpt.bench train --configs bf16+compile,bf16+compile+triton --warmup 10 --steps 30 --out-dir "$OUT" --tag train-compile-triton 2>&1 | tee $LOG/train.log | grep "tok/s\|rror\|break"
echo "train: $(( $(date +%s) - t0 )) s"
tar czf $OUT/logs-s3-call5.tgz -C /tmp logs
