#!/usr/bin/env bash
# Session 3, call 1 (kind nvidia-h200, .whl carried): the kernel GPU tests (new: the lean launch
# path), the TMA-kernel variant sweep (benchmarks/tma_variants.py) and the host-time probe with
# the lean launch path.
source benchmarks/device_env.sh
t0=$(date +%s)
MPGPT_AUTOTUNE=0 timeout 150 python3 -m pytest -q -p no:cacheprovider -m "sm80" tests/test_kernels.py 2>&1 | tee $LOG/gpu_tests.log | tail -4
echo "gpu tests: $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 300 python3 benchmarks/tma_variants.py "$OUT/tma-variants_nvidia-h200_2026-11-30.json" > $LOG/variants.log 2>&1
grep -v '^{' $LOG/variants.log | cut -c1-200 | head -70
echo "variants: $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 90 python3 benchmarks/kernel_probe.py "$OUT/kernel-probe-v5_nvidia-h200_2026-11-30.json" --host-profile > $LOG/probe.log 2>&1
grep "triton matmul()\|torch.matmul\|_matmul_2d\|rror" $LOG/probe.log | cut -c1-200; grep -A22 "Ordered by" $LOG/probe.log | cut -c1-150
echo "probe: $(( $(date +%s) - t0 )) s"
tar czf $OUT/logs-s3-call1.tgz -C /tmp logs
