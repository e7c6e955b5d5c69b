#!/usr/bin/env bash
# Session 3, call 2 (kind nvidia-h200, .whl carried): with the configs chosen from the variant
# sweep, the kernel GPU tests (every TMA config forced in turn; the lean launch path), the kernel
# benchmark (do_bench, the measure), the host-time probe, and the eager training row
# with the Triton kernels.
source benchmarks/device_env.sh
t0=$(date +%s)
MPGPT_AUTOTUNE=0 timeout 120 python3 -m pytest -q -p no:cacheprovider -m "sm80" tests/test_kernels.py 2>&1 | tee $LOG/gpu_tests.log | tail -4
echo "gpu tests: $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 300 python3 -m mpgpt.bench kernels --out-dir "$OUT" > $LOG/bench.log 2>&1
grep -v "^ " $LOG/bench.log | cut -c1-220 | tail -40
echo "bench: $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 60 python3 benchmarks/kernel_probe.py "$OUT/kernel-probe-v6_nvidia-h200_2026-11-30.json" > $LOG/probe.log 2>&1
grep "triton matmul()\|torch.matmul\|rror" $LOG/probe.log | cut -c1-200
echo "probe: $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 80 python3 -m mpgpt.bench train --configs bf16,bf16+triton --warmup 10 --steps 30 --out-dir "$OUT" --tag train-triton-v4 2>&1 | grep "tok/s\|rror"
echo "train: $(( $(date +%s) - t0 )) s"
tar czf $OUT/logs-s3-call2.tgz -C /tmp logs
