#!/usr/bin/env bash
# One H200 (kind nvidia-h200, .whl carried): the tiny-GPT tracking test again, the kernel benchmark
# (default TMA use, then TMA for every layout in TritonLinear's backward too) and the host probe.
source benchmarks/device_env.sh
t0=$(date +%s)
MPGPT_AUTOTUNE=0 timeout 90 python3 -m pytest -q -p no:cacheprovider -s tests/test_kernels.py -k "tiny_gpt or split_k" \
  2>&1 | tee $LOG/gpu_tests.log | grep "tiny GPT\|passed\|failed"
echo "gpu tests: $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 170 python3 -m mpgpt.bench kernels --out-dir "$OUT" 2>&1 | tee $LOG/kernels.log | grep -v "^\s*$" | tail -22
MPGPT_TRITON_TMA=all timeout 80 python3 -m mpgpt.bench kernels --skip matmul,fused --tag kernels-tma-all --out-dir "$OUT" \
  2>&1 | tee $LOG/kernels_tma_all.log | grep "fwd+bwd"
timeout 60 python3 benchmarks/kernel_probe.py "$OUT/kernel-probe-v3_nvidia-h200_2026-11-30.json" > $LOG/probe.log 2>&1
grep "triton matmul()\|torch.matmul" $LOG/probe.log | cut -c1-170
echo "kernels: $(( $(date +%s) - t0 )) s"
tar czf "$OUT/kernels_logs.tgz" -C /tmp logs
