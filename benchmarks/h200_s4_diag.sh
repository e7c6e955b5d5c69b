#!/usr/bin/env bash
# Session 4, calls 6, 8, 12-15: overlap kernel debugging (benchmarks/overlap_diag*.py).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 200 python3 benchmarks/overlap_diag.py 640,128,768,1,2,4 768,128,768,1,2,4 896,128,768,1,2,4 \
  67584,128,768,132,2,4 84480,128,768,132,2,4 16896,128,768,132,2,4 33792,128,768,132,2,4 \
  12288,768,768,132,2,4 12288,768,768,66,2,4 2>&1 | grep -v Warn
