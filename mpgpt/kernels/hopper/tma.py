"""The Hopper (sm_90) matmul: a persistent grid and tensor-memory-accelerator (TMA) loads (chapter 6).

    c = act(a @ b + bias)      a: (M, K)   b: (K, N)   bias: (N,)   c: (M, N)   (z: (M, N), optional)

Same product and epilogue as the grouped kernel (grouped.py), two Hopper features more:

* **TMA descriptors.** A descriptor describes a whole matrix once (base, shape, strides, the
  tile "box"); a load then names a tile by its corner and the copy engine fetches it into shared
  memory, zero-filling whatever lies past the edge (no masks, no address arithmetic in the
  program's registers). The descriptors are built on the device (`tl.make_tensor_descriptor`),
  which needs a little global scratch memory (`set_allocator`).
* **A persistent grid.** One program per multiprocessor (or two, PPS=2) loops over the output
  tiles, in the grouped order of epilogue.tile_coords, instead of one program per tile: the
  compiler can then overlap one tile's epilogue with the next tile's loads.

What a descriptor can address, checked by `layout`: a 16-byte-aligned base, one unit stride
and the other stride a multiple of 16 bytes, for a and b each; M, N, K >= 16. Either operand may
be transposed (A_T, B_T: the memory holds the transpose, row-major), so the forward product
x @ w.t() and both gradient products of a linear layer (dX = dY @ W with B row-major, dW =
dY.t() @ X with A transposed) all fit. Whether `matmul(kernel="auto")` takes this kernel is
decided in matmul.plan.

Its autotuned options, chosen by measurement (`python -m mpgpt.bench kernels`): output tiles stored
through TMA too (when `store_ok`), the epilogue run on two half tiles, compiler warp
specialisation, and two programs per multiprocessor. Compiled only: the interpreter runs the
grouped kernel instead.
"""
from __future__ import annotations

import torch

from .. import env
from ..env import tl, triton
from ..epilogue import bias_act, store_tile, tile_coords
from ..launch import autotune_enabled, compiled_launch


# ----------------------------------------------------------------------------------------------
# Configurations. Besides the tile, a config picks how the epilogue stores (TMA_STORE: through
# a TMA descriptor; EPILOGUE_SUBTILE: in two half-width pieces), WARP_SPECIALIZE (the tile loop
# split by the compiler into load and MMA warps) and PPS (programs per multiprocessor: 2 lets
# one program's epilogue overlap another's main loop). Chosen from a sweep of 72 variants on
# Hopper: the fastest one or two per
# GPT-2 shape, plus the large-square configs.
# ----------------------------------------------------------------------------------------------
def _cfg(bm, bn, bk, stages, warps, store=False, subtile=False, ws=False, pps=1):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "TMA_STORE": store,
                          "EPILOGUE_SUBTILE": subtile, "WARP_SPECIALIZE": ws, "PPS": pps},
                         num_stages=stages, num_warps=warps)


CONFIGS = [
    _cfg(128, 256, 64, 3, 8, store=True, ws=True),      # c_attn, c_fc
    _cfg(128, 256, 64, 3, 8, store=True),               # c_fc + bias + GELU
    _cfg(128, 256, 64, 3, 8),                           # c_fc + bias + GELU + Z
    _cfg(128, 256, 64, 4, 8),                           # large squares, lm_head
    _cfg(128, 128, 64, 4, 4, store=True, subtile=True),  # mlp.c_proj
    _cfg(128, 128, 64, 4, 4, store=True, ws=True),      # attn.c_proj (2nd)
    _cfg(128, 128, 64, 3, 4, subtile=True, pps=2),      # attn.c_proj
    _cfg(128, 128, 64, 3, 4, store=True, subtile=True, pps=2),
    _cfg(128, 128, 128, 3, 8),                          # mlp.c_proj (2nd)
    _cfg(128, 128, 64, 4, 8),
]
# MPGPT_AUTOTUNE=0 (launch.autotune_enabled): this one configuration instead.
FIXED = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, EPILOGUE_SUBTILE=False, TMA_STORE=True,
             WARP_SPECIALIZE=False, PPS=1, num_warps=8, num_stages=4)


# ----------------------------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------------------------
@triton.jit
def operand_descriptors(a_ptr, b_ptr, M, N, K, stride_a, stride_b, A_T: tl.constexpr, B_T: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Device-built TMA descriptors of A (M, K) and B (K, N) as they lie in memory: each may hold
    its transpose, row-major (A_T: A's memory is (K, M); B_T: B's memory is (N, K)), with a box
    of one tile."""
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
    return a_desc, b_desc


@triton.jit
def load_operands(a_desc, b_desc, off_m, off_n, off_k, A_T: tl.constexpr, B_T: tl.constexpr):
    """A's (BLOCK_M, BLOCK_K) tile at (off_m, off_k) and B's (BLOCK_K, BLOCK_N) tile at
    (off_k, off_n), loaded through the descriptors of operand_descriptors; a transposed operand
    is loaded as stored and read through a transposed view (no data moves)."""
    if A_T:
        a = a_desc.load([off_k, off_m]).T                      # (BLOCK_K, BLOCK_M) -> (BLOCK_M, BLOCK_K)
    else:
        a = a_desc.load([off_m, off_k])                        # (BLOCK_M, BLOCK_K)
    if B_T:
        b = b_desc.load([off_n, off_k]).T                      # (BLOCK_N, BLOCK_K) -> (BLOCK_K, BLOCK_N)
    else:
        b = b_desc.load([off_k, off_n])                        # (BLOCK_K, BLOCK_N)
    return a, b


@triton.jit
def matmul_kernel_tma(
    a_ptr, b_ptr, c_ptr, bias_ptr, z_ptr,   # as in grouped.matmul_kernel
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
    a_desc, b_desc = operand_descriptors(a_ptr, b_ptr, M, N, K, stride_a, stride_b, A_T, B_T,
                                         BLOCK_M, BLOCK_N, BLOCK_K)
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
        pid_m, pid_n = tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)          # (BLOCK_M, BLOCK_N)
        for ki in range(k_tiles):
            a, b = load_operands(a_desc, b_desc, off_m, off_n, ki * BLOCK_K, A_T, B_T)  # (BM, BK), (BK, BN)
            acc = tl.dot(a, b, acc)

        tile_id_c += NUM_PROGRAMS
        pid_m, pid_n = tile_coords(tile_id_c, num_pid_m, num_pid_n, GROUP_M)
        off_cm = pid_m * BLOCK_M
        off_cn = pid_n * BLOCK_N
        if EPILOGUE_SUBTILE:
            # (BLOCK_M, BLOCK_N) -> (BLOCK_M, 2, SUB_N) -> (BLOCK_M, SUB_N, 2) -> two (BLOCK_M, SUB_N)
            # halves: the epilogue's fp32 temporaries (GELU's) and the store buffer are half the size.
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
    z, y = bias_act(acc, bias_ptr, offs_n, N, HAS_BIAS, ACTIVATION)
    if TMA_STORE:
        c_desc.store([off_m, off_n], y.to(c_desc.dtype))
        if STORE_Z:
            z_desc.store([off_m, off_n], z.to(z_desc.dtype))
    else:
        offs_m = off_m + tl.arange(0, BLOCK_M)
        store_tile(y, z, c_ptr, z_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn,
                   stride_zm, stride_zn, STORE_Z)


def _prune_tma_store(configs, named_args, **kwargs):
    """Without TMA_STORE_OK a TMA_STORE config is the same kernel as its pointer-store twin: skip it."""
    if kwargs.get("TMA_STORE_OK", named_args.get("TMA_STORE_OK", True)):
        return configs
    return [c for c in configs if not c.kwargs.get("TMA_STORE")] or configs


# The epilogue flags are part of the key for the same reason as in grouped.py.
matmul_tma_autotuned = triton.autotune(
    configs=CONFIGS, key=["M", "N", "K", "A_T", "B_T", "TMA_STORE_OK", "HAS_BIAS", "ACTIVATION", "STORE_Z"],
    prune_configs_by={"early_config_prune": _prune_tma_store})(matmul_kernel_tma)


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------
def operand_layout(t):
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


def layout(a, b):
    """((A_T, stride_a), (B_T, stride_b)) if this kernel can compute a @ b here, else None:
    a CUDA device of compute capability >= 9.0 (env.capability), M, N, K >= 16, and both
    operands addressable by a TMA descriptor (operand_layout)."""
    if a.device.type != "cuda" or env.capability(a.device) < (9, 0):
        return None
    if min(a.shape[0], a.shape[1], b.shape[1]) < 16:
        return None
    la, lb = operand_layout(a), operand_layout(b)
    if la is None or lb is None:
        return None
    return la, lb


def store_ok(c, z):
    """Whether the kernel may store c (and z) through descriptors: each must be addressable by
    a TMA descriptor as row-major (the kernel's store descriptors are)."""
    for t in (c, z):
        if t is not None:
            lay = operand_layout(t)
            if lay is None or lay[0]:
                return False
    return True


def set_allocator():
    """Device-built TMA descriptors need a little global scratch memory per launch. Triton keeps
    the allocator in a ContextVar, i.e. per thread, and autograd runs backward on its own
    thread, so we set it before every launch rather than once."""
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))


def launch(a, b, c, bias=None, z=None, activation=None):
    """c = act(a @ b + bias) (z = a @ b + bias if given) on the persistent TMA kernel; the
    caller (matmul.plan) checked `layout(a, b)`. Returns a replay function `(a, b, c, bias, z)`
    for new tensors of the same signature (see launch.py), or None."""
    M, K = a.shape
    N = b.shape[1]
    (a_t, stride_a), (b_t, stride_b) = layout(a, b)
    num_sms = env.num_sms(a.device)
    flags = dict(HAS_BIAS=bias is not None, ACTIVATION=activation or "", STORE_Z=z is not None)
    bias_arg = bias if bias is not None else c  # never read when HAS_BIAS is False
    z_arg = z if z is not None else c
    zs = z.stride() if z is not None else (0, 0)
    set_allocator()
    # Persistent grid: at most PPS programs per multiprocessor, never more than there are tiles.
    grid = lambda meta: (min(num_sms * meta["PPS"], triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"])),)
    args = (a, b, c, bias_arg, z_arg, M, N, K, stride_a, stride_b, *c.stride(), *zs)
    kwargs = dict(A_T=a_t, B_T=b_t, TMA_STORE_OK=store_ok(c, z), NUM_SMS=num_sms, **flags)
    if autotune_enabled():
        compiled = matmul_tma_autotuned[grid](*args, **kwargs)
        jit_fn, config = matmul_tma_autotuned.fn, matmul_tma_autotuned.best_config.all_kwargs()
    else:
        config = FIXED
        compiled = matmul_kernel_tma[grid](*args, **kwargs, **config)
        jit_fn = matmul_kernel_tma
    remembered = compiled_launch(jit_fn, compiled, grid, args, {**kwargs, **config}, n_tensors=5)
    if remembered is None:
        return None

    def replay(a, b, c, bias, z):
        set_allocator()  # the device-side descriptors' scratch memory (per thread)
        remembered(a.device.index, a, b, c, bias if bias is not None else c, z if z is not None else c)
    return replay
