#!/usr/bin/env bash
# Session 3, call 3 (kind nvidia-h200, .whl carried): with 192-row tiles (EXTRA_M) in the TMA
# configs: the kernel GPU tests, the focused variant sweep (--extra), the kernel benchmark again,
# and chapter 6 executed on the GPU (a copy; its CPU outputs stay committed).
source benchmarks/device_env.sh
t0=$(date +%s)
MPGPT_AUTOTUNE=0 timeout 120 python3 -m pytest -q -p no:cacheprovider -m "sm80" tests/test_kernels.py 2>&1 | tee $LOG/gpu_tests.log | tail -4
echo "gpu tests: $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 150 python3 benchmarks/tma_variants.py "$OUT/tma-variants-extra_nvidia-h200_2026-11-30.json" --extra > $LOG/variants.log 2>&1
grep -v '^{' $LOG/variants.log | cut -c1-200 | head -50
echo "variants: $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 200 python3 -m mpgpt.bench kernels --out-dir "$OUT" > $LOG/bench.log 2>&1
tail -12 $LOG/bench.log | cut -c1-200
echo "bench: $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
mkdir -p nbgpu && cp notebooks/06_triton_kernel.ipynb nbgpu/
timeout 200 python3 scripts/run_notebook.py nbgpu/06_triton_kernel.ipynb > $LOG/ch6.log 2>&1; echo "ch6 exit $?" >> $LOG/ch6.log
tail -3 $LOG/ch6.log; cp nbgpu/06_triton_kernel.ipynb $LOG/
echo "ch6: $(( $(date +%s) - t0 )) s"
tar czf $OUT/logs-s3-call3.tgz -C /tmp logs
