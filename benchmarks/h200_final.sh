#!/usr/bin/env bash
# One call on one H200 (kind nvidia-h200, .whl carried), after split-K, the fused GELU backward and
# the new TMA configs: GPU tests, the kernel benchmark (and with TMA for every layout), the host-
# overhead probe, and the training rows with the Triton kernels plus a profile of the fastest row.
source benchmarks/device_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t0=$(date +%s)
MPGPT_AUTOTUNE=0 timeout 150 python3 -m pytest -q -p no:cacheprovider -m "gpu or sm80" tests/test_kernels.py tests/test_model.py \
  2>&1 | tee $LOG/gpu_tests.log | tail -3
echo "gpu tests: $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 150 python3 -m mpgpt.bench kernels --out-dir "$OUT" 2>&1 | tee $LOG/kernels.log | grep -v "^\s*$" | tail -22
MPGPT_TRITON_TMA=all timeout 80 python3 -m mpgpt.bench kernels --skip matmul,fused --tag kernels-tma-all --out-dir "$OUT" \
  2>&1 | tee $LOG/kernels_tma_all.log | grep "fwd+bwd"
timeout 60 python3 benchmarks/kernel_probe.py "$OUT/kernel-probe-v2_nvidia-h200_2026-11-30.json" > $LOG/probe.log 2>&1
grep "triton matmul()\|torch.matmul" $LOG/probe.log | cut -c1-160
echo "kernels: $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 230 python3 -m mpgpt.bench train --configs bf16+compile-nobias,bf16+triton,bf16+compile+triton \
  --profile bf16+compile-nobias --warmup 10 --steps 30 --out-dir "$OUT" --tag train-triton 2>&1 | tee $LOG/train.log | grep "tok/s\|rror"
echo "train rows: $(( $(date +%s) - t0 )) s"
tar czf "$OUT/final_logs.tgz" -C /tmp logs
