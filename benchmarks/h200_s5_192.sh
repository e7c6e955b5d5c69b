#!/usr/bin/env bash
# Session 5, call 2 (kind nvidia-h200): 128 x 192 tiles (EXTRA_N = 64) against the current tiles
# and cuBLAS at the N = 768 shapes (benchmarks/tma_192.py), graph replay and do_bench.
source benchmarks/device_env.sh
t0=$(date +%s)
timeout 540 python3 benchmarks/tma_192.py $OUT/tma-192_nvidia-h200_$(date +%F).json 2>&1 | tee $LOG/tma_192.log | grep -v "^check.*rel err [0-9.e-]*$"
echo "tma_192: $(( $(date +%s) - t0 )) s"
tar czf $OUT/logs-s5-call2.tgz -C /tmp logs
