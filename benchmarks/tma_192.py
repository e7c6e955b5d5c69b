"""192-wide tiles for the N = 768 outputs (session 5, issue 3).

Nsight Compute showed that cuBLAS runs attn.c_proj and mlp.c_proj with 192 x 192 tiles
(`nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN`): 64 x 4 = 256 tiles, 1.94 waves over 132 SMs.
Our power-of-two tiles give 576 tiles of 128 x 128 (4.36 waves, run as 5) or 288 of 128 x 256
(2.18, run as 3). `EXTRA_N = 64` makes a 128 x 192 tile from a 128-wide and a 64-wide accumulator
sharing the A tile: 96 x 4 = 384 tiles, 2.91 waves. This script checks each variant (odd shapes,
poisoned outputs, fresh inputs) and times it against cuBLAS two ways: CUDA-graph replay (GPU time
only) and `do_bench` (L2 cleared before each run, the issue's measure).

Run on a Hopper GPU:  python benchmarks/tma_192.py OUT.json [--small]
(--small: the small-tile, several-programs-per-SM set instead of the 192-wide one.)
"""
import json
import multiprocessing as mp
import sys
import time

import torch

sys.path.insert(0, "benchmarks")
from tma_variants import _launch, _tensors  # noqa: E402


def V(tile, ts=True, sub=False, pps=1, extra=0, flatten=True):
    return dict(tile=tile, TMA_STORE=ts, EPILOGUE_SUBTILE=sub, WARP_SPECIALIZE=False, PPS=pps, EXTRA_N=extra,
                FLATTEN=flatten)


VARIANTS_192 = {  # tile = BLOCK_M, BLOCK_N, BLOCK_K, stages, warps
    "128x128 (current)": V((128, 128, 64, 4, 8)),
    "128x128 not flattened": V((128, 128, 64, 4, 8), flatten=False),
    "128x128 pps2": V((128, 128, 64, 3, 4), ts=False, sub=True, pps=2),
    "128x192 s3": V((128, 128, 64, 3, 8), extra=64, flatten=False),
    "128x192 s4": V((128, 128, 64, 4, 8), extra=64, flatten=False),
    "128x192 s4 sub": V((128, 128, 64, 4, 8), sub=True, extra=64, flatten=False),
    "128x192 s4 ptr": V((128, 128, 64, 4, 8), ts=False, extra=64, flatten=False),
    "128x192 s3 flattened": V((128, 128, 64, 3, 8), extra=64, flatten=True),
    "128x192 bk128 s2": V((128, 128, 128, 2, 8), extra=64, flatten=False),
    "128x192 pps2 bk32 s3": V((128, 128, 32, 3, 8), pps=2, extra=64, flatten=False),
}
# Session 5, call 3: small tiles, several programs per SM. 64 x 128 tiles: 192 x 6 = 1152 of them,
# 8.73 per SM (run as 9: 97 %); each program is one warpgroup, and the programs sharing an SM
# overlap one another's pipeline fill and epilogue.
VARIANTS_SMALL = {
    "128x128 (current)": V((128, 128, 64, 4, 8)),
    "128x128 pps2": V((128, 128, 64, 3, 4), ts=False, sub=True, pps=2),
    "128x128 pps2 ts": V((128, 128, 64, 3, 4), sub=True, pps=2),
    "64x128 s3 pps2": V((64, 128, 64, 3, 4), pps=2),
    "64x128 s3 pps2 ptr": V((64, 128, 64, 3, 4), ts=False, pps=2),
    "64x128 s2 pps3": V((64, 128, 64, 2, 4), pps=3),
    "64x128 s2 pps3 ptr": V((64, 128, 64, 2, 4), ts=False, pps=3),
    "64x128 s4 pps2": V((64, 128, 64, 4, 4), pps=2),
    "64x128 s2 pps4 ptr": V((64, 128, 64, 2, 4), ts=False, pps=4),
    "64x256 s2 pps2": V((64, 256, 64, 2, 4), pps=2),
    "128x64 s3 pps2": V((128, 64, 64, 3, 4), pps=2),
    "128x64 s2 pps3": V((128, 64, 64, 2, 4), pps=3),
}
VARIANTS = VARIANTS_SMALL if "--small" in sys.argv else VARIANTS_192
SHAPES = {"attn.c_proj": (12288, 768, 768), "mlp.c_proj": (12288, 3072, 768)}
ODD = [(1000, 1000, 776), (77, 3072, 200), (12288, 768, 768)]  # M, K, N


def _compile_worker(job):
    """Compile one variant at one shape's specialisation (into Triton's disk cache) in a worker."""
    name, (M, K, N) = job
    try:
        t = _tensors(M, K, N, "plain")
        _launch(VARIANTS[name], *t, "plain", torch.cuda.get_device_properties(0).multi_processor_count)
        torch.cuda.synchronize()
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[:200]}"


def main():
    from triton.testing import do_bench, do_bench_cudagraph
    t0 = time.time()
    jobs = [(n, s) for n in VARIANTS for s in ODD]
    with mp.get_context("spawn").Pool(14) as pool:
        errs = pool.map(_compile_worker, jobs)
    print(f"compiled {len(jobs)} in {time.time() - t0:.0f} s;", [(j, e) for j, e in zip(jobs, errs) if e], flush=True)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows, bad = [], []
    for name, v in VARIANTS.items():  # correctness first, fresh inputs each time
        for seed, (M, K, N) in enumerate(ODD):
            try:
                a, w, bias, c, z = _tensors(M, K, N, "plain", seed=1000 + seed + int(torch.randint(1 << 20, ())))
                c.fill_(float("nan"))
                _launch(v, a, w, bias, c, z, "plain", num_sms)
                torch.cuda.synchronize()
                ref = a.double() @ w.double().t()
                err = ((c.double() - ref).norm() / ref.norm()).item()
            except Exception as e:
                err = f"{type(e).__name__}: {str(e)[:200]}"
            ok = isinstance(err, float) and err < 1e-2
            print(f"check {name:24s} {M}x{K}x{N}: rel err {err}", "" if ok else "  <-- WRONG", flush=True)
            if not ok:
                bad.append(name)
    for shape, (M, K, N) in SHAPES.items():
        a, w, bias, c, z = _tensors(M, K, N, "plain")
        cub = lambda: torch.matmul(a, w.t())
        cub_g, cub_d = do_bench_cudagraph(cub, rep=100) * 1e3, do_bench(cub, rep=200) * 1e3
        print(f"{shape}: cuBLAS graph {cub_g:.2f} us, do_bench {cub_d:.2f} us", flush=True)
        for name, v in VARIANTS.items():
            if name in bad:
                continue
            fn = lambda: _launch(v, a, w, bias, c, z, "plain", num_sms)
            g, d = do_bench_cudagraph(fn, rep=100) * 1e3, do_bench(fn, rep=200) * 1e3
            row = dict(shape=shape, variant=name, **{k: (list(x) if isinstance(x, tuple) else x) for k, x in v.items()},
                       graph_us=round(g, 2), do_bench_us=round(d, 2), cublas_graph_us=round(cub_g, 2),
                       cublas_do_bench_us=round(cub_d, 2), graph_ratio=round(cub_g / g, 3),
                       do_bench_ratio=round(cub_d / d, 3))
            rows.append(row)
            print(f"  {name:24s} graph {g:7.2f} us ({cub_g / g:.3f}x)   do_bench {d:7.2f} us ({cub_d / d:.3f}x)",
                  flush=True)
    out = [x for x in sys.argv[1:] if not x.startswith("--")]
    if out:
        from mpgpt.bench import environment
        with open(out[0], "w") as fh:
            json.dump({"environment": environment(), "command": " ".join(sys.argv), "wrong": bad, "rows": rows}, fh,
                      indent=1)


if __name__ == "__main__":
    main()
