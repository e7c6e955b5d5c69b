#!/usr/bin/env bash
# Session 4, calls 6 and 8: overlap kernel debugging (benchmarks/overlap_diag.py).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 200 python3 benchmarks/overlap_diag.py 12288,768,768,132,1,4 12288,768,768,132,2,4 1024,128,768,1,1,4 \
  12288,768,768,132,3,5 12288,768,768,132,4,6 1000,776,1000,132,1,4/12288,768,768,132,1,4 \
  1000,776,1000,132,2,4/12288,768,768,132,2,4
timeout 100 compute-sanitizer --tool memcheck --target-processes all python3 benchmarks/overlap_diag.py 1024,128,768,1,1,4 2>&1 | head -30
