"""The overlapped-epilogue Gluon kernel (mpgpt/kernels/overlap.py) against cuBLAS and the Triton
TMA kernel, on the H200.

1. Correctness first: every variant (AHEAD x STAGES), with and without bias, at an odd shape
   (M, N, K = 1000, 776, 1000: edges in all three) and at each benchmark shape, into a NaN-poisoned
   output, against a float32 reference on the same bf16 inputs (relative error < 1e-2).
2. Times at the GPT-2 shapes and 4096^3: do_bench_cudagraph (GPU time only) and do_bench (the
   issue's measure: L2 cleared between runs, launch included), for cuBLAS (torch.matmul), the
   package's `matmul` (kernel="auto", the Triton TMA kernel) and each overlap variant.
Run on a Hopper GPU:  python benchmarks/overlap_probe.py OUT.json

Ran at commits 2af3d68-e57f11d (session 4, calls 5-18); mpgpt/kernels/overlap.py, the kernel it
imports, was removed afterwards because it faulted with 132 programs (benchmarks/NOTES-kernels.md,
"Session 4"). Check out e57f11d to run it.
"""
import json
import sys

import torch
from triton.testing import do_bench, do_bench_cudagraph

from mpgpt.kernels import matmul
from mpgpt.kernels.matmul import _set_tma_allocator
from mpgpt.kernels.overlap import OVERLAP_IMPORT_ERROR, matmul_overlap

VARIANTS = [dict(AHEAD=1, STAGES=4), dict(AHEAD=2, STAGES=4), dict(AHEAD=2, STAGES=4, GROUP_M=4),
            dict(AHEAD=3, STAGES=5), dict(AHEAD=2, STAGES=5)]
SHAPES = [("attn.c_proj", 12288, 768, 768), ("mlp.c_proj", 12288, 768, 3072), ("c_attn", 12288, 2304, 768),
          ("c_fc", 12288, 3072, 768), ("4096^3", 4096, 4096, 4096)]


def rel_err(out, ref):
    out = out.float()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm()).item()


def main():
    assert OVERLAP_IMPORT_ERROR is None, OVERLAP_IMPORT_ERROR
    _set_tma_allocator()
    rows, bad = [], 0
    only = [x[len("--shape="):] for x in sys.argv if x.startswith("--shape=")]
    for label, M, N, K in [("odd", 1000, 776, 1000)] + SHAPES:
        if only and label not in only:
            continue
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
        bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        ref = a.float() @ w.float().t()
        for v in VARIANTS:
            for b in (None, bias):
                c = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
                if "--verbose" in sys.argv:
                    print("  launching", label, v, "bias" if b is not None else "", flush=True)
                matmul_overlap(a, w, c, b, **v)
                torch.cuda.synchronize()
                err = rel_err(c, ref + (b.float() if b is not None else 0))
                if not err < 1e-2:
                    bad += 1
                    print(f"WRONG {label} {v} bias={b is not None}: rel err {err}", flush=True)
        print(f"{label}: correctness checked", flush=True)
        if label == "odd":
            continue
        c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        fns = {"cublas": lambda: torch.matmul(a, w.t()), "triton auto": lambda: matmul(a, w.t(), out=c)}
        for v in VARIANTS:
            fns["overlap " + ",".join(f"{k}={x}" for k, x in v.items())] = (lambda v=v: matmul_overlap(a, w, c, **v))
        times = {}
        for name, fn in fns.items():
            fn()
            times[name] = (do_bench_cudagraph(fn, rep=50) * 1e3, do_bench(fn, warmup=25, rep=100) * 1e3)
        cg0, db0 = times["cublas"]
        for name, (cg, db) in times.items():
            row = dict(shape=label, M=M, N=N, K=K, kernel=name, graph_us=round(cg, 2), do_bench_us=round(db, 2),
                       graph_vs_cublas=round(cg0 / cg, 3), do_bench_vs_cublas=round(db0 / db, 3))
            rows.append(row)
            print(f"{label:12} {name:42} graph {cg:7.2f} us ({cg0 / cg:.3f}x)   do_bench {db:7.2f} us ({db0 / db:.3f}x)",
                  flush=True)
    print("wrong results:", bad, flush=True)
    out = [x for x in sys.argv[1:] if not x.startswith("--")]
    if out:
        from mpgpt.bench import environment
        with open(out[0], "w") as fh:
            json.dump({"environment": environment(), "command": " ".join(sys.argv), "wrong": bad, "rows": rows}, fh,
                      indent=1)


if __name__ == "__main__":
    main()
