"""A warp-specialised Hopper matmul written in Gluon, on 128 x 192 tiles (chapter 6).

Why 128 x 192. GPT-2's products with N = 768 outputs (attn.c_proj, mlp.c_proj) fill the GPU badly
with power-of-two tiles: 12288 x 768 makes 576 tiles of 128 x 128, 4.36 waves on 132
multiprocessors, run as 5. cuBLAS takes 192 x 192 tiles there (256 tiles, 1.94 waves), with one
warpgroup issuing TMA loads and two doing the MMAs. Triton's tile language has only power-of-two
blocks, and a 192-wide tile written as two `tl.dot` accumulators (128 + 64 columns) is slow: the
persistent loop resets them between tiles with register selects, and the assembler then
serialises every MMA (ptxas warning C7515). Gluon, Triton's lower-level dialect, lets the kernel
state its schedule itself, as partitions of warps (`gl.warp_specialize`):

* the **producer** (one warp) runs the TMA loads of every (tile, K-step) of this program into a
  ring of STAGES shared-memory stages. Before reusing a stage it waits on that stage's `empty`
  barrier; each load arms the stage's `ready` barrier with the bytes it will deliver. It runs
  ahead into the next tile while the MMA warps are in an epilogue, so a new tile starts with its
  operands already loaded;
* the **MMA** partition (8 warps, two warpgroups sharing a tile's 128 rows) waits on `ready`,
  issues two asynchronous warpgroup MMAs per K-step (the 128- and the 64-wide part, same A
  stage), starts every tile with `use_acc=False` instead of zeroing registers, and releases a
  stage (arrives on `empty`) once the MMAs that read it are done. Then the epilogue: bias in
  fp32 (loaded before the tile's MMAs), one rounding, TMA stores (which drop what lies past
  the edges; loads past the edges read zeros);
* with a bias, **two MMA partitions** of one warpgroup each instead (ROLES = 2, `mma_roles`),
  each owning a whole 128 x 192 accumulator and taking the program's tiles in turn, so that one's
  epilogue, the bias's load among it, runs while the other's MMAs keep the tensor cores busy
  (CUTLASS's "ping-pong" schedule);
* for an output at most four tiles across (N = 768), the **sliced store** instead
  (`sliced_store`): one partition, the tile stored in three 128 x 64 slices through a single
  staging buffer, which leaves room in shared memory for a fifth load stage.

The epilogues (EPILOGUE):

0. C = A B (+ bias), rounded once (`launch`, for `matmul.plan`).
1. `gelu_forward`, the MLP's first product (fast/mlp.py): Z = A w^T + bias and gelu(Z), both
   stored. A third partition of four warps stores Z, evaluates GELU from it in place and stores
   that, while the MMA warps go on to the next tile (barriers z_ready and z_empty), so GELU's
   arithmetic costs no tensor-core time.
2. `gelu_backward_fused`, the MLP's backward: dZ = (dOut W_proj) * gelu'(Z) and the bias
   gradient's column sums, in a partition of eight warps (`_gelu_grad_partition`). Withdrawn from
   the recipes: it gave different gradients when other work shared the GPU (fast/mlp.py's
   WITHDRAWN); the kernel keeps it for its tests.
3. `launch_split`, the weight gradient dW = dY.t() @ X (A read transposed: the producer loads
   (K, M) boxes of dY and the MMA reads them as transposed views, as it reads w). Such a product
   has few output tiles and a long K (attn.c_proj's dW: 24 tiles for 132 multiprocessors, 192
   K-steps each), so each tile's K-steps are split into SPLIT_K slices, each a work unit of its
   own whose fp32 product goes from registers into plane s of a (SPLIT_K, M, N) buffer; the host
   adds the planes with one rounding. `split_for` picks the slices from a cost model
   (`split_cost`), `split_tile` whether an unsplit product takes 128 x 160 tiles that fill more
   of the GPU, and `split_preferred` whether `auto` takes this path.

Scope, checked by `ws_eligible`: sm_90 exactly (Blackwell has no wgmma), bf16/fp16, A (M, K)
with unit column stride, and B either as the forward layout reads it (B = w.t() for a row-major
weight w (N, K): the MMA reads each (N, K) stage transposed) or row-major (K, N), as the input
gradient dX = dY @ W reads the weight (the MMA reads the (K, N) stage as it is); optional bias,
no activation, C row-major; every base address and row pitch 16-byte aligned. `kernel="auto"`
takes it for either layout where `ws_preferred` says its tiles fill the waves. Everything else
goes to the TMA kernel (tma.py) or the grouped kernel (grouped.py); `matmul.plan` decides. Gluon
kernels run only compiled (there is no interpreter for them); where Gluon is missing,
WS_IMPORT_ERROR says why and nothing here is used.
measured: records train-profile-epilogue-h200 (epilogue 1), kernels-grads-h200 (dX)
"""
from __future__ import annotations

import torch

from .. import env
from ..env import TRITON_IMPORT_ERROR, triton
from ..launch import compiled_launch, lean_launch_enabled

WS_IMPORT_ERROR = TRITON_IMPORT_ERROR
try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
except Exception as e:  # no Triton, or one without Gluon's Hopper module
    WS_IMPORT_ERROR = WS_IMPORT_ERROR or f"triton.experimental.gluon is unavailable ({e})"
else:
    # Triton 3.9 renamed Gluon's TMA copies (async_copy_global_to_shared -> async_load,
    # async_copy_shared_to_global -> async_store; same arguments) and made the old names raise.
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    # A barrier among the warps of one partition: gl.barrier in Triton 3.9, gl.thread_barrier in 3.6.
    _sync_partition = getattr(gl, "barrier", None) or gl.thread_barrier

# The one configuration (four load stages: faster than three on the H200 at every shape timed).
BLOCK_M, BLOCK_N, EXTRA_N, BLOCK_K, STAGES, GROUP_M, NUM_WARPS = 128, 128, 64, 64, 4, 8, 8
# Four stages of 40 KiB and C's two staging buffers (48 KiB) fill the 227 KiB of shared memory a
# block may have. Without the 128 x 128 staging buffer, a fifth stage fits: DEEP_STAGES, for
# launch_split's units (they write their fp32 products from registers, on 128 x 192 tiles or, where
# split_tile picks it, 128 x 160: NARROW_EXTRA_N, a 32-wide second accumulator) and for the sliced
# store (see sliced_store; SLICED_STORE False turns it off).
NARROW_EXTRA_N, DEEP_STAGES = 32, 5
SLICED_STORE = True

if WS_IMPORT_ERROR is None and not env.interpreting():

    @gluon.jit
    def tile_offsets(tile_id, num_pid_m, num_pid_n, GROUP_M: gl.constexpr, BLOCK_M: gl.constexpr,
                      TILE_N: gl.constexpr):
        """Corner of tile `tile_id` in grouped order (as epilogue.tile_coords, in Gluon)."""
        num_pid_in_group = GROUP_M * num_pid_n
        group_id = tile_id // num_pid_in_group
        first_pid_m = group_id * GROUP_M
        group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
        pid_m = first_pid_m + (tile_id % num_pid_in_group) % group_size_m
        pid_n = (tile_id % num_pid_in_group) // group_size_m
        return pid_m * BLOCK_M, pid_n * TILE_N

    @gluon.jit
    def unit_work(unit, num_tiles, k_tiles, SPLIT_K: gl.constexpr):
        """(tile, first K-step, end K-step) of work unit `unit`. With SPLIT_K > 1 each tile is
        SPLIT_K units, each summing a contiguous slice of the K-steps into a partial sum of its
        own; units are numbered slice-major (slice 0 of every tile first), so the programs at
        work at one time read neighbouring tiles' operands, as in the unsplit kernel."""
        if SPLIT_K == 1:
            tile_id = unit
            k_lo = 0
            k_hi = k_tiles
        else:
            s = unit // num_tiles
            tile_id = unit - s * num_tiles
            k_lo = s * k_tiles // SPLIT_K
            k_hi = (s + 1) * k_tiles // SPLIT_K
        return tile_id, k_lo, k_hi

    @gluon.jit
    def _producer(a_desc, b_desc, b2_desc, a_bufs, b_bufs, b2_bufs, ready, empty, M, N, K,
                  A_T: gl.constexpr, B_ROW_MAJOR: gl.constexpr, GROUP_M: gl.constexpr, SPLIT_K: gl.constexpr,
                  STAGES: gl.constexpr):
        """One warp: the TMA loads of every (tile, K-step) of this program, at most STAGES ahead."""
        # A's boxes are (BLOCK_M, BLOCK_K), or (BLOCK_K, BLOCK_M) when A is read transposed (A_T)
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[1 if A_T else 0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[0 if A_T else 1]
        # B's boxes are (BLOCK_K, width) when B is row-major (K, N), (width, BLOCK_K) for w (N, K)
        N_DIM: gl.constexpr = 1 if B_ROW_MAJOR else 0
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[N_DIM]
        TILE_N: gl.constexpr = BLOCK_N + b2_desc.block_type.shape[N_DIM]
        nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes + b2_desc.block_type.nbytes
        num_pid_m = gl.cdiv(M, BLOCK_M)
        num_pid_n = gl.cdiv(N, TILE_N)
        k_tiles = gl.cdiv(K, BLOCK_K)
        num_tiles = num_pid_m * num_pid_n
        p = 0  # steps loaded so far; step p uses stage p % STAGES
        for unit in range(gl.program_id(0), num_tiles * SPLIT_K, gl.num_programs(0)):
            tile_id, k_lo, k_hi = unit_work(unit, num_tiles, k_tiles, SPLIT_K)
            off_m, off_n = tile_offsets(tile_id, num_pid_m, num_pid_n, GROUP_M, BLOCK_M, TILE_N)
            for k in range(k_lo, k_hi):
                s = p % STAGES
                # Wait until the MMA warps released this stage. In the first pass through the
                # ring nothing was released yet: waiting on the parity of the phase "before"
                # phase 0 returns at once.
                mbarrier.wait(empty.index(s), ((p // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(s), nbytes)
                if A_T:
                    tma_load(a_desc, [k * BLOCK_K, off_m], ready.index(s), a_bufs.index(s))
                else:
                    tma_load(a_desc, [off_m, k * BLOCK_K], ready.index(s), a_bufs.index(s))
                if B_ROW_MAJOR:
                    tma_load(b_desc, [k * BLOCK_K, off_n], ready.index(s), b_bufs.index(s))
                    tma_load(b2_desc, [k * BLOCK_K, off_n + BLOCK_N], ready.index(s), b2_bufs.index(s))
                else:
                    tma_load(b_desc, [off_n, k * BLOCK_K], ready.index(s), b_bufs.index(s))
                    tma_load(b2_desc, [off_n + BLOCK_N, k * BLOCK_K], ready.index(s), b2_bufs.index(s))
                p += 1

    @gluon.jit
    def _load_bias(bias_ptr, off_n, N, WIDTH: gl.constexpr, layout: gl.constexpr):
        """bias[off_n : off_n + WIDTH] in fp32 as a (1, WIDTH) row in the accumulator's layout (0 past N)."""
        cols = off_n + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, layout))
        return gl.expand_dims(gl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(gl.float32), 0)

    @gluon.jit
    def _tanh(x):
        """tanh(x) in one instruction, PTX tanh.approx.f32 (sm_75 and later; about 2^-11 relative
        error by the PTX ISA manual). In GELU, 0.5 z (1 + t), that allows an absolute error of
        about 2^-12 |z| where t is near -1 (z well below 0, where gelu(z) itself is near 0): at
        z = -3 up to 7e-4, against gelu(-3) = -0.0036.
        Why one instruction: the epilogue runs while the tensor cores wait, and the
        special-function unit, which evaluates exp, reciprocals and tanh, does 16 of them per
        clock and multiprocessor against 128 fused multiply-adds: one call instead of two (exp and
        a reciprocal, as epilogue.sigmoid_f32 has) is most of what GELU costs here."""
        return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True,
                                         pack=1)

    @gluon.jit
    def _gelu(z):
        """GELU's tanh approximation, 0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3))), in fp32."""
        t = _tanh(0.7978845608028654 * z * (1.0 + 0.044715 * z * z))
        hz = 0.5 * z
        return hz + hz * t

    @gluon.jit
    def _store_slice(c2_desc, c2_smem, x, off_m, off_n):
        """x (BLOCK_M, EXTRA_N), rounded once, through the staging buffer c2_smem to C at (off_m,
        off_n) by TMA, after the buffer's previous store has read it. One thread issues each copy,
        and a bulk-copy wait covers only the copies its own thread issued; so each barrier of the
        partition's warps lets that one thread's wait, or its copy, speak for all of them."""
        tma.store_wait(pendings=0)  # (the thread that issued it) the previous copy has read the buffer
        _sync_partition()
        c2_smem.store(x.to(c2_desc.dtype))
        fence_async_shared()        # the stores above, visible to the TMA unit
        _sync_partition()           # every warp has stored its rows before one thread issues the copy
        tma_store(c2_desc, [off_m, off_n], c2_smem)

    @gluon.jit
    def _mma_partition(a_bufs, b_bufs, b2_bufs, ready, empty, z_ready, z_empty, c_free, turn, c_desc, c2_desc,
                       c_smem, c2_smem, bias_ptr, part_ptr, M, N, K,
                       HAS_BIAS: gl.constexpr, EPILOGUE: gl.constexpr, A_T: gl.constexpr, B_ROW_MAJOR: gl.constexpr,
                       GROUP_M: gl.constexpr, SPLIT_K: gl.constexpr, STAGES: gl.constexpr, ROLE: gl.constexpr,
                       ROLES: gl.constexpr, SLICED: gl.constexpr, num_warps: gl.constexpr):
        """The MMAs and the epilogue of every tile (or, split along K, every work unit) of this
        program; with ROLES = 2 (EPILOGUE 0, unsplit), of every other tile: two such partitions,
        one warpgroup each, take the program's tiles in turn (ROLE 0 the first, third, ...), so
        that one's epilogue runs while the other's MMAs keep the tensor cores busy.

        Taking turns needs two more barriers. `turn` completes once per tile, when that tile's
        MMAs have all been issued: a partition waits for it before its next tile's first step.
        Without it, the second partition would wait on the ready barrier of a step a whole ring
        ahead, and a phase parity cannot tell that step from the one loaded a ring earlier.
        `c_free` completes once per tile, when that tile's TMA stores have read the shared
        staging buffers (c_smem, c2_smem), which the two partitions share (two sets and four load
        stages do not fit in shared memory)."""
        BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
        EXTRA_N: gl.constexpr = c2_desc.block_type.shape[1]
        BLOCK_K: gl.constexpr = a_bufs.type.shape[1 if A_T else 2]  # (STAGES, BLOCK_M, BLOCK_K), or K first if A_T
        # Accumulators in wgmma's register layout: warpgroups stacked along M, each owning
        # BLOCK_M / (num_warps / 4) rows; one instruction covers 64 rows x (BLOCK_N or EXTRA_N) x 16.
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
        layout2: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                          instr_shape=[16, EXTRA_N, 16])
        num_pid_m = gl.cdiv(M, BLOCK_M)
        num_pid_n = gl.cdiv(N, BLOCK_N + EXTRA_N)
        k_tiles = gl.cdiv(K, BLOCK_K)
        acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, layout)     # (BLOCK_M, BLOCK_N)
        acc2 = gl.zeros((BLOCK_M, EXTRA_N), gl.float32, layout2)   # (BLOCK_M, EXTRA_N): the next columns
        num_tiles = num_pid_m * num_pid_n
        # Taking turns assumes whole tiles (each tile's first step is i * k_tiles) and the plain epilogue;
        # the sliced store, the plain epilogue of one partition.
        gl.static_assert(ROLES == 1 or (EPILOGUE == 0 and SPLIT_K == 1))
        gl.static_assert(not SLICED or (ROLES == 1 and EPILOGUE == 0))
        pid = gl.program_id(0)
        step = gl.num_programs(0)
        c = 0  # steps consumed so far
        t = 0  # tiles handed to the epilogue partition so far (EPILOGUE 1 and 2)
        for unit in range(pid + ROLE * step, num_tiles * SPLIT_K, ROLES * step):
            tile_id, k_lo, k_hi = unit_work(unit, num_tiles, k_tiles, SPLIT_K)
            if ROLES > 1:
                i = (unit - pid) // step  # this is the program's i-th tile
                c = i * k_tiles           # the steps of its tiles before this one (all of K each)
                mbarrier.wait(turn, (i & 1) ^ 1)  # tile i - 1's MMAs are issued (tile 0 waits on nothing)
            off_m, off_n = tile_offsets(tile_id, num_pid_m, num_pid_n, GROUP_M, BLOCK_M, BLOCK_N + EXTRA_N)
            if HAS_BIAS and ROLES == 1:  # loaded now, so that its latency hides behind the MMAs
                bias = _load_bias(bias_ptr, off_n, N, BLOCK_N, layout)
                bias2 = _load_bias(bias_ptr, off_n + BLOCK_N, N, EXTRA_N, layout2)
            for k in range(k_lo, k_hi):
                s = c % STAGES
                mbarrier.wait(ready.index(s), (c // STAGES) & 1)
                # Row-major B stages are (K, N) tiles, read as they are; stages of w are (N, K)
                # tiles, read transposed (a view: wgmma reads either order of a 16-bit operand).
                # The same for A: (K, M) stages of a transposed A are read as (M, K) views.
                # use_acc=False on a unit's first step discards what the registers held.
                if A_T:
                    a_op = a_bufs.index(s).permute((1, 0))
                else:
                    a_op = a_bufs.index(s)
                if B_ROW_MAJOR:
                    b_op = b_bufs.index(s)
                    b2_op = b2_bufs.index(s)
                else:
                    b_op = b_bufs.index(s).permute((1, 0))
                    b2_op = b2_bufs.index(s).permute((1, 0))
                acc = warpgroup_mma(a_op, b_op, acc, use_acc=k > k_lo, is_async=True)
                acc2 = warpgroup_mma(a_op, b2_op, acc2, use_acc=k > k_lo, is_async=True)
                # At most this step's two MMAs are still running, so the previous step's stage
                # has been read: hand it back to the producer.
                acc, acc2 = warpgroup_mma_wait(2, deps=(acc, acc2))
                mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES), pred=k > k_lo)
                c += 1
            if ROLES > 1:
                # Every warp of this partition has passed its waits of this tile (one thread
                # arrives): with a single K-step, a lagging warp could otherwise still be waiting
                # on `turn` for this tile when the arrive completes the next phase, of the same
                # parity, and wait for ever.
                _sync_partition()
                mbarrier.arrive(turn)  # the other partition may start the next tile
            acc, acc2 = warpgroup_mma_wait(0, deps=(acc, acc2))
            mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES))
            y, y2 = acc, acc2  # new names: a bias sum must not write the accumulators' registers
            if HAS_BIAS and ROLES > 1:  # loaded only now: a whole tile's accumulator leaves no registers for
                # it during the MMAs, and here its latency hides behind the other partition's MMAs
                bias = _load_bias(bias_ptr, off_n, N, BLOCK_N, layout)
                bias2 = _load_bias(bias_ptr, off_n + BLOCK_N, N, EXTRA_N, layout2)
            if HAS_BIAS:
                y, y2 = acc + bias, acc2 + bias2
            if EPILOGUE == 3:
                # The unit's fp32 partial sum, from registers into its slice's plane of
                # part (SPLIT_K, M, N); the host adds the planes, with one rounding.
                plane = part_ptr + (unit // num_tiles).to(gl.int64) * M * N
                _store_rows(plane, acc, off_m, 0, off_n, M, N, BLOCK_M, BLOCK_N, layout)
                _store_rows(plane, acc2, off_m, 0, off_n + BLOCK_N, M, N, BLOCK_M, EXTRA_N, layout2)
            elif EPILOGUE >= 1:
                # The tile, rounded once, goes to the epilogue partition through c_smem / c2_smem
                # (Z for EPILOGUE 1, dH for EPILOGUE 2); these warps go on to the next tile's MMAs
                # while that partition finishes it.
                mbarrier.wait(z_empty, (t & 1) ^ 1)  # the partition is done with the last tile
                c_smem.store(y.to(c_desc.dtype))
                c2_smem.store(y2.to(c2_desc.dtype))
                fence_async_shared()  # the stores above, visible to the TMA unit (EPILOGUE 1 stores Z by TMA)
                _sync_partition()     # every warp has stored its rows before one thread arrives
                mbarrier.arrive(z_ready)
                t += 1
            elif ROLES > 1:
                mbarrier.wait(c_free, (i & 1) ^ 1)  # tile i - 1's stores have read the staging buffers
                c_smem.store(y.to(c_desc.dtype))  # one rounding
                c2_smem.store(y2.to(c2_desc.dtype))
                fence_async_shared()  # the stores above, visible to the TMA unit
                _sync_partition()     # every warp has stored its rows before one thread issues the copies
                tma_store(c_desc, [off_m, off_n], c_smem)
                tma_store(c2_desc, [off_m, off_n + BLOCK_N], c2_smem)
                tma.store_wait(pendings=0)  # (each thread that issued a copy) the buffers have been read ...
                _sync_partition()           # ... and every warp knows it
                mbarrier.arrive(c_free)     # ... so the other partition may fill them
            elif SLICED:
                # Only c2_smem (BLOCK_M x EXTRA_N) stages the tile. c_smem is then never used, and
                # the compiler drops unused allocations, which leaves room for a fifth stage
                # (sliced_store; the ahead-of-time test checks the size). The first BLOCK_N columns
                # go out as two halves split in registers, then the last EXTRA_N; each slice is
                # written once the previous slice's TMA store has read the buffer.
                gl.static_assert(BLOCK_N == 2 * EXTRA_N)
                y_lo, y_hi = gl.split(gl.permute(gl.reshape(y, [BLOCK_M, 2, EXTRA_N]), (0, 2, 1)))
                _store_slice(c2_desc, c2_smem, y_lo, off_m, off_n)
                _store_slice(c2_desc, c2_smem, y_hi, off_m, off_n + EXTRA_N)
                _store_slice(c2_desc, c2_smem, y2, off_m, off_n + BLOCK_N)
            else:
                # The previous tile's TMA stores must have read c_smem / c2_smem before we overwrite them.
                tma.store_wait(pendings=0)
                c_smem.store(y.to(c_desc.dtype))  # one rounding
                c2_smem.store(y2.to(c2_desc.dtype))
                fence_async_shared()  # the stores above, visible to the TMA unit
                tma_store(c_desc, [off_m, off_n], c_smem)
                tma_store(c2_desc, [off_m, off_n + BLOCK_N], c2_smem)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _gelu_partition(c_desc, c2_desc, z_desc, z2_desc, c_smem, c2_smem, z_ready, z_empty, M, N,
                        GROUP_M: gl.constexpr):
        """EPILOGUE == 1, four warps: for each tile the MMA warps hand over (Z in c_smem / c2_smem),
        store Z, then gelu(Z) in place of it, and hand the buffers back. It runs beside the next
        tile's MMAs, so GELU's arithmetic costs no tensor-core time."""
        BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
        EXTRA_N: gl.constexpr = c2_desc.block_type.shape[1]
        # Row chunks of ROWS x BLOCK_N (and ROWS x EXTRA_N): 32 and 16 values a thread.
        ROWS: gl.constexpr = 32
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])   # 8 rows x 128 columns
        layout2: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])   # 16 rows x 64 columns
        num_pid_m = gl.cdiv(M, BLOCK_M)
        num_pid_n = gl.cdiv(N, BLOCK_N + EXTRA_N)
        t = 0
        for tile_id in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
            off_m, off_n = tile_offsets(tile_id, num_pid_m, num_pid_n, GROUP_M, BLOCK_M, BLOCK_N + EXTRA_N)
            mbarrier.wait(z_ready, t & 1)
            tma_store(z_desc, [off_m, off_n], c_smem)
            tma_store(z2_desc, [off_m, off_n + BLOCK_N], c2_smem)
            tma.store_wait(pendings=0)  # the thread that issued the stores: Z has been read out of the buffers
            _sync_partition()           # ... and every warp knows it before overwriting them
            for r in gl.static_range(BLOCK_M // ROWS):
                part = c_smem.slice(r * ROWS, ROWS)
                part.store(_gelu(part.load(layout).to(gl.float32)).to(c_desc.dtype))
                part2 = c2_smem.slice(r * ROWS, ROWS)
                part2.store(_gelu(part2.load(layout2).to(gl.float32)).to(c2_desc.dtype))
            fence_async_shared()
            _sync_partition()  # all four warps' rows are in place before the stores read them
            tma_store(c_desc, [off_m, off_n], c_smem)
            tma_store(c2_desc, [off_m, off_n + BLOCK_N], c2_smem)
            tma.store_wait(pendings=0)
            mbarrier.arrive(z_empty)  # the buffers are free for the next tile's Z
            t += 1

    @gluon.jit
    def _gelu_grad(z):
        """gelu'(z) in fp32, as gelu.gelu_grad_f32 computes it (the sigmoid form, exp and one fast
        division), so the fused backward gives the separate pass's dZ:
        s = sigmoid(v), v = 2 sqrt(2/pi) (z + 0.044715 z^3); gelu'(z) = s + z s (1 - s) 2 sqrt(2/pi) (1 + 3 * 0.044715 z^2).
        Not tanh.approx as in the forward: near |t| = 1 its 2^-11 relative error grows through
        1 - t^2 to the size of dZ's own bf16 rounding."""
        zz = z * z
        v = 1.5957691216057308 * z * (1.0 + 0.044715 * zz)
        e = gl.exp(-gl.abs(v))
        r = gl.fdiv(gl.full(v.shape, 1.0, gl.float32, v.type.layout), 1.0 + e, ieee_rounding=False)
        s = gl.where(v >= 0, r, e * r)
        return s + z * s * (1.0 - s) * 1.5957691216057308 * (1.0 + 0.134145 * zz)

    @gluon.jit
    def _load_z_tile(z_desc, z2_desc, z_smem, z2_smem, z_loaded, tile_id, num_pid_m, num_pid_n,
                     GROUP_M: gl.constexpr):
        """TMA loads of tile `tile_id` of Z into z_smem / z2_smem, arriving on z_loaded (zeros past
        the edges)."""
        BLOCK_M: gl.constexpr = z_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = z_desc.block_type.shape[1]
        off_m, off_n = tile_offsets(tile_id, num_pid_m, num_pid_n, GROUP_M, BLOCK_M, BLOCK_N + z2_desc.block_type.shape[1])
        mbarrier.expect(z_loaded, z_desc.block_type.nbytes + z2_desc.block_type.nbytes)
        tma_load(z_desc, [off_m, off_n], z_loaded, z_smem)
        tma_load(z2_desc, [off_m, off_n + BLOCK_N], z_loaded, z2_smem)

    @gluon.jit
    def _store_rows(out_ptr, x, off_m, r0, col0, M, N, ROWS: gl.constexpr, WIDTH: gl.constexpr,
                    layout: gl.constexpr):
        """x (ROWS, WIDTH) into out (M, N), row-major contiguous, at rows off_m + r0 .., columns
        col0 ..; what lies past M or N is left out (as a TMA store leaves it)."""
        rows = off_m + r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        cols = cols_of(col0, WIDTH, layout)
        offs = gl.expand_dims(rows.to(gl.int64) * N, 1) + gl.expand_dims(cols, 0)
        gl.store(out_ptr + offs, x, mask=gl.expand_dims(rows < M, 1) & gl.expand_dims(cols < N, 0))

    @gluon.jit
    def _gelu_grad_partition(c_desc, c2_desc, z_desc, z2_desc, c_smem, c2_smem, z_smem, z2_smem, z_ready, z_empty,
                             z_loaded, out_ptr, part_ptr, M, N, HAS_BIAS: gl.constexpr, GROUP_M: gl.constexpr):
        """EPILOGUE == 2, eight warps: for each tile the MMA warps hand over dH = dOut W (in c_smem /
        c2_smem); dZ = dH * gelu'(Z) goes from registers straight to out (M, N) in global memory;
        with HAS_BIAS each column's sum of the fp32 dZ over the tile's rows goes to part
        (N, cdiv(M, BLOCK_M)) at [column, tile row].
        Withdrawn from the recipes: it gave different gradients when other work shared the GPU
        (fast/mlp.py's WITHDRAWN); the kernel keeps it for its tests.
        Z comes by TMA into shared memory of its own: the next tile's load starts as soon as this
        tile's Z has been read, so it arrives while that tile's MMAs run. Why this shape:
        * dZ goes to global memory from registers, not back into the staging buffers for a TMA
          store: a store into a buffer that a later chunk loads from makes the compiler put a
          barrier of the partition's warps between them (it cannot tell that the two slices do
          not overlap), two a chunk, so each chunk's loads, arithmetic and stores would run in turn.
        * Eight warps of 64 registers, not four of 96: the arithmetic (about 30 instructions an
          element) waits on its own latency, not on issue, and twice the warps hide more of it.
        measured: record kernels-dgelu-eight-warps-h100"""
        BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
        EXTRA_N: gl.constexpr = c2_desc.block_type.shape[1]
        ROWS: gl.constexpr = 8  # row chunks of ROWS x BLOCK_N (and ROWS x EXTRA_N): 4 and 2 values a thread
        CHUNKS: gl.constexpr = BLOCK_M // ROWS
        # Eight warps, each owning an eighth of the columns and all ROWS rows, so the column sums
        # need only shuffles within a warp (a sum across warps would go through shared memory).
        layout: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [1, 8], [1, 0])    # 8 rows x 128 columns
        layout2: gl.constexpr = gl.BlockedLayout([1, 2], [8, 4], [1, 8], [1, 0])   # 8 rows x 64 columns
        dtype: gl.constexpr = c_desc.dtype
        num_pid_m = gl.cdiv(M, BLOCK_M)
        num_pid_n = gl.cdiv(N, BLOCK_N + EXTRA_N)
        num_tiles = num_pid_m * num_pid_n
        step = gl.num_programs(0)
        _load_z_tile(z_desc, z2_desc, z_smem, z2_smem, z_loaded, gl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
        t = 0
        for tile_id in range(gl.program_id(0), num_tiles, step):
            off_m, off_n = tile_offsets(tile_id, num_pid_m, num_pid_n, GROUP_M, BLOCK_M, BLOCK_N + EXTRA_N)
            acc = gl.zeros((ROWS, BLOCK_N), gl.float32, layout)    # column sums, element-wise over chunks
            acc2 = gl.zeros((ROWS, EXTRA_N), gl.float32, layout2)
            mbarrier.wait(z_ready, t & 1)   # dH handed over
            mbarrier.wait(z_loaded, t & 1)  # Z arrived
            for r in gl.static_range(CHUNKS):
                dz = c_smem.slice(r * ROWS, ROWS).load(layout).to(gl.float32) * _gelu_grad(
                    z_smem.slice(r * ROWS, ROWS).load(layout).to(gl.float32))
                _store_rows(out_ptr, dz.to(dtype), off_m, r * ROWS, off_n, M, N, ROWS, BLOCK_N, layout)
                dz2 = c2_smem.slice(r * ROWS, ROWS).load(layout2).to(gl.float32) * _gelu_grad(
                    z2_smem.slice(r * ROWS, ROWS).load(layout2).to(gl.float32))
                _store_rows(out_ptr, dz2.to(dtype), off_m, r * ROWS, off_n + BLOCK_N, M, N, ROWS, EXTRA_N, layout2)
                if HAS_BIAS:  # rows past M hold dH = 0 (TMA read zeros there), so they add nothing
                    acc += dz
                    acc2 += dz2
            _sync_partition()          # all eight warps have read dH and Z ...
            mbarrier.arrive(z_empty)   # ... so the MMA warps may hand over the next tile's dH
            if tile_id + step < num_tiles:  # and the next tile's Z may come, during that tile's MMAs
                _load_z_tile(z_desc, z2_desc, z_smem, z2_smem, z_loaded, tile_id + step, num_pid_m, num_pid_n,
                             GROUP_M)
            if HAS_BIAS:  # one sum across the rows a tile
                pid_m = off_m // BLOCK_M
                gl.store(part_ptr + cols_of(off_n, BLOCK_N, layout).to(gl.int64) * num_pid_m + pid_m,
                         gl.sum(acc, axis=0), mask=cols_of(off_n, BLOCK_N, layout) < N)
                gl.store(part_ptr + cols_of(off_n + BLOCK_N, EXTRA_N, layout2).to(gl.int64) * num_pid_m + pid_m,
                         gl.sum(acc2, axis=0), mask=cols_of(off_n + BLOCK_N, EXTRA_N, layout2) < N)
            t += 1

    @gluon.jit
    def cols_of(off_n, WIDTH: gl.constexpr, layout: gl.constexpr):
        """Columns off_n .. off_n + WIDTH as a vector along the columns of `layout`."""
        return off_n + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, layout))

    @gluon.jit
    def matmul_ws_kernel(
        a_desc, b_desc, b2_desc,            # TMA descriptors of A (M, K) and of w (N, K) or B (K, N), two box widths
        c_desc, c2_desc,                    # ... of C (M, N), two box widths
        z_desc, z2_desc,                    # ... of Z (M, N): written if EPILOGUE == 1, read if EPILOGUE == 2
        bias_ptr,                           # bias (N,), read only if HAS_BIAS and EPILOGUE < 2
        out_ptr,                            # C's memory (M, N), contiguous: EPILOGUE 2 writes C through it
        part_ptr,                           # fp32: (N, cdiv(M, BLOCK_M)) column sums if EPILOGUE == 2 and HAS_BIAS,
                                            # (SPLIT_K, M, N) partial products if EPILOGUE == 3
        M, N, K,
        HAS_BIAS: gl.constexpr,             # EPILOGUE < 2: add bias; EPILOGUE == 2: sum dZ's columns into part
        EPILOGUE: gl.constexpr,             # 0: C = A B (+ bias); 1: also Z = that, and C = gelu(Z);
                                            # 2: C = (A B) * gelu'(Z), GELU's backward (A = dOut, B = W; withdrawn);
                                            # 3: part[s] = A[:, Ks] B[Ks, :] in fp32, for each K slice s
        A_T: gl.constexpr,                  # False: a_desc describes A (M, K); True: A.t() (K, M) row-major
        B_ROW_MAJOR: gl.constexpr,          # False: b_desc describes w (N, K); True: B (K, N) row-major
        GROUP_M: gl.constexpr,
        SPLIT_K: gl.constexpr,              # work units per tile, each a slice of K (only with EPILOGUE 3)
        STAGES: gl.constexpr,               # shared-memory stages in the load ring
        ROLES: gl.constexpr,                # MMA partitions taking the tiles in turn: 1, or 2 (EPILOGUE 0, SPLIT_K 1)
        SLICED: gl.constexpr,               # EPILOGUE 0, ROLES 1: the tile stored in slices through c2_smem alone
        num_warps: gl.constexpr,            # of each MMA partition (the producer adds one warp)
    ):
        # The descriptors are built on the host (ws_launch) and passed as kernel parameters, so
        # every thread of every partition sees them without a device-side fence. Their boxes
        # fix the tile: BLOCK_M x BLOCK_K for A, BLOCK_N (EXTRA_N) x BLOCK_K for w (BLOCK_K x
        # BLOCK_N for a row-major B), and so on.
        dtype: gl.constexpr = a_desc.dtype
        a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
        b2_bufs = gl.allocate_shared_memory(dtype, [STAGES] + b2_desc.block_type.shape, b2_desc.layout)
        c_smem = gl.allocate_shared_memory(dtype, c_desc.block_type.shape, c_desc.layout)
        c2_smem = gl.allocate_shared_memory(dtype, c2_desc.block_type.shape, c2_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        z_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())  # Z handed over
        z_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())  # ... and handed back
        c_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())   # ROLES 2: C's buffers free
        turn = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())     # ROLES 2: a tile's MMAs issued
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        mbarrier.init(z_ready, count=1)
        mbarrier.init(z_empty, count=1)
        mbarrier.init(c_free, count=1)
        mbarrier.init(turn, count=1)
        fence_async_shared()  # the initialised barriers, visible to the TMA unit
        # The producer: 1 warp, 40 registers a thread; for EPILOGUE == 1 the GELU partition: 4 warps,
        # 96 registers a thread; for EPILOGUE == 2 GELU's backward: 8 warps of 64 registers, which
        # leaves the MMA warps 152, enough not to spill (ptxas, ahead of time for sm_90). The MMA
        # warps get the rest. The three
        # lists repeat the first two partitions because the JIT can hold neither a function nor
        # (keeping it constexpr) a constexpr argument in a variable.
        if EPILOGUE == 2:
            z_smem = gl.allocate_shared_memory(dtype, z_desc.block_type.shape, z_desc.layout)
            z2_smem = gl.allocate_shared_memory(dtype, z2_desc.block_type.shape, z2_desc.layout)
            z_loaded = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            mbarrier.init(z_loaded, count=1)
            fence_async_shared()
            gl.warp_specialize([
                (_mma_partition, (a_bufs, b_bufs, b2_bufs, ready, empty, z_ready, z_empty, c_free, turn, c_desc,
                                  c2_desc, c_smem, c2_smem, bias_ptr, part_ptr, M, N, K, False, EPILOGUE, A_T,
                                  B_ROW_MAJOR, GROUP_M, SPLIT_K, STAGES, 0, 1, SLICED, num_warps)),
                (_producer, (a_desc, b_desc, b2_desc, a_bufs, b_bufs, b2_bufs, ready, empty, M, N, K, A_T, B_ROW_MAJOR,
                             GROUP_M, SPLIT_K, STAGES)),
                (_gelu_grad_partition, (c_desc, c2_desc, z_desc, z2_desc, c_smem, c2_smem, z_smem, z2_smem, z_ready,
                                        z_empty, z_loaded, out_ptr, part_ptr, M, N, HAS_BIAS, GROUP_M)),
            ], [1, 8], [40, 64])
        elif EPILOGUE == 1:
            gl.warp_specialize([
                (_mma_partition, (a_bufs, b_bufs, b2_bufs, ready, empty, z_ready, z_empty, c_free, turn, c_desc,
                                  c2_desc, c_smem, c2_smem, bias_ptr, part_ptr, M, N, K, HAS_BIAS, EPILOGUE, A_T,
                                  B_ROW_MAJOR, GROUP_M, SPLIT_K, STAGES, 0, 1, SLICED, num_warps)),
                (_producer, (a_desc, b_desc, b2_desc, a_bufs, b_bufs, b2_bufs, ready, empty, M, N, K, A_T, B_ROW_MAJOR,
                             GROUP_M, SPLIT_K, STAGES)),
                (_gelu_partition, (c_desc, c2_desc, z_desc, z2_desc, c_smem, c2_smem, z_ready, z_empty, M, N,
                                   GROUP_M)),
            ], [1, 4], [40, 96])
        elif ROLES == 2:
            # Two MMA partitions of num_warps (4) warps, taking the tiles in turn, and the producer.
            gl.warp_specialize([
                (_mma_partition, (a_bufs, b_bufs, b2_bufs, ready, empty, z_ready, z_empty, c_free, turn, c_desc,
                                  c2_desc, c_smem, c2_smem, bias_ptr, part_ptr, M, N, K, HAS_BIAS, EPILOGUE, A_T,
                                  B_ROW_MAJOR, GROUP_M, SPLIT_K, STAGES, 0, 2, SLICED, num_warps)),
                (_mma_partition, (a_bufs, b_bufs, b2_bufs, ready, empty, z_ready, z_empty, c_free, turn, c_desc,
                                  c2_desc, c_smem, c2_smem, bias_ptr, part_ptr, M, N, K, HAS_BIAS, EPILOGUE, A_T,
                                  B_ROW_MAJOR, GROUP_M, SPLIT_K, STAGES, 1, 2, SLICED, num_warps)),
                (_producer, (a_desc, b_desc, b2_desc, a_bufs, b_bufs, b2_bufs, ready, empty, M, N, K, A_T, B_ROW_MAJOR,
                             GROUP_M, SPLIT_K, STAGES)),
            ], [num_warps, 1], [232, 40])  # 232 registers: a 128 x 192 fp32 accumulator is 192 a thread
        else:
            gl.warp_specialize([
                (_mma_partition, (a_bufs, b_bufs, b2_bufs, ready, empty, z_ready, z_empty, c_free, turn, c_desc,
                                  c2_desc, c_smem, c2_smem, bias_ptr, part_ptr, M, N, K, HAS_BIAS, EPILOGUE, A_T,
                                  B_ROW_MAJOR, GROUP_M, SPLIT_K, STAGES, 0, 1, SLICED, num_warps)),
                (_producer, (a_desc, b_desc, b2_desc, a_bufs, b_bufs, b2_bufs, ready, empty, M, N, K, A_T, B_ROW_MAJOR,
                             GROUP_M, SPLIT_K, STAGES)),
            ], [1], [40])


def _aligned(t: torch.Tensor) -> bool:
    """A TMA descriptor can address t: 2-D, unit column stride, 16-byte base and row pitch."""
    return (t.dim() == 2 and t.stride(1) == 1 and t.data_ptr() % 16 == 0
            and (t.stride(0) * t.element_size()) % 16 == 0)


def b_row_major(b: torch.Tensor) -> bool | None:
    """How the kernel can read b (K, N): False for the forward layout (b = w.t() of a
    row-major, aligned (N, K) weight w), True for b itself row-major and aligned, None otherwise."""
    if _aligned(b.t()):
        return False
    if _aligned(b):
        return True
    return None


def a_transposed(a: torch.Tensor) -> bool | None:
    """How the kernel can read a (M, K): False for a itself row-major and aligned, True for a
    transposed view of an aligned row-major (K, M) tensor (dY.t() in dW = dY.t() @ X), None
    otherwise: the same test as b_row_major, asked of a.t()."""
    return b_row_major(a.t())


def ws_operands_fit(a, b, c, bias, activation, z) -> bool:
    """The operands' half of ws_eligible (any device): dtypes, a layout of B it reads
    (b_row_major), alignment, bias but no activation or saved pre-activation, no dimension
    below 16."""
    if activation is not None or z is not None or a.dtype not in (torch.bfloat16, torch.float16):
        return False
    if c.dtype != a.dtype:
        return False
    M, K = a.shape
    N = b.shape[1]
    if min(M, N, K) < 16 or (bias is not None and bias.stride(0) != 1):
        return False
    return _aligned(a) and b_row_major(b) is not None and _aligned(c)


def split_operands_fit(a, b, c, bias, activation, z) -> bool:
    """The operands' half of split_eligible (any device): the product through fp32 partial sums
    (launch_split) for A read transposed, as the weight gradient dW = dY.t() @ X reads dY:
    bf16/fp16 a and b, a.t() and B in a layout the TMA loads can address, an output in a's
    dtype or fp32 (any strides), no bias, activation or saved pre-activation, no dimension below 16."""
    if bias is not None or activation is not None or z is not None:
        return False
    if a.dtype not in (torch.bfloat16, torch.float16) or c.dtype not in (a.dtype, torch.float32):
        return False
    M, K = a.shape
    N = b.shape[1]
    return min(M, N, K) >= 16 and a_transposed(a) is True and b_row_major(b) is not None


def runs_here(t: torch.Tensor) -> bool:
    """The device half of every *_eligible check: Gluon importable, compiled mode (not Triton's
    interpreter), and t on a CUDA device with env.capability == (9, 0)."""
    return WS_IMPORT_ERROR is None and not env.interpreting() and t.is_cuda and env.capability(t.device) == (9, 0)


def split_eligible(a, b, c, bias, activation, z) -> bool:
    """True if launch_split can compute c = a @ b here (runs_here, and split_operands_fit)."""
    return runs_here(a) and split_operands_fit(a, b, c, bias, activation, z)


def ws_eligible(a, b, c, bias, activation, z) -> bool:
    """True if this kernel can compute c = a @ b (+ bias) here: see the module docstring's scope.
    The device half is runs_here; the operands' half ws_operands_fit."""
    return runs_here(a) and ws_operands_fit(a, b, c, bias, activation, z)


def _wave_efficiency(tiles: int, slots: int) -> float:
    """Share of the programs' time spent on real tiles when `tiles` run in waves of `slots`."""
    return tiles / (-(-tiles // slots) * slots)


def balanced_programs(tiles: int, num_sms: int) -> int:
    """How many persistent programs to launch for `tiles` output tiles: the fewest that still take
    as many waves as one program per multiprocessor, so that every program runs the same number
    of tiles, give or take one (384 tiles on 132 multiprocessors: 128 programs of 3 tiles, not
    120 of 3 and 12 of 2). The time is set by the programs that run the most tiles either way;
    with fewer programs at once, each runs a little faster (less contention for L2 and memory,
    and for the power budget). A count that adds a wave is much slower.
    measured: record kernels-auto-balanced-h100"""
    if tiles <= 0 or num_sms <= 0:
        raise ValueError(f"tiles and num_sms must be positive, got {tiles} and {num_sms}")
    waves = -(-tiles // num_sms)
    return -(-tiles // waves)


def group_rows(N: int, extra_n: int = EXTRA_N) -> int:
    """GROUP_M, the tile rows a program sweeps before the next column of tiles, for an output N
    wide in tiles BLOCK_N + extra_n wide: 4 where the output is at most four tiles wide (GPT-2's
    N = 768 products at 192), else GROUP_M: the shorter sweep is faster on those narrow outputs,
    no faster on the wide ones, and much slower on the output layer (N = 50304).
    measured: record kernels-auto-balanced-h100"""
    return 4 if _narrow_output(N, extra_n) else GROUP_M


def _narrow_output(N: int, extra_n: int = EXTRA_N) -> bool:
    """An output at most four tiles (BLOCK_N + extra_n wide) across: GPT-2's N = 768 products."""
    return -(-N // (BLOCK_N + extra_n)) <= 4


# The cost model behind split_for and split_preferred, in microseconds, fitted to replayed graphs on
# an H100 (the weight gradients of GPT-2's layers, 12288 tokens, 1 to 12 slices):
# * a K-step of one 128 x 192 x 64 tile on one multiprocessor takes _STEP_US[0] + _STEP_US[1] * the
#   share of the multiprocessors at work (they share L2, memory and the power budget);
# * each work unit adds _UNIT_STEPS K-steps (filling the ring, the epilogue);
# * the host's sum of the fp32 planes: _SUM_US, plus each plane read once and the output written once
#   at _SUM_BYTES_PER_US (bytes a microsecond);
# * a K-step of a narrow 128 x 160 tile costs _NARROW_STEP of a 128 x 192 one at the same share of
#   busy multiprocessors, not the 160/192 of its products (probably because the narrow second MMA
#   reads as much of A from shared memory for half the work). Fitted to the MLP's two weight
#   gradients unsplit, five stages each.
# Not modelled: with one slice and a bf16 or strided output, the kernel writes an fp32 plane that the
# host then copies into the output (one more pass over M x N).
_STEP_US = (0.45, 0.2)
_UNIT_STEPS = 4
_SUM_US = 7.0
_SUM_BYTES_PER_US = 2.8e6
_NARROW_STEP = 0.92


def _step_us(programs: int, num_sms: int) -> float:
    return _STEP_US[0] + _STEP_US[1] * min(programs, num_sms) / num_sms


def split_cost(M: int, N: int, K: int, split_k: int, num_sms: int, extra_n: int = EXTRA_N) -> float:
    """Predicted microseconds of launch_split with `split_k` slices and tiles BLOCK_N + extra_n
    wide (see the constants above): the busiest program's units (waves of balanced programs, each
    unit its share of the K-steps plus _UNIT_STEPS), plus the sum of the fp32 planes where there
    is one to do."""
    units = -(-M // BLOCK_M) * -(-N // (BLOCK_N + extra_n)) * split_k
    k_tiles = -(-K // BLOCK_K)
    waves = -(-units // num_sms)
    step = _step_us(balanced_programs(units, num_sms), num_sms) * (_NARROW_STEP if extra_n != EXTRA_N else 1.0)
    us = waves * (-(-k_tiles // split_k) + _UNIT_STEPS) * step
    if split_k > 1:
        us += _SUM_US + (split_k + 1) * M * N * 4 / _SUM_BYTES_PER_US
    return us


def tma_cost(M: int, N: int, K: int, num_sms: int) -> float:
    """The same model for the TMA kernel unsplit: waves of its 128 x 128 tiles, each K-step two
    thirds of a 128 x 192 one. It overestimates the MLP's weight gradients, whose second wave
    holds only 12 tiles, but chooses between the kernels as the measured times do."""
    tiles = -(-M // 128) * -(-N // 128)
    return -(-tiles // num_sms) * -(-K // BLOCK_K) * 2 / 3 * _step_us(tiles, num_sms)


def split_tile(M: int, N: int, K: int, split_k: int, num_sms: int) -> int:
    """The second accumulator's width (extra_n) for launch_split: NARROW_EXTRA_N (128 x 160 tiles)
    for an unsplit product where split_cost predicts it faster, else EXTRA_N (128 x 192). The MLP's
    weight gradients (768 x 3072 and 3072 x 768) make 96 wide tiles, one wave on 96 of 132
    multiprocessors, or 120 narrow ones, and the narrow ones are faster there. With slices they
    lose: 768 is 4.8 of them across, so attn.c_proj's 5 slices make 150 units, two waves of 132.
    Five stages beat four at both widths (DEEP_STAGES).
    measured: record kernels-dw-tiles-h100"""
    if split_k == 1 and split_cost(M, N, K, 1, num_sms, NARROW_EXTRA_N) < split_cost(M, N, K, 1, num_sms):
        return NARROW_EXTRA_N
    return EXTRA_N


def _split_cost_at(M: int, N: int, K: int, split_k: int, num_sms: int) -> float:
    """split_cost with split_tile's tile for those slices."""
    return split_cost(M, N, K, split_k, num_sms, split_tile(M, N, K, split_k, num_sms))


def split_for(M: int, N: int, K: int, num_sms: int, most: int = 16) -> int:
    """The slices of K for launch_split that split_cost predicts fastest (1 to `most`, at
    least one K-step each, with split_tile's tile). attn.c_proj's dW (768 x 768, K = 12288): 5
    slices, 120 units of 38-39 K-steps, one wave; the MLP's: 1, on 120 narrow tiles, since the sum
    of the planes would cost more than the idle multiprocessors."""
    k_tiles = -(-K // BLOCK_K)
    return min(range(1, min(most, k_tiles) + 1), key=lambda s: (_split_cost_at(M, N, K, s, num_sms), s))


def split_preferred(M: int, N: int, K: int, num_sms: int) -> bool:
    """Whether kernel="auto" should run a product with a transposed A through launch_split rather
    than on the TMA kernel: where split_cost (at split_for's slices) is below tma_cost. For GPT-2's
    weight gradients that takes attn.c_proj's (the TMA kernel's 36 tiles leave most of the GPU idle
    unless K is sliced) and the MLP's (its 144 tiles make two waves, the second nearly empty), and
    leaves c_attn's (108 tiles, one full wave) on the TMA kernel.
    measured: record kernels-grads-split-h100"""
    return _split_cost_at(M, N, K, split_for(M, N, K, num_sms), num_sms) < tma_cost(M, N, K, num_sms)


def ws_preferred(M: int, N: int, num_sms: int) -> bool:
    """Whether kernel="auto" should take this kernel over the TMA kernel for an (M, N) output.

    Both kernels reach about the same speed per tile; what differs is how well their tiles fill
    the last wave. We compare 128 x 192 tiles with the TMA kernel's 128 x 256 (its choice for
    large outputs) and keep the TMA kernel only where it fills the waves clearly better. On the
    H200 (record kernels-h200, do_bench) this picks the faster kernel at
    all seven benchmark shapes: the warp-specialised one at the five GPT-2 shapes and 8192^3, the
    TMA one at 4096^3 (704 tiles, 5.3 waves of 132, against 512 = 3.9 waves: 0.90x against 0.98x
    of cuBLAS). A rule from seven measurements, not a model: treat it as such."""
    ws = _wave_efficiency(-(-M // BLOCK_M) * -(-N // (BLOCK_N + EXTRA_N)), num_sms)
    tma = _wave_efficiency(-(-M // 128) * -(-N // 256), num_sms)
    return ws >= tma - 0.02


def check_split(split_k: int, K: int) -> None:
    """A ValueError unless every one of split_k slices gets at least one of K's K-steps (an empty
    slice would store an accumulator it never computed)."""
    if not 1 <= split_k <= -(-K // BLOCK_K):
        raise ValueError(f"split_k must be between 1 and the {-(-K // BLOCK_K)} K-steps of {BLOCK_K} in K = {K}, "
                         f"got {split_k}; leave it None to choose")


_LAYOUTS: dict = {}


def _layouts(dtype, row_major_b=False, a_t=False, extra_n=EXTRA_N):
    """The NVMMA shared-memory layouts (swizzles) of the five descriptor boxes, per dtype, layouts
    of A and B and width of the second accumulator: A's ((M, K) boxes, or (K, M) ones of a.t() for
    a transposed A), B's two (w's (N, K) boxes, or (K, N) ones for a row-major B), C's two. The
    boxes fix the tile: BLOCK_N + extra_n wide."""
    key = (dtype, row_major_b, a_t, extra_n)
    if key not in _LAYOUTS:
        gdt = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
        get = gl.NVMMASharedLayout.get_default_for
        a_box = (BLOCK_K, BLOCK_M) if a_t else (BLOCK_M, BLOCK_K)
        b_boxes = ((BLOCK_K, BLOCK_N), (BLOCK_K, extra_n)) if row_major_b else ((BLOCK_N, BLOCK_K), (extra_n, BLOCK_K))
        _LAYOUTS[key] = [([bm, bn], get([bm, bn], gdt)) for bm, bn in
                         (a_box, *b_boxes, (BLOCK_M, BLOCK_N), (BLOCK_M, extra_n))]
    return _LAYOUTS[key]


def ws_tensors(a, b, c, z=None, row_major_b=None, a_t=False):
    """The seven descriptor operands of a launch, in kernel order: A's memory (a, or a.t() for
    a transposed A), B's memory twice (w = b.t() for the forward layout, b itself when
    row-major; row_major_b: b_row_major(b) if the caller knows it), C twice, Z twice (Z is C
    where the epilogue writes no Z)."""
    bm = b if (b_row_major(b) if row_major_b is None else row_major_b) else b.t()
    z = c if z is None else z
    return a.t() if a_t else a, bm, bm, c, c, z, z


def _layouts7(dtype, row_major_b=False, a_t=False, extra_n=EXTRA_N):
    """Box and layout of each of the seven descriptors: Z's are C's."""
    layouts = _layouts(dtype, row_major_b, a_t, extra_n)
    return layouts + layouts[3:5]


N_TENSORS = 10  # the arguments that change from call to call: seven descriptors, the bias, C, the partial sums
# EPILOGUE 2 keeps a tile of Z in shared memory beside C's: three load stages instead of four fit beside it.
STAGES_GELU_BACKWARD = 3


# How many MMA partitions take a plain product's tiles in turn where mma_roles says two pay (1 turns
# that off; see _mma_partition).
PINGPONG_ROLES = 2


def sliced_store(epilogue: int, split_k: int, N: int) -> bool:
    """Whether a launch stores its tiles in slices (SLICED): a plain product (EPILOGUE 0), unsplit,
    whose output is at most four tiles across (GPT-2's N = 768 products). Each tile then leaves
    in three 128 x 64 slices through one staging buffer instead of two buffers at once, which
    frees 32 KiB of shared memory for a fifth load stage (DEEP_STAGES), on one MMA partition.
    The slices wait for one another, about half a microsecond a tile; on these outputs, a few
    tiles a program, the fifth stage repays that, and the product runs faster than on two
    partitions. On wide outputs the stage gains nothing and the waits remain.
    SLICED_STORE = False turns it off.
    measured: record kernels-sliced-h100"""
    return SLICED_STORE and epilogue == 0 and split_k == 1 and _narrow_output(N)


def mma_roles(epilogue: int, split_k: int, has_bias: bool, N: int) -> int:
    """ROLES for a launch: two MMA partitions taking the tiles in turn (PINGPONG_ROLES) for a plain
    product (EPILOGUE 0) of whole tiles with a bias, else one. With one partition the bias costs
    about 0.6 us a tile; with two next to nothing, since each partition's epilogue, the bias's load
    among it, runs while the other's MMAs keep the tensor cores busy. Without a bias one partition
    of two warpgroups is faster: both issue each step's MMAs, where in turns one warpgroup issues
    them alone. The GELU epilogues (1, 2) have a partition of their own for their epilogue work,
    and split units (EPILOGUE 3) write fp32 planes: one partition for those, and for the sliced
    store (sliced_store, N = 768 outputs), which is faster than two.
    measured: record kernels-pingpong-h100"""
    if sliced_store(epilogue, split_k, N):
        return 1
    return PINGPONG_ROLES if epilogue == 0 and split_k == 1 and has_bias else 1


def ws_launch(a, b, c, bias, num_sms, num_programs=None, epilogue=0, z=None, part=None, split_k=1,
              extra_n=EXTRA_N):
    """Launch c = a @ b (+ bias) on the warp-specialised kernel (the caller checked ws_eligible),
    or with epilogue 1 (z = a @ b + bias, c = gelu(z)), or 2 (c = (a @ b) * gelu'(z), and with
    ``part`` the column sums of that, see gelu_backward_fused), or 3 (``part`` (split_k, M, N)
    fp32 receives the product of each slice of K; c is then only a 16-bit stand-in for the
    unused C descriptors, see launch_split; there extra_n may be NARROW_EXTRA_N). Returns (the
    jitted kernel, the compiled kernel, grid, args, kwargs): what launch.compiled_launch needs to
    repeat it, with the N_TENSORS tensor arguments first."""
    if extra_n != EXTRA_N and epilogue != 3:
        raise ValueError(f"extra_n={extra_n} (narrow tiles) is for launch_split's products only; leave it {EXTRA_N}")
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    M, K = a.shape
    N = b.shape[1]
    row_major_b = b_row_major(b)
    a_t = bool(a_transposed(a))
    descs = tuple(TensorDescriptor.from_tensor(t, box, layout) for t, (box, layout) in
                  zip(ws_tensors(a, b, c, z if epilogue else None, row_major_b, a_t),
                      _layouts7(a.dtype, row_major_b, a_t, extra_n)))
    check_split(split_k, K)
    sliced = sliced_store(epilogue, split_k, N)
    stages = STAGES_GELU_BACKWARD if epilogue == 2 else DEEP_STAGES if epilogue == 3 or sliced else STAGES
    units = triton.cdiv(M, BLOCK_M) * triton.cdiv(N, BLOCK_N + extra_n) * split_k
    grid = (min(num_programs or balanced_programs(units, num_sms), units),)
    args = (*descs, bias if bias is not None else c, c, part if part is not None else c, M, N, K)
    has_bias = part is not None if epilogue == 2 else bias is not None
    roles = mma_roles(epilogue, split_k, bias is not None, N)
    kwargs = dict(HAS_BIAS=has_bias, EPILOGUE=epilogue, A_T=a_t, B_ROW_MAJOR=row_major_b,
                  GROUP_M=group_rows(N, extra_n), SPLIT_K=split_k, STAGES=stages, ROLES=roles, SLICED=sliced,
                  num_warps=NUM_WARPS // roles)
    compiled = matmul_ws_kernel[grid](*args, **kwargs)
    return matmul_ws_kernel, compiled, grid, args, kwargs


def launch(a, b, c, bias=None):
    """c = a @ b (+ bias) on this kernel (the caller, matmul.plan, checked ws_eligible). Returns
    a replay function `(a, b, c, bias, z)` for new tensors of the same signature (launch.py),
    which passes the tensors behind the descriptors (launch.CompiledLaunch.with_descriptors) instead
    of building TensorDescriptors again, or None."""
    jit_fn, compiled, grid, args, kwargs = ws_launch(a, b, c, bias, env.num_sms(a.device))
    remembered = compiled_launch(jit_fn, compiled, grid, args, kwargs, n_tensors=N_TENSORS)
    if remembered is None:
        return None
    row_major_b = kwargs["B_ROW_MAJOR"]  # the same for every call of this signature (strides are in it)

    def replay(a, b, c, bias, z):  # the seven descriptors' tensors, the bias, then c as C's pointer and the unused table
        remembered.with_descriptors(a.device.index, ws_tensors(a, b, c, None, row_major_b), bias if bias is not None else c,
                                    c, c)
    return replay


def _add_planes(part, c):
    """c = the sum of part's planes (split_k, M, N) fp32, rounded once into c's dtype (any strides)."""
    if c.dtype == torch.float32:
        torch.sum(part, dim=0, out=c)
    else:
        c.copy_(part.sum(dim=0))


def launch_split(a, b, c, split_k, narrow=None):
    """c = a @ b for a transposed A (the caller checked split_eligible) through fp32 partial sums:
    the kernel splits each 128 x 192 tile's K-steps into `split_k` slices (work units of their
    own, so that few tiles and a long K, as in a weight gradient, still fill the GPU), each unit
    writes its slice's fp32 product into plane s of a (split_k, M, N) buffer, and the host adds
    the planes with one rounding into c (torch.sum over the planes: the same order every call,
    so the result repeats bit for bit). With split_k = 1 and a contiguous fp32 c, the kernel
    writes c directly. `narrow`: 128 x 160 tiles (True) or 128 x 192 (False); None leaves it to
    split_tile. Returns a replay function `(a, b, c, bias, z)`, as `launch` does, or None."""
    M, K = a.shape
    N = b.shape[1]
    check_split(split_k, K)
    if narrow is None:
        extra_n = split_tile(M, N, K, split_k, env.num_sms(a.device))
    else:
        extra_n = NARROW_EXTRA_N if narrow else EXTRA_N
    direct = split_k == 1 and c.dtype == torch.float32 and c.is_contiguous()

    def planes(c):
        return c.view(1, M, N) if direct else torch.empty((split_k, M, N), dtype=torch.float32, device=c.device)
    stand_in = a.t()  # a 16-bit tensor for the C and Z descriptors, which this epilogue never uses
    part = planes(c)
    jit_fn, compiled, grid, args, kwargs = ws_launch(a, b, stand_in, None, env.num_sms(a.device), epilogue=3,
                                                     part=part, split_k=split_k, extra_n=extra_n)
    if not direct:
        _add_planes(part, c)
    remembered = compiled_launch(jit_fn, compiled, grid, args, kwargs, n_tensors=N_TENSORS)
    if remembered is None:
        return None
    row_major_b = kwargs["B_ROW_MAJOR"]

    def replay(a, b, c, bias, z):
        part = planes(c)
        stand_in = a.t()
        remembered.with_descriptors(a.device.index, ws_tensors(a, b, stand_in, None, row_major_b, True), stand_in,
                                    stand_in, part)
        if not direct:
            _add_planes(part, c)
    return replay


# ----------------------------------------------------------------------------------------------
# GELU fused into the MLP's first product (used by fast/mlp.py)
# ----------------------------------------------------------------------------------------------
_GELU_LAUNCHES: dict = {}  # call signature -> CompiledLaunch (the lean path, as launch() has)


def gelu_eligible(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether gelu_forward(a, w, bias) can run here: this kernel on this GPU (sm_90, compiled),
    bf16/fp16 operands of one dtype, a (M, K) and w (N, K) addressable by TMA, rows of the
    (M, N) outputs a multiple of 16 bytes, no dimension below 16, M * N below 2^31 (the sizes
    tested), and a bias (if any) with unit stride."""
    if not runs_here(a) or (bias is not None and bias.stride(0) != 1):
        return False
    if a.dtype not in (torch.bfloat16, torch.float16) or w.dtype != a.dtype or a.dim() != 2 or w.dim() != 2:
        return False
    (M, K), N = a.shape, w.shape[0]
    return (w.shape[1] == K and min(M, N, K) >= 16 and M * N < 2**31 and _aligned(a) and _aligned(w)
            and N * a.element_size() % 16 == 0)


def gelu_forward(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None):
    """(y, z) with z = a @ w.T + bias and y = gelu(z) (tanh approximation), both in a's dtype,
    from one launch: the epilogue writes z (GELU's backward needs it) and then y = gelu(z) of z as
    stored, in fp32 from its 16-bit value (what the unfused model computes under autocast, and
    the z the backward reads). a: (M, K), w: (N, K) -> y, z: (M, N). The caller checked
    gelu_eligible(a, w, bias). Repeated calls with one signature take the lean launch path."""
    if w.shape[1] != a.shape[1]:
        raise ValueError(f"a is {tuple(a.shape)} but w is {tuple(w.shape)}: w must be (N, {a.shape[1]})")
    M, N = a.shape[0], w.shape[0]
    if bias is not None and (bias.shape != (N,) or bias.stride(0) != 1 or bias.device != a.device):
        raise ValueError(f"bias must be a contiguous ({N},) tensor on {a.device}, got {tuple(bias.shape)} "
                         f"strides {bias.stride()} on {bias.device}; pass bias.contiguous()")
    y = torch.empty((M, N), dtype=a.dtype, device=a.device)
    z = torch.empty_like(y)
    key = (a.device.index, a.dtype, a.shape, a.stride(), w.shape, w.stride(), a.data_ptr() % 16, w.data_ptr() % 16,
           None if bias is None else (bias.dtype, bias.stride(), bias.data_ptr() % 16))
    remembered = _GELU_LAUNCHES.get(key) if lean_launch_enabled() else None  # the switches, read at every call
    if remembered is not None:
        remembered.with_descriptors(a.device.index, ws_tensors(a, w.t(), y, z, False), bias if bias is not None else y,
                                    y, y)
        return y, z
    jit_fn, compiled, grid, args, kwargs = ws_launch(a, w.t(), y, bias, env.num_sms(a.device), epilogue=1, z=z)
    if lean_launch_enabled():
        remembered = compiled_launch(jit_fn, compiled, grid, args, kwargs, n_tensors=N_TENSORS)
        if remembered is not None:
            _GELU_LAUNCHES[key] = remembered
    return y, z


# ----------------------------------------------------------------------------------------------
# GELU's backward fused into the MLP's dOut @ W_proj (used by fast/mlp.py)
# ----------------------------------------------------------------------------------------------
_GELU_GRAD_LAUNCHES: dict = {}  # call signature -> CompiledLaunch


def gelu_backward_eligible(g: torch.Tensor, w: torch.Tensor, z: torch.Tensor) -> bool:
    """Whether gelu_backward_fused(g, w, z) can run here: this kernel on this GPU (sm_90,
    compiled), bf16/fp16 g (M, K), w (K, N) and z (M, N) of one dtype, each addressable by TMA,
    rows of the (M, N) output a multiple of 16 bytes, no dimension below 16."""
    if not runs_here(g):
        return False
    if g.dtype not in (torch.bfloat16, torch.float16) or w.dtype != g.dtype or z.dtype != g.dtype:
        return False
    if g.dim() != 2 or w.dim() != 2 or z.dim() != 2:
        return False
    (M, K), N = g.shape, w.shape[1]
    return (w.shape[0] == K and z.shape == (M, N) and min(M, N, K) >= 16
            and _aligned(g) and _aligned(w) and _aligned(z) and N * g.element_size() % 16 == 0)


def gelu_backward_fused(g: torch.Tensor, w: torch.Tensor, z: torch.Tensor, with_bias: bool = True,
                        db_dtype: torch.dtype = torch.float32, num_programs: int | None = None):
    """(dZ, db) for the MLP's backward in one launch: dH = g @ w (the product the unfused
    backward hands to cuBLAS, rounded once into g's dtype as cuBLAS rounds it), then in the
    epilogue dZ = dH * gelu'(z) in fp32, rounded once, and with ``with_bias`` the column sums of
    the fp32 dZ, one partial sum per tile of 128 rows, summed and rounded into ``db_dtype`` by
    partials.sum_partials (without it, db is an empty tensor). g: (M, K) = dOut, w: (K, N) =
    W_proj as nn.Linear holds it, z: (M, N) the saved pre-activation -> dZ (M, N), db (N,). The
    same dZ and db as gelu.gelu_backward_bias(g @ w, z), up to the order of fp32 sums. The caller
    checked gelu_backward_eligible(g, w, z). ``num_programs`` (default: balanced_programs)
    lets a test give each program several tiles at a small shape. Withdrawn from the recipes: it
    gave different gradients when other work shared the GPU (fast/mlp.py's WITHDRAWN)."""
    from .. import partials
    M, N = g.shape[0], w.shape[1]
    dz = torch.empty((M, N), dtype=g.dtype, device=g.device)
    part = torch.empty((N, triton.cdiv(M, BLOCK_M)), dtype=torch.float32, device=g.device) if with_bias else None
    key = (g.device.index, g.dtype, g.shape, g.stride(), w.shape, w.stride(), g.data_ptr() % 16, w.data_ptr() % 16,
           with_bias, num_programs)
    remembered = _GELU_GRAD_LAUNCHES.get(key) if lean_launch_enabled() else None
    if remembered is not None:
        remembered.with_descriptors(g.device.index, ws_tensors(g, w, dz, z, True), dz, dz, part if with_bias else dz)
    else:
        jit_fn, compiled, grid, args, kwargs = ws_launch(g, w, dz, None, env.num_sms(g.device), num_programs,
                                                         epilogue=2, z=z, part=part)
        if lean_launch_enabled():
            remembered = compiled_launch(jit_fn, compiled, grid, args, kwargs, n_tensors=N_TENSORS)
            if remembered is not None:
                _GELU_GRAD_LAUNCHES[key] = remembered
    db = partials.sum_partials(part, db_dtype) if with_bias else dz.new_empty(0, dtype=db_dtype)
    return dz, db
