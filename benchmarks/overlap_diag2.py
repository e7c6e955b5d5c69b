"""Session 4 debugging: the overlap kernel fails in overlap_probe.py but passed in overlap_diag.py at the
same shape. Which difference matters? Each variant in its own process."""
import subprocess
import sys

CASE = r'''
import torch, sys
from mpgpt.kernels.matmul import _set_tma_allocator
from mpgpt.kernels.overlap import matmul_overlap
mode = sys.argv[1]
_set_tma_allocator()
M, N, K = 12288, 768, 768
a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
if "scaled" in mode:
    w = w / K ** 0.5
if "ref_before" in mode:
    ref = a.float() @ w.float().t()
if "sync" in mode:
    torch.cuda.synchronize()
if "bigalloc" in mode:
    x = torch.empty(2**30, dtype=torch.int8, device="cuda"); x.fill_(7)
c = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
kw = dict(num_sms=132) if "sms132" in mode else {}
if "ahead2" in mode:
    kw.update(AHEAD=2, STAGES=4)
else:
    kw.update(AHEAD=1, STAGES=4)
if "fewsms" in mode:
    kw.update(num_sms=16)
matmul_overlap(a, w, c, None, **kw)
torch.cuda.synchronize()
ref = a.float() @ w.float().t()
err = ((c.float() - ref).norm() / ref.norm()).item()
print("PASS" if err < 1e-2 else f"WRONG {err}")
'''
for mode in ["plain", "ahead2", "ahead2+ref_before", "fewsms"]:
    r = subprocess.run([sys.executable, "-c", CASE, mode], capture_output=True, text=True, timeout=100)
    out = r.stdout.strip() if r.returncode == 0 else "FAULT " + ([l for l in r.stderr.splitlines() if "rror" in l][-1:] or [""])[0][:100]
    print(f"{mode:22} {out}", flush=True)
