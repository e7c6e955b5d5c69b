#!/usr/bin/env bash
# Session 5, call 6 (kind nvidia-h200): the warp-specialised Gluon kernel with 128 x 192 tiles
# (benchmarks/ws_probe.py): correctness at odd shapes and with all 132 programs, then timings.
source benchmarks/device_env.sh
t0=$(date +%s)
timeout 300 python3 benchmarks/ws_probe.py $OUT/ws-probe_nvidia-h200_$(date +%F).json 2>&1 | tee $LOG/ws_probe.log | grep -v "Warning\|warn"
echo "ws_probe rc ${PIPESTATUS[0]}: $(( $(date +%s) - t0 )) s"
tar czf $OUT/logs-s5-call6.tgz -C /tmp logs
