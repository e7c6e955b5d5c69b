"""A bf16/fp16 matrix product in Triton with fp32 accumulation and a fused epilogue (chapter 6).

What you will learn here, in the order of Triton's own matmul tutorial (03): the kernel, with
one comment per argument; the host wrapper that checks inputs, allocates the output and computes
the grid with `triton.cdiv`; then the tests (tests/test_kernels.py) and the benchmark
(mpgpt/kernels/bench.py, `python -m mpgpt.bench kernels`).

    out = act(a @ b + bias)      a: (..., K)   b: (K, N)   bias: (N,)   out: (..., N)

* Inputs are bf16 or fp16 (both the same); every product is accumulated in fp32 and the
  epilogue (bias, activation) runs in fp32; the result is rounded once, to the input dtype.
* `activation`: None, "relu", or "gelu" = the **tanh approximation**
  0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3))), what nn.GELU(approximate="tanh") and GPT-2
  use. We evaluate it as z * sigmoid(2 sqrt(2/pi) (z + 0.044715 z^3)), the same function
  (0.5 (1 + tanh(u)) = sigmoid(2u)) written with an op that both the compiler and the
  interpreter have.
* Any M, N, K >= 1 (edges are masked), leading batch dimensions of `a` are flattened, and
  strided or transposed operands are read in place: the kernel takes the strides, so
  `matmul(x, w.t())` reads nn.Linear's weight without a copy.

Two kernels here, and a third in matmul_ws.py:

1. `_matmul_kernel` — the tutorial's kernel: one program per (BLOCK_M, BLOCK_N) output tile,
   tiles visited in *grouped* order (GROUP_M rows of tiles at a time) so the tiles running
   together share rows of A and columns of B in L2. Runs everywhere: Ampere, Hopper, and the
   CPU interpreter.
2. `_matmul_kernel_tma` — Hopper (sm_90) only: a *persistent* grid (one program per
   multiprocessor, looping over tiles) and tensor-memory-accelerator (TMA) descriptors built on
   the device (`tl.make_tensor_descriptor`), so tiles arrive by the bulk-copy engine; edges
   are zero-filled by the hardware instead of masked. Needs 16-byte-aligned operands with one
   unit stride each; otherwise we fall back to kernel 1. `kernel="auto"` uses it for the
   forward GEMM and both gradient GEMMs, except a weight gradient that needs K split 4 ways or
   more (see _TMA_AUTO below).
   Its autotuned options, chosen by measurement (benchmarks/tma_variants.py): output tiles
   stored through TMA too, the epilogue run on two half tiles, compiler warp specialisation,
   and two programs per multiprocessor.
3. `matmul_ws._matmul_ws_kernel` — sm_90 only, written in Gluon: warp-specialised (a TMA
   producer warp, two MMA warpgroups) with 128 x 192 tiles, the shape of cuBLAS's own kernel for
   GPT-2's N = 768 outputs, which power-of-two tiles cannot fill evenly. `kernel="auto"` uses it
   for forward products without activation (bias allowed) wherever its tiles fill the GPU's
   waves about as well as the TMA kernel's (matmul_ws.ws_preferred).

Host time. A Triton launch costs tens of microseconds of Python before the GPU starts, more than
a 12288 x 768 x 768 product takes on an H200. After the first call with a given signature,
`matmul` calls the compiled kernel's launcher directly (launch.py; MPGPT_LEAN_LAUNCH=0 turns it
off).

Interpreter: without a CUDA GPU, mpgpt sets TRITON_INTERPRET=1 before these kernels are
decorated (see _env.py). The interpreter stores bf16 as raw uint16 bits, so `tl.dot` and
arithmetic on bf16 values are silently wrong there; with UPCAST=True the kernel converts each
tile to fp32 first (exact: a bf16 or fp16 value is exactly representable in fp32, and so is the
product of two of them), and uses one small fixed tile size instead of autotuning.
"""
from __future__ import annotations

import os

import torch

from ._env import TRITON_IMPORT_ERROR, _capability, check_device, interpreting, tl, triton
from .gelu import sigmoid_f32
from .launch import compiled_launch, lean_launch_enabled
from .matmul_ws import lean_descriptors, ws_eligible, ws_launch, ws_preferred

ACTIVATIONS = (None, "gelu", "relu")
KERNELS = ("auto", "grouped", "tma", "ws")
_LOW_PRECISION = (torch.bfloat16, torch.float16)


# ----------------------------------------------------------------------------------------------
# Autotuning configurations. Each Config fixes the tile (BLOCK_M x BLOCK_N, stepping BLOCK_K
# along K), GROUP_M, the warps per program and the software-pipelining depth (num_stages:
# how many K-tiles are loaded ahead into shared memory). Which tile wins depends on the shape,
# so the autotuner times each config the first time it sees a new (M, N, K) (and dtypes).
# ----------------------------------------------------------------------------------------------
def _cfg(bm, bn, bk, stages, warps, group=8, arch="any", **extra):
    c = triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group, **extra},
                      num_stages=stages, num_warps=warps)
    if c is not None:
        c.mpgpt_arch = arch  # read by _prune_by_arch
    return c


# Hopper (sm_90, 228 KB shared memory a multiprocessor): large tiles, 3-4 stages.
_HOPPER = [
    _cfg(128, 256, 64, 3, 8, arch="sm90"),
    _cfg(256, 128, 64, 3, 8, arch="sm90"),
    _cfg(128, 128, 64, 4, 8, arch="sm90"),
    _cfg(128, 128, 64, 4, 4, arch="sm90"),
    _cfg(128, 64, 64, 4, 4, arch="sm90"),
    _cfg(64, 128, 64, 4, 4, arch="sm90"),
]
# Ampere/Ada (sm_80/86/89, 100-164 KB): the configurations of Triton's tutorial 03, with small
# tiles for small problems; configs that do not fit a GPU's shared memory are skipped by the
# autotuner (they fail to compile with OutOfResources and time as infinity).
_AMPERE = [
    _cfg(128, 256, 64, 3, 8, arch="sm80"),
    _cfg(64, 256, 32, 4, 4, arch="sm80"),
    _cfg(128, 128, 32, 4, 4, arch="sm80"),
    _cfg(128, 64, 32, 4, 4, arch="sm80"),
    _cfg(64, 128, 32, 4, 4, arch="sm80"),
    _cfg(128, 32, 32, 4, 4, arch="sm80"),
    _cfg(64, 32, 32, 5, 2, arch="sm80"),
    _cfg(32, 64, 32, 5, 2, arch="sm80"),
]
# The persistent TMA kernel (Hopper only). Besides the tile, a config picks how the epilogue
# stores (TMA_STORE: through a TMA descriptor; EPILOGUE_SUBTILE: in two half-width pieces),
# WARP_SPECIALIZE (the tile loop split by the compiler into load and MMA warps) and PPS (programs
# per multiprocessor: 2 lets one program's epilogue overlap another's main loop). Chosen from a
# sweep of 72 variants on the H200 (benchmarks/tma_variants.py, results/tma-variants_*.json):
# the fastest one or two per GPT-2 shape, plus the large-square configs.
def _tma_cfg(bm, bn, bk, stages, warps, store=False, subtile=False, ws=False, pps=1):
    return _cfg(bm, bn, bk, stages, warps, arch="sm90", TMA_STORE=store, EPILOGUE_SUBTILE=subtile,
                WARP_SPECIALIZE=ws, PPS=pps)


_TMA = [
    _tma_cfg(128, 256, 64, 3, 8, store=True, ws=True),      # c_attn, c_fc
    _tma_cfg(128, 256, 64, 3, 8, store=True),               # c_fc + bias + GELU
    _tma_cfg(128, 256, 64, 3, 8),                           # c_fc + bias + GELU + Z
    _tma_cfg(128, 256, 64, 4, 8),                           # large squares, lm_head
    _tma_cfg(128, 128, 64, 4, 4, store=True, subtile=True),  # mlp.c_proj
    _tma_cfg(128, 128, 64, 4, 4, store=True, ws=True),      # attn.c_proj (2nd)
    _tma_cfg(128, 128, 64, 3, 4, subtile=True, pps=2),      # attn.c_proj
    _tma_cfg(128, 128, 64, 3, 4, store=True, subtile=True, pps=2),
    _tma_cfg(128, 128, 128, 3, 8),                          # mlp.c_proj (2nd)
    _tma_cfg(128, 128, 64, 4, 8),
]
# The interpreter runs one program at a time in numpy: a fixed small tile, no autotuning.
_INTERPRET_BLOCK = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=4)


def _prune_by_arch(configs, named_args, **kwargs):
    """Keep the configurations written for this GPU (decided at the first launch, not at import,
    so importing mpgpt never initialises CUDA)."""
    cc = torch.cuda.get_device_capability()
    want = "sm90" if cc >= (9, 0) else "sm80"
    kept = [c for c in configs if getattr(c, "mpgpt_arch", "any") in (want, "any")]
    return kept or configs


# ----------------------------------------------------------------------------------------------
# The kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _epilogue(acc, bias_ptr, offs_n, N,
              HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr):
    """fp32 epilogue on one tile: z = acc + bias; y = act(z). Returns (z, y)."""
    z = acc
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
        z = z + bias.to(tl.float32)[None, :]
    if ACTIVATION == "gelu":
        # tanh-approximate GELU, written as z * sigmoid(2u) with u = sqrt(2/pi) (z + 0.044715 z^3)
        v = 1.5957691216057308 * (z + 0.044715 * z * z * z)  # 2 * sqrt(2/pi) = 1.5957...
        y = z * sigmoid_f32(v)
    elif ACTIVATION == "relu":
        y = tl.maximum(z, 0.0)
    else:
        y = z
    return z, y


@triton.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped ordering: walk GROUP_M rows of tiles column by column, so programs that run at the
    same time reuse the same rows of A and columns of B from L2 (Triton tutorial 03)."""
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((tile_id % num_pid_in_group) % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _store_tile(y, z, c_ptr, z_ptr, offs_cm, offs_cn, M, N, stride_cm, stride_cn, stride_zm, stride_zn,
                STORE_Z: tl.constexpr):
    """Masked pointer stores of one output tile y (and the pre-activation z), rounded once."""
    mask = (offs_cm[:, None] < M) & (offs_cn[None, :] < N)
    c_ptrs = c_ptr + offs_cm[:, None] * stride_cm + offs_cn[None, :] * stride_cn
    tl.store(c_ptrs, y.to(c_ptr.dtype.element_ty), mask=mask)
    if STORE_Z:
        z_ptrs = z_ptr + offs_cm[:, None] * stride_zm + offs_cn[None, :] * stride_zn
        tl.store(z_ptrs, z.to(z_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _matmul_kernel(
    a_ptr, b_ptr, c_ptr,            # A (M, K), B (K, N), C (M, N): any strides
    bias_ptr,                       # bias (N,), read only if HAS_BIAS
    z_ptr,                          # Z (M, N) = pre-activation output, written only if STORE_Z
    M, N, K,                        # problem size
    stride_am, stride_ak,           # A[m, k] is at a_ptr + m*stride_am + k*stride_ak
    stride_bk, stride_bn,           # B[k, n] likewise (a transposed view just swaps these)
    stride_cm, stride_cn,
    stride_zm, stride_zn,
    stride_cs,                      # split-K: C holds SPLIT_K fp32 partial sums, this far apart
    HAS_BIAS: tl.constexpr,         # add bias before the activation
    ACTIVATION: tl.constexpr,       # "" (none), "gelu" (tanh approximation) or "relu"
    STORE_Z: tl.constexpr,          # also write z = A@B + bias (what GELU's backward needs)
    UPCAST: tl.constexpr,           # interpreter: convert tiles to fp32 before tl.dot
    SPLIT_K: tl.constexpr,          # programs along K per output tile (1: the whole K in one)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,  # tile sizes
    GROUP_M: tl.constexpr,          # rows of tiles per group in the grouped ordering
):
    pid = tl.program_id(axis=0)
    pid_k = tl.program_id(axis=1)   # which slice of K this program sums (0 without split-K)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _tile_coords(pid, num_pid_m, num_pid_n, GROUP_M)
    # Split-K: the K-tiles [k_first, k_last) are this program's share; the host adds the shares.
    k_tiles = tl.cdiv(K, BLOCK_K)
    tiles_per_split = tl.cdiv(k_tiles, SPLIT_K)
    k_first = pid_k * tiles_per_split
    k_last = tl.minimum(k_first + tiles_per_split, k_tiles)

    # Rows/columns past the edge wrap around (% M, % N) so the loads need no mask there: they
    # read valid memory, and the results for those rows are dropped by the masked store below.
    offs_am = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_bn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = k_first * BLOCK_K + tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_am[:, None] * stride_am + offs_k[None, :] * stride_ak  # (BLOCK_M, BLOCK_K)
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_bn[None, :] * stride_bn  # (BLOCK_K, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)

    # fp32 accumulator: each bf16 x bf16 product is exact in fp32, and the long sum along K keeps
    # fp32's 24 significant bits instead of bf16's 8.
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_first, k_last):
        # The K edge must be masked (a wrapped k would add wrong products): other=0 adds nothing.
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if UPCAST:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)  # tensor cores: bf16/fp16 in, fp32 accumulate
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    offs_cm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_cn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    z, y = _epilogue(acc, bias_ptr, offs_cn, N, HAS_BIAS, ACTIVATION)
    # One rounding, fp32 -> the output dtype; split-K slice pid_k writes its own partial.
    _store_tile(y, z, c_ptr + pid_k * stride_cs, z_ptr, offs_cm, offs_cn, M, N, stride_cm, stride_cn,
                stride_zm, stride_zn, STORE_Z)


@triton.jit
def _matmul_kernel_tma(
    a_ptr, b_ptr, c_ptr, bias_ptr, z_ptr,   # as in _matmul_kernel
    M, N, K,
    stride_a,                       # the non-unit stride of A's memory (its row pitch)
    stride_b,                       # the non-unit stride of B's memory
    stride_cm, stride_cn, stride_zm, stride_zn,
    A_T: tl.constexpr,              # False: A is (M, K) row-major; True: A's memory is (K, M) row-major
    B_T: tl.constexpr,              # False: B is (K, N) row-major; True: B's memory is (N, K) (nn.Linear's weight)
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, STORE_Z: tl.constexpr,
    TMA_STORE_OK: tl.constexpr,     # C (and Z) are row-major and 16-byte aligned (decided by the host)
    NUM_SMS: tl.constexpr,          # the GPU's multiprocessors
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EPILOGUE_SUBTILE: tl.constexpr,  # run the epilogue on two (BLOCK_M, BLOCK_N/2) halves
    TMA_STORE: tl.constexpr,        # store output tiles through TMA descriptors (if TMA_STORE_OK)
    WARP_SPECIALIZE: tl.constexpr,  # let the compiler split loads and MMAs into separate warps
    PPS: tl.constexpr,              # persistent programs per multiprocessor (1 or 2)
):
    # TMA descriptors describe the whole matrix once; loads then name a tile by its corner and
    # the copy engine fetches it into shared memory, zero-filling whatever lies past the edge.
    if A_T:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[K, M], strides=[stride_a, 1],
                                           block_shape=[BLOCK_K, BLOCK_M])
    else:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_a, 1],
                                           block_shape=[BLOCK_M, BLOCK_K])
    if B_T:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[stride_b, 1],
                                           block_shape=[BLOCK_N, BLOCK_K])
    else:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[stride_b, 1],
                                           block_shape=[BLOCK_K, BLOCK_N])
    SUB_N: tl.constexpr = BLOCK_N // 2 if EPILOGUE_SUBTILE else BLOCK_N
    USE_TMA_STORE: tl.constexpr = TMA_STORE and TMA_STORE_OK
    NUM_PROGRAMS: tl.constexpr = NUM_SMS * PPS  # programs launched; each loops over tiles
    # With TMA_STORE, output tiles go registers -> shared memory -> global memory by the copy
    # engine too, which drops whatever lies past the edge (no mask). Otherwise the names are
    # unused placeholders (the helper's TMA branch is compiled out).
    c_desc = c_ptr
    z_desc = z_ptr
    if USE_TMA_STORE:
        c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[stride_cm, 1],
                                           block_shape=[BLOCK_M, SUB_N])
        if STORE_Z:
            z_desc = tl.make_tensor_descriptor(z_ptr, shape=[M, N], strides=[stride_zm, 1],
                                               block_shape=[BLOCK_M, SUB_N])

    start_pid = tl.program_id(axis=0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_tiles = num_pid_m * num_pid_n
    # A second tile counter for the epilogue (as in Triton's tutorial 09): the flattened loop is
    # software-pipelined across tiles, and the epilogue must not share the prologue's counter.
    tile_id_c = start_pid - NUM_PROGRAMS

    for tile_id in tl.range(start_pid, num_tiles, NUM_PROGRAMS, flatten=True, warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            off_k = ki * BLOCK_K
            if A_T:
                a = a_desc.load([off_k, off_m]).T
            else:
                a = a_desc.load([off_m, off_k])
            if B_T:
                b = b_desc.load([off_n, off_k]).T
            else:
                b = b_desc.load([off_k, off_n])
            acc = tl.dot(a, b, acc)

        tile_id_c += NUM_PROGRAMS
        pid_m, pid_n = _tile_coords(tile_id_c, num_pid_m, num_pid_n, GROUP_M)
        off_cm = pid_m * BLOCK_M
        off_cn = pid_n * BLOCK_N
        if EPILOGUE_SUBTILE:
            # (BLOCK_M, BLOCK_N) -> two (BLOCK_M, BLOCK_N/2) halves: the epilogue's fp32
            # temporaries (GELU's) and the store buffer are half the size.
            acc0, acc1 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, SUB_N)), (0, 2, 1)))
            _tma_epilogue(acc0, c_desc, z_desc, c_ptr, z_ptr, bias_ptr, off_cm, off_cn, M, N,
                          stride_cm, stride_cn, stride_zm, stride_zn,
                          HAS_BIAS, ACTIVATION, STORE_Z, USE_TMA_STORE, BLOCK_M, SUB_N)
            _tma_epilogue(acc1, c_desc, z_desc, c_ptr, z_ptr, bias_ptr, off_cm, off_cn + SUB_N, M, N,
                          stride_cm, stride_cn, stride_zm, stride_zn,
                          HAS_BIAS, ACTIVATION, STORE_Z, USE_TMA_STORE, BLOCK_M, SUB_N)
        else:
            _tma_epilogue(acc, c_desc, z_desc, c_ptr, z_ptr, bias_ptr, off_cm, off_cn, M, N,
                          stride_cm, stride_cn, stride_zm, stride_zn,
                          HAS_BIAS, ACTIVATION, STORE_Z, USE_TMA_STORE, BLOCK_M, SUB_N)


@triton.jit
def _tma_epilogue(acc, c_desc, z_desc, c_ptr, z_ptr, bias_ptr, off_m, off_n, M, N,
                  stride_cm, stride_cn, stride_zm, stride_zn,
                  HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, STORE_Z: tl.constexpr,
                  TMA_STORE: tl.constexpr, BLOCK_M: tl.constexpr, SUB_N: tl.constexpr):
    """Bias, activation and store of one (BLOCK_M, SUB_N) piece of a tile whose corner is
    (off_m, off_n): through the TMA descriptors, or through masked pointer stores."""
    offs_n = off_n + tl.arange(0, SUB_N)
    z, y = _epilogue(acc, bias_ptr, offs_n, N, HAS_BIAS, ACTIVATION)
    if TMA_STORE:
        c_desc.store([off_m, off_n], y.to(c_desc.dtype))
        if STORE_Z:
            z_desc.store([off_m, off_n], z.to(z_desc.dtype))
    else:
        offs_m = off_m + tl.arange(0, BLOCK_M)
        _store_tile(y, z, c_ptr, z_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn,
                    stride_zm, stride_zn, STORE_Z)


def _prune_tma_store(configs, named_args, **kwargs):
    """Without TMA_STORE_OK a TMA_STORE config is the same kernel as its pointer-store twin: skip it."""
    if kwargs.get("TMA_STORE_OK", named_args.get("TMA_STORE_OK", True)):
        return configs
    return [c for c in configs if not c.kwargs.get("TMA_STORE")] or configs


# Autotuned launchers (compiled mode). The key names the arguments whose values select a
# config; Triton adds the tensors' dtypes to it.
# The epilogue flags are part of the key: a GELU epilogue needs registers that a plain store does
# not, so the best tile can differ between them for the same (M, N, K).
_EPILOGUE_KEY = ["HAS_BIAS", "ACTIVATION", "STORE_Z"]
_matmul_grouped = triton.autotune(configs=_HOPPER + _AMPERE, key=["M", "N", "K", "SPLIT_K"] + _EPILOGUE_KEY,
                                  prune_configs_by={"early_config_prune": _prune_by_arch})(_matmul_kernel)
_matmul_tma = triton.autotune(configs=_TMA, key=["M", "N", "K", "A_T", "B_T", "TMA_STORE_OK"] + _EPILOGUE_KEY,
                              prune_configs_by={"early_config_prune": _prune_tma_store})(_matmul_kernel_tma)


# ----------------------------------------------------------------------------------------------
# Host wrappers
# ----------------------------------------------------------------------------------------------
def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
           activation: str | None = None, *, out: torch.Tensor | None = None,
           kernel: str = "auto", split_k: int | None = None) -> torch.Tensor:
    """act(a @ b + bias) with fp32 accumulation, returned in a's dtype.

    a: (..., K) bf16 or fp16; leading dimensions are flattened (no copy when they can be viewed).
    b: (K, N), same dtype as a; any strides (pass w.t() for nn.Linear's (N, K) weight).
    bias: (N,) in a's dtype or fp32, or None.
    activation: None, "relu", or "gelu" (the tanh approximation, = nn.GELU(approximate="tanh")).
    out: optional preallocated (..., N) result, a's dtype or fp32 (any strides).
    kernel: "auto" (on sm_90: the warp-specialised kernel for a @ w.t() without activation
        where it fills the GPU better (matmul_ws.py); the persistent TMA kernel wherever it can
        read the operands, 16-byte aligned with one unit stride each; the grouped kernel
        otherwise, and for a product that splits K 4 ways or more), "grouped", "tma" or "ws"
        (to compare them). Without a GPU every choice runs the grouped kernel in the interpreter.
    split_k: programs that share one output tile, each summing a slice of K into an fp32
        partial that the host then adds (grouped kernel; no bias or activation). None chooses
        from the shape on a GPU: more than 1 only when there are too few output tiles to fill
        the GPU and K is long, the shape of a weight gradient dW = dY^T X (out x in, K = tokens).

    Runs compiled on CUDA GPUs with compute capability >= 8.0, and through Triton's interpreter
    on CPU tensors when no GPU is present. On sm_70/75 GPUs (V100, T4) bf16 raises a RuntimeError
    that names the GPU; fp16 inputs are passed to Triton there but this project has not tested
    that path (Triton's README lists sm_80+ as supported).
    """
    a2, b, bias, out_shape = _check(a, b, bias, activation)
    M, K = a2.shape
    N = b.shape[1]
    if out is None:
        c = torch.empty((M, N), dtype=a.dtype, device=a.device)
    else:
        if tuple(out.shape) != tuple(out_shape):
            raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(out_shape)}")
        if out.dtype not in (a.dtype, torch.float32) or out.device != a.device:
            raise ValueError(f"out must be {a.dtype} or float32 on {a.device}, got {out.dtype} on {out.device}")
        c = out.view(M, N) if out.dim() != 2 else out
    if split_k is not None and (not isinstance(split_k, int) or isinstance(split_k, bool) or split_k < 1):
        raise ValueError(f"split_k must be a positive int or None (chosen from the shape), got {split_k!r}")
    _matmul_2d(a2, b, c, bias=bias, activation=activation, kernel=kernel, split_k=split_k)
    return out if out is not None else c.view(out_shape)


def _check(a, b, bias, activation):
    """Validate matmul's inputs; return (a as 2-D, b, bias, output shape)."""
    if TRITON_IMPORT_ERROR is not None:
        raise RuntimeError(TRITON_IMPORT_ERROR)
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise TypeError(f"a and b must be torch.Tensors, got {type(a).__name__} and {type(b).__name__}")
    if a.dtype not in _LOW_PRECISION:
        raise TypeError(f"matmul takes bfloat16 or float16 inputs, got a: {a.dtype}; cast with "
                        ".to(torch.bfloat16) (accumulation is fp32 inside the kernel) or use torch.matmul")
    if b.dtype != a.dtype:
        raise TypeError(f"a and b must have the same dtype, got a: {a.dtype} and b: {b.dtype}; cast one of them")
    if b.dim() != 2:
        raise ValueError(f"b must be 2-D (K, N), got shape {tuple(b.shape)}")
    if a.dim() == 0:
        raise ValueError("a must have at least one dimension (..., K)")
    if a.shape[-1] != b.shape[0]:
        raise ValueError(f"inner dimensions differ: a is {tuple(a.shape)} (K={a.shape[-1]}) but b is "
                         f"{tuple(b.shape)} (K={b.shape[0]})")
    if a.device != b.device:
        raise ValueError(f"a and b are on different devices ({a.device} and {b.device})")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be None, 'gelu' (tanh approximation) or 'relu', got {activation!r}")
    N = b.shape[1]
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.dim() != 1 or bias.shape[0] != N:
            shape = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
            raise ValueError(f"bias must be a 1-D tensor of length N={N}, got {shape}")
        if bias.dtype not in (a.dtype, torch.float32):
            raise TypeError(f"bias must be {a.dtype} or float32, got {bias.dtype}")
        if bias.device != a.device:
            raise ValueError(f"bias is on {bias.device} but a is on {a.device}")
    check_device(a)
    K = a.shape[-1]
    out_shape = (*a.shape[:-1], N)
    if a.dim() == 2:
        a2 = a
    else:
        try:
            a2 = a.view(-1, K)  # no copy: the common case (contiguous activations)
        except RuntimeError:
            a2 = a.reshape(-1, K)  # the batch dimensions cannot be merged in place: copy
    return a2, b, bias, out_shape


def _auto_split_k(M, N, K, num_sms) -> int:
    """Split K when the output has too few 128x128 tiles for two waves over the multiprocessors
    and K is long: then every program would run a long K loop while most SMs sit idle. Each
    split adds an fp32 (M, N) partial (small: this is only chosen when M x N is small)."""
    tiles = triton.cdiv(M, 128) * triton.cdiv(N, 128)
    target = 2 * num_sms
    if tiles >= target or K < 2048:
        return 1
    return max(1, min(triton.cdiv(target, tiles), K // 512, 16))


# Call signature -> (split_k, CompiledLaunch): the lean launch path (launch.py). Filled by the
# first call with a signature, used by every later one.
_PLANS: dict = {}


def _plan_key(a, b, c, bias, z, activation, kernel, split_k):
    """Everything that decides how a call is launched: which kernel and configuration, its
    specialisation (dtypes; 16-byte alignment of each address; integer values), and the grid.
    Shapes and strides are in it exactly, so the integers passed to the kernel are too."""
    return (torch.cuda.current_device(), a.dtype, c.dtype, a.shape, b.shape, a.stride(), b.stride(), c.stride(),
            a.data_ptr() % 16 == 0, b.data_ptr() % 16 == 0, c.data_ptr() % 16 == 0,
            None if bias is None else (bias.dtype, bias.stride(), bias.data_ptr() % 16 == 0),
            None if z is None else (z.dtype, z.stride(), z.data_ptr() % 16 == 0),
            activation, kernel, split_k, os.environ.get("MPGPT_AUTOTUNE", "1") != "0")


def _matmul_2d(a, b, c, bias=None, z=None, activation=None, kernel="auto", split_k=None):
    """Launch on 2-D a (M, K), b (K, N) into c (M, N); z (M, N) receives the pre-activation."""
    M, K = a.shape
    N = b.shape[1]
    if M == 0 or N == 0:
        return c
    interp = interpreting()  # an environment read: once per call, not once per decision
    key = None
    if not interp and a.is_cuda and lean_launch_enabled():
        key = _plan_key(a, b, c, bias, z, activation, kernel, split_k)
        plan = _PLANS.get(key)
        if plan is not None:  # seen before: every check below passed for this signature
            return _run_plan(plan, a, b, c, bias, z)

    for t in (a, b, c) + ((z,) if z is not None else ()):
        # Offsets are 32-bit inside the kernels: keep every element reachable.
        span = sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()))
        if span >= 2**31:
            raise ValueError(f"tensor of shape {tuple(t.shape)} spans >= 2**31 elements; split the batch")
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    flags = dict(HAS_BIAS=bias is not None, ACTIVATION=activation or "", STORE_Z=z is not None)
    epilogue = bias is not None or activation is not None or z is not None
    if split_k is None:
        split_k = 1 if (epilogue or kernel in ("tma", "ws") or interp) else _auto_split_k(M, N, K, _num_sms(a.device))
        if 1 < split_k < _SPLIT_K_OVER_TMA and kernel == "auto" and _TMA_AUTO in ("1", "all") \
                and _tma_layout(a, b, M, N, K) is not None:
            split_k = 1  # the TMA kernel, unsplit, measured faster than a 2- or 3-way split (see below)
    if split_k > 1:
        if epilogue:
            raise ValueError("split_k > 1 adds fp32 partial sums after the kernel: it takes no bias, activation "
                             "or z; use split_k=1")
        if kernel in ("tma", "ws"):
            raise ValueError("split_k > 1 runs on the grouped kernel; use kernel='grouped' or 'auto'")
        # The K slices write fp32 partials side by side; their sum, rounded once, is the result.
        parts = torch.empty((split_k, M, N), dtype=torch.float32, device=a.device)
        if interp:
            parts.fill_(float("nan"))  # a test's poison: a slice the kernel never writes cannot pass
        launch, _ = _matmul_2d_launch(a, b, parts[0], None, None, flags, "grouped", split_k, parts.stride(0),
                                      interp)
        _sum_parts(parts, c)
        kind = "grouped"
    else:
        launch, kind = _matmul_2d_launch(a, b, c, bias, z, flags, kernel, 1, 0, interp)
    if key is not None and launch is not None:
        _PLANS[key] = (split_k, kind, launch)
    return c


def _sum_parts(parts, c):
    """c = the sum of the split-K partials (split_k, M, N), rounded once to c's dtype."""
    if c.dtype == torch.float32 and c.is_contiguous():
        torch.sum(parts, dim=0, out=c)
    else:
        c.copy_(parts.sum(0))


def _run_plan(plan, a, b, c, bias, z):
    """Repeat a remembered launch with new tensors (same signature)."""
    split_k, kind, launch = plan
    dev = a.device.index
    if split_k > 1:
        M, N = c.shape
        parts = torch.empty((split_k, M, N), dtype=torch.float32, device=a.device)
        p0 = parts[0]
        launch(dev, a, b, p0, p0, p0)  # bias and z unused: c stands in, as in _matmul_2d_launch
        _sum_parts(parts, c)
        return c
    if kind == "ws":  # host-built TMA descriptors: five of them, then the bias
        launch(dev, *lean_descriptors(a, b, c), bias if bias is not None else c)
        return c
    if kind == "tma":
        _set_tma_allocator()  # the device-side TMA descriptors' scratch memory
    launch(dev, a, b, c, bias if bias is not None else c, z if z is not None else c)
    return c


def _matmul_2d_launch(a, b, c, bias, z, flags, kernel, split_k, stride_cs, interp):
    """Launch one kernel the ordinary way. Returns (a CompiledLaunch that repeats it, or None;
    which kernel ran: "grouped", "tma" or "ws")."""
    M, K = a.shape
    N = b.shape[1]
    bias_arg = bias if bias is not None else c  # never read when HAS_BIAS is False
    z_arg = z if z is not None else c
    zs = z.stride() if z is not None else (0, 0)

    if interp:
        # The interpreter converts fp32 -> bf16 by truncation, not round-to-nearest-even (we
        # measured a bias of -0.3 % and twice the rounding error), so bf16 results are written
        # to fp32 scratch and rounded by torch. The scratch starts as NaN: a tile the kernel
        # fails to write still shows up as NaN in c.
        def scratch(t):
            if t is None or t.dtype != torch.bfloat16:
                return t
            return torch.full(t.shape, float("nan"), dtype=torch.float32, device=t.device)

        c32, z32 = scratch(c), scratch(z)
        z_arg = z32 if z32 is not None else c32
        zs = z32.stride() if z32 is not None else (0, 0)
        grid = (triton.cdiv(M, _INTERPRET_BLOCK["BLOCK_M"]) * triton.cdiv(N, _INTERPRET_BLOCK["BLOCK_N"]), split_k)
        _matmul_kernel[grid](a, b, c32, bias_arg, z_arg, M, N, K, *a.stride(), *b.stride(), *c32.stride(),
                             *zs, stride_cs, UPCAST=True, SPLIT_K=split_k, **flags, **_INTERPRET_BLOCK)
        if c32 is not c:
            c.copy_(c32)
        if z is not None and z32 is not z:
            z.copy_(z32)
        return None, "grouped"

    global _LAST_KIND
    if split_k == 1 and (kernel == "ws" or (kernel == "auto" and _TMA_AUTO != "0" and _WS_AUTO != "0")):
        if ws_eligible(a, b, c, bias, flags["ACTIVATION"] or None, z) and (
                kernel == "ws" or ws_preferred(M, N, _num_sms(a.device))):
            jit_fn, compiled, grid, args, kwargs = ws_launch(a, b, c, bias, _num_sms(a.device))
            _LAST_KIND = "ws"
            return compiled_launch(jit_fn, compiled, grid, args, kwargs, n_tensors=6), "ws"
    if kernel == "ws":
        raise ValueError("the warp-specialised kernel needs an sm_90 GPU (H100/H200), bf16 or fp16, the forward "
                         "layout a @ w.t() with 16-byte-aligned rows, no activation; use kernel='auto'")
    want_tma = kernel == "tma" or (kernel == "auto" and _TMA_AUTO != "0")
    tma = _tma_layout(a, b, M, N, K) if want_tma else None
    if kernel == "auto" and _TMA_AUTO == "fwd" and tma is not None and (tma[0][0], tma[1][0]) != (False, True):
        tma = None  # MPGPT_TRITON_TMA=fwd: the forward layout only (A row-major, B = w.t())
    if kernel == "tma" and tma is None:
        raise ValueError("the TMA kernel needs a Hopper GPU (sm_90), 16-byte-aligned operands with a unit "
                         "stride each, and M, N, K >= 16; use kernel='grouped'")
    if tma is not None:
        (a_t, stride_a), (b_t, stride_b) = tma
        num_sms = _num_sms(a.device)
        _set_tma_allocator()
        tuned, fixed = _launcher(_matmul_tma, _matmul_kernel_tma, _FIXED_TMA)
        grid = lambda meta: (min(num_sms * meta["PPS"], triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"])),)
        args = (a, b, c, bias_arg, z_arg, M, N, K, stride_a, stride_b, *c.stride(), *zs)
        kwargs = dict(A_T=a_t, B_T=b_t, TMA_STORE_OK=_tma_store_ok(c, z), NUM_SMS=num_sms, **flags)
    else:
        tuned, fixed = _launcher(_matmul_grouped, _matmul_kernel, _FIXED_GROUPED)
        grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]), split_k)
        args = (a, b, c, bias_arg, z_arg, M, N, K, *a.stride(), *b.stride(), *c.stride(), *zs, stride_cs)
        kwargs = dict(UPCAST=False, SPLIT_K=split_k, **flags)
    compiled = tuned[grid](*args, **kwargs, **fixed)
    if tuned is _matmul_tma or tuned is _matmul_grouped:  # autotuned: the config it chose
        jit_fn, config = tuned.fn, tuned.best_config.all_kwargs()
    else:
        jit_fn, config = tuned, fixed
    _LAST_KIND = "tma" if tma is not None else "grouped"
    return compiled_launch(jit_fn, compiled, grid, args, {**kwargs, **config}, n_tensors=5), _LAST_KIND


# MPGPT_AUTOTUNE=0 launches one fixed configuration instead of autotuning. Autotuning compiles
# every configuration for every new specialisation of the shape (about 3 s each on the H200
# machine's CPUs), which dominates a test run over many odd shapes; the fixed configs are
# large tiles, so edge masking is still exercised.
_FIXED_GROUPED = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)
_FIXED_GROUPED_SM80 = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=4)
_FIXED_TMA = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, EPILOGUE_SUBTILE=False, TMA_STORE=True,
                  WARP_SPECIALIZE=False, PPS=1, num_warps=8, num_stages=4)


def _launcher(tuned, plain, fixed):
    """(kernel to index with the grid, extra launch kwargs): autotuned unless MPGPT_AUTOTUNE=0."""
    if os.environ.get("MPGPT_AUTOTUNE", "1") != "0":
        return tuned, {}
    if plain is _matmul_kernel and torch.cuda.get_device_capability() < (9, 0):
        fixed = _FIXED_GROUPED_SM80
    return plain, fixed


# kernel="auto" on sm_90: MPGPT_TRITON_TMA=1 (default; "all" is the same) takes the TMA kernel for
# every layout it can read: the forward GEMM and both gradient GEMMs, dX = dY W (B row-major) and
# dW = dY^T X (A transposed). "fwd" takes it for the forward layout only (sessions 2-4's default),
# "0" never. The one exception: a weight gradient with so few output tiles that _auto_split_k
# splits K 4 ways or more stays on the grouped kernel, which can split K; the TMA kernel cannot.
# Measured on the H200 (benchmarks/linear_probe.py, graph replay, GPT-2 layers at 12288 tokens):
# dX on TMA 78 / 29 / 105 / 102 us against 94 / 35 / 120 / 119 on the grouped kernel; dW on TMA
# unsplit 75 us against 96 split 3 ways (c_attn) and 128-131 either way for the MLP (split 2), but
# 65 against 44 split 8 ways for attn.c_proj's 768 x 768 output.
_TMA_AUTO = os.environ.get("MPGPT_TRITON_TMA", "1")
_SPLIT_K_OVER_TMA = 4
# MPGPT_WS=0 keeps kernel="auto" off the warp-specialised kernel (matmul_ws.py), to compare.
_WS_AUTO = os.environ.get("MPGPT_WS", "1")
_LAST_KIND = None  # which kernel the last ordinary (not lean) launch used: "grouped", "tma" or "ws" (benchmarks)


def _tma_layout(a, b, M, N, K):
    """((A_T, stride_a), (B_T, stride_b)) if the TMA kernel can read a and b, else None.

    A TMA descriptor needs a 16-byte-aligned base, a unit stride in its last dimension and the
    other stride a multiple of 16 bytes."""
    if a.device.type != "cuda" or _capability(a.device) < (9, 0):
        return None
    if min(M, N, K) < 16:
        return None

    la, lb = _tma_operand_layout(a), _tma_operand_layout(b)
    if la is None or lb is None:
        return None
    return la, lb


def _tma_operand_layout(t):
    """(transposed, pitch) if a TMA descriptor can address the 2-D tensor t, else None: a
    16-byte-aligned base, one unit stride, and the other stride a multiple of 16 bytes."""
    if t.data_ptr() % 16:
        return None
    s0, s1 = t.stride()
    if s1 == 1 and (s0 * t.element_size()) % 16 == 0:
        return False, s0  # row-major
    if s0 == 1 and (s1 * t.element_size()) % 16 == 0:
        return True, s1  # column-major: the memory holds the transpose, row-major
    return None


def _tma_store_ok(c, z):
    """Whether the TMA kernel may store c (and z) through descriptors: each must be addressable
    by a TMA descriptor as row-major (the kernel's store descriptors are)."""
    for t in (c, z):
        if t is not None:
            layout = _tma_operand_layout(t)
            if layout is None or layout[0]:
                return False
    return True


_NUM_SMS: dict = {}


def _num_sms(device):
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


def _set_tma_allocator():
    """Device-built TMA descriptors need a little global scratch memory per launch. Triton keeps
    the allocator in a ContextVar, i.e. per thread, and autograd runs backward on its own
    thread, so we set it before every TMA launch rather than once."""
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
