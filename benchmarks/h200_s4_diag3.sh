#!/usr/bin/env bash
# Session 4, call 10: the overlap kernel's fault under compute-sanitizer (memcheck), as overlap_probe.py runs it.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 200 compute-sanitizer --tool memcheck --print-limit 5 python3 benchmarks/overlap_probe.py --shape=attn.c_proj 2>&1 | grep -v "^\s*$\|Warn" | head -60
