"""Find the smallest failing case of overlap.py's kernel (session 4 debugging): each case in its own
process (a fault ends the CUDA context). Prints PASS / WRONG / FAULT per case.
Ran at commits 2af3d68-e57f11d (session 4, calls 5-18); mpgpt/kernels/overlap.py, the kernel it
imports, was removed afterwards because it faulted with 132 programs (benchmarks/NOTES-kernels.md,
"Session 4"). Check out e57f11d to run it.
"""
import subprocess
import sys

CASE = r'''
import torch, sys
from mpgpt.kernels.matmul import _set_tma_allocator
from mpgpt.kernels.overlap import matmul_overlap
_set_tma_allocator()
for spec in sys.argv[1:]:
  M, N, K, sms, ahead, stages = map(int, spec.split(","))
  a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16); w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
  c = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
  matmul_overlap(a, w, c, None, num_sms=sms, AHEAD=ahead, STAGES=stages)
  torch.cuda.synchronize()
  ref = a.float() @ w.float().t()
  err = ((c.float() - ref).norm() / ref.norm()).item()
  bad = torch.isnan(c).nonzero()
  print(spec, "PASS" if err < 1e-2 else f"WRONG err={err} nan_rows={bad[:,0].unique()[:10].tolist() if len(bad) else []}")
'''
cases = [tuple(map(int, c.split(","))) for c in sys.argv[1:] if "/" not in c] or [(128, 128, 768, 1, 2, 4), (256, 128, 768, 1, 2, 4), (384, 128, 768, 1, 2, 4), (512, 128, 768, 1, 2, 4),
         (256, 128, 768, 1, 1, 4), (256, 128, 256, 1, 2, 4), (128, 256, 768, 1, 2, 4), (1024, 768, 768, 4, 2, 4),
         (12288, 768, 768, 132, 2, 4)]
seqs = [c.split("/") for c in sys.argv[1:] if "/" in c]  # "a/b": cases run one after another in one process
runs = [[",".join(map(str, c))] for c in cases] + seqs
for c in runs:
    r = subprocess.run([sys.executable, "-c", CASE, *c], capture_output=True, text=True, timeout=120)
    out = " | ".join(r.stdout.strip().splitlines())
    if r.returncode != 0:
        err = [l for l in r.stderr.splitlines() if "Error" in l or "error" in l][-1:]
        out = f"FAULT rc={r.returncode} {err}"
    print(c, out, flush=True)
