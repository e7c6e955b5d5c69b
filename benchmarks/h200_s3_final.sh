#!/usr/bin/env bash
# Session 3, call 4 (kind nvidia-h200, .whl carried), on the final code: the kernel GPU tests, the
# kernel benchmark (the do_bench numbers), TritonLinear forward+backward and the eager
# training row with the backward GEMMs on the TMA kernel too (MPGPT_TRITON_TMA=all), and the
# eager training rows with the defaults.
source benchmarks/device_env.sh
t0=$(date +%s)
MPGPT_AUTOTUNE=0 timeout 120 python3 -m pytest -q -p no:cacheprovider -m "sm80" tests/test_kernels.py 2>&1 | tee $LOG/gpu_tests.log | tail -4
echo "gpu tests: $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 200 python3 -m mpgpt.bench kernels --out-dir "$OUT" > $LOG/bench.log 2>&1
grep "x)" $LOG/bench.log | cut -c1-200
echo "bench: $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
MPGPT_TRITON_TMA=all timeout 60 python3 -m mpgpt.bench kernels --skip matmul,fused --tag kernels-linear-tma-all --out-dir "$OUT" 2>&1 | grep "fwd+bwd"
timeout 70 python3 -m mpgpt.bench train --configs bf16,bf16+triton --warmup 10 --steps 30 --out-dir "$OUT" --tag train-triton-v5 2>&1 | grep "tok/s\|rror"
MPGPT_TRITON_TMA=all timeout 50 python3 -m mpgpt.bench train --configs bf16+triton --warmup 10 --steps 30 --out-dir "$OUT" --tag train-triton-tma-all 2>&1 | grep "tok/s\|rror"
echo "linear + train: $(( $(date +%s) - t0 )) s"
tar czf $OUT/logs-s3-call4.tgz -C /tmp logs
