#!/usr/bin/env bash
# Session 4, calls 6 and 8: overlap kernel debugging (benchmarks/overlap_diag.py).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 200 python3 benchmarks/overlap_diag2.py
