#!/usr/bin/env bash
# Session 5, call 4 (kind nvidia-h200): where TritonLinear's forward+backward time goes
# (benchmarks/linear_probe.py: wall, host and GPU time per step; the gradient GEMMs alone).
source benchmarks/device_env.sh
t0=$(date +%s)
timeout 500 python3 benchmarks/linear_probe.py $OUT/linear-probe_nvidia-h200_$(date +%F).json 2>&1 | tee $LOG/linear_probe.log | grep -v Warning
echo "linear_probe: $(( $(date +%s) - t0 )) s"
tar czf $OUT/logs-s5-call4.tgz -C /tmp logs
