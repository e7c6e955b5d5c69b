"""Stream-K: a product whose output tiles do not fill the GPU's waves, shared out evenly (chapter 6).

    c = a @ b          a: (M, K)   b: (K, N)   c: (M, N), summed in fp32

The weight gradient of an MLP layer, dW = dY.t() @ X, has few output tiles and a long K (the
tokens): for GPT-2's c_fc, a 3072 x 768 output is 144 tiles of 128 x 128, each a loop of 192
K-steps over 12288 tokens. On the H200's 132 multiprocessors a grid of one program per tile (or
a persistent grid looping over tiles, tma.py) runs 132 tiles, then the last 12 while 120
multiprocessors wait: two tile-times for 1.09 tiles of work each.

Stream-K (Osama, Merrill, Cecka, Garland and Owens, "Stream-K: Work-centric Parallel
Decomposition for Dense Matrix-Matrix Multiplication on the GPU", PPoPP 2023) cuts the work
differently. Lay every (tile, K-step) pair of the product end to end, tile after tile:

    total = tiles x k_steps            (144 x 192 = 27,648 for c_fc's dW)

and give each of the P persistent programs one contiguous stretch of it, total / P long (209 or
210 K-steps here). A program walks its stretch: it finishes the tile it starts in the middle of,
runs any whole tiles, and starts the tile its stretch ends in.

* A tile a program computed whole, it stores, rounded once to c's dtype.
* A part of a tile it writes, in fp32, to its own slot of a scratch buffer: slot 0 for the first
  tile of its stretch, slot 1 for the last (a stretch has at most those two parts).
* A second, small kernel (the fixup) then sums the parts of each shared tile in program order and
  stores the tile, rounded once.

So the result does not depend on which program ran first: the same inputs give the same bits, as
cuBLAS's do. (Adding the parts into the output with atomic adds would need a zeroed output and
an fp32 one, and with three or more parts to a tile the order of the additions, hence the
rounding, would change from run to run.)

The loads are the TMA kernel's (tma.py): device-built tensor descriptors, either operand may be
transposed in memory, so dW = dY.t() @ X reads dY in place.

Hopper (sm_90) only, like the TMA kernel; the interpreter runs it too, on fp32 copies of the
operands (it stores bf16 as raw 16-bit integers, so its arithmetic on bf16 tiles is wrong).
`matmul(..., kernel="streamk")` runs it; `kernel="auto"` does not choose it: measured on an H200 at
GPT-2's weight-gradient shapes it was no faster than the TMA kernel, and slower than cuBLAS
(measured: record kernels-grads-h200). Evening out
the last wave was not what those products needed.
"""
from __future__ import annotations

import torch

from . import env, tma
from .env import tl, triton
from .epilogue import tile_coords
from .launch import compiled_launch
from .tma import load_operands, operand_descriptors

BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M = 128, 128, 64, 8
NUM_STAGES, NUM_WARPS = 4, 8
# Tile shapes a caller may ask for by name (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps): the default,
# and a wider tile that reads less operand data per multiply-add (the kernel benchmark times both).
TILES = {"128x128": (BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, NUM_WARPS), "128x256": (128, 256, 64, 3, 8)}
# The interpreter: small tiles and a stand-in for the multiprocessor count, so that a test's few
# hundred rows still make several tiles, shared between programs.
INTERPRET_BLOCK = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=16)
INTERPRET_PROGRAMS = 5


@triton.jit
def streamk_kernel(
    a_ptr, b_ptr, c_ptr,
    part_ptr,                       # (2 * NUM_PROGRAMS, BLOCK_M, BLOCK_N) fp32: each program's two slots
    M, N, K,
    stride_a,                       # the non-unit stride of A's memory (its row pitch)
    stride_b,                       # the non-unit stride of B's memory
    stride_cm, stride_cn,
    A_T: tl.constexpr,              # False: A is (M, K) row-major; True: A's memory is (K, M) row-major
    B_T: tl.constexpr,              # False: B is (K, N) row-major; True: B's memory is (N, K)
    NUM_PROGRAMS: tl.constexpr,     # the persistent grid (the host keeps it <= total)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    a_desc, b_desc = operand_descriptors(a_ptr, b_ptr, M, N, K, stride_a, stride_b, A_T, B_T,
                                         BLOCK_M, BLOCK_N, BLOCK_K)   # as the TMA kernel's (tma.py)

    pid = tl.program_id(axis=0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    total = num_pid_m * num_pid_n * k_steps     # every (tile, K-step) pair, tile after tile
    # This program's stretch [start, end): the same formula for every program, so the stretches
    # cover [0, total) exactly once (the host checks total * NUM_PROGRAMS fits in 32 bits).
    start = pid * total // NUM_PROGRAMS
    end = (pid + 1) * total // NUM_PROGRAMS
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    it = start
    while it < end:
        tile_id = it // k_steps
        k_lo = it - tile_id * k_steps                       # where in the tile the stretch enters
        k_hi = tl.minimum(k_steps, k_lo + (end - it))       # and where it leaves
        pid_m, pid_n = tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)          # (BLOCK_M, BLOCK_N)
        for ki in range(k_lo, k_hi):
            a, b = load_operands(a_desc, b_desc, off_m, off_n, ki * BLOCK_K, A_T, B_T)  # (BM, BK), (BK, BN)
            acc = tl.dot(a, b, acc)
        if (k_lo == 0) & (k_hi == k_steps):
            # the whole tile: no other program touches it, so it goes straight to c
            offs_m = off_m + rows
            offs_n = off_n + cols
            mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
            tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn,
                     acc.to(c_ptr.dtype.element_ty), mask=mask)
        else:
            # a part: slot 0 if this is the stretch's first tile, else slot 1 (its last)
            slot = 2 * pid + tl.where(it == start, 0, 1)
            tl.store(part_ptr + (slot * BLOCK_M + rows[:, None]) * BLOCK_N + cols[None, :], acc)
        it += k_hi - k_lo


@triton.jit
def streamk_fixup_kernel(
    part_ptr, c_ptr, M, N, K, stride_cm, stride_cn,
    NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """One program per output tile: if more than one stretch met this tile, sum their parts in
    program order and store the tile. Tiles one program computed whole were stored already."""
    tile_id = tl.program_id(axis=0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    total = num_pid_m * num_pid_n * k_steps
    first = tile_id * k_steps                   # the tile's first and last (tile, K-step) pair
    last = first + k_steps - 1
    # The program whose stretch holds pair i is the last p with p * total // P <= i,
    # that is p = ((i + 1) * P - 1) // total.
    p_first = ((first + 1) * NUM_PROGRAMS - 1) // total
    p_last = ((last + 1) * NUM_PROGRAMS - 1) // total
    if p_first != p_last:
        rows = tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)          # (BLOCK_M, BLOCK_N)
        for p in range(p_first, p_last + 1):
            # this tile is p's first tile (slot 0) if p's stretch starts inside it, else its last
            slot = 2 * p + tl.where(p * total // NUM_PROGRAMS >= first, 0, 1)
            acc += tl.load(part_ptr + (slot * BLOCK_M + rows[:, None]) * BLOCK_N + cols[None, :])
        pid_m, pid_n = tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + rows
        offs_n = pid_n * BLOCK_N + cols
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn,
                 acc.to(c_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------
def _block(tile: str = "128x128") -> dict:
    if env.interpreting():
        return dict(INTERPRET_BLOCK, GROUP_M=GROUP_M)
    bm, bn, bk, _, _ = TILES[tile]
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=GROUP_M)


def pairs(M: int, N: int, K: int, tile: str = "128x128") -> tuple[int, int]:
    """(output tiles, total (tile, K-step) pairs) of an (M, N, K) product at this machine's tiles."""
    blk = _block(tile)
    tiles = triton.cdiv(M, blk["BLOCK_M"]) * triton.cdiv(N, blk["BLOCK_N"])
    return tiles, tiles * triton.cdiv(K, blk["BLOCK_K"])


def stretches(total: int, programs: int) -> list[tuple[int, int]]:
    """Each program's [start, end) of the (tile, K-step) pairs, as the kernel computes it."""
    return [(p * total // programs, (p + 1) * total // programs) for p in range(programs)]


def programs_for(device: torch.device, M: int, N: int, K: int, tile: str = "128x128") -> int:
    """The persistent grid: one program per multiprocessor, never more than there are pairs
    (so no stretch is empty)."""
    sms = INTERPRET_PROGRAMS if env.interpreting() else env.num_sms(device)
    return min(sms, pairs(M, N, K, tile)[1])


def eligible(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """None if the stream-K kernel can compute a @ b here, else why not: the TMA kernel's operand
    rules (tma.layout), which is why it needs sm_90, and few enough (tile, K-step) pairs for the
    kernel's 32-bit arithmetic."""
    M, K = a.shape
    N = b.shape[1]
    if env.interpreting():
        readable = min(M, N, K) >= 16 and None not in (tma.operand_layout(a), tma.operand_layout(b))
    else:
        readable = tma.layout(a, b) is not None
    if not readable:
        return ("it needs a Hopper GPU (sm_90) and operands a TMA descriptor can address "
                "(16-byte-aligned, one unit stride each, M, N, K >= 16)")
    if pairs(M, N, K)[1] * 256 >= 2**31:  # total * programs, for any GPU up to 256 multiprocessors
        return "the product has too many (tile, K-step) pairs for the kernel's 32-bit arithmetic; split it"
    return None


def launch(a, b, c, programs: int | None = None, tile: str = "128x128"):
    """c = a @ b on the stream-K kernel, then the fixup. a (M, K), b (K, N): the caller checked
    `eligible`; c (M, N) bf16, fp16 or fp32, any strides. programs: the persistent grid (default
    programs_for; a test passes others to vary the parts); tile: a name in TILES. Returns a replay function
    `(a, b, c, bias, z)` for new tensors of the same signature (launch.py), or None."""
    M, K = a.shape
    N = b.shape[1]
    tiles, total = pairs(M, N, K, tile)
    programs = programs_for(a.device, M, N, K, tile) if programs is None else programs
    if not 1 <= programs <= total:
        raise ValueError(f"programs must be between 1 and the product's {total} (tile, K-step) pairs, got {programs}")
    if total * programs >= 2**31:
        raise ValueError(f"{programs} programs over {total} (tile, K-step) pairs overflow the kernel's 32-bit "
                         "arithmetic; use fewer programs")
    interpreted = env.interpreting()
    if interpreted:
        # fp32 operands: exact copies of bf16/fp16 ones, which the interpreter cannot multiply,
        # with the same strides (a copy of a column slice would otherwise get another row pitch)
        a, b = (torch.empty_strided(t.shape, t.stride(), dtype=torch.float32).copy_(t) for t in (a, b))
    else:
        tma.set_allocator()
    (a_t, stride_a), (b_t, stride_b) = tma.operand_layout(a), tma.operand_layout(b)
    blk = _block(tile)
    parts = torch.empty((2 * programs, blk["BLOCK_M"], blk["BLOCK_N"]), dtype=torch.float32, device=c.device)
    # The interpreter's c in fp32 (it rounds to bf16 by truncation), rounded by torch afterwards.
    out = c if not interpreted or c.dtype == torch.float32 else torch.empty((M, N), dtype=torch.float32)
    args = (a, b, out, parts, M, N, K, stride_a, stride_b, *out.stride())
    kwargs = dict(A_T=a_t, B_T=b_t, NUM_PROGRAMS=programs, **blk)
    options = {} if interpreted else dict(num_stages=TILES[tile][3], num_warps=TILES[tile][4])
    main = streamk_kernel[(programs,)](*args, **kwargs, **options)
    fix_args = (parts, out, M, N, K, *out.stride())
    fix_kwargs = dict(NUM_PROGRAMS=programs, **blk, **({} if interpreted else dict(num_warps=8)))
    fixup = streamk_fixup_kernel[(tiles,)](*fix_args, **fix_kwargs)
    if out is not c:
        c.copy_(out)
    if interpreted:
        return None
    main = compiled_launch(streamk_kernel, main, (programs,), args, {**kwargs, **options}, n_tensors=4)
    fixup = compiled_launch(streamk_fixup_kernel, fixup, (tiles,), fix_args, fix_kwargs, n_tensors=2)
    if main is None or fixup is None:
        return None
    shape = parts.shape

    def replay(a, b, c, bias, z):
        tma.set_allocator()  # the device-side descriptors' scratch memory (per thread)
        scratch = torch.empty(shape, dtype=torch.float32, device=c.device)
        main(a.device.index, a, b, c, scratch)
        fixup(a.device.index, scratch, c)
    return replay
