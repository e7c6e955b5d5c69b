#!/usr/bin/env bash
# Session 4, calls 6, 8, 12, 13 and 14: overlap kernel debugging (benchmarks/overlap_diag*.py); call 14 with
# host-built TMA descriptors, then the probe at the two N = 768 shapes if the checks pass.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 150 python3 benchmarks/overlap_diag2.py | tee /tmp/diag.log
if ! grep -q FAULT /tmp/diag.log; then
  for s in attn.c_proj mlp.c_proj; do
    timeout 100 python3 benchmarks/overlap_probe.py --shape=$s "$OUT/overlap-probe-$s.json" 2>&1 | grep -v "Warn\|launching" | tail -9
  done
fi
