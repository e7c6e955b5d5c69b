"""Which variant of the persistent TMA kernel is fastest on the GPU, shape by shape?

Times `mpgpt.kernels.tma.matmul_kernel_tma` launched directly (no autotuner, no wrapper) with one configuration at a
time, as CUDA-graph replays (`triton.testing.do_bench_cudagraph`: GPU time only, no host time),
against cuBLAS timed the same way, at the GPT-2-small shapes. Each variant is a tile configuration
combined with:
  TMA_STORE         output tiles stored through a TMA descriptor instead of masked pointer stores
  EPILOGUE_SUBTILE  the epilogue (bias, GELU, store) run on two half-width pieces of the tile
  WARP_SPECIALIZE   tl.range(..., warp_specialize=True) on the tile loop
  PPS               persistent programs per multiprocessor (1 or 2)
Every variant's output is checked against a float32 reference first (relative error < 1e-2).
Kernels are compiled in parallel worker processes first (into Triton's disk cache), then timed
one at a time in this process.

Run on a Hopper GPU:  python benchmarks/tma_variants.py OUT.json
(results/tma-variants-extra_*.json came from this script's --extra mode at commit b5fedbe, which
timed 192-row tiles, EXTRA_M=64, a kernel option removed after it measured slower.)
"""
import itertools
import json
import multiprocessing as mp
import sys
import time

SHAPES = {  # name: (M, K, N, flags)
    "attn.c_proj": (12288, 768, 768, "plain"),
    "mlp.c_proj": (12288, 3072, 768, "plain"),
    "c_attn": (12288, 768, 2304, "plain"),
    "c_fc": (12288, 768, 3072, "plain"),
    "c_fc+bias+gelu": (12288, 768, 3072, "gelu"),
    "c_fc+bias+gelu+z": (12288, 768, 3072, "gelu_z"),
}
FLAGS = {"plain": dict(HAS_BIAS=False, ACTIVATION="", STORE_Z=False),
         "gelu": dict(HAS_BIAS=True, ACTIVATION="gelu", STORE_Z=False),
         "gelu_z": dict(HAS_BIAS=True, ACTIVATION="gelu", STORE_Z=True)}
TILES = [(128, 128, 64, 4, 8), (128, 128, 64, 4, 4), (128, 128, 64, 3, 4), (128, 256, 64, 3, 8),
         (128, 128, 128, 3, 8), (128, 64, 64, 4, 4)]


def variants():
    """The 72 variants: every tile x TMA store x subtiled epilogue x warp specialisation x PPS
    (warp specialisation with one program per SM only)."""
    out = []
    for tile, ts, sub, ws, pps in itertools.product(TILES, (False, True), (False, True), (False, True), (1, 2)):
        if ws and pps == 2:
            continue
        out.append(dict(tile=tile, TMA_STORE=ts, EPILOGUE_SUBTILE=sub, WARP_SPECIALIZE=ws, PPS=pps))
    return out


def _tensors(M, K, N, flags):
    import torch
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) / K ** 0.5
    bias = torch.randn(N, device="cuda", dtype=torch.bfloat16, generator=g)
    c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    z = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    f = FLAGS[flags]
    return a, w, (bias if f["HAS_BIAS"] else c), c, (z if f["STORE_Z"] else c)


def _launch(v, a, w, bias, c, z, flags, num_sms):
    import triton
    from mpgpt.kernels.tma import matmul_kernel_tma, set_allocator
    M, K = a.shape
    N = w.shape[0]
    bm, bn, bk, stages, warps = v["tile"]
    set_allocator()
    grid = (min(num_sms * v["PPS"], triton.cdiv(M, bm) * triton.cdiv(N, bn)),)
    matmul_kernel_tma[grid](a, w, c, bias, z, M, N, K, a.stride(0), w.stride(0), c.stride(0), 1, z.stride(0), 1,
                             A_T=False, B_T=True, TMA_STORE_OK=True, TMA_STORE=v["TMA_STORE"], PPS=v["PPS"],
                             NUM_SMS=num_sms,
                             BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, EPILOGUE_SUBTILE=v["EPILOGUE_SUBTILE"],
                             WARP_SPECIALIZE=v["WARP_SPECIALIZE"], num_warps=warps, num_stages=stages,
                             **FLAGS[flags])


def _compile_worker(job):
    """Compile one (variant, flags) by launching it once on a small problem (same specialisation:
    every size and stride here divides by 16)."""
    v, flags = job
    import torch
    try:
        t = _tensors(256, 256, 256, flags)
        _launch(v, *t, flags, torch.cuda.get_device_properties(0).multi_processor_count)
        torch.cuda.synchronize()
        return None
    except Exception as e:  # reported, and the variant is skipped in the timing phase
        return f"{type(e).__name__}: {str(e)[:300]}"


def main():
    import torch
    import torch.nn.functional as F
    from triton.testing import do_bench_cudagraph
    vs = variants()
    jobs = [(v, f) for f in FLAGS for v in vs]
    t0 = time.time()
    with mp.get_context("spawn").Pool(14) as pool:
        errors = pool.map(_compile_worker, jobs)
    failed = {(json.dumps(v, sort_keys=True), f): e for (v, f), e in zip(jobs, errors) if e}
    print(f"compiled {len(jobs)} kernels in {time.time() - t0:.0f} s; {len(failed)} failed", flush=True)
    for (v, f), e in list(failed.items())[:10]:
        print("  failed:", f, v, e, flush=True)

    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for name, (M, K, N, flags) in SHAPES.items():
        a, w, bias, c, z = _tensors(M, K, N, flags)
        f = FLAGS[flags]
        ref = a.float() @ w.float().t()
        if f["HAS_BIAS"]:
            ref = F.gelu(ref + bias.float(), approximate="tanh")
        if f["HAS_BIAS"]:
            cublas = lambda: F.gelu(F.linear(a, w, bias), approximate="tanh")
        else:
            cublas = lambda: torch.matmul(a, w.t())
        cublas_ms = do_bench_cudagraph(cublas, rep=50)
        best = None
        for v in vs:
            key = (json.dumps(v, sort_keys=True), flags)
            row = dict(shape=name, M=M, K=K, N=N, flags=flags, cublas_us=round(cublas_ms * 1e3, 2), **v)
            if key in failed:
                row["error"] = failed[key]
                rows.append(row)
                continue
            c.fill_(float("nan"))
            fn = lambda: _launch(v, a, w, bias, c, z, flags, num_sms)
            fn()
            torch.cuda.synchronize()
            err = ((c.float() - ref).norm() / ref.norm()).item()
            row["rel_err"] = err
            if not err < 1e-2:  # NaN (an unwritten tile) fails too
                row["error"] = f"wrong result: relative error {err}"
                rows.append(row)
                print(json.dumps(row), flush=True)
                continue
            ms = do_bench_cudagraph(fn, rep=50)
            row["us"] = round(ms * 1e3, 2)
            row["vs_cublas"] = round(cublas_ms / ms, 3)
            rows.append(row)
            if best is None or row["us"] < best["us"]:
                best = row
        print(f"{name}: cuBLAS {cublas_ms * 1e3:.1f} us; best {best['us']} us ({best['vs_cublas']}x) "
              f"{ {k: best[k] for k in ('tile', 'TMA_STORE', 'EPILOGUE_SUBTILE', 'WARP_SPECIALIZE', 'PPS')} }",
              flush=True)
        for r in sorted((r for r in rows if r["shape"] == name and "us" in r), key=lambda r: r["us"])[:6]:
            print("   ", r["us"], r["vs_cublas"], r["tile"], "TS" if r["TMA_STORE"] else "--",
                  "SUB" if r["EPILOGUE_SUBTILE"] else "---", "WS" if r["WARP_SPECIALIZE"] else "--",
                  f"pps{r['PPS']}", flush=True)
    out = [x for x in sys.argv[1:] if not x.startswith("--")]
    if out:
        from mpgpt.bench import environment
        with open(out[0], "w") as fh:
            json.dump({"environment": environment(), "command": " ".join(sys.argv), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
