#!/usr/bin/env bash
# Session 4, calls 6, 8, 12-16: overlap kernel debugging (benchmarks/overlap_diag*.py); call 16: racecheck, synccheck.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
cat > /tmp/one.py <<'PY'
import torch
from mpgpt.kernels.overlap import matmul_overlap
a = torch.randn(67584, 768, device="cuda", dtype=torch.bfloat16); w = torch.randn(128, 768, device="cuda", dtype=torch.bfloat16)
c = torch.empty(67584, 128, device="cuda", dtype=torch.bfloat16)
matmul_overlap(a, w, c, None, AHEAD=2, STAGES=4)
torch.cuda.synchronize(); print("done")
PY
for tool in racecheck synccheck; do
  timeout 150 compute-sanitizer --tool $tool --print-limit 4 python3 /tmp/one.py 2>&1 | grep -v "Host Frame\|^\s*$\|Warn" | head -24
done
