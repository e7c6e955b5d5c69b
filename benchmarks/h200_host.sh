#!/usr/bin/env bash
# One H200 (kind nvidia-h200, .whl carried): after caching the device-capability checks, the kernel
# GPU tests again, the host-time probe with a cProfile breakdown, TritonLinear forward+backward,
# and the eager training row with the Triton kernels.
source benchmarks/device_env.sh
t0=$(date +%s)
MPGPT_AUTOTUNE=0 timeout 100 python3 -m pytest -q -p no:cacheprovider -m "sm80" tests/test_kernels.py 2>&1 | tee $LOG/gpu_tests.log | tail -1
echo "gpu tests: $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 70 python3 benchmarks/kernel_probe.py "$OUT/kernel-probe-v4_nvidia-h200_2026-11-30.json" --host-profile > $LOG/probe.log 2>&1
grep "triton matmul()\|torch.matmul" $LOG/probe.log | cut -c1-170; grep -A32 "Ordered by" $LOG/probe.log | cut -c1-150
timeout 60 python3 -m mpgpt.bench kernels --skip matmul,fused --tag kernels-linear-v3 --out-dir "$OUT" 2>&1 | grep "fwd+bwd"
timeout 60 python3 -m mpgpt.bench train --configs bf16+triton --warmup 10 --steps 30 --out-dir "$OUT" --tag train-triton-v3 2>&1 | grep "tok/s\|rror"
echo "probe + bench: $(( $(date +%s) - t0 )) s"
cp $LOG/probe.log $OUT/probe-v4.log
