#!/usr/bin/env bash
# Session 4, calls 6, 8 and 12-18 (kind nvidia-h200): debugging the overlap kernel (mpgpt/kernels/overlap.py,
# since removed; its last version is at e57f11d). This is the last form (call 18); earlier ones are in git history.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 120 python3 benchmarks/overlap_diag.py 67584,128,768,132,2,4 12288,768,768,132,2,4 12288,768,768,132,1,4 \
  84480,128,768,132,2,4 2>&1 | grep -v Warn | tee /tmp/diag.log
if ! grep -q "FAULT\|WRONG" /tmp/diag.log; then
  for s in attn.c_proj mlp.c_proj; do
    timeout 100 python3 benchmarks/overlap_probe.py --shape=$s "$OUT/overlap-probe-$s.json" 2>&1 | grep -v "Warn\|launching" | tail -9
  done
else
  cat > /tmp/one.py <<'PY'
import torch
from mpgpt.kernels.overlap import matmul_overlap
a = torch.randn(67584, 768, device="cuda", dtype=torch.bfloat16); w = torch.randn(128, 768, device="cuda", dtype=torch.bfloat16)
c = torch.empty(67584, 128, device="cuda", dtype=torch.bfloat16)
matmul_overlap(a, w, c, None, AHEAD=2, STAGES=4)
torch.cuda.synchronize(); print("done")
PY
  timeout 100 compute-sanitizer --tool synccheck --print-limit 2 python3 /tmp/one.py 2>&1 | grep -v "Host Frame\|^\s*$\|Warn" | head -12
fi
