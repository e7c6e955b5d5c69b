#!/usr/bin/env bash
# Session 4, call 7: which launch of overlap_probe.py's correctness pass faults (verbose, blocking launches).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
CUDA_LAUNCH_BLOCKING=1 timeout 150 python3 benchmarks/overlap_probe.py --verbose 2>&1 | grep -v Warn | grep -B3 -A3 "Error\|WRONG\|checked" | head -40
