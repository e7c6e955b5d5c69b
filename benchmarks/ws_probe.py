"""A warp-specialised Hopper matmul in Gluon with 128 x 192 tiles (session 5, issue 3).

Why. Nsight Compute shows cuBLAS running the N = 768 GPT-2 products with 192 x 192 tiles
(`nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB`: one TMA producer warpgroup, two cooperating MMA
warpgroups): 256 tiles, 1.94 waves over 132 SMs. Triton's tile language needs power-of-two
blocks; a 192-wide tile as two accumulators (128 + 64 columns sharing the A tile) measured slower
there, because the flattened persistent loop resets the accumulators with selects that make ptxas
serialise the MMAs (C7515) and the unflattened loop refills the pipeline at every tile.

Here the same 128 x 192 tile is written in Gluon, where both problems go away:
  - a producer partition (one warp) runs the TMA loads into a STAGES-deep ring of shared-memory
    stages, waiting on each stage's `empty` barrier and arming its `ready` barrier; it runs ahead
    into the next tile while the MMA warps do the epilogue;
  - the default partition (8 warps, two warpgroups sharing each tile's 128 rows) waits on
    `ready`, issues two asynchronous wgmmas per K step (128- and 64-wide, same A stage), starts a
    fresh tile with `use_acc=False` (no register reset), and releases the previous step's stage
    once its wgmmas are done.

Scope: the forward layout (A (M, K) row-major, B = w.t() with w (N, K) row-major), bf16/fp16, no
bias or activation, C (M, N) row-major. Run on a Hopper GPU:
    python benchmarks/ws_probe.py [OUT.json]
"""
import json
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)


@gluon.jit
def _tile_offsets(tile_id, num_pid_m, num_pid_n, GROUP_M: gl.constexpr, BLOCK_M: gl.constexpr, TILE_N: gl.constexpr):
    """Corner of tile `tile_id` in grouped order (matmul._tile_coords)."""
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (tile_id % num_pid_in_group) % group_size_m
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m * BLOCK_M, pid_n * TILE_N


@gluon.jit
def _producer(a_desc, b_desc, b2_desc, a_bufs, b_bufs, b2_bufs, ready, empty, M, N, K,
              GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    """One warp: TMA loads of every (tile, k) step of this program, STAGES ahead at most."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    EXTRA_N: gl.constexpr = b2_desc.block_type.shape[0]
    TILE_N: gl.constexpr = BLOCK_N + EXTRA_N
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, TILE_N)
    k_tiles = gl.cdiv(K, BLOCK_K)
    start = gl.program_id(0)
    step = gl.num_programs(0)
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes + b2_desc.block_type.nbytes
    p = 0
    for tile_id in range(start, num_pid_m * num_pid_n, step):
        off_m, off_n = _tile_offsets(tile_id, num_pid_m, num_pid_n, GROUP_M, BLOCK_M, TILE_N)
        for k in range(k_tiles):
            s = p % STAGES
            # A stage is free once the MMA warps released it. On the first pass through the ring
            # no release has happened: waiting for the phase *before* phase 0 returns at once.
            mbarrier.wait(empty.index(s), ((p // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), nbytes)
            tma.async_copy_global_to_shared(a_desc, [off_m, k * BLOCK_K], ready.index(s), a_bufs.index(s))
            tma.async_copy_global_to_shared(b_desc, [off_n, k * BLOCK_K], ready.index(s), b_bufs.index(s))
            tma.async_copy_global_to_shared(b2_desc, [off_n + BLOCK_N, k * BLOCK_K], ready.index(s),
                                            b2_bufs.index(s))
            p += 1


@gluon.jit
def _consumer(a_bufs, b_bufs, b2_bufs, ready, empty, c_desc, c2_desc, c_smem, c2_smem, M, N, K,
              GROUP_M: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    """The default partition: MMAs and the epilogue of every tile of this program."""
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    EXTRA_N: gl.constexpr = c2_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    TILE_N: gl.constexpr = BLOCK_N + EXTRA_N
    # Accumulator layouts: warpgroups stacked along M (each owns BLOCK_M / (num_warps / 4) rows).
    l1: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                 instr_shape=[16, BLOCK_N, 16])
    l2: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                 instr_shape=[16, EXTRA_N, 16])
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, TILE_N)
    k_tiles = gl.cdiv(K, BLOCK_K)
    start = gl.program_id(0)
    step = gl.num_programs(0)
    acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, l1)
    acc2 = gl.zeros((BLOCK_M, EXTRA_N), gl.float32, l2)
    c = 0
    for tile_id in range(start, num_pid_m * num_pid_n, step):
        off_m, off_n = _tile_offsets(tile_id, num_pid_m, num_pid_n, GROUP_M, BLOCK_M, TILE_N)
        for k in range(k_tiles):
            s = c % STAGES
            mbarrier.wait(ready.index(s), (c // STAGES) & 1)
            a = a_bufs.index(s)
            acc = warpgroup_mma(a, b_bufs.index(s).permute((1, 0)), acc, use_acc=k > 0, is_async=True)
            acc2 = warpgroup_mma(a, b2_bufs.index(s).permute((1, 0)), acc2, use_acc=k > 0, is_async=True)
            # At most this step's two wgmmas still run: the previous step's stage is free again.
            acc, acc2 = warpgroup_mma_wait(2, deps=(acc, acc2))
            mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES), pred=k > 0)
            c += 1
        acc, acc2 = warpgroup_mma_wait(0, deps=(acc, acc2))
        mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES))
        # Epilogue: one rounding each, TMA stores (which drop what lies past the edges). The
        # previous tile's stores must have left the buffers first.
        tma.store_wait(pendings=0)
        c_smem.store(acc.to(c_desc.dtype))
        c2_smem.store(acc2.to(c2_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [off_m, off_n], c_smem)
        tma.async_copy_shared_to_global(c2_desc, [off_m, off_n + BLOCK_N], c2_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def _matmul_ws_kernel(a_desc, b_desc, b2_desc, c_desc, c2_desc, M, N, K,
                      GROUP_M: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    dtype: gl.constexpr = a_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    b2_bufs = gl.allocate_shared_memory(dtype, [STAGES] + b2_desc.block_type.shape, b2_desc.layout)
    c_smem = gl.allocate_shared_memory(dtype, c_desc.block_type.shape, c_desc.layout)
    c2_smem = gl.allocate_shared_memory(dtype, c2_desc.block_type.shape, c2_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()
    gl.warp_specialize([
        (_consumer, (a_bufs, b_bufs, b2_bufs, ready, empty, c_desc, c2_desc, c_smem, c2_smem, M, N, K, GROUP_M,
                     STAGES, num_warps)),
        (_producer, (a_desc, b_desc, b2_desc, a_bufs, b_bufs, b2_bufs, ready, empty, M, N, K, GROUP_M, STAGES)),
    ], [1], [40])


def matmul_ws(a, w, c, BLOCK_M=128, BLOCK_N=128, EXTRA_N=64, BLOCK_K=64, STAGES=4, GROUP_M=8, num_warps=8,
              num_sms=None):
    """c = a @ w.t() on the warp-specialised kernel; a (M, K), w (N, K), c (M, N) row-major."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    gdt = gl.bfloat16 if a.dtype == torch.bfloat16 else gl.float16
    lay = lambda shape: gl.NVMMASharedLayout.get_default_for(shape, gdt)  # noqa: E731
    M, K = a.shape
    N = w.shape[0]
    a_desc = TensorDescriptor.from_tensor(a, [BLOCK_M, BLOCK_K], lay([BLOCK_M, BLOCK_K]))
    b_desc = TensorDescriptor.from_tensor(w, [BLOCK_N, BLOCK_K], lay([BLOCK_N, BLOCK_K]))
    b2_desc = TensorDescriptor.from_tensor(w, [EXTRA_N, BLOCK_K], lay([EXTRA_N, BLOCK_K]))
    c_desc = TensorDescriptor.from_tensor(c, [BLOCK_M, BLOCK_N], lay([BLOCK_M, BLOCK_N]))
    c2_desc = TensorDescriptor.from_tensor(c, [BLOCK_M, EXTRA_N], lay([BLOCK_M, EXTRA_N]))
    if num_sms is None:
        num_sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    tiles = triton.cdiv(M, BLOCK_M) * triton.cdiv(N, BLOCK_N + EXTRA_N)
    return _matmul_ws_kernel[(min(num_sms, tiles),)](a_desc, b_desc, b2_desc, c_desc, c2_desc, M, N, K,
                                                     GROUP_M=GROUP_M, STAGES=STAGES, num_warps=num_warps)


SHAPES = {"attn.c_proj": (12288, 768, 768), "mlp.c_proj": (12288, 3072, 768), "c_fc": (12288, 768, 3072)}
ODD = [(1000, 1000, 776), (77, 3072, 200), (12288, 768, 768), (12288, 3072, 768), (300, 64, 192)]  # M, K, N


def main():
    from triton.testing import do_bench, do_bench_cudagraph
    ok = True
    for rep in range(3):  # correctness: odd shapes, poisoned outputs, fresh inputs, programs 132 and fewer
        for (M, K, N) in ODD:
            for sms in (None, 7):
                a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
                c = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
                try:
                    matmul_ws(a, w, c, num_sms=sms)
                    torch.cuda.synchronize()
                    ref = a.double() @ w.double().t()
                    err = ((c.double() - ref).norm() / ref.norm()).item()
                except Exception as e:
                    err = f"{type(e).__name__}: {str(e)[:300]}"
                good = isinstance(err, float) and err < 1e-2
                ok &= good
                if rep == 0 or not good:
                    print(f"check {M}x{K}x{N} programs={sms or 'all'}: rel err {err}", "" if good else "<-- WRONG",
                          flush=True)
                if not good and not isinstance(err, float) and "launch failure" in str(err):
                    print("launch failure: stopping", flush=True)
                    sys.exit(1)
    print("all correct" if ok else "SOME WRONG", flush=True)
    rows = []
    for shape, (M, K, N) in SHAPES.items():
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        cub = lambda: torch.matmul(a, w.t())  # noqa: E731
        cg, cd = do_bench_cudagraph(cub, rep=100) * 1e3, do_bench(cub, rep=200) * 1e3
        print(f"{shape}: cuBLAS graph {cg:.2f} us, do_bench {cd:.2f} us", flush=True)
        for stages in (3, 4):
            fn = lambda: matmul_ws(a, w, c, STAGES=stages)  # noqa: E731
            g, d = do_bench_cudagraph(fn, rep=100) * 1e3, do_bench(fn, rep=200) * 1e3
            rows.append(dict(shape=shape, M=M, K=K, N=N, stages=stages, graph_us=round(g, 2), do_bench_us=round(d, 2),
                             cublas_graph_us=round(cg, 2), cublas_do_bench_us=round(cd, 2),
                             graph_ratio=round(cg / g, 3), do_bench_ratio=round(cd / d, 3)))
            print(f"  ws 128x192, {stages} stages: graph {g:7.2f} us ({cg / g:.3f}x)   do_bench {d:7.2f} us "
                  f"({cd / d:.3f}x; host-bound if the launch path is slower than the kernel)", flush=True)
    out = [x for x in sys.argv[1:] if not x.startswith("--")]
    if out:
        from mpgpt.bench import environment
        with open(out[0], "w") as fh:
            json.dump({"environment": environment(), "command": " ".join(sys.argv), "all_correct": ok, "rows": rows},
                      fh, indent=1)


if __name__ == "__main__":
    main()
