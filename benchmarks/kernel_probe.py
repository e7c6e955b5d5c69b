"""Where does a small Triton matmul's time go: the GPU, or the Python host path?

For the GPT-2 shapes with N = 768 (attn.c_proj, mlp.c_proj) this prints, per path:
  - do_bench median of the public wrapper `matmul` (what `python -m mpgpt.bench kernels` records),
  - the same with the wrapper's checks skipped (`_matmul_2d`),
  - the kernel alone: the wrapper captured once in a CUDA graph and replayed (no host work),
  - host time per call: 2000 calls back to back, no synchronisation inside, divided by 2000,
and torch.matmul (cuBLAS) the same ways. With --host-profile it also prints where the host time
of `matmul()` goes: cProfile over 1000 calls at attn.c_proj's shape, the functions with the most
own time. Run on a GPU: python benchmarks/kernel_probe.py [OUT_DIR] [--host-profile]
"""
import cProfile
import io
import json
import pstats
import sys
import time

import torch
from triton.testing import do_bench

from mpgpt.kernels import matmul
from mpgpt.kernels.matmul import _matmul_2d


def graphed(fn):
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def host_us(fn, n=2000):
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return host


def main():
    rows = []
    for name, (M, K, N) in {"attn.c_proj": (12288, 768, 768), "mlp.c_proj": (12288, 3072, 768),
                            "c_fc": (12288, 768, 3072)}.items():
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        b = w.t()
        c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        paths = {"triton matmul()": lambda: matmul(a, b),
                 "triton _matmul_2d": lambda: _matmul_2d(a, b, c),
                 "torch.matmul": lambda: torch.matmul(a, b)}
        for label, fn in paths.items():
            fn()
            ms = do_bench(fn, warmup=50, rep=300, return_mode="median")
            replay = graphed(fn)
            ms_graph = do_bench(replay, warmup=50, rep=300, return_mode="median")
            row = {"shape": name, "M": M, "K": K, "N": N, "path": label, "do_bench_us": round(ms * 1e3, 1),
                   "graph_replay_us": round(ms_graph * 1e3, 1), "host_us_per_call": round(host_us(fn), 1),
                   "tflops_graph": round(2 * M * N * K / (ms_graph * 1e-3) / 1e12, 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if "--host-profile" in sys.argv:
        a = torch.randn(12288, 768, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(768, 768, device="cuda", dtype=torch.bfloat16).t()
        matmul(a, b)
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(1000):
            matmul(a, b)
        prof.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
        print(text.getvalue(), flush=True)
    args = [x for x in sys.argv[1:] if not x.startswith("--")]
    out = args[0] if args else None
    if out:
        from mpgpt.results import write_result
        print("wrote", write_result("kernel-probe", {"rows": rows}, out, command=" ".join(["python", *sys.argv])))


if __name__ == "__main__":
    main()
