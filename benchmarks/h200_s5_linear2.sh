#!/usr/bin/env bash
# Session 5, call 5 (kind nvidia-h200): the kernel GPU tests after the layout-policy change (the
# gradient GEMMs on the TMA kernel), then linear_probe.py again with a cProfile of the host path.
source benchmarks/device_env.sh
t0=$(date +%s)
MPGPT_AUTOTUNE=0 timeout 200 python3 -m pytest -q -p no:cacheprovider -m "sm80 or not sm80" -k "gpu or compiles" tests/test_kernels.py 2>&1 | tee $LOG/gpu_tests.log | tail -4
echo "gpu tests: $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 330 python3 benchmarks/linear_probe.py $OUT/linear-probe-v2_nvidia-h200_$(date +%F).json --profile 2>&1 | tee $LOG/linear_probe.log | grep -v Warning
echo "linear_probe: $(( $(date +%s) - t0 )) s"
tar czf $OUT/logs-s5-call5.tgz -C /tmp logs
