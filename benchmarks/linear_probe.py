"""Where does TritonLinear's forward+backward time go?

The kernel benchmark (`python -m mpgpt.bench kernels`) measures TritonLinear forward+backward below
nn.Linear (+GELU) under bf16 autocast, worst on the smallest layer, attn.c_proj. This probe
splits each step's time, for both layers, into:
  - wall time per step (20 steps back to back, one synchronisation at the end),
  - host time per step (the same 20 steps with the GPU kept busy first, so Python never waits),
  - GPU kernel time per step, summed from torch.profiler's CUDA events, and its largest kernels,
then times the two gradient GEMMs' layouts alone (dX = dY W: B row-major; dW = dY^T X: A
transposed, K = tokens) on the grouped and the TMA kernel and cuBLAS, as CUDA-graph replays.
With --profile it also prints where the host time of one TritonLinear step goes at attn.c_proj:
cProfile over 50 steps, backward run on the calling thread so that cProfile sees it.
Run on a GPU: python benchmarks/linear_probe.py [OUT_DIR] [--profile]  (writes linear-probe_<gpu>_<date>.json)
"""
import cProfile
import io
import json
import pstats
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench_cudagraph

from mpgpt.bench.kernels import LINEAR_SHAPES, linear_case
from mpgpt.kernels.matmul import _matmul_2d

M = 12288


def split_step(fn, params, n=20):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        for p in params:
            p.grad = None
        fn()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / n * 1e6
    torch.cuda._sleep(int(2e9))  # ~1 s of GPU work queued first: the host never waits for the GPU below
    t = time.perf_counter()
    for _ in range(n):
        for p in params:
            p.grad = None
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            for p in params:
                p.grad = None
            fn()
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.key_averages():
        t_us = getattr(e, "device_time_total", None)
        if t_us is None:
            t_us = e.cuda_time_total
        if t_us > 0 and e.count > 0:
            kernels[e.key] = (t_us / n, e.count / n)
    gpu = sum(v[0] for v in kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:8]
    return dict(wall_us=round(wall, 1), host_us=round(host, 1), gpu_us=round(gpu, 1),
                top_kernels=[(k[:90], round(v[0], 1), v[1]) for k, v in top])


def host_profile():
    label, fin, fout, act = [s for s in LINEAR_SHAPES if s[0] == "attn.c_proj"][0]
    lin, _, tri, x, g, step = linear_case(M, fin, fout, act)
    fn = step(tri)
    torch.autograd.set_multithreading_enabled(False)  # backward on this thread, where cProfile looks
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        x.grad = lin.weight.grad = lin.bias.grad = None
        fn()
    prof.disable()
    torch.cuda.synchronize()
    torch.autograd.set_multithreading_enabled(True)
    for key in ("tottime", "cumtime"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(28)
        print(f"--- cProfile of 50 TritonLinear steps ({label}), by {key} ---")
        print("\n".join(buf.getvalue().splitlines()[6:40]), flush=True)


def main():
    if "--profile" in sys.argv:
        host_profile()
    rows = []
    for label, fin, fout, act in LINEAR_SHAPES:
        lin, ref, tri, x, g, step = linear_case(M, fin, fout, act)
        params = [x, lin.weight, lin.bias]
        for name, layer in (("nn.Linear", ref), ("TritonLinear", tri)):
            r = dict(layer=label, path=name, **split_step(step(layer), params))
            rows.append(r)
            print(f"{label:12s} {name:12s} wall {r['wall_us']:7.1f} us  host {r['host_us']:7.1f} us  "
                  f"GPU {r['gpu_us']:7.1f} us", flush=True)
            for k, t, c in r["top_kernels"]:
                print(f"      {t:7.1f} us  x{c:<4} {k}", flush=True)
        # The gradient GEMMs' layouts alone, GPU time only.
        gb = torch.randn(M, fout, device="cuda", dtype=torch.bfloat16)
        xb = torch.randn(M, fin, device="cuda", dtype=torch.bfloat16)
        wb = torch.randn(fout, fin, device="cuda", dtype=torch.bfloat16)
        dx = torch.empty(M, fin, device="cuda", dtype=torch.bfloat16)
        dw = torch.empty(fout, fin, device="cuda", dtype=torch.float32)
        cases = {"dX cuBLAS": lambda: torch.matmul(gb, wb),
                 "dX grouped": lambda: _matmul_2d(gb, wb, dx, kernel="grouped"),
                 "dX tma": lambda: _matmul_2d(gb, wb, dx, kernel="tma"),
                 "dW cuBLAS": lambda: torch.matmul(gb.t(), xb),
                 "dW grouped (auto split-K)": lambda: _matmul_2d(gb.t(), xb, dw, kernel="grouped"),
                 "dW tma": lambda: _matmul_2d(gb.t(), xb, dw, kernel="tma")}
        for name, fn in cases.items():
            try:
                us = do_bench_cudagraph(fn, rep=50) * 1e3
            except Exception as e:
                print(f"   {label} {name}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            rows.append(dict(layer=label, gemm=name, graph_us=round(us, 2)))
            print(f"   {label:12s} {name:28s} {us:8.2f} us (graph replay)", flush=True)
    out = [a for a in sys.argv[1:] if not a.startswith("--")]
    if out:
        from mpgpt.results import write_result
        print("wrote", write_result("linear-probe", {"M": M, "rows": rows}, out[0], command=" ".join(["python", *sys.argv])))


if __name__ == "__main__":
    main()
