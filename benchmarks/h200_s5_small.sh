#!/usr/bin/env bash
# Session 5, call 3 (kind nvidia-h200): small tiles (64 x 128 and others) with 2-4 programs per SM
# and cuBLAS at the N = 768 shapes (benchmarks/tma_192.py), graph replay and do_bench.
source benchmarks/device_env.sh
t0=$(date +%s)
timeout 540 python3 benchmarks/tma_192.py $OUT/tma-small_nvidia-h200_$(date +%F).json --small 2>&1 | tee $LOG/tma_192.log | grep -v "^check.*rel err [0-9.e-]*$"
echo "tma_192: $(( $(date +%s) - t0 )) s"
tar czf $OUT/logs-s5-call3.tgz -C /tmp logs
