"""The promoted fp8 GEMM for Hopper, warp-specialised and written in Gluon (chapter 9).

    c = (a @ b.T) * scale_a * scale_b      a: (M, K) fp8   b: (N, K) fp8   c: (M, N) bf16/fp16/fp32

Why a second fp8 kernel. Hopper's fp8 tensor cores keep about 14 mantissa bits while they
accumulate, so an accurate fp8 GEMM *promotes*: every 128 elements of K it adds the tensor
cores' partial sum into an fp32 accumulator held in registers (DeepSeek-V3, section 3.3.2). In
fp8_matmul.py that is `tl.dot(..., max_num_imprecise_acc=128)`. There each promotion waits for
the tensor cores to finish, the warps then add, and only then start the next product: the
tensor cores stand idle during every add, and the kernel runs well below cuBLAS's promoted fp8
GEMM (measured: record fp8-h200).

The cure is the one DeepGEMM and cuBLAS use: two groups of warps that do not wait for each other,
so that while one group adds its partial sums the other group's products keep the tensor cores
busy. Triton's tile language cannot say "these warps, independently"; Gluon can:

* a **producer** (one warp) runs the TMA loads of every (tile, K-step) into a ring of STAGES
  shared-memory stages, as in ws.py;
* two **consumer** partitions of one warpgroup each (4 warps) share every tile: consumer 0 owns
  rows 0-63, consumer 1 rows 64-127, and both read the same B stage. Each K-step a consumer
  waits for the stage, issues an asynchronous warpgroup MMA into a scratch accumulator
  (`use_acc=False`: the partial sum of these 128 elements of K, from zero), waits for it, tells
  the producer it is done with the stage, and adds the partial sum into its fp32 accumulator;
* the two consumers run free: nothing makes them take turns. Forcing turns (two mbarriers passed
  back and forth, as CUTLASS's ping-pong kernels do) was no faster, and 128 x 128 tiles were
  slower than 128 x 256.

A tile is 128 rows by 256 columns, made as two 128-column parts. Each part has its own fp32
accumulator (64 registers a thread) and both reuse one scratch accumulator: 3 x 64 registers a
thread for the sums. That is why the halves are not one 256-wide MMA: a 128-register
accumulator plus a 128-register scratch would not fit beside the addresses.

The epilogue is fp8_matmul's for a 16- or 32-bit output: the scales (one each, or one per row of a and
of b) applied once in fp32, one rounding, TMA stores (which drop what lies past the edges; loads
past the edges read zeros, so a ragged K adds nothing).

Scope, checked by `fp8_ws_eligible`: sm_90 exactly, Gluon importable, compiled mode, a bf16/fp16/fp32
output, both operands row-major with 16-byte aligned bases and row pitches, C too. An fp8 output
(with its amax) stays on fp8_matmul.py's kernels.

Promoting, it runs about as fast as cuBLAS's promoted fp8 GEMM (torch._scaled_mm) and well above
bf16 cuBLAS at large cubes (measured: record fp8-h200, which chapter 9 shows).
"""
from __future__ import annotations

import torch

from .. import env
from ..env import TRITON_IMPORT_ERROR, triton
from .ws import _aligned

WS_FP8_IMPORT_ERROR = TRITON_IMPORT_ERROR
try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from .ws import tma_load, tma_store   # the TMA copies under this Triton's names
except Exception as e:  # no Triton, or one without Gluon's Hopper module
    WS_FP8_IMPORT_ERROR = WS_FP8_IMPORT_ERROR or f"triton.experimental.gluon is unavailable ({e})"

HALF_M, SUB_N, BLOCK_K, GROUP_M = 64, 128, 128, 8   # a consumer's rows, one column part, K per promotion
SPLIT = 2                                           # column parts per tile: tiles are 128 x 256
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8_OPERANDS = (torch.float8_e4m3fn, torch.float8_e5m2)

if WS_FP8_IMPORT_ERROR is None and not env.interpreting():

    from .ws import tile_offsets   # a tile's corner in grouped order, shared with the bf16 kernel

    @gluon.jit
    def _producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K,
                  SPLIT: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
        """One warp: per (tile, K-step), both consumers' A rows (64 x 128 each) and the SPLIT
        128 x 128 parts of B, into stage s."""
        HALF_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        SUB_N: gl.constexpr = b_desc.block_type.shape[0]
        nbytes: gl.constexpr = 2 * a_desc.block_type.nbytes + SPLIT * b_desc.block_type.nbytes
        num_pid_m = gl.cdiv(M, 2 * HALF_M)
        num_pid_n = gl.cdiv(N, SPLIT * SUB_N)
        k_tiles = gl.cdiv(K, BLOCK_K)
        p = 0  # steps loaded so far; step p uses stage p % STAGES
        for tile_id in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
            off_m, off_n = tile_offsets(tile_id, num_pid_m, num_pid_n, GROUP_M, 2 * HALF_M, SPLIT * SUB_N)
            for k in range(k_tiles):
                s = p % STAGES
                # both consumers must have released the stage (the first pass returns at once)
                mbarrier.wait(empty.index(s), ((p // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(s), nbytes)
                for h in gl.static_range(2):
                    tma_load(a_desc, [off_m + h * HALF_M, k * BLOCK_K], ready.index(s),
                                                    a_bufs.index(2 * s + h))
                for j in gl.static_range(SPLIT):
                    tma_load(b_desc, [off_n + j * SUB_N, k * BLOCK_K], ready.index(s),
                                                    b_bufs.index(SPLIT * s + j))
                p += 1

    @gluon.jit
    def _mma_part(a_s, b_s, acc, scratch, use_acc, PROMOTE: gl.constexpr):
        """One 128-deep product into acc (64 x 128): through the scratch accumulator and an fp32
        add (PROMOTE), or straight into acc."""
        if PROMOTE:
            scratch = warpgroup_mma(a_s, b_s.permute((1, 0)), scratch, use_acc=False, is_async=True)
            scratch = warpgroup_mma_wait(0, deps=(scratch,))
            acc = acc + scratch   # the promotion: fp32 adds in registers
        else:
            acc = warpgroup_mma(a_s, b_s.permute((1, 0)), acc, use_acc=use_acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc,))
        return acc, scratch

    @gluon.jit
    def _consumer(a_bufs, b_bufs, ready, empty, c_desc, c_smem, scale_a_ptr, scale_b_ptr, M, N, K,
                  HALF: gl.constexpr, SPLIT: gl.constexpr, ROWWISE: gl.constexpr, PROMOTE: gl.constexpr,
                  GROUP_M: gl.constexpr, STAGES: gl.constexpr):
        """One warpgroup: rows HALF*64 .. HALF*64+63 of every tile of this program."""
        HALF_M: gl.constexpr = c_desc.block_type.shape[0]
        SUB_N: gl.constexpr = c_desc.block_type.shape[1]
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, SUB_N, 32])
        num_pid_m = gl.cdiv(M, 2 * HALF_M)
        num_pid_n = gl.cdiv(N, SPLIT * SUB_N)
        k_tiles = gl.cdiv(K, a_bufs.type.shape[2])
        scratch = gl.zeros((HALF_M, SUB_N), gl.float32, layout)   # (64, 128): one K-step's partial sum
        if not ROWWISE:
            scale = gl.load(scale_a_ptr) * gl.load(scale_b_ptr)
        c = 0  # steps consumed so far
        for tile_id in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
            off_m, off_n = tile_offsets(tile_id, num_pid_m, num_pid_n, GROUP_M, 2 * HALF_M, SPLIT * SUB_N)
            off_m += HALF * HALF_M
            acc0 = gl.zeros((HALF_M, SUB_N), gl.float32, layout)      # (64, 128): columns off_n ..
            acc1 = gl.zeros((HALF_M, SUB_N), gl.float32, layout)      # (64, 128): columns off_n + 128 ..
            for k in range(k_tiles):
                s = c % STAGES
                mbarrier.wait(ready.index(s), (c // STAGES) & 1)
                a_s = a_bufs.index(2 * s + HALF)
                acc0, scratch = _mma_part(a_s, b_bufs.index(SPLIT * s), acc0, scratch, k > 0, PROMOTE)
                acc1, scratch = _mma_part(a_s, b_bufs.index(SPLIT * s + 1), acc1, scratch, k > 0, PROMOTE)
                mbarrier.arrive(empty.index(s))   # this consumer has read the stage
                c += 1
            for j in gl.static_range(SPLIT):
                y = acc0 if j == 0 else acc1
                if ROWWISE:
                    rows = off_m + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, layout))
                    cols = off_n + j * SUB_N + gl.arange(0, SUB_N, layout=gl.SliceLayout(0, layout))
                    sa = gl.load(scale_a_ptr + rows, mask=rows < M, other=0.0)
                    sb = gl.load(scale_b_ptr + cols, mask=cols < N, other=0.0)
                    y = y * gl.expand_dims(sa, 1) * gl.expand_dims(sb, 0)
                else:
                    y = y * scale
                tma.store_wait(pendings=0)   # the previous store has read c_smem
                c_smem.index(HALF).store(y.to(c_desc.dtype))   # one rounding
                fence_async_shared()
                tma_store(c_desc, [off_m, off_n + j * SUB_N], c_smem.index(HALF))
        tma.store_wait(pendings=0)

    @gluon.jit
    def fp8_ws_kernel(
        a_desc, b_desc, c_desc,             # TMA descriptors: a (M, K) box 64 x 128; b (N, K) box 128 x 128; c box 64 x 128
        scale_a_ptr, scale_b_ptr,           # fp32 dequantisation scales: 1 each, or M and N (ROWWISE)
        M, N, K,
        SPLIT: gl.constexpr,                # 128-column parts per tile (2)
        ROWWISE: gl.constexpr, PROMOTE: gl.constexpr,
        GROUP_M: gl.constexpr, STAGES: gl.constexpr,
    ):
        dtype: gl.constexpr = a_desc.dtype
        a_bufs = gl.allocate_shared_memory(dtype, [2 * STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [SPLIT * STAGES] + b_desc.block_type.shape, b_desc.layout)
        c_smem = gl.allocate_shared_memory(c_desc.dtype, [2] + c_desc.block_type.shape, c_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)   # one arrival from each consumer
        fence_async_shared()  # the initialised barriers, visible to the TMA unit
        gl.warp_specialize([
            (_consumer, (a_bufs, b_bufs, ready, empty, c_desc, c_smem, scale_a_ptr, scale_b_ptr, M, N, K,
                         0, SPLIT, ROWWISE, PROMOTE, GROUP_M, STAGES)),
            (_consumer, (a_bufs, b_bufs, ready, empty, c_desc, c_smem, scale_a_ptr, scale_b_ptr, M, N, K,
                         1, SPLIT, ROWWISE, PROMOTE, GROUP_M, STAGES)),
            (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, SPLIT, GROUP_M, STAGES)),
        ], [4, 1], [232, 40])  # consumer 1: 4 warps, 232 registers a thread; the producer: 1 warp, 40


def fp8_ws_operands_fit(a: torch.Tensor, b: torch.Tensor, out_dtype) -> bool:
    """The operands' half of fp8_ws_eligible (any device): fp8 operands, a 16- or 32-bit output,
    a (M, K) and b (N, K) row-major with 16-byte aligned bases and row pitches, output rows of a
    multiple of 16 bytes, no dimension below 16."""
    if a.dtype not in FP8_OPERANDS or b.dtype not in FP8_OPERANDS or out_dtype not in OUT_DTYPES:
        return False
    if a.dim() != 2 or b.dim() != 2 or min(a.shape[0], b.shape[0], a.shape[1]) < 16:
        return False
    return _aligned(a) and _aligned(b) and (b.shape[0] * torch.finfo(out_dtype).bits // 8) % 16 == 0


def fp8_ws_eligible(a: torch.Tensor, b: torch.Tensor, out_dtype) -> bool:
    """True if fp8_ws_kernel can compute a @ b.T here: see the module docstring's scope. The device
    half: Gluon importable, compiled mode, a CUDA device with env.capability == (9, 0)."""
    if WS_FP8_IMPORT_ERROR is not None or env.interpreting() or not a.is_cuda or env.capability(a.device) != (9, 0):
        return False
    return fp8_ws_operands_fit(a, b, out_dtype)


_LAYOUTS: dict = {}
SMEM_BYTES = 227 * 1024   # the H100/H200 limit of dynamic shared memory per block


def default_stages(out_dtype) -> int:
    """As many load stages as fit beside the two consumers' output tiles, at most 4 (3 and 4
    timed alike on the H200): 4 for a 16-bit output, 3 for fp32."""
    stage = 2 * HALF_M * BLOCK_K + SPLIT * SUB_N * BLOCK_K          # fp8: one byte an element
    out = 2 * HALF_M * SUB_N * torch.finfo(out_dtype).bits // 8
    return min(4, (SMEM_BYTES - out - 1024) // stage)


def _layouts(out_dtype):
    """The NVMMA shared-memory layouts (swizzles) of the three descriptor boxes."""
    if out_dtype not in _LAYOUTS:
        get = gl.NVMMASharedLayout.get_default_for
        gout = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[out_dtype]
        _LAYOUTS[out_dtype] = [([HALF_M, BLOCK_K], get([HALF_M, BLOCK_K], gl.float8e4nv)),
                               ([SUB_N, BLOCK_K], get([SUB_N, BLOCK_K], gl.float8e4nv)),
                               ([HALF_M, SUB_N], get([HALF_M, SUB_N], gout))]
    return _LAYOUTS[out_dtype]


def fp8_ws_launch(a, b, c, scale_a, scale_b, rowwise: bool, promote: bool = True, stages: int | None = None,
                  num_programs: int | None = None):
    """Launch c = (a @ b.T) * scale_a * scale_b (the caller checked fp8_ws_eligible). Returns
    (the jitted kernel, the compiled kernel, grid, args, kwargs), as ws.ws_launch does."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    M, K = a.shape
    N = b.shape[0]
    (ba, la), (bb, lb), (bc, lc) = _layouts(c.dtype)
    if a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn:
        la = gl.NVMMASharedLayout.get_default_for(ba, gl.float8e5 if a.dtype == torch.float8_e5m2 else gl.float8e4nv)
        lb = gl.NVMMASharedLayout.get_default_for(bb, gl.float8e5 if b.dtype == torch.float8_e5m2 else gl.float8e4nv)
    descs = (TensorDescriptor.from_tensor(a, ba, la), TensorDescriptor.from_tensor(b, bb, lb),
             TensorDescriptor.from_tensor(c, bc, lc))
    tiles = triton.cdiv(M, 2 * HALF_M) * triton.cdiv(N, SPLIT * SUB_N)
    grid = (min(num_programs or env.num_sms(a.device), tiles),)
    if stages is None:
        stages = default_stages(c.dtype)
    args = (*descs, scale_a, scale_b, M, N, K)
    kwargs = dict(SPLIT=SPLIT, ROWWISE=rowwise, PROMOTE=promote, GROUP_M=GROUP_M, STAGES=stages, num_warps=4)
    compiled = fp8_ws_kernel[grid](*args, **kwargs)
    return fp8_ws_kernel, compiled, grid, args, kwargs
