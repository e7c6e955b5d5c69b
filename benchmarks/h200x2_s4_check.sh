#!/usr/bin/env bash
# Session 4, call 4 (kind nvidia-h200-x2, .whl carried): the distributed tests (gloo and NCCL, both
# GPUs) - not re-run on GPUs since session 2 - and, after them, the kernel GPU tests on the code as
# it stands (session 3's kernel; the stream-K option was removed again).
source benchmarks/device_env.sh
nvidia-smi --query-gpu=index,name,driver_version --format=csv | tee "$LOG/nvidia-smi.txt"
t0=$(date +%s)
timeout 250 python3 -m pytest -q -p no:cacheprovider tests/test_distributed.py 2>&1 | tee "$LOG/dist_tests.log" | tail -4
echo "distributed tests: $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
MPGPT_AUTOTUNE=0 timeout 250 python3 -m pytest -q -p no:cacheprovider -m "sm80 or not sm80" -k "gpu or compiles" tests/test_kernels.py 2>&1 | tee $LOG/gpu_tests.log | tail -4
echo "kernel gpu tests: $(( $(date +%s) - t0 )) s"
tar czf $OUT/logs-s4-call4.tgz -C /tmp logs
