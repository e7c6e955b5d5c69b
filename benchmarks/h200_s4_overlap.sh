#!/usr/bin/env bash
# Session 4, calls 5, 9 and 11 (kind nvidia-h200), at commits 2af3d68, d12614f and 108fcfc: the overlapped-
# epilogue Gluon kernel (mpgpt/kernels/overlap.py, since removed): correctness, then times; one process a shape.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; LOG=/tmp/logs; mkdir -p $LOG
export PYTHONPATH=$PWD
t0=$(date +%s)
for s in attn.c_proj mlp.c_proj c_attn c_fc odd; do
  timeout 100 python3 benchmarks/overlap_probe.py --shape=$s "$OUT/overlap-probe-$s.json" 2>&1 | tee $LOG/overlap-$s.log | grep -v "Warn\|launching" | tail -7
done
echo "probe: $(( $(date +%s) - t0 )) s"
tar czf $OUT/logs-s4-call11.tgz -C /tmp logs
