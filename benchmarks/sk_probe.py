"""Where does stream-K's time go? (session 4 probe; see NOTES-kernels.md)

Times the TMA kernel (128x128x64 tile, 4 stages, 8 warps, TMA stores) as CUDA-graph replays at
the two N = 768 shapes: whole tiles only; stream-K over the last wave (STREAM_K=1) and the last
two (2); the same without the fixup (SK_FIXUP=False: no workspace, no flags, wrong sums: the
cost of the split schedule alone); and the two phases on their own: the whole-tile waves alone
(the first 4 or 3 waves' rows) and the stream-K part alone (the remaining rows, every tile split).
Run on the H200:  python benchmarks/sk_probe.py [--wide] OUT.json
This ran at commit 6e7d906, whose TMA kernel had the STREAM_K option (and this probe's SK_FIXUP
knob); both were removed after these measurements (results/sk-probe*_*.json; NOTES-kernels.md,
"Session 4"). The sweep results/tma-variants-sk_*.json came from tma_variants.py --stream-k at
commit ddad518 (same kernel).
"""
import json
import sys

import torch
import triton
from triton.testing import do_bench_cudagraph

from mpgpt.kernels.matmul import _matmul_kernel_tma, _set_tma_allocator

SMS = torch.cuda.get_device_properties(0).multi_processor_count
WS = torch.empty(SMS * 128 * 256, device="cuda")
FLAGS = torch.zeros(SMS, dtype=torch.int32, device="cuda")


def launch(a, w, c, sk, fix=True, warps=8, stages=4, bk=64, bn=128):
    M, K = a.shape
    N = w.shape[0]
    grid = (SMS if sk else min(SMS, triton.cdiv(M, 128) * triton.cdiv(N, bn)),)
    _matmul_kernel_tma[grid](a, w, c, c, c, WS, FLAGS, M, N, K, K, K, N, 1, 0, 0, A_T=False, B_T=True,
                             HAS_BIAS=False, ACTIVATION="", STORE_Z=False, TMA_STORE_OK=True, NUM_SMS=SMS,
                             BLOCK_M=128, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, EPILOGUE_SUBTILE=False, TMA_STORE=True,
                             WARP_SPECIALIZE=False, PPS=1, STREAM_K=sk, SK_FIXUP=fix, num_warps=warps,
                             num_stages=stages)


def main():
    _set_tma_allocator()
    rows = []
    for name, K in (("attn.c_proj", 768), ("mlp.c_proj", 3072)):
        M, N = 12288, 768
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
        c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        ref = a.float() @ w.float().t()
        cub = do_bench_cudagraph(lambda: torch.matmul(a, w.t()), rep=50) * 1e3
        tiles_per_row = N // 128
        cases = [("whole tiles", M, 0, True), ("sk1", M, 1, True), ("sk2", M, 2, True),
                 ("sk1 no fixup", M, 1, False), ("sk2 no fixup", M, 2, False)]
        for waves in (4, 3):  # the whole-tile phase alone, and the stream-K phase alone
            rows_dp = waves * SMS // tiles_per_row * 128
            cases.append((f"first {waves} waves alone", rows_dp, 0, True))
            cases.append((f"rest after {waves} waves, all split", M - rows_dp, 1, True))
            cases.append((f"rest after {waves} waves, split, no fixup", M - rows_dp, 1, False))
        cases += [("whole tiles 4 warps", M, 0, True, 4), ("sk1 4 warps", M, 1, True, 4)]
        if "--wide" in sys.argv:  # 128 x 256 tiles, 3 stages: 288 tiles, 2.18 waves
            cases = [(f"128x256 {lab}", M, sk, fix, 8, 256) for lab, sk, fix in (
                ("whole tiles", 0, True), ("sk1", 1, True), ("sk2", 2, True), ("sk1 no fixup", 1, False),
                ("sk2 no fixup", 2, False))]
            cases += [("128x256 first 2 waves alone", 2 * SMS // 3 * 128, 0, True, 8, 256),
                      ("128x256 rest after 2 waves, split", M - 2 * SMS // 3 * 128, 1, True, 8, 256),
                      ("128x256 rest after 2 waves, split, no fixup", M - 2 * SMS // 3 * 128, 1, False, 8, 256)]
        for case in cases:
            label, m, sk, fix = case[:4]
            warps = case[4] if len(case) > 4 else 8
            bn = case[5] if len(case) > 5 else 128
            aa, cc = a[:m], c[:m]
            fn = lambda: launch(aa, w, cc, sk, fix, warps, stages=3 if bn == 256 else 4, bn=bn)
            cc.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            err = ((cc.float() - ref[:m]).norm() / ref[:m].norm()).item()
            us = do_bench_cudagraph(fn, rep=50) * 1e3
            row = dict(shape=name, case=label, M=m, K=K, N=N, stream_k=sk, fixup=fix, warps=warps, us=round(us, 2),
                       cublas_us_full=round(cub, 2), rel_err=err, flags_left=int(FLAGS.sum().item()))
            rows.append(row)
            print(f"{name:12} {label:40} M={m:6} {us:7.2f} us  (cuBLAS full {cub:.1f})  err {err:.1e}", flush=True)
    out = [x for x in sys.argv[1:] if not x.startswith("--")]
    if out:
        from mpgpt.bench import environment
        with open(out[0], "w") as fh:
            json.dump({"environment": environment(), "command": " ".join(sys.argv), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
