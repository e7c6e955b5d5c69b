"""A Hopper matmul whose epilogue overlaps the next tile's tensor-core work (Gluon; chapter 6).

Why another kernel. The persistent TMA kernel (matmul.py) finishes a tile in a fixed order: wait
for the last MMA, then run the epilogue (round to bf16, write shared memory, TMA store), and only
then start the next tile's MMAs. With K = 768 a 128 x 128 tile is just 12 MMA steps, so the
tensor cores sit idle for a noticeable share of every tile while the epilogue runs
(benchmarks/NOTES-kernels.md, "Session 4": the first four waves of attn.c_proj took 26.4 us, where
cuBLAS does all five in 23.9).

Triton's tile language (`triton.language`) decides that order itself. Gluon, Triton's lower-level
dialect, hands it to the kernel author: shared-memory buffers, mbarriers, TMA copies and
asynchronous warpgroup MMAs (`wgmma`) are written out explicitly. So this kernel, at the end of a
tile, *first* issues the next tile's first AHEAD MMAs into a second accumulator, and only then
waits for the finished tile and runs its epilogue. The MMAs run on the tensor cores while the
same warps do the epilogue.

Schedule, for one persistent program. Its work is a list of steps: (tile, k) pairs, tile after
tile. Step j uses shared-memory stage j % STAGES. A TMA load fills a stage and signals the stage's
mbarrier; an MMA waits on it. A stage is refilled (for step j + STAGES) only once step j's MMA
has completed, which the kernel learns from `warpgroup_mma_wait(n)` ("at most n MMAs still in
flight"): that is `_refill`'s `done`.

Scope: the forward layout only (A row-major (M, K), B = w.t() with w row-major (N, K), as
nn.Linear stores it), bf16/fp16, optional bias, no activation; C row-major and addressable by TMA.
`matmul.py` uses it for those calls on sm_90 (MPGPT_OVERLAP=0 turns it off) and keeps its own
kernels for everything else. Gluon kernels run only compiled on the GPU (no interpreter); where
`triton.experimental.gluon` is missing, OVERLAP_IMPORT_ERROR says why and nothing here is used.
"""
from __future__ import annotations

from ._env import TRITON_IMPORT_ERROR, triton

OVERLAP_IMPORT_ERROR = TRITON_IMPORT_ERROR
try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)
except Exception as e:  # no Triton, or a Triton without Gluon's Hopper module
    OVERLAP_IMPORT_ERROR = OVERLAP_IMPORT_ERROR or f"triton.experimental.gluon is unavailable ({e})"

if OVERLAP_IMPORT_ERROR is None:

    @gluon.jit
    def _tile_offsets(tile_id, num_pid_m, num_pid_n, GROUP_M: gl.constexpr, BLOCK_M: gl.constexpr,
                      BLOCK_N: gl.constexpr):
        """Corner of tile `tile_id` in grouped order (as matmul._tile_coords)."""
        num_pid_in_group = GROUP_M * num_pid_n
        group_id = tile_id // num_pid_in_group
        first_pid_m = group_id * GROUP_M
        group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
        pid_m = first_pid_m + (tile_id % num_pid_in_group) % group_size_m
        pid_n = (tile_id % num_pid_in_group) // group_size_m
        return pid_m * BLOCK_M, pid_n * BLOCK_N

    @gluon.jit
    def _issue_load(j, total, a_desc, b_desc, a_bufs, b_bufs, ready, start_pid, num_programs, num_pid_m, num_pid_n,
                    k_tiles, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
        """Start the TMA loads of step j (if j < total) into stage j % STAGES."""
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
        pred = j < total
        t = j // k_tiles
        off_m, off_n = _tile_offsets(start_pid + t * num_programs, num_pid_m, num_pid_n, GROUP_M, BLOCK_M, BLOCK_N)
        off_k = (j - t * k_tiles) * BLOCK_K
        s = j % STAGES
        bar = ready.index(s)
        mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(a_desc, [off_m, off_k], bar, a_bufs.index(s), pred)
        tma.async_copy_global_to_shared(b_desc, [off_n, off_k], bar, b_bufs.index(s), pred)

    @gluon.jit
    def _refill(prod, done, total, a_desc, b_desc, a_bufs, b_bufs, ready, start_pid, num_programs, num_pid_m,
                num_pid_n, k_tiles, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
        """Load every step below done + STAGES - 1 not loaded yet (steps < done have finished their
        MMAs, so their stages are free; one stage of slack, as in Triton's Gluon tutorials).
        Returns the new count of steps loaded."""
        for j in range(prod, done + STAGES - 1):
            _issue_load(j, total, a_desc, b_desc, a_bufs, b_bufs, ready, start_pid, num_programs, num_pid_m,
                        num_pid_n, k_tiles, GROUP_M, STAGES)
        return gl.maximum(prod, done + STAGES - 1)

    @gluon.jit
    def _issue_mma(j, acc, use_acc, a_bufs, b_bufs, ready, STAGES: gl.constexpr):
        """Wait for step j's operands, then start acc += A_tile @ B_tile on the tensor cores
        (asynchronous: returns at once)."""
        s = j % STAGES
        mbarrier.wait(ready.index(s), (j // STAGES) & 1)
        # The B stage holds a (BLOCK_N, BLOCK_K) tile of w; the MMA reads it transposed.
        return warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, use_acc=use_acc, is_async=True)

    @gluon.jit
    def _tile(acc, t, my_tiles, issued, prod, total, a_desc, b_desc, c_desc, a_bufs, b_bufs, c_smem, ready, bias_ptr,
              N, start_pid, num_programs, num_pid_m, num_pid_n, k_tiles, mma_layout: gl.constexpr,
              HAS_BIAS: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, AHEAD: gl.constexpr):
        """Finish this program's tile t in acc (its first AHEAD steps are already started), start
        the next tile's first AHEAD steps in a fresh accumulator, then run tile t's epilogue while
        they run. Returns (acc, the next tile's accumulator, steps issued, steps loaded)."""
        BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
        off_m, off_n = _tile_offsets(start_pid + t * num_programs, num_pid_m, num_pid_n, GROUP_M, BLOCK_M, BLOCK_N)
        if HAS_BIAS:  # loaded now, so that its latency hides behind the MMAs
            offs_n = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_layout))
            bias = gl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(gl.float32)
        for _ in range(AHEAD, k_tiles):
            # Every MMA issued so far has finished: their stages are free to refill.
            acc = warpgroup_mma_wait(0, deps=(acc,))
            prod = _refill(prod, issued, total, a_desc, b_desc, a_bufs, b_bufs, ready, start_pid, num_programs,
                           num_pid_m, num_pid_n, k_tiles, GROUP_M, STAGES)
            acc = _issue_mma(issued, acc, True, a_bufs, b_bufs, ready, STAGES)
            acc = warpgroup_mma_wait(1, deps=(acc,))  # returns at once (one in flight): a tensor again
            issued += 1
        # Wait for this tile, start the next one, and run this tile's epilogue beside those MMAs.
        # (Waiting for everything first costs the tensor cores a short gap, but it is the form in
        # which the assembler can see that the epilogue reads finished registers only; waiting
        # with the next tile's MMAs already issued made it serialise every MMA of the kernel.)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        prod = _refill(prod, issued, total, a_desc, b_desc, a_bufs, b_bufs, ready, start_pid, num_programs,
                       num_pid_m, num_pid_n, k_tiles, GROUP_M, STAGES)
        # y, not acc: acc's registers are an MMA accumulator (the loop hands them to a later tile),
        # and the assembler serialises MMAs if other instructions write them.
        y = acc
        if HAS_BIAS:
            y = acc + gl.expand_dims(bias, 0)
        nxt = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, mma_layout)
        if t + 1 < my_tiles:
            for d in gl.static_range(AHEAD):
                nxt = _issue_mma(issued + d, nxt, d > 0, a_bufs, b_bufs, ready, STAGES)
            nxt = warpgroup_mma_wait(AHEAD, deps=(nxt,))  # returns at once (AHEAD in flight)
        issued += AHEAD

        # Epilogue: one rounding, TMA store (which drops what lies past the edges).
        tma.store_wait(pendings=0)            # the previous tile's store has left c_smem
        c_smem.store(y.to(c_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [off_m, off_n], c_smem)
        return acc, nxt, issued, prod

    @gluon.jit
    def _matmul_overlap_kernel(
        a_desc, b_desc, c_desc,          # TMA descriptors (host-built) of A (M, K), w (N, K), C (M, N)
        bias_ptr, M, N, K,               # bias (N,), read only if HAS_BIAS
        HAS_BIAS: gl.constexpr, GROUP_M: gl.constexpr,
        STAGES: gl.constexpr,            # shared-memory stages (loads in flight)
        AHEAD: gl.constexpr,             # MMAs of the next tile started before a tile's epilogue
        num_warps: gl.constexpr,
    ):
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
        dtype: gl.constexpr = a_desc.dtype
        a_layout: gl.constexpr = a_desc.layout
        b_layout: gl.constexpr = b_desc.layout
        c_layout: gl.constexpr = c_desc.layout
        a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], a_layout)
        b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_K], b_layout)
        c_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], c_layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
        # Make the initialised barriers visible to the TMA unit (the "async proxy") before its first
        # copy signals one. Without this fence the copy engine may see whatever the previous kernel
        # left in that shared memory: we measured launch failures that came and went with it.
        fence_async_shared()
        # The accumulator's register layout: each warpgroup (4 warps) owns BLOCK_M / (num_warps / 4)
        # rows; one wgmma instruction covers 64 x BLOCK_N x 16.
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, BLOCK_N, 16])

        start_pid = gl.program_id(0)
        num_programs = gl.num_programs(0)
        num_pid_m = gl.cdiv(M, BLOCK_M)
        num_pid_n = gl.cdiv(N, BLOCK_N)
        my_tiles = gl.cdiv(num_pid_m * num_pid_n - start_pid, num_programs)
        k_tiles = gl.cdiv(K, BLOCK_K)             # the host guarantees k_tiles > AHEAD
        total = my_tiles * k_tiles                # this program's steps

        prod = _refill(0, 0, total, a_desc, b_desc, a_bufs, b_bufs, ready, start_pid, num_programs, num_pid_m,
                       num_pid_n, k_tiles, GROUP_M, STAGES)
        # Two accumulators, used by turns: tile t in acc0 when t is even, acc1 when odd. The loop
        # below takes two tiles an iteration so that neither is ever copied into the other (a
        # copy would read registers an MMA is still writing, and the assembler would then make
        # the MMA finish first: no overlap).
        # The first AHEAD steps of tile 0 (for later tiles they are started during the epilogue).
        acc0 = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, mma_layout)
        for d in gl.static_range(AHEAD):
            acc0 = _issue_mma(d, acc0, d > 0, a_bufs, b_bufs, ready, STAGES)
        acc0 = warpgroup_mma_wait(AHEAD, deps=(acc0,))
        issued = AHEAD

        for t in range(0, my_tiles, 2):
            acc0, acc1, issued, prod = _tile(acc0, t, my_tiles, issued, prod, total, a_desc, b_desc, c_desc, a_bufs,
                                             b_bufs, c_smem, ready, bias_ptr, N, start_pid, num_programs, num_pid_m,
                                             num_pid_n, k_tiles, mma_layout, HAS_BIAS, GROUP_M, STAGES, AHEAD)
            if t + 1 < my_tiles:
                acc1, acc0, issued, prod = _tile(acc1, t + 1, my_tiles, issued, prod, total, a_desc, b_desc, c_desc,
                                                 a_bufs, b_bufs, c_smem, ready, bias_ptr, N, start_pid, num_programs,
                                                 num_pid_m, num_pid_n, k_tiles, mma_layout, HAS_BIAS, GROUP_M, STAGES,
                                                 AHEAD)
        acc0 = warpgroup_mma_wait(0, deps=(acc0,))  # nothing is in flight here; tells the assembler so
        tma.store_wait(pendings=0)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))


# Launch parameters, chosen on the H200 (benchmarks/overlap_probe.py).
BLOCK = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, STAGES=4, AHEAD=2, num_warps=8)


def matmul_overlap(a, w, c, bias=None, num_sms=None, **overrides):
    """c = a @ w.t() (+ bias) on the overlapped-epilogue kernel. a (M, K) and w (N, K) row-major,
    c (M, N) row-major, all 16-byte aligned with 16-byte row pitches (the caller checks);
    K > AHEAD * BLOCK_K. Returns what the launch returns (the compiled kernel)."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    cfg = {**BLOCK, **overrides}
    bm, bn, bk = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    M, K = a.shape
    N = w.shape[0]
    if num_sms is None:
        num_sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    gdt = gl.bfloat16 if a.dtype == torch.bfloat16 else gl.float16
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk], gl.NVMMASharedLayout.get_default_for([bm, bk], gdt))
    b_desc = TensorDescriptor.from_tensor(w, [bn, bk], gl.NVMMASharedLayout.get_default_for([bn, bk], gdt))
    c_desc = TensorDescriptor.from_tensor(c, [bm, bn], gl.NVMMASharedLayout.get_default_for([bm, bn], gdt))
    grid = (min(num_sms, triton.cdiv(M, bm) * triton.cdiv(N, bn)),)
    return _matmul_overlap_kernel[grid](a_desc, b_desc, c_desc, bias if bias is not None else c, M, N, K,
                                        HAS_BIAS=bias is not None, **cfg)
