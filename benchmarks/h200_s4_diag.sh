#!/usr/bin/env bash
# Session 4, call 6: overlap kernel debugging (benchmarks/overlap_diag.py); compute-sanitizer if present.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 200 python3 benchmarks/overlap_diag.py
which compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -2
