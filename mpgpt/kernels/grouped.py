"""The teaching kernel of chapter 6: a tiled matmul in grouped tile order, fused epilogue, split-K.

    c = act(a @ b + bias)      a: (M, K)   b: (K, N)   bias: (N,)   c: (M, N)   (z: (M, N), optional)

This file has the shape of Triton's matmul tutorial (03): the autotuning configurations, the
kernel (one comment per argument), then the host wrapper that computes the grid with
`triton.cdiv` and launches it. The chapter builds this kernel step by step; `matmul.matmul` is
the checked public entry point that calls `launch` here (or one of the Hopper kernels in tma.py
and ws.py, see `matmul.plan`).

The idea. One program computes one (BLOCK_M, BLOCK_N) tile of c: it walks along K in steps of
BLOCK_K, loads a (BLOCK_M, BLOCK_K) tile of a and a (BLOCK_K, BLOCK_N) tile of b, and lets
`tl.dot` (the tensor cores) add their product into an fp32 accumulator. Programs are numbered
in *grouped* order (epilogue.tile_coords) so the ones running together share rows of a and
columns of b in L2. The epilogue (bias, activation) runs on the fp32 accumulator and the result
is rounded once. The operands are read through their strides, so a transposed view (nn.Linear's
weight as w.t(), dY.t() in a weight gradient) costs no copy. Runs everywhere: Ampere (sm_80),
Ada (sm_89), Hopper (sm_90) and Triton's CPU interpreter.

Split-K. A weight gradient dW = dY^T X has a small output (out x in) and a long K (the tokens):
too few tiles to occupy the GPU, each with a long loop. With SPLIT_K > 1 a second grid axis
splits K into slices; each slice writes an fp32 partial tile into its own (M, N) plane and the
host adds the planes (one rounding). `auto_split_k` picks the split from the shape.

The interpreter (no GPU: mpgpt sets TRITON_INTERPRET=1 before this module is decorated, see
env.py) stores bf16 as raw uint16 bits, so `tl.dot` and arithmetic on bf16 values are silently
wrong there. With UPCAST=True the kernel converts each tile to fp32 first (exact: a bf16 or fp16
value is exactly representable in fp32, and so is the product of two of them), and the host
uses one small fixed tile size instead of autotuning.
"""
from __future__ import annotations

import torch

from . import env
from .env import tl, triton
from .epilogue import bias_act, store_tile, tile_coords
from .launch import autotune_enabled, compiled_launch


# ----------------------------------------------------------------------------------------------
# Autotuning configurations. Each Config fixes the tile (BLOCK_M x BLOCK_N, stepping BLOCK_K
# along K), GROUP_M, the warps per program and the software-pipelining depth (num_stages:
# how many K-tiles are loaded ahead into shared memory). Which tile wins depends on the shape,
# so the autotuner times each config the first time it sees a new (M, N, K) (and dtypes).
# ----------------------------------------------------------------------------------------------
def _cfg(bm, bn, bk, stages, warps, arch, group=8):
    c = triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group},
                      num_stages=stages, num_warps=warps)
    if c is not None:  # None: the stand-in when Triton is not installed
        c.mpgpt_arch = arch  # read by _prune_by_arch
    return c


# Hopper (sm_90, 228 KB shared memory a multiprocessor): large tiles, 3-4 stages.
CONFIGS_SM90 = [
    _cfg(128, 256, 64, 3, 8, "sm90"),
    _cfg(256, 128, 64, 3, 8, "sm90"),
    _cfg(128, 128, 64, 4, 8, "sm90"),
    _cfg(128, 128, 64, 4, 4, "sm90"),
    _cfg(128, 64, 64, 4, 4, "sm90"),
    _cfg(64, 128, 64, 4, 4, "sm90"),
]
# Ampere/Ada (sm_80/86/89, 100-164 KB): the configurations of Triton's tutorial 03, with small
# tiles for small problems; configs that do not fit a GPU's shared memory are skipped by the
# autotuner (they fail to compile with OutOfResources and time as infinity).
CONFIGS_SM80 = [
    _cfg(128, 256, 64, 3, 8, "sm80"),
    _cfg(64, 256, 32, 4, 4, "sm80"),
    _cfg(128, 128, 32, 4, 4, "sm80"),
    _cfg(128, 64, 32, 4, 4, "sm80"),
    _cfg(64, 128, 32, 4, 4, "sm80"),
    _cfg(128, 32, 32, 4, 4, "sm80"),
    _cfg(64, 32, 32, 5, 2, "sm80"),
    _cfg(32, 64, 32, 5, 2, "sm80"),
]
# Turing (sm_75, Colab's T4: 64 KB of shared memory per block). Triton 3.2 and later compile tl.dot
# there to plain FMA instructions, not tensor cores (triton-lang/triton pull request 5066), so the
# kernels run correctly but far below cuBLAS; two pipeline stages of small tiles fit the memory.
CONFIGS_SM75 = [
    _cfg(128, 64, 32, 2, 4, "sm75"),
    _cfg(64, 128, 32, 2, 4, "sm75"),
    _cfg(64, 64, 32, 2, 4, "sm75"),
    _cfg(32, 64, 32, 2, 2, "sm75"),
]
# MPGPT_AUTOTUNE=0 (launch.autotune_enabled) launches one fixed configuration instead: large
# tiles, so edge masking is still exercised.
FIXED_SM90 = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)
FIXED_SM80 = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=4)
FIXED_SM75 = dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=2)
# The interpreter runs one program at a time in numpy: a fixed small tile, no autotuning.
INTERPRET_BLOCK = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=4)


def arch_of(cc: tuple[int, int]) -> str:
    """The configuration family for a compute capability: "sm90", "sm80" (Ampere, Ada) or "sm75"."""
    return "sm90" if cc >= (9, 0) else "sm80" if cc >= (8, 0) else "sm75"


FIXED = {"sm90": FIXED_SM90, "sm80": FIXED_SM80, "sm75": FIXED_SM75}


def _prune_by_arch(configs, named_args, **kwargs):
    """Keep the configurations written for this GPU (decided at the first launch, not at import,
    so importing mpgpt never initialises CUDA)."""
    a = named_args.get("a_ptr")
    cc = env.capability(a.device if isinstance(a, torch.Tensor) else None)
    want = arch_of(cc)
    kept = [c for c in configs if getattr(c, "mpgpt_arch", None) == want]
    return kept or configs


# ----------------------------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------------------------
@triton.jit
def matmul_kernel(
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
    # Grid: (number of output tiles, SPLIT_K). Axis 0 picks the tile, axis 1 the slice of K.
    pid = tl.program_id(axis=0)
    pid_k = tl.program_id(axis=1)   # which slice of K this program sums (0 without split-K)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = tile_coords(pid, num_pid_m, num_pid_n, GROUP_M)
    # Split-K: the K-tiles [k_first, k_last) are this program's share; the host adds the shares.
    k_tiles = tl.cdiv(K, BLOCK_K)
    tiles_per_split = tl.cdiv(k_tiles, SPLIT_K)
    k_first = pid_k * tiles_per_split
    k_last = tl.minimum(k_first + tiles_per_split, k_tiles)

    # Rows/columns past the edge wrap around (% M, % N) so the loads need no mask there: they
    # read valid memory, and the results for those rows are dropped by the masked store below.
    offs_am = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M                       # (BLOCK_M,)
    offs_bn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N                       # (BLOCK_N,)
    offs_k = k_first * BLOCK_K + tl.arange(0, BLOCK_K)                            # (BLOCK_K,)
    a_ptrs = a_ptr + offs_am[:, None] * stride_am + offs_k[None, :] * stride_ak  # (BLOCK_M, BLOCK_K)
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_bn[None, :] * stride_bn  # (BLOCK_K, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)

    # fp32 accumulator: each bf16 x bf16 product is exact in fp32, and the long sum along K keeps
    # fp32's 24 significant bits instead of bf16's 8.
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)                          # (BLOCK_M, BLOCK_N)
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
    z, y = bias_act(acc, bias_ptr, offs_cn, N, HAS_BIAS, ACTIVATION)
    # One rounding, fp32 -> the output dtype; split-K slice pid_k writes its own partial.
    store_tile(y, z, c_ptr + pid_k * stride_cs, z_ptr, offs_cm, offs_cn, M, N, stride_cm, stride_cn,
               stride_zm, stride_zn, STORE_Z)


# The autotuned launcher (compiled mode). The key names the arguments whose values select a
# config; Triton adds the tensors' dtypes to it. The epilogue flags are part of the key: a GELU
# epilogue needs registers that a plain store does not, so the best tile can differ between them
# for the same (M, N, K).
EPILOGUE_KEY = ["HAS_BIAS", "ACTIVATION", "STORE_Z"]
matmul_autotuned = triton.autotune(configs=CONFIGS_SM90 + CONFIGS_SM80 + CONFIGS_SM75,
                                   key=["M", "N", "K", "SPLIT_K"] + EPILOGUE_KEY,
                                   prune_configs_by={"early_config_prune": _prune_by_arch})(matmul_kernel)


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------
def auto_split_k(M, N, K, num_sms) -> int:
    """Split K when the output has too few 128x128 tiles for two waves over the multiprocessors
    and K is long: then every program would run a long K loop while most SMs sit idle. Each
    split adds an fp32 (M, N) partial (small: this is only chosen when M x N is small)."""
    tiles = triton.cdiv(M, 128) * triton.cdiv(N, 128)
    target = 2 * num_sms
    if tiles >= target or K < 2048:
        return 1
    return max(1, min(triton.cdiv(target, tiles), K // 512, 16))


def launch(a, b, c, bias=None, z=None, activation=None, split_k=1, interpreted=False):
    """c = act(a @ b + bias) on the grouped kernel, z = a @ b + bias if z is given.

    a (M, K), b (K, N), c (M, N) and z: 2-D tensors, any strides, already checked (matmul.py).
    split_k > 1: K in that many slices, summed by the host (no bias, activation or z then).
    interpreted: Triton's CPU interpreter (fixed small tiles, UPCAST).
    Returns a replay function `(a, b, c, bias, z) -> None` that repeats this launch for new
    tensors of the same signature without Triton's Python launch path, or None (interpreter,
    or Triton's objects not as expected)."""
    M, K = a.shape
    N = b.shape[1]
    flags = dict(HAS_BIAS=bias is not None, ACTIVATION=activation or "", STORE_Z=z is not None)
    if split_k > 1:
        # The K slices write fp32 partials side by side; their sum, rounded once, is the result.
        parts = torch.empty((split_k, M, N), dtype=torch.float32, device=a.device)  # (SPLIT_K, M, N)
        if interpreted:
            parts.fill_(float("nan"))  # a test's poison: a slice the kernel never writes cannot pass
            _launch_interpreted(a, b, parts[0], None, None, flags, split_k, parts.stride(0))
            _sum_parts(parts, c)
            return None
        compiled = _launch_compiled(a, b, parts[0], None, None, flags, split_k, parts.stride(0))
        _sum_parts(parts, c)
        if compiled is None:
            return None

        def replay_split(a, b, c, bias, z):
            parts = torch.empty((split_k, M, N), dtype=torch.float32, device=a.device)
            p0 = parts[0]
            compiled(a.device.index, a, b, p0, p0, p0)  # bias and z unused: c stands in
            _sum_parts(parts, c)
        return replay_split
    if interpreted:
        _launch_interpreted(a, b, c, bias, z, flags, 1, 0)
        return None
    compiled = _launch_compiled(a, b, c, bias, z, flags, 1, 0)
    if compiled is None:
        return None

    def replay(a, b, c, bias, z):
        compiled(a.device.index, a, b, c, bias if bias is not None else c, z if z is not None else c)
    return replay


def _launch_compiled(a, b, c, bias, z, flags, split_k, stride_cs):
    """One ordinary launch (autotuned unless MPGPT_AUTOTUNE=0). Returns a CompiledLaunch that
    repeats it with new tensors, or None."""
    M, K = a.shape
    N = b.shape[1]
    bias_arg = bias if bias is not None else c  # never read when HAS_BIAS is False
    z_arg = z if z is not None else c           # never written when STORE_Z is False
    zs = z.stride() if z is not None else (0, 0)
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]), split_k)
    args = (a, b, c, bias_arg, z_arg, M, N, K, *a.stride(), *b.stride(), *c.stride(), *zs, stride_cs)
    kwargs = dict(UPCAST=False, SPLIT_K=split_k, **flags)
    if autotune_enabled():
        compiled = matmul_autotuned[grid](*args, **kwargs)
        jit_fn, config = matmul_autotuned.fn, matmul_autotuned.best_config.all_kwargs()
    else:
        config = FIXED[arch_of(env.capability(a.device))]
        compiled = matmul_kernel[grid](*args, **kwargs, **config)
        jit_fn = matmul_kernel
    return compiled_launch(jit_fn, compiled, grid, args, {**kwargs, **config}, n_tensors=5)


def _launch_interpreted(a, b, c, bias, z, flags, split_k, stride_cs):
    """The interpreter's launch: fixed INTERPRET_BLOCK tiles, UPCAST.

    The interpreter converts fp32 -> bf16 by truncation, not round-to-nearest-even (we measured
    a bias of -0.3 % and twice the rounding error), so bf16 results are written to fp32 scratch
    and rounded by torch. The scratch starts as NaN: a tile the kernel fails to write still
    shows up as NaN in c."""
    M, K = a.shape
    N = b.shape[1]

    def scratch(t):
        if t is None or t.dtype != torch.bfloat16:
            return t
        return torch.full(t.shape, float("nan"), dtype=torch.float32, device=t.device)

    c32, z32 = scratch(c), scratch(z)
    bias_arg = bias if bias is not None else c32
    z_arg = z32 if z32 is not None else c32
    zs = z32.stride() if z32 is not None else (0, 0)
    grid = (triton.cdiv(M, INTERPRET_BLOCK["BLOCK_M"]) * triton.cdiv(N, INTERPRET_BLOCK["BLOCK_N"]), split_k)
    matmul_kernel[grid](a, b, c32, bias_arg, z_arg, M, N, K, *a.stride(), *b.stride(), *c32.stride(),
                        *zs, stride_cs, UPCAST=True, SPLIT_K=split_k, **flags, **INTERPRET_BLOCK)
    if c32 is not c:
        c.copy_(c32)
    if z is not None and z32 is not z:
        z.copy_(z32)


def _sum_parts(parts, c):
    """c = the sum of the split-K partials (split_k, M, N), rounded once to c's dtype."""
    if c.dtype == torch.float32 and c.is_contiguous():
        torch.sum(parts, dim=0, out=c)
    else:
        c.copy_(parts.sum(0))
