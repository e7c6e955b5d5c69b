#!/usr/bin/env bash
# Session 4, call 5 (kind nvidia-h200, .whl carried): the overlapped-epilogue Gluon kernel's first
# run: correctness of every variant, then times against cuBLAS and the Triton TMA kernel.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; LOG=/tmp/logs; mkdir -p $LOG
export PYTHONPATH=$PWD
t0=$(date +%s)
timeout 400 python3 benchmarks/overlap_probe.py "$OUT/overlap-probe.json" 2>&1 | tee $LOG/overlap.log | grep -v Warn
echo "probe: $(( $(date +%s) - t0 )) s"
tar czf $OUT/logs-s4-call5.tgz -C /tmp logs
